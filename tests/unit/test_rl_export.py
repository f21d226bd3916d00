"""Weights for an inference engine (megatron/packed_training/rl/export.py,
`PackedPolicy.export_weights`) on CPU, for every family the converter knows: the fork's model
built from a tiny Hugging Face model and its converted checkpoint (tests/unit/hf_tiny.py, as
test_hf_convert.py builds it), exported from its live parameters.

* From the loaded model, the export is the Hugging Face checkpoint: every tensor once, under
  its name, bitwise (Nemotron-H's Mamba layers too: built, not run, without mamba-ssm).
* After the fork's weights moved off the checkpoint, transformers takes the pairs as a
  checkpoint's state dict with no tensor missing, unknown or misfit (and a fresh model of the
  dense families with ``load_state_dict(strict=True)``: transformers 5 fuses MoE experts in
  memory) and gives the fork's logits on packed rows (test_hf_convert.py's tolerance): the
  export is of the live weights.
* ``bucket_bytes`` buckets hold the same pairs; the policy's method is the function.
* Tensor, expert and pipeline parallel size 2 (and all three at once on four processes),
  megatron-core's parallel state on a gloo world of CPU processes: every rank's export equals
  the single-process export bit for bit.
* The two-GPU layouts of tests/gpu/test_rl_export_on_gpus.py that run the TE-free spec, built
  from its worker's flags as `PackedPolicy.build` parses them (bf16, the layout's
  ``--sequence-parallel`` included), on two gloo CPU processes: they build, and their exports
  equal the one-process export of the same flags bit for bit.
* Refusals: a family the converter does not know, a model of another config, a policy without a
  family, bad ``bucket_bytes``.
"""

import argparse
import contextlib
import io
import json
import os
import re
from types import SimpleNamespace

import pytest
import torch

from megatron.packed_training.hf import ConversionError
from megatron.packed_training.hf.families import supported_model_types
from megatron.packed_training.rl import PackedPolicy, PolicyConfig
from megatron.packed_training.rl.export import buckets, export_weights
from megatron.packed_training.rl.policy import hf_family
from tests.unit.hf_tiny import (
    VOCAB,
    NEMOTRON_H,
    agreement,
    hf_document_logits,
    load_release,
    packed_documents,
    packed_logits,
    tiny_qwen3_moe,
)
from tests.unit.test_hf_convert import (  # noqa: F401  (fixtures)
    BUILDERS as CONVERTER_BUILDERS,
    DOCUMENTS,
    ON_CPU,
    _fork_args,
    _fork_model,
    _kind,
    _weights,
    conversions,
    cpu_mamba,
    cpu_rope,
)

# Qwen3-MoE of four layers (one dense first): two pipeline stages of two layers.
BUILDERS = {**CONVERTER_BUILDERS, "qwen3_moe_4_layers": lambda folder: tiny_qwen3_moe(
    folder, num_hidden_layers=4, mlp_only_layers=[0])}
# Every family the converter knows, Nemotron-H whole (Mamba layers built, not run) and without
# Mamba layers (its model runs on CPU).
EVERY = sorted(set(CONVERTER_BUILDERS))
HEAVY = ("deepseek_v3", "nemotron_h_cpu", "qwen3_moe")  # as test_hf_convert.py marks them


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """`conversions` of this module's builders (the converter's and a 4-layer Qwen3-MoE)."""
    return conversions(tmp_path_factory, BUILDERS)


def loaded_model(family, megatron):
    """The fork's model of a converted checkpoint, loaded (test_hf_convert's `_fork_model`)."""
    with contextlib.redirect_stdout(io.StringIO()):  # Megatron-LM's argument dump
        model = _fork_model(family, megatron).eval()
    load_release(model, megatron)
    return model


def exported(model_chunks, hf_config, **kwargs) -> list:
    return list(export_weights(model_chunks, hf_config, **kwargs))


# ----------------------------------------------------------------------------- the layout

