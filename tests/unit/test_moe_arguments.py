"""MoE flags: accepted values reach TransformerConfig; one test per rejection.

CPU only; Transformer Engine is absent unless a test patches ``argument_checks.is_importable``.
"""

import pytest

from megatron.packed_training import argument_checks
from megatron.packed_training.arguments import build_parser, validate_args
from megatron.packed_training.config import transformer_config_from_args

BASE = {
    "gpt": ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "256", "--train-iters", "10", "--lr", "1e-3", "--mock-data"],
    "hybrid": ["--hybrid-override-pattern", "M*E-", "--hidden-size", "64",
               "--num-attention-heads", "4", "--mamba-head-dim", "16", "--seq-length", "256",
               "--train-iters", "10", "--lr", "1e-3", "--mock-data"],
}
MOE = ["--num-experts", "8"]
DROP_AND_PAD = ["--moe-expert-capacity-factor", "1.0", "--moe-pad-expert-input-to-capacity"]
GRAPHS = ["--cuda-graph-impl", "local", "--cuda-graph-max-packed-seqs", "16"]


def validate(*extra, model="gpt", world_size=1):
    args = build_parser(model).parse_args(BASE[model] + [str(x) for x in extra])
    return validate_args(args, model, world_size=world_size)


@pytest.fixture(autouse=True)
def no_optional_packages(monkeypatch):
    monkeypatch.setattr(argument_checks, "is_importable", lambda package: False)


# ------------------------------------------------------------------------- accepted values

def test_defaults_without_moe_leave_the_config_dense():
    args = validate()
    assert args.num_experts is None and args.moe_ffn_hidden_size is None
    config = transformer_config_from_args(args)
    assert config.num_moe_experts is None


def test_flags_map_onto_transformer_config():
    args = validate(*MOE, "--moe-router-topk", 2, "--moe-ffn-hidden-size", 96,
                    "--moe-shared-expert-intermediate-size", 128,
                    "--moe-router-load-balancing-type", "seq_aux_loss",
                    "--moe-aux-loss-coeff", 0.01, "--moe-z-loss-coeff", 0.001,
                    "--moe-router-score-function", "sigmoid", "--moe-router-dtype", "fp32",
                    *DROP_AND_PAD, "--expert-model-parallel-size", 2, world_size=2)
    config = transformer_config_from_args(args)
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size) == (8, 2, 96)
    assert config.moe_shared_expert_intermediate_size == 128
    assert config.moe_router_load_balancing_type == "seq_aux_loss"
    assert (config.moe_aux_loss_coeff, config.moe_z_loss_coeff) == (0.01, 0.001)
    assert config.moe_router_score_function == "sigmoid" and config.moe_router_dtype == "fp32"
    assert config.moe_token_dispatcher_type == "alltoall"
    assert config.moe_expert_capacity_factor == 1.0 and config.moe_pad_expert_input_to_capacity
    assert config.expert_model_parallel_size == 2 and not config.moe_grouped_gemm


def test_expert_width_defaults_to_ffn_hidden_size():
    assert validate(*MOE, "--ffn-hidden-size", 80).moe_ffn_hidden_size == 80


def test_hybrid_moe_pattern():
    args = validate(*MOE, model="hybrid")
    assert args.num_layers == 4 and transformer_config_from_args(args).num_moe_experts == 8


def test_graphs_with_drop_and_pad(with_te):
    args = validate(*MOE, *DROP_AND_PAD, *GRAPHS, "--attention-backend", "torch")
    assert args.cuda_graph_impl == "local"


def test_capacity_overflow_rerun_with_graphs_and_drop_and_pad(with_te):
    assert validate(*MOE).moe_capacity_overflow == "drop"
    args = validate(*MOE, *DROP_AND_PAD, *GRAPHS, "--attention-backend", "torch",
                    "--moe-capacity-overflow", "rerun")
    assert args.moe_capacity_overflow == "rerun" and args.moe_router_load_file is None


def test_grouped_gemm_with_te(with_te):
    assert validate(*MOE, "--moe-grouped-gemm", "--attention-backend", "te").moe_grouped_gemm


# ------------------------------------------------------------------------- one per rejection

