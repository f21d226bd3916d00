"""Hugging Face checkpoints in and out (megatron/packed_training/hf, tools/convert_hf.py), on
CPU with tiny random models built offline by transformers.

* HF -> fork -> HF is bitwise on every tensor, and the export loads in transformers.
* The converted checkpoint holds exactly what the fork's model (built by pretrain_gpt.py's
  provider from the printed launch flags) shards at TP = 1: every key, global shape and
  ``_extra_state`` object.
* Loaded through megatron-core's dist_checkpointing (and through Megatron-LM's own
  ``load_checkpoint`` with --pretrained-checkpoint and with --load), the fork's model gives
  the Hugging Face logits on packed rows: several documents per row, each document run
  alone through the Hugging Face model; fp32, last-position argmax equal, cosine >= 0.999.
* Vocabulary padding both ways, the hub's older config key names, and the refusals.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from megatron.packed_training.hf import ConversionError, export_hf, import_hf
from megatron.packed_training.hf.config import HFConfig
from megatron.packed_training.hf.convert import flag_tokens
from megatron.packed_training.hf.families import describe, supported_model_types
from tests.unit.hf_tiny import (
    VOCAB,
    agreement,
    build_fork_model,
    cpu_mla_model,
    flags_of,
    hf_document_logits,
    load_release,
    packed_documents,
    packed_logits,
    parse_fork_args,
    NEMOTRON_H,
    NEMOTRON_H_CPU_LAYERS,
    NEMOTRON_H_LAYERS,
    tiny_deepseek_v3,
    tiny_llama,
    tiny_moonlight,
    tiny_nemotron_h,
    tiny_qwen3,
    tiny_qwen3_moe,
)
from tests.unit.scripts import load_script

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILDERS = {"llama": tiny_llama, "qwen3": tiny_qwen3, "qwen3_moe": tiny_qwen3_moe,
            "deepseek_v3": tiny_deepseek_v3, "nemotron_h": tiny_nemotron_h,
            # DeepSeek-V3 without q-LoRA, shaped like Moonlight: a plain query projection
            "deepseek_v3_no_q_lora": tiny_moonlight,
            # Nemotron-H without Mamba layers: the fork's hybrid model builds on CPU
            "nemotron_h_cpu": lambda folder: tiny_nemotron_h(folder, layers=NEMOTRON_H_CPU_LAYERS),
            # a dense first layer: --moe-layer-freq as a list, one checkpoint key per layer
            "qwen3_moe_dense_first": lambda folder: tiny_qwen3_moe(folder, mlp_only_layers=[0])}
# Models whose fork model runs on CPU (Mamba layers need mamba-ssm's kernels: tests/gpu).
ON_CPU = sorted(set(BUILDERS) - {"nemotron_h"})
ROUND_TRIP = sorted(set(BUILDERS) - {"nemotron_h_cpu"})
MLA = ("deepseek_v3", "deepseek_v3_no_q_lora")  # on CPU over `hf_tiny.cpu_mla_model`
DOCUMENTS = [9, 17, 5, 12]  # one packed row
# MoE on CPU runs megatron-core's drop-and-pad dispatch (dropless dispatch needs a GPU): a
# capacity of all tokens per expert drops none, so it routes as dropless does.
DROP_NOTHING = {"qwen3_moe": ["--moe-expert-capacity-factor=2",
                              "--moe-pad-expert-input-to-capacity"],
                "deepseek_v3": ["--moe-expert-capacity-factor=2",
                                "--moe-pad-expert-input-to-capacity"],
                "deepseek_v3_no_q_lora": ["--moe-expert-capacity-factor=2",
                                          "--moe-pad-expert-input-to-capacity"],
                "nemotron_h_cpu": ["--moe-expert-capacity-factor=2",
                                   "--moe-pad-expert-input-to-capacity"],
                "qwen3_moe_dense_first": ["--moe-expert-capacity-factor=2",
                                          "--moe-pad-expert-input-to-capacity"]}


def _weights(folder) -> dict:
    tensors = {}
    for name in os.listdir(folder):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(folder, name)))
    return tensors


def conversions(tmp_path_factory, builders: dict):
    """family -> (Hugging Face folder, converted folder) of ``builders``' tiny models, each
    built and converted at its first ask."""
    cache = {}

    def get(family):
        if family not in cache:
            root = tmp_path_factory.mktemp(family)
            hf = builders[family](root / "hf")
            import_hf(hf, root / "megatron")
            cache[family] = (hf, os.fspath(root / "megatron"))
        return cache[family]
    return get


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """`conversions` of the converter's families, built once per module."""
    return conversions(tmp_path_factory, BUILDERS)


@pytest.fixture
def cpu_rope(monkeypatch):
    # megatron-core builds RoPE tables and the expert bias on torch.cuda.current_device()
    # (rotary_pos_embedding.py, moe/router.py)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")


# ------------------------------------------------------------------------------ round trip

@pytest.mark.parametrize("family", ROUND_TRIP)
def test_round_trip_is_bitwise(converted, family, tmp_path):
    hf, megatron = converted(family)
    export_hf(megatron, tmp_path / "back")
    original, back = _weights(hf), _weights(tmp_path / "back")
    assert sorted(back) == sorted(original)
    for name, tensor in original.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    for side_file in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        with open(os.path.join(hf, side_file), "rb") as a, open(tmp_path / "back" / side_file,
                                                               "rb") as b:
            assert a.read() == b.read(), side_file


