"""Megatron-LM's FP8 flags on packed rows (fp8_flags.py): each refusal names the flag, the value
and a valid one; what passes gets the start-up note on what stays BF16. The rules are called on
copies of tests/unit/test_extra_args.py's parsed baseline; one launch line goes through the
whole parser."""

import copy
import os
import re
from types import SimpleNamespace

import pytest
import torch

from megatron.packed_training.arguments import parse_args
from megatron.packed_training.fp8_flags import check_fp8
from tests.unit.test_extra_args import (  # noqa: F401  (parsed)
    BASE,
    MOE,
    PADDED,
    parsed,
    pin_importable,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HOPPER, BLACKWELL = (9, 0), (10, 0)
ROUTER_PADDING = dict(MOE, moe_router_padding_for_quantization=True)


def fp8(parsed, **values):
    args = copy.deepcopy(parsed)
    values = {"fp8": "e4m3", "fp8_recipe": "tensorwise", "normalization": "RMSNorm",
              "add_bias_linear": False, "transformer_impl": "transformer_engine",
              "packed_notes": []} | values
    for name, value in values.items():
        setattr(args, name, value)
    return args


def check(args, model="gpt", te_attention=True, cuda_version=(13, 0), capability=HOPPER):
    check_fp8(args, model, te_attention=te_attention, cuda_version=cuda_version,
              capability=capability)
    return args


def test_tensorwise_blockwise_and_delayed_pass_on_hopper_with_the_bf16_attention_note(parsed):
    for recipe in ("tensorwise", "blockwise", "delayed"):
        args = check(fp8(parsed, fp8_recipe=recipe))  # seq 128, one micro-batch of 1 row
        assert args.packed_notes == [f"FP8 (e4m3, {recipe} scaling): the linear layers' GEMMs; "
                                     "core attention on packed THD stays BF16 (cuDNN's FP8 "
                                     "attention takes no THD layout)"]
    assert check(fp8(parsed, fp8=None)).packed_notes == []  # no FP8: nothing to say


@pytest.mark.parametrize("values,flag,value,fix", [
    ({"seq_length": 120}, "--seq-length", 120, "use --seq-length 128"),
    ({"seq_length": 120, "fp8_recipe": "blockwise"}, "--seq-length", 120,
     "a multiple of 128 rows per rank"),
    ({"seq_length": 128, "context_parallel_size": 2, "fp8_recipe": "blockwise"}, "--seq-length",
     128, "use --seq-length 256"),
    ({"seq_length": 130, "micro_batch_size": 4}, "--seq-length", 130, "use --seq-length 132"),
])
def test_positions_per_rank_must_fill_whole_fp8_blocks(parsed, values, flag, value, fix):
    args = fp8(parsed, **values)
    with pytest.raises(ValueError, match=re.escape(f"{flag} is wrong: {value}.")) as error:
        check(args)
    assert fix in str(error.value)


@pytest.mark.parametrize("values,flag,value,fix", [
    ({"normalization": "LayerNorm"}, "--normalization", "LayerNorm", "use --normalization RMSNorm"),
    ({"add_bias_linear": True}, "--disable-bias-linear", "not given",
     "pass --disable-bias-linear (--add-qkv-bias is fine)"),
])
def test_layers_that_would_carry_values_into_padding_rows_are_refused(parsed, values, flag,
                                                                       value, fix):
    """Padding rows reach the FP8 GEMMs as zeros (packed_model/padding_rows.py) only where a
    zero row stays zero: RMSNorm, no linear bias but QKV's."""
    with pytest.raises(ValueError, match=re.escape(f"{flag} is wrong: {value}.")) as error:
        check(fp8(parsed, **values))
    assert fix in str(error.value)
    check(fp8(parsed, add_qkv_bias=True))


def test_context_parallel_ranks_each_take_whole_blocks(parsed):
    check(fp8(parsed, seq_length=256, context_parallel_size=2, fp8_recipe="blockwise"))


def test_sequence_parallelism_splits_the_rows_over_tensor_parallel_ranks_too(parsed):
    args = fp8(parsed, seq_length=128, tensor_model_parallel_size=2, sequence_parallel=True,
               fp8_recipe="blockwise")
    with pytest.raises(ValueError, match=r"--seq-length is wrong: 128\. .* 128 positions split "
                                         r"over 2 rank\(s\) \(context parallel x tensor "
                                         r"parallel \(sequence parallelism\)\) .* use "
                                         r"--seq-length 256"):
        check(args)
    check(fp8(parsed, seq_length=256, tensor_model_parallel_size=2, sequence_parallel=True,
              fp8_recipe="blockwise"))


def test_recipes_the_gpu_or_cuda_cannot_run_are_refused(parsed):
    with pytest.raises(ValueError, match=r"--fp8-recipe is wrong: mxfp8\. It needs a Blackwell "
                                         r"GPU \(sm100\) and this one is sm90; use --fp8-recipe "
                                         r"tensorwise"):
        check(fp8(parsed, fp8_recipe="mxfp8"))
    check(fp8(parsed, fp8_recipe="mxfp8"), capability=BLACKWELL)
    check(fp8(parsed, fp8_recipe="mxfp8"), capability=None)  # no GPU at parse time: the run's
    with pytest.raises(ValueError, match=r"--fp8-recipe is wrong: blockwise\. It needs CUDA "
                                         r"12\.9 or newer and torch runs CUDA 12\.4"):
        check(fp8(parsed, fp8_recipe="blockwise"), cuda_version=(12, 4))
    nvfp4 = fp8(parsed, fp8=None, fp4="e2m1")
    with pytest.raises(ValueError, match=r"--fp4-format is wrong: e2m1\. NVFP4 needs a "
                                         r"Blackwell GPU \(sm100\) and this one is sm90"):
        check(nvfp4)


def test_fp8_needs_transformer_engines_linears_and_attention(parsed):
    for args, te_attention in ((fp8(parsed, transformer_impl="local"), True),
                               (fp8(parsed), False)):
        with pytest.raises(ValueError, match=r"--fp8-format is wrong: e4m3\. FP8 GEMMs are "
                                             r"Transformer Engine's"):
            check(args, te_attention=te_attention)


def test_the_hybrids_mamba_input_projection_must_be_a_multiple_of_16_wide(parsed):
    # 2 x 8 heads x 64 + 2 x 1 group x 128 + 8 heads = 1288: not a multiple of 16.
    mamba = dict(mamba_num_heads=8, mamba_head_dim=64, mamba_num_groups=1, mamba_state_dim=128)
    with pytest.raises(ValueError, match=r"--mamba-num-heads is wrong: 8\. Mamba's FP8 input "
                                         r"projection is 1288 wide"):
        check(fp8(parsed, **mamba), model="hybrid")
    args = check(fp8(parsed, **(mamba | {"mamba_num_heads": 16})), model="hybrid")  # 2320
    assert args.packed_notes[0].endswith("Mamba's SSD and conv kernels BF16")


def test_a_launch_line_with_fp8_on_the_te_free_path_is_refused_at_parse_time(monkeypatch):
    from megatron.packed_training import extra_args

    pin_importable(monkeypatch)  # no Transformer Engine: the TE-free path
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match=r"--fp8-format is wrong: e4m3\. FP8 GEMMs are "
                                         r"Transformer Engine's"):
        parse_args(BASE + ["--fp8-format", "e4m3"], raise_on_error=True)
    assert extra_args.check_fp8 is check_fp8  # the one rule set the parser runs