@pytest.mark.parametrize("flag, value", [
    ("--moe-router-topk", 4), ("--moe-ffn-hidden-size", 32),
    ("--moe-shared-expert-intermediate-size", 32),
    ("--moe-router-load-balancing-type", "none"), ("--moe-aux-loss-coeff", 0.01),
    ("--moe-z-loss-coeff", 0.001), ("--moe-router-score-function", "sigmoid"),
    ("--moe-router-dtype", "fp32"), ("--moe-expert-capacity-factor", 1.0),
    ("--expert-model-parallel-size", 2), ("--moe-capacity-overflow", "rerun"),
    ("--moe-router-load-file", "loads.json"), ("--moe-router-bias-update-rate", 0.01),
    ("--moe-router-topk-scaling-factor", 2.5), ("--moe-router-num-groups", 2),
    ("--moe-router-group-topk", 1),
])
def test_moe_flag_without_experts(flag, value):
    with pytest.raises(ValueError, match=f"{flag} is wrong: {value}. It configures MoE layers; "
                                         "add --num-experts"):
        validate(flag, value)


@pytest.mark.parametrize("flag", ["--moe-pad-expert-input-to-capacity", "--moe-grouped-gemm",
                                  "--moe-router-enable-expert-bias", "--moe-router-pre-softmax"])
def test_moe_switch_without_experts(flag):
    with pytest.raises(ValueError, match=f"{flag} is wrong: True. It configures MoE layers"):
        validate(flag)


def test_hybrid_experts_without_an_e_layer():
    with pytest.raises(ValueError, match="--num-experts is wrong: 8. --hybrid-override-pattern "
                                         "'M\\*M-' has no 'E'"):
        validate(*MOE, "--hybrid-override-pattern", "M*M-", model="hybrid")


def test_num_experts_positive():
    with pytest.raises(ValueError, match="--num-experts is wrong: 0. Use a value >= 1"):
        validate("--num-experts", 0)


@pytest.mark.parametrize("topk", [0, 9])
def test_topk_range(topk):
    with pytest.raises(ValueError, match=f"--moe-router-topk is wrong: {topk}. Use a value in "
                                         r"\[1, --num-experts \(8\)\]"):
        validate(*MOE, "--moe-router-topk", topk)


@pytest.mark.parametrize("flag, value, minimum", [
    ("--moe-ffn-hidden-size", 0, 1), ("--moe-shared-expert-intermediate-size", 0, 1),
    ("--moe-aux-loss-coeff", -0.1, 0.0), ("--moe-z-loss-coeff", -0.1, 0.0),
    ("--expert-model-parallel-size", 0, 1),
])
def test_moe_sizes_and_coefficients_bounded(flag, value, minimum):
    with pytest.raises(ValueError, match=f"{flag} is wrong: {value}. Use a value >= {minimum}"):
        validate(*MOE, flag, value)


@pytest.mark.parametrize("given, parsed", [("2", 2), ("[0]*1+[1]*1", [0, 1]), ("[1, 0]", [1, 0])])
def test_moe_layer_freq_takes_megatrons_two_forms(given, parsed):
    args = validate(*MOE, "--moe-layer-freq", given)
    assert args.moe_layer_freq == parsed
    assert transformer_config_from_args(args).moe_layer_freq == parsed


@pytest.mark.parametrize("extra, match", [
    (["--moe-layer-freq", "__import__('os')"],
     r"--moe-layer-freq is wrong: \"__import__\('os'\)\". Give N .*lists, ints, \+ and \*"),
    (["--moe-layer-freq", "[0]*3"], r"--moe-layer-freq is wrong: \[0, 0, 0\]. Give one 0 "
                                    r"\(dense\) or 1 \(MoE\) per layer: 2 for --num-layers 2"),
    (["--moe-layer-freq", "[0, 2]"], r"Give one 0 \(dense\) or 1 \(MoE\) per layer"),
    (["--moe-layer-freq", "[0, 0]"], "It makes no layer MoE; drop --num-experts"),
    (["--moe-layer-freq", "0"], "--moe-layer-freq is wrong: 0. Use N >= 1"),
])
def test_moe_layer_freq_refusals(extra, match):
    with pytest.raises(ValueError, match=match):
        validate(*MOE, *extra)