@pytest.mark.parametrize("family", ROUND_TRIP)
def test_export_loads_in_transformers(converted, family, tmp_path):
    from transformers import AutoModelForCausalLM

    hf, megatron = converted(family)
    export_hf(megatron, tmp_path / "back", max_shard_bytes=40_000)  # several shards
    assert os.path.isfile(tmp_path / "back" / "model.safetensors.index.json")
    tokens = torch.randint(3, VOCAB, (1, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(hf).eval()(tokens).logits
        actual = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()(tokens).logits
    assert torch.equal(actual, expected)


# ----------------------------------------------------------------- the fork's model and loader

def _fork_args(family, megatron, extra=()):
    """The parsed launch line of a converted checkpoint (and ``extra``), on CPU."""
    if family in MLA:
        from megatron.packed_training import extra_args

        with pytest.MonkeyPatch.context() as patch:  # the parse's check for TE attention
            patch.setattr(extra_args, "is_importable", lambda name: name == "transformer_engine")
            return parse_fork_args(flags_of(megatron), extra=[*DROP_NOTHING[family], *extra])
    return parse_fork_args(flags_of(megatron), _kind(family),
                           extra=["--attention-backend=local", *DROP_NOTHING.get(family, []),
                                  *extra])


def _kind(family) -> str:
    return "hybrid" if family.startswith("nemotron_h") else "gpt"


def _fork_model(family, megatron, extra=()):
    """The fork's model of a converted checkpoint on CPU: pretrain_gpt.py's or
    pretrain_mamba.py's provider, or for MLA (whose packed attention needs Transformer
    Engine) `hf_tiny.cpu_mla_model`."""
    args = _fork_args(family, megatron, extra)
    torch.manual_seed(1234)
    if family in MLA:
        return cpu_mla_model(args)
    return build_fork_model(args, _kind(family))


def _model_layout(model) -> tuple[dict, set]:
    """What megatron-core's save would store for ``model``: {key: global shape} and the
    ShardedObjects' unique keys."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, apply_factories

    sharded = model.sharded_state_dict()
    apply_factories(sharded)
    tensors, objects = {}, set()
    for value in nested_values(sharded):
        if isinstance(value, ShardedObject):
            objects.add(value.unique_key)
        else:
            tensors[value.key] = tuple(value.global_shape)
    return tensors, objects


def _checkpoint_layout(megatron) -> tuple[dict, set]:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    entries = FileSystemReader(os.path.join(megatron, "release")).read_metadata() \
        .state_dict_metadata
    tensors = {key: tuple(entry.size) for key, entry in entries.items()
               if not isinstance(entry, BytesStorageMetadata)}
    objects = {key for key, entry in entries.items() if isinstance(entry, BytesStorageMetadata)
               and not key.startswith("common_state")}
    return tensors, objects


def assert_checkpoint_fits(megatron, model):
    """The checkpoint holds exactly ``model``'s tensors and ``_extra_state`` entries, but for
    that of megatron-core's default GPT final norm, which has none where Transformer Engine
    is missing. (Every other norm of the TE-free spec saves one where TE's norm does.)"""
    model_tensors, model_objects = _model_layout(model)
    tensors, objects = _checkpoint_layout(megatron)
    assert tensors == model_tensors
    assert model_objects <= objects, sorted(model_objects - objects)
    extra = {key.partition("/")[0] for key in objects - model_objects}
    assert extra <= {"decoder.final_layernorm._extra_state"}, sorted(extra)


@pytest.mark.parametrize("family", ON_CPU)
def test_checkpoint_holds_what_the_fork_model_shards(converted, family, cpu_moe, cpu_rope):
    _, megatron = converted(family)
    assert_checkpoint_fits(megatron, _fork_model(family, megatron))


@pytest.mark.parametrize("family", [
    pytest.param(f, marks=pytest.mark.slow) if f in ("deepseek_v3", "nemotron_h_cpu", "qwen3_moe")
    else f for f in ON_CPU])
def test_fork_logits_equal_hugging_face_on_packed_rows(converted, family, cpu_moe, cpu_rope):
    from transformers import AutoModelForCausalLM

    hf, megatron = converted(family)
    model = _fork_model(family, megatron).eval()
    load_release(model, megatron)
    documents, tokens, positions, params = packed_documents(DOCUMENTS)
    logits = packed_logits(model, tokens, positions, params)
    reference = hf_document_logits(AutoModelForCausalLM.from_pretrained(hf).eval(), documents)
    for same_token, cosine, largest in agreement(logits, documents, reference, VOCAB):
        assert same_token and cosine >= 0.999
        assert largest < 1e-3  # fp32: only the summation order differs


def test_llama3_rope_scaling_reaches_the_model(converted, cpu_dist, cpu_rope):
    from transformers import AutoModelForCausalLM

    hf, megatron = converted("llama")
    model = _fork_model("llama", megatron)
    reference = AutoModelForCausalLM.from_pretrained(hf).model.rotary_emb.inv_freq
    assert "--use-rope-scaling" in flags_of(megatron)
    torch.testing.assert_close(model.rotary_pos_emb.inv_freq.float(), reference.float())


class _GatedNormStandIn(torch.nn.Module):
    """mamba-ssm's RMSNormGated as the checkpoint sees it: one weight, sharded on dim 0."""

    def __init__(self, hidden_size, eps, group_size, norm_before_gate, device, dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        return make_sharded_tensors_for_checkpoint(self.state_dict(keep_vars=True), prefix,
                                                   {"weight": 0}, sharded_offsets)


@pytest.fixture
def cpu_mamba(cpu_dist, cpu_rope, monkeypatch):
    """megatron-core's Mamba mixer built on CPU without mamba-ssm (built and loaded, never
    run): its gated norm `_GatedNormStandIn`, its CUDA RNG fork a no-op."""
    import contextlib
    from types import SimpleNamespace

    from megatron.core.ssm import mamba_mixer

    monkeypatch.setattr(mamba_mixer, "HAVE_MAMBA_SSM", True)
    monkeypatch.setattr(mamba_mixer, "ExtendedRMSNorm", _GatedNormStandIn)
    monkeypatch.setattr(mamba_mixer, "get_cuda_rng_tracker",
                        lambda: SimpleNamespace(fork=contextlib.nullcontext))


def test_a_nemotron_h_of_conv_width_3_converts_and_loads(tmp_path, cpu_mamba):
    """``conv_kernel`` 3 (megatron-core's d_conv; causal-conv1d computes 2 to 4) converts with
    --mamba-conv-kernel-size=3: pretrain_mamba.py's model, Mamba layers included, holds
    conv1d weights [channels, 1, 3], shards exactly what the checkpoint holds and loads the
    Hugging Face convolution; the export keeps the width."""
    hf = tiny_nemotron_h(tmp_path / "hf", layers=["linear_attention", "full_attention", "mlp",
                                                  "linear_attention"], conv_kernel=3)
    result = import_hf(hf, tmp_path / "megatron")
    assert "--mamba-conv-kernel-size=3" in result.flags
    model = _fork_model("nemotron_h", tmp_path / "megatron")
    assert model.decoder.layers[0].mixer.d_conv == 3
    assert model.decoder.layers[3].mixer.conv1d_weight.shape == (192, 1, 3)
    assert_checkpoint_fits(tmp_path / "megatron", model)
    load_release(model, tmp_path / "megatron")
    reference = _weights(hf)["backbone.layers.3.mixer.conv1d.weight"]
    assert torch.equal(model.decoder.layers[3].mixer.conv1d_weight, reference)
    export_hf(tmp_path / "megatron", tmp_path / "back")
    assert torch.equal(_weights(tmp_path / "back")["backbone.layers.3.mixer.conv1d.weight"],
                       reference)
    with open(tmp_path / "back" / "config.json") as f:
        assert json.load(f)["conv_kernel"] == 3


@pytest.fixture
def megatron_lm_loader(monkeypatch):
    """Megatron-LM's load_checkpoint on CPU: its tracker read all-reduces the iteration on a
    CUDA tensor (checkpointing.read_metadata); one rank reads it as it would alone."""
    from megatron.training import checkpointing

    read = checkpointing.read_metadata

    def one_rank(tracker):
        with monkeypatch.context() as patch:
            patch.setattr(torch.distributed, "is_initialized", lambda: False)
            return read(tracker)
    monkeypatch.setattr(checkpointing, "read_metadata", one_rank)
    return checkpointing.load_checkpoint


@pytest.mark.parametrize("family, how", [
    ("qwen3", ["--pretrained-checkpoint={ckpt}"]),
    ("qwen3", ["--load={ckpt}"]),
    ("qwen3", ["--load={ckpt}", "--finetune"]),
    ("qwen3_moe", ["--pretrained-checkpoint={ckpt}"]),
    # a hybrid checkpoint's args name its pattern; without it Megatron-LM would load it as a
    # GPT checkpoint retargeted to the hybrid stack
    ("nemotron_h_cpu", ["--load={ckpt}"]),
])
def test_megatron_lm_load_checkpoint_reads_it(converted, megatron_lm_loader, cpu_moe, cpu_rope,
                                              family, how, monkeypatch):
    """Megatron-LM's own loader, as the training scripts run it: a release loads as
    iteration 0 (no optimizer, no RNG state) with the model's every tensor from the
    checkpoint."""
    from megatron.core import num_microbatches_calculator
    from megatron.training import global_vars

    _, megatron = converted(family)
    reference = _fork_model(family, megatron)
    load_release(reference, megatron)
    model = _fork_model(family, megatron, [flag.format(ckpt=megatron) for flag in how])
    args = _fork_args(family, megatron, [flag.format(ckpt=megatron) for flag in how])
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", args)  # Megatron-LM's get_args()
    num_microbatches_calculator.init_num_microbatches_calculator(0, None, 1, 1, 1)
    try:
        iteration, _ = megatron_lm_loader([model], None, None)
    finally:
        num_microbatches_calculator.destroy_num_microbatches_calculator()
    assert iteration == 0
    expected = reference.state_dict()
    for name, tensor in model.state_dict().items():
        if torch.is_tensor(tensor):
            assert torch.equal(tensor, expected[name]), name


# ------------------------------------------------------------------------ vocabulary padding

def test_vocabulary_is_padded_for_the_tensor_parallel_size(converted, tmp_path):
    hf, _ = converted("llama")
    import_hf(hf, tmp_path / "tp2", tensor_parallel_size=2, make_vocab_size_divisible_by=64)
    tensors, _ = _checkpoint_layout(tmp_path / "tp2")
    assert tensors["embedding.word_embeddings.weight"][0] == 128  # 96 -> multiple of 64 x 2
    assert tensors["output_layer.weight"][0] == 128
    assert "--make-vocab-size-divisible-by=64" in flags_of(tmp_path / "tp2")
    export_hf(tmp_path / "tp2", tmp_path / "back")
    assert torch.equal(_weights(tmp_path / "back")["model.embed_tokens.weight"],
                       _weights(hf)["model.embed_tokens.weight"])


def test_a_tokenizer_smaller_than_the_config_vocabulary(tmp_path, cpu_dist, cpu_rope):
    """Qwen's config.json counts more embedding rows than its tokenizer has ids: the
    checkpoint keeps every row (the round trip stays bitwise), the run's model has the
    tokenizer's padded vocabulary and loads the rows it has."""
    from tests.unit.hf_tiny import make_tokenizer

    hf = tiny_qwen3(tmp_path / "hf", vocab_size=200)
    make_tokenizer(hf, VOCAB)  # 96 ids
    import_hf(hf, tmp_path / "megatron")
    tensors, _ = _checkpoint_layout(tmp_path / "megatron")
    assert tensors["embedding.word_embeddings.weight"][0] == 256
    args = parse_fork_args(flags_of(tmp_path / "megatron"), extra=["--attention-backend=local"])
    assert args.padded_vocab_size == 128
    model = build_fork_model(args)
    load_release(model, tmp_path / "megatron")
    rows = _weights(hf)["model.embed_tokens.weight"]
    assert torch.equal(model.embedding.word_embeddings.weight, rows[:128])
    export_hf(tmp_path / "megatron", tmp_path / "back")
    assert torch.equal(_weights(tmp_path / "back")["model.embed_tokens.weight"], rows)


# ---------------------------------------------------------------------- config.json spellings

def _rewrite_config(folder, change):
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    change(config)
    with open(path, "w") as f:
        json.dump(config, f)


def _hub_rope(config):
    parameters = config.pop("rope_parameters")
    config["rope_theta"] = parameters.pop("rope_theta")
    if parameters.get("rope_type", "default") != "default":
        parameters["type"] = parameters.pop("rope_type")  # the oldest hub spelling
        config["rope_scaling"] = parameters


def _hub_nemotron_h(config):
    chars = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}
    config["hybrid_override_pattern"] = "".join(chars[kind]
                                                for kind in config.pop("layers_block_type"))
    config["attention_head_dim"] = config.pop("head_dim")
    config["rms_norm_eps"] = config.pop("layer_norm_epsilon")


@pytest.mark.parametrize("family, change", [
    ("llama", _hub_rope),
    ("qwen3_moe", lambda c: (_hub_rope(c), c.update(num_experts=c.pop("num_local_experts")))),
    ("nemotron_h", _hub_nemotron_h),
])
def test_hub_key_names_give_the_same_model(converted, family, change, tmp_path):
    hf, _ = converted(family)
    hub = shutil.copytree(hf, tmp_path / "hub")
    _rewrite_config(hub, change)
    assert (flag_tokens(describe(HFConfig.from_folder(hub)).flags)
            == flag_tokens(describe(HFConfig.from_folder(hf)).flags))


# -------------------------------------------------------------------------------- refusals

def _describe(raw):
    return describe(HFConfig(raw))


def test_unknown_model_type_lists_the_supported_ones():
    with pytest.raises(ConversionError, match="model_type is 'gpt2': the converter supports "
                                              + ", ".join(supported_model_types())):
        _describe({"model_type": "gpt2"})


@pytest.mark.parametrize("change, message", [
    (dict(mlp_bias=True), "mlp_bias is True: the fork's GPT model is built with "
                          "--disable-bias-linear"),
    (dict(hidden_act="gelu"), "hidden_act is 'gelu': this family converts with silu"),
    (dict(num_key_value_heads=3), "num_key_value_heads is 3: it must divide "
                                  "num_attention_heads"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}),
     "rope_scaling.rope_type is 'yarn': Llama converts plain RoPE or llama3"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0}),
     "rope_scaling.low_freq_factor is 2.0: Megatron's --use-rope-scaling fixes it at 1"),
])
def test_llama_fields_the_fork_cannot_build_are_refused(change, message):
    raw = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
           "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 96,
           "vocab_size": VOCAB, "max_position_embeddings": 256, **change}
    with pytest.raises(ConversionError, match=message):
        _describe(raw)