def test_megatron_cores_experts_pad_a_drop_and_pad_capacity_for_fp8_themselves(parsed):
    """No capacity factor is refused for its capacity: under FP8 megatron-core's SequentialMLP
    pads each expert's rows to 16 with zero rows of probability zero (TEGroupedMLP with TE's
    Fp8Padding), eager or graphed (static shapes under drop-and-pad)."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    args = check(fp8(parsed, **MOE, **dict(PADDED, moe_expert_capacity_factor=1.1)))
    rows = torch.randn(71, 8)  # capacity ceil(128 positions x top-2 / 4 experts x 1.1)
    padded, probs = SequentialMLP._pad_tensor_for_quantization(
        SimpleNamespace(config=args), rows, torch.rand(71))
    assert padded.shape == (80, 8) and torch.equal(padded[:71], rows)
    assert not padded[71:].any() and not probs[71:].any()


@pytest.mark.parametrize("kind", ["quantization", "fp8"])  # the flag and its old alias
def test_router_padding_is_refused_under_drop_and_pad(parsed, kind):
    flag = f"--moe-router-padding-for-{kind}"
    args = fp8(parsed, **MOE, **PADDED, **{f"moe_router_padding_for_{kind}": True})
    with pytest.raises(ValueError, match=re.escape(f"{flag} is wrong: True. Under drop-and-pad "
                                                   "each expert takes its capacity") +
                       r".* push routed tokens out: drop it\.$"):
        check(args)
    check(fp8(parsed, **MOE, **PADDED))  # the experts pad the capacity themselves
    check(fp8(parsed, **ROUTER_PADDING))  # dropless, eager: the dispatcher pads the map


def test_router_padding_pushes_routed_tokens_out_of_a_drop_and_pad_capacity():
    """Why: megatron-core's drop-and-pad permutation keeps each expert's first ``capacity``
    tokens of the routing map, and router padding marks the first unrouted ones, so routed
    tokens fall out though the capacity holds them all (drop_and_pad permute, pad_routing_map)."""
    from megatron.core.transformer.moe.moe_utils import (
        apply_router_token_dropping,
        get_capacity,
        pad_routing_map,
        permute,
    )

    tokens, experts, topk, factor = 64, 4, 2, 1.1
    scores = torch.softmax(torch.randn(tokens, experts, generator=torch.Generator().manual_seed(0)),
                           dim=-1).topk(topk, dim=-1)
    routing = torch.zeros(tokens, experts, dtype=torch.bool).scatter(1, scores.indices, True)
    probs = torch.zeros(tokens, experts).scatter(1, scores.indices, scores.values)
    probs, routing = apply_router_token_dropping(probs, routing, router_topk=topk,
                                                 capacity_factor=factor, pad_to_capacity=True)
    capacity = get_capacity(tokens * topk, experts, factor)  # 36: room for every routed slot
    rows = torch.randn(tokens, 16)

    def kept(routing_map):
        _, kept_probs, *_ = permute(rows, routing_map, probs=probs, drop_and_pad=True,
                                    num_out_tokens=capacity * experts)
        return int((kept_probs != 0).sum())

    assert kept(routing) == tokens * topk
    assert kept(pad_routing_map(routing.clone(), 16)) < tokens * topk  # (in place, hence clone)


@pytest.mark.parametrize("impl,modules,refused", [
    ("local", ["moe_router"], True),  # local graphs the preprocess with the router
    ("transformer_engine", ["moe_router", "moe_preprocess"], True),
    ("transformer_engine", ["moe_router"], False),  # the preprocess runs eager
])
def test_router_padding_is_refused_in_a_moe_preprocess_graph(parsed, impl, modules, refused):
    args = fp8(parsed, **ROUTER_PADDING, packed_graph_impl=impl,
               packed_cuda_graph_modules=modules)
    if not refused:
        check(args)
        return
    with pytest.raises(ValueError, match=r"--moe-router-padding-for-quantization is wrong: "
                                         r"True\. It makes the dispatcher's preprocess read the "
                                         r"token count on the host, in the moe_preprocess graph"):
        check(args)


def test_megatron_core_checks_only_the_router_padding_alias_against_a_preprocess_graph(
        monkeypatch):
    """Why the rule above: megatron-core 0.19.2 refuses the preprocess graph for
    ``moe_router_padding_for_fp8`` but not for the flag it became (transformer_config.py). When
    this fails, upstream checks both and the fork's rule can go."""
    from megatron.core.transformer import TransformerConfig, transformer_config
    from megatron.core.transformer.enums import CudaGraphModule

    monkeypatch.setattr(transformer_config, "is_te_min_version", lambda *_, **__: True)  # no TE

    def config(**padding):
        return TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                                 num_moe_experts=4, moe_token_dispatcher_type="alltoall",
                                 fp8="e4m3", fp8_recipe="tensorwise", bf16=True,
                                 cuda_graph_impl="local",
                                 cuda_graph_modules=[CudaGraphModule.moe_router], **padding)

    with pytest.raises(AssertionError, match="moe_preprocess cuda graph is not supported"):
        config(moe_router_padding_for_fp8=True)
    assert CudaGraphModule.moe_preprocess in config(
        moe_router_padding_for_quantization=True).cuda_graph_modules