def test_moe_layer_freq_needs_experts_and_a_gpt_model():
    with pytest.raises(ValueError, match="--moe-layer-freq is wrong: 2. It configures MoE layers"):
        validate("--moe-layer-freq", "2")
    with pytest.raises(ValueError, match="A hybrid model's MoE layers are the 'E' layers"):
        validate(*MOE, "--hybrid-override-pattern", "M*EE", "--moe-layer-freq", "2",
                 model="hybrid")


def test_top1_softmax_routing_needs_pre_softmax():
    with pytest.raises(ValueError, match="--moe-router-topk is wrong: 1. Top-1 softmax routing "
                                         "needs --moe-router-pre-softmax"):
        validate(*MOE, "--moe-router-topk", 1)
    for extra in (["--moe-router-pre-softmax"], ["--moe-router-score-function", "sigmoid"]):
        config = transformer_config_from_args(validate(*MOE, "--moe-router-topk", 1, *extra))
        assert config.moe_router_topk == 1
    config = transformer_config_from_args(validate(*MOE, "--moe-router-pre-softmax"))
    assert config.moe_router_pre_softmax


def test_group_limited_routing_maps_onto_the_config():
    config = transformer_config_from_args(validate(
        *MOE, "--moe-router-topk", 4, "--moe-router-num-groups", 4, "--moe-router-group-topk", 2))
    assert (config.moe_router_num_groups, config.moe_router_group_topk) == (4, 2)


@pytest.mark.parametrize("extra, match", [
    (["--moe-router-num-groups", 4], "--moe-router-num-groups is wrong: 4. Group-limited "
                                     "routing needs both"),
    (["--moe-router-group-topk", 2], "--moe-router-group-topk is wrong: 2. Group-limited"),
    (["--moe-router-num-groups", 3, "--moe-router-group-topk", 1],
     r"--moe-router-num-groups is wrong: 3. Use a divisor of --num-experts \(8\)"),
    (["--moe-router-num-groups", 4, "--moe-router-group-topk", 5],
     r"--moe-router-group-topk is wrong: 5. Use a value in \[1, --moe-router-num-groups \(4\)\]"),
    (["--moe-router-topk", 3, "--moe-router-num-groups", 4, "--moe-router-group-topk", 2],
     r"--moe-router-group-topk is wrong: 2. megatron-core scores a group by its best"),
    (["--moe-router-topk", 6, "--moe-router-num-groups", 4, "--moe-router-group-topk", 2],
     r"at most the 2 experts of a group"),
])
def test_group_limited_routing_refusals(extra, match):
    with pytest.raises(ValueError, match=match):
        validate(*MOE, *extra)


def test_aux_loss_free_balancing_maps_onto_the_config():
    # DeepSeek-V3 / Moonlight: sigmoid scores, a per-expert bias, scaled top-k weights.
    config = transformer_config_from_args(validate(
        *MOE, "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
        "--moe-router-bias-update-rate", 0.002, "--moe-router-topk-scaling-factor", 2.446))
    assert config.moe_router_enable_expert_bias and config.moe_router_bias_update_rate == 0.002
    assert config.moe_router_topk_scaling_factor == 2.446


@pytest.mark.parametrize("extra, match", [
    (["--moe-router-enable-expert-bias"],
     "--moe-router-enable-expert-bias is wrong: True. Aux-loss-free balancing biases sigmoid "
     "scores .*softmax.*add --moe-router-score-function sigmoid"),
    (["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
      "--moe-router-bias-update-rate", 0], "--moe-router-bias-update-rate is wrong: 0.0. Use a "
                                           "positive rate"),
    (["--moe-router-bias-update-rate", 0.01], "--moe-router-bias-update-rate is wrong: 0.01. "
                                              "It moves the expert bias; add "
                                              "--moe-router-enable-expert-bias"),
    (["--moe-router-topk-scaling-factor", 0], "--moe-router-topk-scaling-factor is wrong: 0.0. "
                                              "It multiplies the routed experts' weights"),
])
def test_aux_loss_free_balancing_refusals(extra, match):
    with pytest.raises(ValueError, match=match):
        validate(*MOE, *extra)