@pytest.mark.parametrize("conv_kernel, layers, flag", [
    (4, NEMOTRON_H_LAYERS, None), (2, NEMOTRON_H_LAYERS, 2), (3, NEMOTRON_H_LAYERS, 3),
    (5, NEMOTRON_H_CPU_LAYERS, None),  # no Mamba layer, no convolution to build
])
def test_nemotron_h_conv_kernel_becomes_the_mamba_conv_flag(conv_kernel, layers, flag):
    flags = _describe({"model_type": "nemotron_h", **NEMOTRON_H, "layers_block_type": layers,
                       "conv_kernel": conv_kernel}).flags
    assert flags.get("--mamba-conv-kernel-size") == flag


@pytest.mark.parametrize("conv_kernel", [1, 5])
def test_a_nemotron_h_conv_kernel_causal_conv1d_cannot_compute_is_refused(conv_kernel):
    raw = {"model_type": "nemotron_h", **NEMOTRON_H, "layers_block_type": NEMOTRON_H_LAYERS,
           "conv_kernel": conv_kernel}
    with pytest.raises(ConversionError, match=f"config.json field conv_kernel is {conv_kernel}: "
                                              "causal-conv1d computes Mamba convolutions of "
                                              r"width 2, 3 or 4 \(--mamba-conv-kernel-size\)"):
        _describe(raw)