def test_a_launch_line_with_router_padding_under_drop_and_pad_is_refused(monkeypatch):
    pin_importable(monkeypatch, "transformer_engine")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    te_attention = [value if value != "local" else "auto" for value in BASE]
    moe = ("--fp8-format e4m3 --fp8-recipe tensorwise --disable-bias-linear --normalization "
           "RMSNorm --num-experts 4 "
           "--moe-token-dispatcher-type alltoall --moe-expert-capacity-factor 1.0 "
           "--moe-pad-expert-input-to-capacity").split()
    with pytest.raises(ValueError, match=r"--moe-router-padding-for-quantization is wrong"):
        parse_args(te_attention + moe + ["--moe-router-padding-for-quantization"],
                   raise_on_error=True)
    assert parse_args(te_attention + moe, raise_on_error=True).fp8 == "e4m3"


# -- examples/fp8/moe_experts_bf16.yaml: Megatron-LM's per-module precision file ---------------

EXPERTS_BF16 = os.path.join(REPO, "examples", "fp8", "moe_experts_bf16.yaml")


def test_the_experts_bf16_file_matches_the_routed_experts_only():
    """megatron-core resolves each TE linear's precision from the file by module path
    (``GPTModel`` / ``HybridModel`` ``finish_init``): the routed experts' linears, grouped and
    sequential, get a BF16 training recipe; shared experts, attention, dense MLPs and the
    output layer keep the run's FP8."""
    from megatron.core.extensions.transformer_engine import TEQuantizationParams
    from megatron.core.quantization.utils import get_quant_config_or_none, load_quantization_recipe

    recipe = load_quantization_recipe(EXPERTS_BF16)
    for path in ("decoder.layers.0.mlp.experts.linear_fc1",
                 "decoder.layers.3.mlp.experts.linear_fc2",
                 "decoder.layers.1.mlp.experts.local_experts.5.linear_fc1"):
        params = TEQuantizationParams.parse_from_config(get_quant_config_or_none(path, recipe))
        assert params.evaluation_recipe is None, path  # forward-only passes: the same
        training = params.training_recipe
        assert training.fp8_quantization_recipe is None and training.fp4_quantization_recipe is None
        assert training.override_quantized_autocast, path  # switches FP8 off inside an autocast
    for path in ("decoder.layers.0.mlp.shared_experts.linear_fc1",
                 "decoder.layers.0.self_attention.linear_qkv",
                 "decoder.layers.0.self_attention.linear_proj", "decoder.layers.0.mlp.linear_fc1",
                 "decoder.layers.2.mixer.in_proj", "output_layer"):
        assert get_quant_config_or_none(path, recipe) is None, path