def test_aux_coefficient_with_no_balancing():
    with pytest.raises(ValueError, match="--moe-aux-loss-coeff is wrong: 0.01. "
                                         "--moe-router-load-balancing-type none has no"):
        validate(*MOE, "--moe-router-load-balancing-type", "none", "--moe-aux-loss-coeff", 0.01)


@pytest.mark.parametrize("dispatcher, reason", [
    ("allgather", "reads token counts back to the host"),
    ("flex", "needs DeepEP or HybridEP"),
])
def test_dispatchers_other_than_alltoall(dispatcher, reason):
    with pytest.raises(ValueError, match=f"--moe-token-dispatcher-type is wrong: {dispatcher}. "
                                         f"The {dispatcher} dispatcher.*{reason}.*use alltoall"):
        validate(*MOE, "--moe-token-dispatcher-type", dispatcher)


@pytest.mark.parametrize("factor", [0, -1])
def test_capacity_factor_positive(factor):
    with pytest.raises(ValueError, match=f"--moe-expert-capacity-factor is wrong: {factor}.0. "
                                         "Use a positive factor"):
        validate(*MOE, "--moe-expert-capacity-factor", factor)


def test_pad_to_capacity_needs_a_capacity():
    with pytest.raises(ValueError, match="--moe-pad-expert-input-to-capacity is wrong: True. "
                                         "It pads every expert to its capacity; add "
                                         "--moe-expert-capacity-factor"):
        validate(*MOE, "--moe-pad-expert-input-to-capacity")


def test_padded_capacity_above_the_token_count():
    with pytest.raises(ValueError, match=r"--moe-expert-capacity-factor is wrong: 5.0. .*"
                                         r"\(5.0 x 2\) above --num-experts \(8\).*<= 4"):
        validate(*MOE, "--moe-expert-capacity-factor", 5, "--moe-pad-expert-input-to-capacity")


def test_capacity_overflow_rerun_needs_graphs():
    with pytest.raises(ValueError, match="--moe-capacity-overflow is wrong: rerun. It reruns "
                                         "micro-batches .* without CUDA graphs MoE layers run "
                                         "dropless directly"):
        validate(*MOE, *DROP_AND_PAD, "--moe-capacity-overflow", "rerun")


@pytest.mark.parametrize("capacity", [[], ["--moe-expert-capacity-factor", "1.0"]])
def test_capacity_overflow_rerun_needs_drop_and_pad(with_te, capacity):
    with pytest.raises(ValueError, match="--moe-capacity-overflow is wrong: rerun. .*needs one: "
                                         "add --moe-expert-capacity-factor <f> "
                                         "--moe-pad-expert-input-to-capacity"):
        validate(*MOE, *capacity, *GRAPHS, "--attention-backend", "torch",
                 "--moe-capacity-overflow", "rerun")


def test_router_load_file_needs_the_rerun_mode():
    with pytest.raises(ValueError, match="--moe-router-load-file is wrong: loads.json. The "
                                         "loads are measured by --moe-capacity-overflow rerun"):
        validate(*MOE, "--moe-router-load-file", "loads.json")


def test_grouped_gemm_needs_te():
    with pytest.raises(ValueError, match="--moe-grouped-gemm is wrong: True. It needs "
                                         "transformer_engine"):
        validate(*MOE, "--moe-grouped-gemm")


def test_grouped_gemm_needs_the_te_spec(with_te):
    with pytest.raises(ValueError, match="--moe-grouped-gemm is wrong: True. Grouped GEMM "
                                         "experts come with the Transformer Engine layer spec, "
                                         "not --attention-backend torch"):
        validate(*MOE, "--moe-grouped-gemm", "--attention-backend", "torch")


def test_expert_parallel_divides_experts():
    with pytest.raises(ValueError, match="--expert-model-parallel-size is wrong: 3. It must "
                                         "divide --num-experts \\(8\\)"):
        validate(*MOE, "--expert-model-parallel-size", 3, world_size=3)