def test_a_checkpoint_with_tensors_the_model_lacks_is_refused(converted, tmp_path):
    from safetensors.torch import save_file

    hf, _ = converted("qwen3")
    extra = shutil.copytree(hf, tmp_path / "extra")
    weights = _weights(extra)
    weights["model.layers.0.self_attn.extra_gate.weight"] = torch.zeros(2, 2)
    save_file(weights, extra / "model.safetensors")
    with pytest.raises(ConversionError, match="1 checkpoint tensors have no place in the "
                                              "fork's model, e.g. model.layers.0.self_attn"):
        import_hf(extra, tmp_path / "out")


def test_export_refuses_a_checkpoint_of_another_model(converted, tmp_path):
    _, llama = converted("llama")
    qwen3, _ = converted("qwen3")
    with pytest.raises(ConversionError, match="has no decoder.layers.self_attention.q_layernorm"):
        export_hf(llama, tmp_path / "out", hf_config=qwen3)


# -------------------------------------------------------------------------------- the tool

def _tool():
    return load_script("tools", "convert_hf.py")


@pytest.mark.slow
def test_tool_converts_both_ways_and_measures(converted, tmp_path, capsys):
    hf, _ = converted("llama")
    run = subprocess.run([sys.executable, os.path.join(REPO, "tools", "convert_hf.py"), "import",
                          hf, tmp_path / "m", "--measure"], cwd=REPO, capture_output=True,
                         text=True, check=True)
    assert "pretrain_gpt.py \\\n    --num-layers=2 \\" in run.stdout
    assert f"--pretrained-checkpoint={tmp_path / 'm'}" in run.stdout
    assert "measured: " in run.stdout and "peak host memory" in run.stdout
    tool = _tool()  # the rest in this process: Megatron-LM's imports are paid already
    assert tool.main(["export", str(tmp_path / "m"), str(tmp_path / "back"), "--measure",
                      "--max-shard-size", "50KB"]) == 0
    assert "measured: " in capsys.readouterr().out
    assert os.path.isfile(tmp_path / "back" / "model.safetensors.index.json")
    assert tool.main(["flags", hf]) == 0
    assert capsys.readouterr().out.startswith("pretrain_gpt.py \\\n    --num-layers=2 \\")
    assert tool.main(["flags", REPO]) == 2
    assert "convert_hf.py: error: " in capsys.readouterr().err