def test_a_launch_line_with_the_experts_bf16_file_reaches_the_model_config(monkeypatch):
    from megatron.core.transformer import transformer_config

    from megatron.packed_training.config import transformer_config_from_args

    pin_importable(monkeypatch, "transformer_engine")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(transformer_config, "is_te_min_version", lambda *_, **__: True)  # no TE
    te_attention = [value if value != "local" else "auto" for value in BASE]
    line = ("--fp8-format e4m3 --fp8-recipe tensorwise --disable-bias-linear --normalization "
            "RMSNorm --num-experts 4 --moe-token-dispatcher-type alltoall "
            "--moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity "
            f"--te-precision-config-file {EXPERTS_BF16}").split()
    args = parse_args(te_attention + line, raise_on_error=True)
    from megatron.core.quantization.utils import get_quant_config_or_none

    recipe = transformer_config_from_args(args).quant_recipe
    assert get_quant_config_or_none("decoder.layers.0.mlp.experts.linear_fc1", recipe)
    assert get_quant_config_or_none("decoder.layers.0.self_attention.linear_qkv", recipe) is None


def test_a_max_over_a_delayed_history_is_refused_under_local_layer_graphs_only(parsed):
    """megatron-core's layer graphs roll delayed histories once per layer's backward
    (fp8_flags.check_delayed_scaling_under_graphs); the most recent amax, a history of one,
    other recipes, eager and TE's layer graphs (one update per micro-batch) are unaffected."""
    history = dict(fp8_recipe="delayed", fp8_amax_history_len=1024, fp8_amax_compute_algo="max")
    with pytest.raises(ValueError, match=r"--fp8-amax-compute-algo is wrong: max\. Under "
                                         r"--cuda-graph-impl local layer graphs .* "
                                         r"\(--fp8-amax-history-len 1024\) once per layer "
                                         r"instead of once per micro-batch; use "
                                         r"--fp8-amax-compute-algo most_recent"):
        check(fp8(parsed, packed_graph_impl="local", cuda_graph_granularity="layer", **history))
    for values in (dict(history, fp8_amax_compute_algo="most_recent"),
                   dict(history, fp8_amax_history_len=1),
                   dict(history, fp8_recipe="tensorwise"),
                   dict(history, packed_graph_impl="none"),
                   dict(history, packed_graph_impl="transformer_engine")):
        check(fp8(parsed, **({"packed_graph_impl": "local"} | values)))