def test_expert_parallel_divides_data_parallel():
    with pytest.raises(ValueError, match="--expert-model-parallel-size is wrong: 4. Expert "
                                         "tensor x expert parallel ranks \\(1 x 4\\) are taken "
                                         "from the tensor x context x data parallel ranks of a "
                                         "pipeline stage \\(1 x 1 x 2 = 2\\)"):
        validate(*MOE, "--expert-model-parallel-size", 4, world_size=2)


def test_expert_tensor_parallel_defaults_to_tensor_parallel(with_te):
    args = validate(*MOE, "--tensor-model-parallel-size", 2, "--sequence-parallel",
                    world_size=2)
    assert args.expert_tensor_parallel_size == 2
    assert transformer_config_from_args(args).expert_tensor_parallel_size == 2


def test_expert_tensor_parallel_one_folds_tensor_ranks_into_expert_parallel(with_te):
    # Two ranks: attention TP = 2, experts EP = 2 with whole (unsplit) experts.
    args = validate(*MOE, "--tensor-model-parallel-size", 2, "--sequence-parallel",
                    "--expert-model-parallel-size", 2, "--expert-tensor-parallel-size", 1,
                    world_size=2)
    config = transformer_config_from_args(args)
    assert (config.expert_model_parallel_size, config.expert_tensor_parallel_size) == (2, 1)


@pytest.mark.parametrize("etp", [3, 4])
def test_expert_tensor_parallel_divides_tensor_parallel(with_te, etp):
    with pytest.raises(ValueError, match=f"--expert-tensor-parallel-size is wrong: {etp}. It "
                                         "must divide --tensor-model-parallel-size \\(2\\)"):
        validate(*MOE, "--tensor-model-parallel-size", 2, "--sequence-parallel",
                 "--expert-tensor-parallel-size", etp, world_size=2)


def test_folded_expert_parallel_must_fit_the_stage(with_te):
    with pytest.raises(ValueError, match="--expert-tensor-parallel-size is wrong: 1. Expert "
                                         "tensor x expert parallel ranks \\(1 x 4\\)"):
        validate(*MOE, "--tensor-model-parallel-size", 2, "--sequence-parallel",
                 "--expert-model-parallel-size", 4, "--expert-tensor-parallel-size", 1,
                 world_size=2)


@pytest.mark.parametrize("value", [0, -1])
def test_expert_tensor_parallel_is_positive(value):
    with pytest.raises(ValueError, match=f"--expert-tensor-parallel-size is wrong: {value}"):
        validate(*MOE, "--expert-tensor-parallel-size", value)


def test_expert_tensor_parallel_needs_moe():
    with pytest.raises(ValueError, match="--expert-tensor-parallel-size is wrong: 1. It "
                                         "configures MoE layers; add --num-experts"):
        validate("--expert-tensor-parallel-size", 1)


def test_expert_parallel_with_dynamic_cp(with_te):
    with pytest.raises(ValueError, match="--expert-model-parallel-size is wrong: 2. Under "
                                         "dynamic CP"):
        validate(*MOE, "--expert-model-parallel-size", 2, "--dynamic-cp-sizes", 1, 2,
                 world_size=2)


def test_tensor_parallel_moe_needs_sequence_parallel():
    with pytest.raises(ValueError, match="--tensor-model-parallel-size is wrong: 2. MoE layers "
                                         "with tensor parallelism need --sequence-parallel"):
        validate(*MOE, "--tensor-model-parallel-size", 2, world_size=2)


@pytest.mark.parametrize("capacity", [[], ["--moe-expert-capacity-factor", "1.0"]])
def test_graphs_need_drop_and_pad(capacity):
    with pytest.raises(ValueError, match="--cuda-graph-impl is wrong: local. Dropless alltoall "
                                         "reads the per-expert token counts back to the host"):
        validate(*MOE, *capacity, *GRAPHS)


@pytest.mark.parametrize("model", ["gpt", "hybrid"])
def test_mlp_graphs_with_moe(model):
    with pytest.raises(ValueError, match="--cuda-graph-modules is wrong: mlp. With "
                                         "--num-experts .*megatron-core refuses mlp graphs"):
        validate(*MOE, *DROP_AND_PAD, *GRAPHS, "--cuda-graph-modules", "mlp", model=model)