# ------------------------------------------------------------------- the SFT example, on CPU

def load_example():
    return load_script("examples", "hf", "sft_from_hugging_face.py")


@pytest.mark.slow
def test_sft_example_line_parses_and_starts_from_the_pretrained_loss(tmp_path, cpu_dist,
                                                                    cpu_rope):
    """The example's training line passes the real parser, and the loss of its first
    micro-batch (the fork's data pipeline on the chat file) under the converted model is the
    Hugging Face model's on the same documents: the first logged loss of a run is the
    pretrained model's (tests/gpu/test_hf_checkpoints.py checks it in a real run)."""
    from transformers import AutoModelForCausalLM

    from tests.unit.hf_tiny import first_micro_batches, fork_loss_sum, hf_loss_sum, write_chat_data

    example = load_example()
    hf = tiny_qwen3(tmp_path / "hf")
    data = write_chat_data(tmp_path / "chat.jsonl")
    converted = example.convert(hf, tmp_path / "work")
    command = example.training_command(converted, data, str(tmp_path / "work"),
                                       train_iters=4, seq_length=128, global_batch_size=2,
                                       capacity=16)
    script = command.index(os.path.join(REPO, "pretrain_gpt.py"))
    args = parse_fork_args(command[script + 1:], extra=["--attention-backend=local"],
                           training=())
    assert (args.sft, args.packed_graph_impl, args.cuda_graph_max_packed_seqs) == (
        True, "local", 16)
    assert args.pretrained_checkpoint == os.path.join(tmp_path / "work", "megatron")
    (batch,) = first_micro_batches(args, 1)
    assert batch["num_documents"] > 1 and batch["loss_mask"].sum() > 0
    model = _fork_model("qwen3", converted.destination).eval()
    load_release(model, converted.destination)
    fork = fork_loss_sum(model, batch)
    reference = hf_loss_sum(AutoModelForCausalLM.from_pretrained(hf).eval(), batch)
    assert fork[1] == reference[1]
    assert abs(fork[0] / fork[1] - reference[0] / reference[1]) < 1e-4
    # The example's last step on the converted model exported straight back.
    export_hf(converted.destination, tmp_path / "back")
    tokens = example.generate(str(tmp_path / "back"), example.first_prompt(data), 4)
    assert len(tokens) == 4 and all(0 <= token < VOCAB for token in tokens)