@pytest.mark.parametrize("family", EVERY)
def test_the_export_of_the_loaded_model_is_the_hugging_face_checkpoint(converted, family,
                                                                       cpu_moe, cpu_rope,
                                                                       request):
    if family == "nemotron_h":  # Mamba layers: megatron-core's mixer built without mamba-ssm
        request.getfixturevalue("cpu_mamba")
    hf, megatron = converted(family)
    model = loaded_model(family, megatron)
    pairs = exported([model], megatron)
    names = [name for name, _ in pairs]
    assert len(names) == len(set(names))  # each tensor exactly once
    original = _weights(hf)
    assert sorted(names) == sorted(original)
    for name, tensor in pairs:
        assert tensor.dtype == original[name].dtype and tensor.device.type == "cpu"
        assert torch.equal(tensor, original[name]), name
        assert not tensor.requires_grad
    # Tensors kept in the parameter's layout are the live parameters, not copies.
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    embedding = dict(pairs)[names[0]]
    assert names[0].endswith("embed_tokens.weight") or names[0] == "backbone.embeddings.weight"
    assert embedding.untyped_storage().data_ptr() in storages


def _tied_aliases(model) -> dict:
    """{name: the name it is tied to} of a transformers model's state dict (a tied lm_head)."""
    first, aliases = {}, {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        source = first.setdefault(id(tensor), name)
        if source != name:
            aliases[name] = source
    return aliases


def _moved(model, seed=5) -> None:
    """Every parameter a few per cent off the checkpoint's value, as training moves them."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(1 + 0.05 * torch.randn(parameter.shape, generator=generator))


# transformers 5 keeps these families' checkpoint names in memory; its MoE models fuse their
# experts in memory (``mlp.experts.gate_up_proj`` [E, 2F, H]) and convert the per-expert
# tensors of a checkpoint (the names vLLM and SGLang load, and the export's) as they load.
SAME_NAMES_IN_MEMORY = ("llama", "qwen3")


@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.slow) if f in HEAVY
                                    else f for f in ON_CPU])
def test_a_fresh_transformers_model_takes_the_export_strictly_and_gives_the_fork_logits(
        converted, family, cpu_moe, cpu_rope):
    from transformers import AutoConfig, AutoModelForCausalLM

    hf, megatron = converted(family)
    model = loaded_model(family, megatron)
    _moved(model)
    pairs = dict(exported([model], megatron))
    original = _weights(hf)
    assert sum(not torch.equal(pairs[name], original[name]) for name in pairs) > len(pairs) // 2
    config = AutoConfig.from_pretrained(hf)
    torch.manual_seed(0)
    fresh = AutoModelForCausalLM.from_config(config).eval()
    # The pairs as a checkpoint's state dict: transformers' loader converts and places every
    # tensor and reports any it lacks, does not know or cannot fit.
    loaded, info = type(fresh).from_pretrained(None, config=config, state_dict=pairs,
                                               output_loading_info=True)
    assert not any(info.values()), info
    if family in SAME_NAMES_IN_MEMORY:  # the literal strict load too (a tied lm_head: its source)
        aliases = _tied_aliases(fresh)
        assert sorted(pairs) == sorted(set(fresh.state_dict()) - set(aliases))
        fresh.load_state_dict({**pairs, **{alias: pairs[source]
                                           for alias, source in aliases.items()}}, strict=True)
        assert all(torch.equal(value, loaded.state_dict()[name])
                   for name, value in fresh.state_dict().items())
    documents, tokens, positions, params = packed_documents(DOCUMENTS)
    logits = packed_logits(model, tokens, positions, params)
    reference = hf_document_logits(loaded.eval(), documents)
    for same_token, cosine, largest in agreement(logits, documents, reference, VOCAB):
        assert same_token and cosine >= 0.999
        assert largest < 1e-3  # fp32: only the summation order differs


# ------------------------------------------------------------------------------- buckets

def test_buckets_hold_the_same_pairs_in_order(converted, cpu_moe, cpu_rope):
    _, megatron = converted("qwen3_moe_dense_first")
    model = loaded_model("qwen3_moe_dense_first", megatron)
    pairs = exported([model], megatron)
    limit = 20_000
    bucketed = exported([model], megatron, bucket_bytes=limit)
    assert len(bucketed) > 3
    flat = [pair for bucket in bucketed for pair in bucket]
    assert [name for name, _ in flat] == [name for name, _ in pairs]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(flat, pairs))
    for bucket in bucketed:
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert size <= limit or len(bucket) == 1
    assert len(exported([model], megatron, bucket_bytes=1 << 40)) == 1


def test_a_bucket_closes_before_the_tensor_that_would_overflow_it():
    tensors = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([10, 10, 30, 5, 5, 1])]  # fp32
    grouped = [[name for name, _ in bucket] for bucket in buckets(tensors, 80)]
    assert grouped == [["t0", "t1"], ["t2"], ["t3", "t4", "t5"]]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "1GB"])
def test_bucket_bytes_other_than_a_positive_number_are_refused(bad):
    with pytest.raises(ValueError, match=rf"bucket_bytes is wrong: {bad!r}. Give a positive "
                                         rf"number of bytes"):
        export_weights([], {"model_type": "llama"}, bucket_bytes=bad)


# ----------------------------------------------------------------------- the policy's method

def cpu_policy(model, hf_config):
    """A `PackedPolicy` around ``model`` with no optimizer, runtime or schedule to run (only
    its weights are used)."""
    return PackedPolicy([model], None, None, SimpleNamespace(listeners=[]), row_positions=64,
                        vocab_size=VOCAB, hf_config=hf_config,
                        step_options={"with_seq_idx": False, "static_max_seqlen": True,
                                      "device": torch.device("cpu")})


def test_the_policy_method_exports_what_the_function_does(converted, cpu_dist, cpu_rope):
    _, megatron = converted("llama")
    model = loaded_model("llama", megatron)
    policy = cpu_policy(model, megatron)
    expected = exported([model], megatron)
    got = list(policy.export_weights())
    assert [n for n, _ in got] == [n for n, _ in expected]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, expected))
    flat = [pair for bucket in policy.export_weights(bucket_bytes=50_000) for pair in bucket]
    assert [n for n, _ in flat] == [n for n, _ in expected]
    with pytest.raises(ValueError, match=r"export_weights has no Hugging Face family to map the "
                                         r"policy to: build it with PolicyConfig\(hf_config="):
        cpu_policy(model, None).export_weights()


def _args(**fields):
    """The parts of the training arguments `PackedPolicy.build` reads before the GPU."""
    return argparse.Namespace(**{"pipeline_model_parallel_size": 1,
                                 "context_parallel_size": 1, "pretrained_checkpoint": None,
                                 "load": None, **fields})


def _config_folder(tmp_path, config: dict):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_the_family_comes_from_the_converted_checkpoint_the_policy_starts_from(converted):
    hf, megatron = converted("llama")
    for name in ("pretrained_checkpoint", "load"):
        family = hf_family(PolicyConfig(_args(**{name: megatron})), _args(**{name: megatron}))
        assert family.family == "llama"
    # A Hugging Face folder is no converted checkpoint: nothing is assumed from it.
    assert hf_family(PolicyConfig(_args()), _args(pretrained_checkpoint=hf)) is None
    assert hf_family(PolicyConfig(_args(), hf_config=hf), _args()).family == "llama"


def test_a_family_the_converter_does_not_know_is_refused_before_any_gpu_work(tmp_path):
    folder = _config_folder(tmp_path / "gpt2", {"model_type": "gpt2"})
    config = PolicyConfig(_args(), hf_config=folder)
    # On this machine the GPU check right after would raise RuntimeError: the family is first.
    with pytest.raises(ValueError, match=(
            rf"PolicyConfig.hf_config is wrong: {re.escape(str(folder))}: config.json "
            rf"model_type is 'gpt2'.* "
            rf"export_weights maps the converter's families "
            rf"\({', '.join(supported_model_types())}\): give hf_config the config.json folder "
            rf"of such a model")):
        PackedPolicy.build(config)
    with pytest.raises(ConversionError, match="config.json model_type is 'gpt2': the converter "
                                              "supports"):
        export_weights([], {"model_type": "gpt2"})


def test_a_family_of_the_other_model_kind_is_refused(tmp_path):
    folder = _config_folder(tmp_path / "nemotron", {
        "model_type": "nemotron_h", **NEMOTRON_H, "layers_block_type": ["full_attention", "mlp"]})
    with pytest.raises(ValueError, match=r"PolicyConfig.model is wrong: 'gpt'. PolicyConfig"
                                         r".hf_config .* is a nemotron_h model, which "
                                         r"pretrain_mamba.py builds: use model='hybrid'"):
        PackedPolicy.build(PolicyConfig(_args(), model="gpt", hf_config=folder))


def test_a_model_of_another_config_is_refused(converted, cpu_dist, cpu_rope):
    _, llama = converted("llama")
    qwen3, _ = converted("qwen3")
    model = loaded_model("llama", llama)
    with pytest.raises(ConversionError, match=r"the policy's model has no decoder.layers."
                                              r"self_attention.q_layernorm.weight, which the "
                                              r"model of this config.json has; give the "
                                              r"config.json of the model the policy was built "
                                              r"from"):
        export_weights([model], qwen3)


# ------------------------------------------------------------------ tensor, expert, pipeline

def _parallel_worker(rank: int, world: int, cases: list, out: str) -> None:
    """One rank of the parallel tests: a gloo world of CPU processes; per case megatron-core's
    parallel state at the case's sizes, the fork's model of this rank's stage built from the
    converted checkpoint's launch line (with the case's sizes) and loaded through
    dist_checkpointing at them, its export saved as ``<case>.rank<r>.pt``."""
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), CUDA_DEVICE_MAX_CONNECTIONS="1")
    torch.distributed.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank,
                                         world_size=world)
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
    from megatron.training import arguments

    from megatron.packed_training import models
    from megatron.packed_training.config import transformer_config_from_args

    # This process's CPU stand-ins (conftest.cpu_moe, test_hf_convert.cpu_rope); Megatron-LM's
    # parse asks the GPU's architecture when TP > 1.
    torch.cuda.current_device = lambda: "cpu"
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = object()
    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = (
        lambda self, point, tokens_per_expert=None: tokens_per_expert)
    arguments.get_device_arch_version = lambda: 9
    for case, family, megatron, sizes in cases:
        parallel_state.initialize_model_parallel(**sizes)
        flags = [f"--{name.replace('_', '-')}={size}" for name, size in sizes.items()]
        with contextlib.redirect_stdout(io.StringIO()):
            args = _fork_args(family, megatron, [*flags, f"--global-batch-size={world}"])
        torch.manual_seed(1234)
        build = models.hybrid_model if _kind(family) == "hybrid" else models.gpt_model
        model = build(args, transformer_config_from_args(args),
                      pre_process=parallel_state.is_pipeline_first_stage(),
                      post_process=parallel_state.is_pipeline_last_stage())
        load_release(model, megatron)
        pairs = [(name, tensor.clone()) for name, tensor in export_weights([model], megatron)]
        torch.save(pairs, f"{out}/{case}.rank{rank}.pt")
        parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


TP2 = {"tensor_model_parallel_size": 2}
PP2 = {"pipeline_model_parallel_size": 2}
EP2 = {"expert_model_parallel_size": 2}
PARALLEL = [
    ("llama_tp2", "llama", TP2),  # fused QKV and SwiGLU fc1 by TP rank, vocabulary-parallel
    ("qwen3_tp2", "qwen3", TP2),  # tied embedding, q / k norms
    ("llama_pp2", "llama", PP2),  # a layer per stage, the output layer on the last
    ("qwen3_moe_ep2", "qwen3_moe", EP2),  # two of four experts per rank
    ("qwen3_moe_pp2", "qwen3_moe_4_layers", PP2),  # a dense layer and an MoE one per stage
    ("nemotron_h_tp2", "nemotron_h_cpu", TP2),  # hybrid stack; experts' TP 2 (ETP = TP)
]
ALL_AT_ONCE = [("qwen3_moe_tp2_pp2_ep2", "qwen3_moe_4_layers",
                {**TP2, **PP2, **EP2, "expert_tensor_parallel_size": 1})]


def _single_process_exports(converted, cases) -> dict:
    exports = {}
    for case, family, _ in cases:
        _, megatron = converted(family)
        exports[case] = exported([loaded_model(family, megatron)], megatron)
    return exports


def _run_parallel(converted, cases, world, tmp_path) -> None:
    import torch.multiprocessing as mp

    work = [(case, family, converted(family)[1], sizes) for case, family, sizes in cases]
    mp.spawn(_parallel_worker, nprocs=world, args=(world, work, str(tmp_path)))
    expected = _single_process_exports(converted, cases)
    for case, _, _ in cases:
        for rank in range(world):
            got = torch.load(tmp_path / f"{case}.rank{rank}.pt")
            assert [name for name, _ in got] == [name for name, _ in expected[case]], case
            for (name, tensor), (_, single) in zip(got, expected[case]):
                assert tensor.dtype == single.dtype and torch.equal(tensor, single), \
                    (case, rank, name)


def test_tensor_expert_and_pipeline_parallel_exports_equal_the_single_process_one(
        converted, cpu_moe, cpu_rope, tmp_path):
    """Two CPU processes (gloo), one case after the other: TP 2 (the experts' TP 2 with it),
    PP 2 and EP 2. Every rank yields every pair, in the same order, bit for bit the single
    process's."""
    _run_parallel(converted, PARALLEL, 2, tmp_path)


@pytest.mark.slow
def test_tensor_pipeline_and_expert_parallel_at_once(converted, cpu_moe, cpu_rope, tmp_path):
    """Four CPU processes: TP 2 x PP 2 with EP 2 (experts' TP 1) on one model."""
    _run_parallel(converted, ALL_AT_ONCE, 4, tmp_path)


# ------------------------------------------------- the GPU test's parallel layouts, on CPU

def _gpu_flags(family: str, megatron: str, world: int, layout: list) -> list:
    """The GPU worker's flags (tests/gpu/rl_export_worker.py, an export only) with the GPU
    test's ``layout`` flags; on CPU, the initial weights (overwritten by the checkpoint) are
    drawn on the host: the CUDA RNG tracker's states need a GPU."""
    from tests.gpu.rl_export_worker import policy_flags

    return policy_flags(family, megatron, ["--global-batch-size", str(world), *layout,
                                           "--use-cpu-initialization"], graphs=False)


def _backend(flags: list) -> str:
    """The ``--attention-backend`` that wins in ``flags`` (argparse: the last)."""
    return [flag.split("=", 1)[1] for flag in flags if flag.startswith("--attention-backend=")][-1]


def _gpu_policy_model(family: str, megatron: str, world: int, layout: list):
    """The GPU worker's policy model on CPU: its flags parsed as `PackedPolicy.build` parses
    them, the fork's model built from them (this rank's part), the converted checkpoint
    loaded, in bf16 under megatron-core's Float16Module as Megatron-LM's setup wraps it (DDP
    and the optimizer, which the export does not read, left out)."""
    from megatron.core import parallel_state
    from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding
    from megatron.core.transformer.module import Float16Module

    from megatron.packed_training import models
    from megatron.packed_training.arguments import parse_args
    from megatron.packed_training.config import transformer_config_from_args

    kind = "hybrid" if family == "nemotron_h" else "gpt"
    with contextlib.redirect_stdout(io.StringIO()):  # Megatron-LM's argument dump
        args = parse_args(_gpu_flags(family, megatron, world, layout), kind,
                          raise_on_error=True)
    args.padded_vocab_size = vocab_size_with_padding(args.vocab_size, args,
                                                     logging_enabled=False)
    config = transformer_config_from_args(args)
    torch.manual_seed(1234)
    model = models.MODEL_BUILDERS[kind](
        args, config, pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage())
    load_release(model, megatron)
    return Float16Module(config, model) if args.bf16 else model


def _on_cpu_stand_ins() -> None:
    """This process's CPU stand-ins: conftest.cpu_moe, test_hf_convert.cpu_rope and
    cpu_mamba (Mamba layers built, never run); Megatron-LM's parse asks the GPU's
    architecture when TP > 1."""
    from types import SimpleNamespace

    from megatron.core.ssm import mamba_mixer
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
    from megatron.training import arguments

    from tests.unit.test_hf_convert import _GatedNormStandIn

    torch.cuda.current_device = lambda: "cpu"
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = object()
    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = (
        lambda self, point, tokens_per_expert=None: tokens_per_expert)
    arguments.get_device_arch_version = lambda: 9
    mamba_mixer.HAVE_MAMBA_SSM = True
    mamba_mixer.ExtendedRMSNorm = _GatedNormStandIn
    mamba_mixer.get_cuda_rng_tracker = lambda: SimpleNamespace(fork=contextlib.nullcontext)


def _gpu_layout_worker(rank: int, world: int, cases: list, out: str) -> None:
    """One rank of `test_the_gpu_tests_te_free_layouts_build_and_export_on_cpu`: per case the
    GPU worker's policy model at the case's layout (megatron-core's parallel state at the
    sizes its flags parse to), its export saved as ``<case>.rank<r>.pt``; a build that fails
    is saved as its error (``<case>.rank<r>.error``) and the next case runs."""
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), CUDA_DEVICE_MAX_CONNECTIONS="1")
    torch.distributed.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank,
                                         world_size=world)
    from megatron.core import parallel_state

    _on_cpu_stand_ins()
    for case, family, megatron, layout in cases:
        sizes = {"tensor_model_parallel_size": 1, "expert_model_parallel_size": 1}
        for name in sizes:
            flag = f"--{name.replace('_', '-')}"
            if flag in layout:
                sizes[name] = int(layout[layout.index(flag) + 1])
        parallel_state.initialize_model_parallel(**sizes)
        try:
            model = _gpu_policy_model(family, megatron, world, layout)
        except Exception as error:  # every rank fails alike: no collective is left waiting
            with open(f"{out}/{case}.rank{rank}.error", "w") as f:
                f.write(f"{type(error).__name__}: {error}")
        else:
            pairs = [(name, tensor.clone()) for name, tensor in export_weights([model],
                                                                               megatron)]
            torch.save(pairs, f"{out}/{case}.rank{rank}.pt")
        parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def gpu_converted(tmp_path_factory):
    """family -> converted folder of the GPU test's tiny model, converted as it converts it
    (tests/gpu/test_rl_export_on_gpus.py: its builders, for TP 2)."""
    from megatron.packed_training.hf import import_hf
    from tests.gpu.test_rl_export_on_gpus import BUILDERS as GPU_BUILDERS

    cache = {}

    def get(family):
        if family not in cache:
            root = tmp_path_factory.mktemp(f"gpu_{family}")
            hf = GPU_BUILDERS[family](root / "hf")
            import_hf(hf, root / "megatron", tensor_parallel_size=2)
            cache[family] = os.fspath(root / "megatron")
        return cache[family]
    return get