def test_moe_module_is_refused():
    with pytest.raises(ValueError, match="--cuda-graph-modules is wrong: 'moe'. MoE layers are "
                                         "captured whole when --cuda-graph-modules is not given"):
        validate(*MOE, *DROP_AND_PAD, *GRAPHS, "--cuda-graph-modules", "moe")


# ------------------------------------------------------------------ partial MoE graphs

@pytest.mark.parametrize("modules, expected", [
    (["moe_router"], ["moe_router", "moe_preprocess"]),
    (["moe_preprocess"], ["moe_preprocess", "moe_router"]),
    (["attn", "moe_router"], ["attn", "moe_router", "moe_preprocess"]),
    (["attn,moe_router,moe_preprocess"], ["attn", "moe_router", "moe_preprocess"]),
])
def test_local_partial_graphs_capture_router_and_preprocess_together(modules, expected):
    args = validate(*MOE, *DROP_AND_PAD, *GRAPHS, "--cuda-graph-modules", *modules)
    assert args.cuda_graph_modules == expected
    config = transformer_config_from_args(args)
    assert {m.name for m in config.cuda_graph_modules} == set(expected)


def test_hybrid_partial_graphs_with_mamba_and_attention():
    args = validate(*MOE, *DROP_AND_PAD, *GRAPHS, "--cuda-graph-modules", "mamba", "attn",
                    "moe_router", model="hybrid")
    assert args.cuda_graph_modules == ["mamba", "attn", "moe_router", "moe_preprocess"]


@pytest.mark.parametrize("model", ["gpt", "hybrid"])
def test_partial_graphs_run_dropless_moe(model):
    args = validate(*MOE, *GRAPHS, "--cuda-graph-modules", "attn", "moe_router", model=model)
    assert args.moe_expert_capacity_factor is None and "moe_preprocess" in args.cuda_graph_modules
    transformer_config_from_args(args)  # megatron-core accepts dropless partial graphs too


def test_whole_layer_graphs_still_need_drop_and_pad():
    with pytest.raises(ValueError, match="--cuda-graph-impl is wrong: local. Dropless alltoall .* "
                                         "or graph MoE layers in part \\(--cuda-graph-modules "
                                         "moe_router"):
        validate(*MOE, *GRAPHS, "--cuda-graph-modules", "attn")


def test_partial_graphs_refuse_a_capacity_without_padding():
    with pytest.raises(ValueError, match="--moe-expert-capacity-factor is wrong: 1.0. With "
                                         "moe_preprocess in the graph \\(the local implementation "
                                         "always graphs it with moe_router\\), a capacity without "
                                         "--moe-pad-expert-input-to-capacity"):
        validate(*MOE, "--moe-expert-capacity-factor", "1.0", *GRAPHS,
                 "--cuda-graph-modules", "moe_router")


@pytest.mark.parametrize("model", ["gpt", "hybrid"])
def test_partial_graphs_need_moe_layers(model):
    extra = ["--hybrid-override-pattern", "M*-M"] if model == "hybrid" else []
    with pytest.raises(ValueError, match="--cuda-graph-modules is wrong: moe_router "
                                         "moe_preprocess. It captures parts of MoE layers and "
                                         "the model has none; add --num-experts"):
        validate(*GRAPHS, "--cuda-graph-modules", "moe_router", *extra, model=model)


def test_partial_graphs_refuse_the_overflow_rerun():
    with pytest.raises(ValueError, match="--moe-capacity-overflow is wrong: rerun. Partial MoE "
                                         "graphs .* run dropless directly"):
        validate(*MOE, *DROP_AND_PAD, *GRAPHS, "--cuda-graph-modules", "moe_router",
                 "--moe-capacity-overflow", "rerun")


def test_partial_graphs_refuse_chunk_granularity():
    with pytest.raises(ValueError, match="--cuda-graph-modules is wrong: moe_router "
                                         "moe_preprocess. Chunk graphs capture the whole model "
                                         "chunk"):
        validate(*MOE, *DROP_AND_PAD, *GRAPHS, "--cuda-graph-modules", "moe_router",
                 "--cuda-graph-granularity", "chunk")