@pytest.mark.parametrize("run_vocab, hf_vocab, tp, divisor, trained_rows_only", [
    (128256, 128256, 1, 128, True),  # Llama 3: no padding at the default
    (128256, 128256, 8, 32, True),   # 128 x 8 would add 768 zero rows at TP 8; 32 x 8 none
    (151669, 151936, 1, 128, True),  # Qwen: the tokenizer pads into the checkpoint's rows
    (96, 96, 1, 32, True),
    (97, 97, 2, 128, False),         # nothing avoids a zero row: Megatron's default
])
def test_vocab_divisor_keeps_the_runs_rows_trained(run_vocab, hf_vocab, tp, divisor,
                                                   trained_rows_only):
    from megatron.packed_training.hf.convert import padded_vocab_size, vocab_divisor

    assert vocab_divisor(run_vocab, hf_vocab, tp) == divisor
    assert (padded_vocab_size(run_vocab, divisor, tp) <= hf_vocab) == trained_rows_only


# ------------------------------------------------------------------------- streaming writes

def test_the_writer_makes_one_chunk_at_a_time(tmp_path, cpu_dist):
    """write_checkpoint asks for each chunk when it writes it: at most the chunk being written
    is alive (peak memory is one chunk, not the checkpoint), and megatron-core reads every
    chunk back where it was planned."""
    import gc
    import weakref

    from megatron.packed_training.hf import torch_dist

    alive = []

    def chunk(layer):
        def produce():
            gc.collect()
            assert sum(ref() is not None for ref in alive) <= 1, "chunks pile up in memory"
            tensor = torch.full((1, 4, 8), float(layer))
            alive.append(weakref.ref(tensor))
            return tensor
        return torch_dist.Chunk((layer, 0, 0), (1, 4, 8), produce)

    stored = torch_dist.StoredTensor("decoder.layers.w", (6, 4, 8), torch.float32,
                                     [chunk(layer) for layer in range(6)])
    torch_dist.write_checkpoint(tmp_path, [stored], [], {"iteration": 0})
    assert len(alive) == 6
    requests = {layer: torch_dist.Request("decoder.layers.w", (6, 4, 8), torch.float32, (layer,))
                for layer in (0, 5)}
    loaded = torch_dist.read_tensors(str(tmp_path), requests)
    assert torch.equal(loaded[5], torch.full((4, 8), 5.0)) and loaded[0].shape == (4, 8)


def test_the_writer_refuses_chunks_that_do_not_tile(tmp_path):
    from megatron.packed_training.hf import torch_dist

    def chunk(offset):
        return torch_dist.Chunk(offset, (1, 4), lambda: torch.zeros(1, 4))

    gap = torch_dist.StoredTensor("w", (3, 4), torch.float32, [chunk((0, 0)), chunk((2, 0))])
    with pytest.raises(ValueError,
                       match="checkpoint tensor w: 2 chunks of \\(1, 4\\) do not cover"):
        torch_dist.write_checkpoint(tmp_path, [gap], [], {})


def test_without_the_tokenizer_the_flags_give_the_vocabulary(converted, tmp_path):
    hf, _ = converted("llama")
    result = import_hf(hf, tmp_path / "m", tokenizer=False)
    assert f"--vocab-size={VOCAB}" in result.flags
    assert not any(flag.startswith("--tokenizer") for flag in result.flags)
    assert sorted(os.listdir(tmp_path / "m")) == ["config.json", "generation_config.json",
                                                  "latest_checkpointed_iteration.txt",
                                                  "megatron_flags.txt", "release"]
    args = parse_fork_args(flags_of(tmp_path / "m"), extra=["--attention-backend=local"])
    assert (args.tokenizer_type, args.padded_vocab_size) == ("NullTokenizer", VOCAB)


def test_import_reads_the_shards_in_their_order(tmp_path, monkeypatch):
    """A model in many shards: each shard is opened once for its headers and about once for
    its tensors (at most two open at a time; a fused weight whose parts straddle two shards
    may reopen one), whatever the order of the checkpoint's keys (key by key, every layer of
    one key, would open each shard once per key)."""
    from megatron.packed_training.hf import safetensors_io

    hf = tiny_llama(tmp_path / "hf", num_hidden_layers=4)
    model = __import__("transformers").AutoModelForCausalLM.from_pretrained(hf)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    for name in os.listdir(hf):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(hf, name), tmp_path / "sharded")
    with open(tmp_path / "sharded" / "model.safetensors.index.json") as f:
        shards = set(json.load(f)["weight_map"].values())
    assert len(shards) >= 4
    opened = []
    real_open = safetensors_io.safe_open
    monkeypatch.setattr(safetensors_io, "safe_open",
                        lambda path, **kw: opened.append(path) or real_open(path, **kw))
    import_hf(tmp_path / "sharded", tmp_path / "out")
    assert len(opened) < 3 * len(shards), sorted(opened)


def test_rope_tables_and_a_tied_output_copy_are_left_out(converted, tmp_path):
    """Older checkpoints save RoPE frequencies, some tied models a copy of the embedding as
    lm_head: neither is a weight of the model; the import says what it left out."""
    from safetensors.torch import save_file

    hf, _ = converted("qwen3")  # tied embeddings
    extra = shutil.copytree(hf, tmp_path / "extra")
    weights = _weights(extra)
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(16)
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, extra / "model.safetensors")
    result = import_hf(extra, tmp_path / "out")
    assert any("rotary_emb.inv_freq" in note for note in result.notes)
    assert any("lm_head.weight" in note and "tie_word_embeddings" in note
               for note in result.notes)