@pytest.mark.slow
def test_the_gpu_tests_te_free_layouts_build_and_export_on_cpu(gpu_converted, cpu_moe,
                                                               cpu_rope, cpu_mamba, tmp_path):
    """Every two-GPU layout of tests/gpu/test_rl_export_on_gpus.py that runs the TE-free spec
    (the worker's flags with the layout's: the winning --attention-backend is local), built
    as its worker builds the policy's model, on two gloo CPU processes: it builds (e.g. no
    --sequence-parallel on megatron-core's torch norms, which refuse it) and both ranks'
    exports equal the one-process export of the same flags bit for bit (names, order, dtypes,
    shapes). The TE layouts need Transformer Engine: the GPU test alone runs them."""
    import torch.multiprocessing as mp

    from tests.gpu import test_rl_export_on_gpus as on_gpus

    cases = []
    for family, layout in on_gpus.LAYOUTS:
        flags = on_gpus.layout_flags(family, layout)
        megatron = gpu_converted(family)
        if _backend(_gpu_flags(family, megatron, 2, flags)) == "local":
            cases.append((f"{family}_{layout}", family, megatron, flags))
    assert len(cases) >= 4, cases  # the dense families at TP 2, the MoE ones at EP 2
    mp.spawn(_gpu_layout_worker, nprocs=2, args=(2, cases, str(tmp_path)))
    failures = {case: (tmp_path / f"{case}.rank{rank}.error").read_text()
                for case, *_ in cases for rank in range(2)
                if (tmp_path / f"{case}.rank{rank}.error").exists()}
    assert not failures, failures
    for case, family, megatron, layout in cases:
        backend = [flag for flag in layout if flag.startswith("--attention-backend")]
        expected = exported([_gpu_policy_model(family, megatron, 1, backend)], megatron)
        for rank in range(2):
            got = torch.load(tmp_path / f"{case}.rank{rank}.pt")
            assert [name for name, _ in got] == [name for name, _ in expected], (case, rank)
            for (name, tensor), (_, single) in zip(got, expected):
                assert (tensor.dtype, tensor.shape) == (single.dtype, single.shape), \
                    (case, rank, name)
                assert torch.equal(tensor, single), (case, rank, name)