def test_partial_graphs_with_pipeline_parallel_layer_graphs():
    args = validate(*MOE, *DROP_AND_PAD, *GRAPHS, "--cuda-graph-modules", "attn,moe_router",
                    "--pipeline-model-parallel-size", 2, world_size=2)
    assert args.pipeline_model_parallel_size == 2


TE_GRAPHS = ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-max-packed-seqs", "16"]


@pytest.mark.parametrize("modules", [["moe_router"], ["attn", "moe_router"],
                                     ["moe_router", "moe_preprocess"]])
def test_te_partial_graphs_keep_the_modules_as_given(with_te, modules):
    args = validate(*MOE, *DROP_AND_PAD, *TE_GRAPHS, "--cuda-graph-modules", *modules)
    assert args.cuda_graph_modules == modules


def test_te_router_graph_takes_a_capacity_without_padding(with_te):
    # The preprocess runs eager: its host read of the routing map is outside the graph.
    args = validate(*MOE, "--moe-expert-capacity-factor", "1.0", *TE_GRAPHS,
                    "--cuda-graph-modules", "moe_router")
    assert args.cuda_graph_modules == ["moe_router"]


def test_te_preprocess_graph_needs_the_router_graph(with_te):
    with pytest.raises(ValueError, match="--cuda-graph-modules is wrong: moe_preprocess. "
                                         "megatron-core captures the dispatcher's preprocess in "
                                         "the router's graph; add moe_router"):
        validate(*MOE, *DROP_AND_PAD, *TE_GRAPHS, "--cuda-graph-modules", "moe_preprocess")


@pytest.mark.parametrize("modules", [["attn"], ["attn", "mamba"], ["mlp", "moe_router"]])
def test_te_graphs_take_modules_only_for_partial_moe(with_te, modules):
    with pytest.raises(ValueError, match="--cuda-graph-modules is wrong: .*--cuda-graph-impl "
                                         "transformer_engine captures whole layers on packed "
                                         "data, or with moe_router the router part"):
        validate(*MOE, *DROP_AND_PAD, *TE_GRAPHS, "--cuda-graph-modules", *modules,
                 model="hybrid")


def test_te_preprocess_graph_with_dynamic_cp(with_te):
    with pytest.raises(ValueError, match="--cuda-graph-modules is wrong: moe_router "
                                         "moe_preprocess. Under dynamic CP each graph bank holds "
                                         "another token count"):
        validate(*MOE, *DROP_AND_PAD, *TE_GRAPHS, "--cuda-graph-modules", "moe_router",
                 "moe_preprocess", "--dynamic-cp-sizes", 1, 2, world_size=2)


# ------------------------------------------------------------------ expert parallelism

@pytest.mark.parametrize("extra, world_size", [
    (["--expert-model-parallel-size", 2], 2),
    (["--expert-model-parallel-size", 4], 4),
    (["--expert-model-parallel-size", 2, "--pipeline-model-parallel-size", 2,
      "--cuda-graph-granularity", "chunk"], 4),
    (["--expert-model-parallel-size", 2, "--pipeline-model-parallel-size", 2], 4),
    (["--expert-model-parallel-size", 2, "--cuda-graph-modules", "attn,moe_router"], 2),
])
def test_expert_parallel_graph_combinations(extra, world_size):
    args = validate(*MOE, *DROP_AND_PAD, *GRAPHS, *extra, world_size=world_size)
    config = transformer_config_from_args(args)
    assert config.expert_model_parallel_size == args.expert_model_parallel_size
    assert args.data_parallel_size % args.expert_model_parallel_size == 0


def test_expert_parallel_with_tensor_and_sequence_parallelism(with_te):
    args = validate(*MOE, *DROP_AND_PAD, *GRAPHS, "--expert-model-parallel-size", 2,
                    "--tensor-model-parallel-size", 2, "--sequence-parallel", world_size=4)
    config = transformer_config_from_args(args)
    assert (config.expert_model_parallel_size, config.tensor_model_parallel_size) == (2, 2)
    assert config.sequence_parallel and args.data_parallel_size == 2