@pytest.mark.parametrize("family, graphs", [
    ("llama", "layer"), ("llama", "full_iteration"), ("qwen3_moe", "layer"),
    ("deepseek_v3", "layer"), ("deepseek_v3_no_q_lora", "layer"), ("nemotron_h", "layer")])
def test_the_gpu_tests_launch_lines_parse(converted, family, graphs, monkeypatch):
    """tests/gpu/test_hf_checkpoints.py's training lines (converted flags, the checkpoint,
    its training and graph flags) pass Megatron-LM's and the fork's checks here, before a GPU
    runs them (Transformer Engine stands importable: the GPU machine has it)."""
    from megatron.packed_training import extra_args
    from megatron.packed_training.arguments import parse_args
    from tests.gpu import test_hf_checkpoints as gpu

    monkeypatch.setattr(extra_args, "is_importable", lambda name: name == "transformer_engine")
    _, megatron = converted(family)
    line = gpu._launch(megatron, family) + gpu.TRAINING + (
        gpu.LAYER_GRAPHS if graphs == "layer" else gpu.FULL_ITERATION)
    args = parse_args(line, _kind(family), raise_on_error=True)
    assert args.packed_graph_impl == ("local" if graphs == "layer" else "full_iteration")
    assert args.pretrained_checkpoint == megatron


# ------------------------------------------------------- what a new user gets wrong, one line

@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory):
    """A tiny Qwen3 folder, never written to (copy it to damage it)."""
    return tiny_qwen3(tmp_path_factory.mktemp("qwen3-tiny") / "hf")


def _shard(folder):
    """Rewrite ``folder``'s model.safetensors as two shards and their index; returns the
    second shard's path."""
    from safetensors.torch import save_file

    weights = load_file(os.path.join(folder, "model.safetensors"))
    os.remove(os.path.join(folder, "model.safetensors"))
    names = sorted(weights)
    shard_of = {name: f"model-0000{1 + 2 * i // len(names)}-of-00002.safetensors"
                for i, name in enumerate(names)}
    for shard in sorted(set(shard_of.values())):
        save_file({n: weights[n] for n in names if shard_of[n] == shard},
                  os.path.join(folder, shard))
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": shard_of}, f)
    return os.path.join(folder, "model-00002-of-00002.safetensors")