def test_the_graph_health_check_is_refused_with_delayed_scaling(parsed):
    """Its two passes would each update the delayed scales (no trace in training otherwise)."""
    with pytest.raises(ValueError, match=r"--cuda-graph-check-interval is wrong: 10\. The "
                                         r"health check's replayed and eager passes would each "
                                         r"update delayed scaling's amax history"):
        check(fp8(parsed, fp8_recipe="delayed", packed_graph_impl="local",
                  cuda_graph_check_interval=10))
    check(fp8(parsed, fp8_recipe="tensorwise", packed_graph_impl="local",
              cuda_graph_check_interval=10))


@pytest.mark.parametrize("impl, granularity", [("local", "chunk"), ("full_iteration", "layer")])
def test_delayed_scaling_under_graphs_that_would_hold_its_update_is_refused_at_parse_time(
        parsed, impl, granularity):
    """The graph setup's rule (fp8_state.check_fp8_graphs) runs at parse time too, before any
    GPU work; layer graphs of either kind pass."""
    with pytest.raises(ValueError, match=r"--fp8-recipe is wrong for --cuda-graph-impl "
                                         r".*: delayed\. .*tensorwise or blockwise"):
        check(fp8(parsed, fp8_recipe="delayed", packed_graph_impl=impl,
                  cuda_graph_granularity=granularity))
    for impl, granularity in (("local", "layer"), ("transformer_engine", "layer"),
                              ("none", "chunk")):
        check(fp8(parsed, fp8_recipe="delayed", packed_graph_impl=impl,
                  cuda_graph_granularity=granularity))