def _truncate(path):
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[:len(data) // 2])


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("damage, message", [
    ("truncated file", r"model\.safetensors is truncated or not a safetensors file \(.+\): "
                       r"download it again$"),
    ("truncated shard", r"model-00002-of-00002\.safetensors is truncated or not a safetensors "
                        r"file \(.+\): download it again$"),
    ("missing shard", r"model\.safetensors\.index\.json names 1 shard file\(s\) that .+ lacks, "
                      r"e\.g\. model-00002-of-00002\.safetensors: download every file the "
                      r"index names$"),
    ("broken index", r"model\.safetensors\.index\.json is not a safetensors index \(JSON with a "
                     r"weight_map object\): download it again$"),
    ("no folder", r"does not exist: the converter reads a local folder, never the hub"),
])
def test_import_of_a_damaged_folder_says_what_is_wrong_in_one_line(qwen3_folder, tmp_path,
                                                                   capsys, damage, message):
    import re

    hf = shutil.copytree(qwen3_folder, tmp_path / "hf")
    if damage == "truncated file":
        _truncate(hf / "model.safetensors")
    elif damage == "truncated shard":
        _truncate(_shard(hf))
    elif damage == "missing shard":
        os.remove(_shard(hf))
    elif damage == "broken index":
        _shard(hf)
        (hf / "model.safetensors.index.json").write_text('{"weight_map": ')
    else:
        shutil.rmtree(hf)
    assert _tool().main(["import", str(hf), str(tmp_path / "out")]) == 2
    assert re.match(r"convert_hf\.py: error: .*" + message, _one_error_line(capsys))
    assert not os.path.exists(tmp_path / "out")  # refused before anything is written


@pytest.mark.parametrize("what, message", [
    ("empty folder", "is not a Megatron-LM checkpoint (it has neither "
                     "latest_checkpointed_iteration.txt nor metadata.json): pass a training "
                     "run's --save folder or one of its iter_* folders"),
    ("hugging face folder", "is not a Megatron-LM checkpoint (it has neither "
                            "latest_checkpointed_iteration.txt nor metadata.json): it is a "
                            "Hugging Face folder: convert it with `import`"),
    ("no folder", "is not a folder: pass a training run's --save folder"),
    ("torch format", "holds a checkpoint of --ckpt-format torch (mp_rank_* folders). Model "
                     "weights are read from torch_dist checkpoints: save with --ckpt-format "
                     "torch_dist, Megatron-LM's default"),
    ("no config", "has no config.json: name the folder that holds the model's config.json "
                  "(the `import` output) with --hf-config"),
])
def test_export_of_a_folder_that_is_no_megatron_checkpoint_is_one_line(qwen3_folder, tmp_path,
                                                                       capsys, what, message):
    checkpoint = tmp_path / "checkpoint"
    if what == "hugging face folder":
        shutil.copytree(qwen3_folder, checkpoint)
    elif what != "no folder":
        checkpoint.mkdir()
    if what == "torch format":  # Megatron-LM's --ckpt-format torch: no metadata.json
        (checkpoint / "latest_checkpointed_iteration.txt").write_text("100")
        (checkpoint / "iter_0000100" / "mp_rank_00").mkdir(parents=True)
    if what == "no config":
        (checkpoint / "metadata.json").write_text("{}")
    hf_config = ["--hf-config", qwen3_folder] if what in ("empty folder", "torch format") else []
    assert _tool().main(["export", str(checkpoint), str(tmp_path / "out"), *hf_config]) == 2
    line = _one_error_line(capsys)
    assert line.startswith(f"convert_hf.py: error: {checkpoint}") and message in line, line
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("command", [["flags", "HF"], ["import", "HF", "OUT"],
                                     ["export", "CHECKPOINT", "OUT"]])
def test_every_command_without_safetensors_names_the_extra(tmp_path, command):
    """A Python where `import safetensors` fails: one line naming the package and the extra
    to install, exit status 2, before anything is imported or read."""
    (tmp_path / "safetensors.py").write_text(
        "raise ImportError('No module named safetensors (stood in by the test)')\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    run = subprocess.run([sys.executable, os.path.join(REPO, "tools", "convert_hf.py"),
                          *[str(tmp_path / word) if word.isupper() else word
                            for word in command]],
                         cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.splitlines() == [
        "convert_hf.py: error: the safetensors package is not importable, and the converter "
        "reads and writes safetensors files: install the converter's dependencies, "
        "pip install -e \".[hf]\""]


def test_import_without_transformers_names_the_extra(qwen3_folder, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import raises ImportError
    with pytest.raises(ConversionError, match=r"reading the tokenizer of .* needs the "
                                              r"transformers package.*pip install -e "
                                              r"\"\.\[hf\]\" \(or pass --no-tokenizer"):
        import_hf(qwen3_folder, tmp_path / "out")


def test_import_of_a_megatron_checkpoint_points_at_export(qwen3_folder, tmp_path):
    folder = shutil.copytree(qwen3_folder, tmp_path / "megatron")
    os.remove(folder / "model.safetensors")
    (folder / "latest_checkpointed_iteration.txt").write_text("release")
    with pytest.raises(ConversionError, match="is a Megatron-LM checkpoint, not a Hugging Face "
                                              "folder: convert it with `export`"):
        import_hf(folder, tmp_path / "out")


# -------------------------------------------------------------- the SFT example's failures

TORCHRUN_LOG = """\
[rank0]: Traceback (most recent call last):
[rank0]:   File "/repo/pretrain_gpt.py", line 28, in <module>
[rank0]:     sys.exit(main())
[rank0]:              ^^^^^^
[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB
[rank0]:[W1129 07:36:32 ProcessGroupNCCL.cpp:1250] Warning: destroy_process_group() was not called
E1129 07:36:32 10287 torch/distributed/elastic/multiprocessing/api.py:986] failed (exitcode: 1)
Traceback (most recent call last):
  File "/venv/lib/python3.12/site-packages/torch/distributed/run.py", line 994, in <module>
    main()
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
/repo/pretrain_gpt.py FAILED
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  exitcode  : 1 (pid: 10302)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""


@pytest.mark.parametrize("log, cause", [
    (TORCHRUN_LOG, "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"),
    ("building model\npretrain_gpt.py: error: chat.jsonl:3: messages[0].content is wrong: null."
     "\n" + TORCHRUN_LOG.split("E1129")[1],
     "pretrain_gpt.py: error: chat.jsonl:3: messages[0].content is wrong: null."),
    ("step 10\n" + TORCHRUN_LOG.split("E1129")[1].replace(
        "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html",
        "Signal 9 (SIGKILL) received by PID 10302"), "Signal 9 (SIGKILL) received by PID 10302"),
    ("loading\nKilled", "Killed"),
    ("", ""),
])
def test_the_cause_of_a_failed_run_is_its_error_not_torchruns_report(log, cause):
    assert load_example().failure_cause(log) == cause


def _failing_run(example, monkeypatch, code):
    """The example's steps with the conversion stood in for and training running ``code``."""
    converted = type("Converted", (), {"script": "pretrain_gpt.py", "flags": []})()
    monkeypatch.setattr(example, "convert", lambda *args: converted)
    monkeypatch.setattr(example, "training_command",
                        lambda *args, **kwargs: [sys.executable, "-c", code])


def test_a_failed_training_step_prints_its_cause_in_one_line(tmp_path, monkeypatch, capsys):
    example = load_example()
    _failing_run(example, monkeypatch, "print('starting'); import json; json.loads('{')")
    work = tmp_path / "work"
    assert example.main(["--hf", str(tmp_path), "--data", "chat.jsonl", "--work",
                         str(work)]) == 1
    assert capsys.readouterr().err.splitlines() == [
        "sft_from_hugging_face.py: training failed (exit 1): json.decoder.JSONDecodeError: "
        "Expecting property name enclosed in double quotes: line 1 column 2 (char 1) "
        f"(full log: {work / 'train.log'})"]


def test_a_failed_conversion_prints_its_cause_in_one_line(tmp_path, capsys):
    assert load_example().main(["--hf", str(tmp_path / "Qwen3-0.6B"), "--data", "chat.jsonl",
                                "--work", str(tmp_path / "work")]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"sft_from_hugging_face.py: conversion failed: {tmp_path / 'Qwen3-0.6B'} does not "
        "exist: the converter reads a local folder, never the hub (download the model first, "
        "e.g. `hf download ORG/MODEL --local-dir MODEL`)"]
