"""Weights for an inference engine on GPUs (`PackedPolicy.export_weights`, rl/export.py;
docs/rl.md, "Weights for an inference engine"): the half of tests/unit/test_rl_export.py that
needs CUDA and NCCL, for every family the converter knows.

* One GPU, per family: a tiny Hugging Face model, converted, is the start of a bf16
  `PackedPolicy`; its export goes into a transformers model of the family's config (strictly);
  that model generates rollouts greedily, as an engine does, and the policy's log-probs of them
  (`policy.logprobs`, forward-only graphs) agree with transformers' (each rollout run alone):
  cosine >= 0.999 per rollout, the greedy token the same wherever transformers' logit margin
  is not a near tie (0.1, or twice the rollout's largest log-prob difference where that is
  more: a bf16 routing flip of an MoE model), a third of the positions or more. A control
  model of the same config without the export stays below a cosine of 0.99 (the check can
  fail). The bucketed export holds the same pairs bit for bit.
* Two GPUs, per family: the export at tensor parallel size 2 (routed experts too), and at
  expert parallel size 2 for the MoE families, equals the one-GPU export of the same
  checkpoint bit for bit, on both ranks (NCCL gathers and broadcasts). An MoE family at TP 2
  runs with ``--sequence-parallel`` (megatron-core's MoE layer needs it to train with TP),
  whose norms only Transformer Engine's spec has (megatron-core's torch norms refuse it): the
  families the worker builds TE-free (Qwen3-MoE, Nemotron-H) are built on TE's spec at TP 2,
  and so is the one-GPU export they are compared with (one variable: the layout).
  tests/unit/test_rl_export.py builds the TE-free layouts from the worker's flags on CPU
  (a flag combination the model cannot build fails there first).

The tiny models are built with weights of std 0.1 (`SPREAD`), not transformers' 0.02: at
0.02 their log-probs sit near -log(vocabulary) with a spread of ~0.15, where two unrelated
models already reach a log-prob cosine of 0.998. Routing is unscaled (`routed_scaling_factor`
1): scaled, the tiny DeepSeek-V3 flips expert choices between bf16 and float32 transformers
alone (a log-prob cosine of 0.997 against its own float32 copy); the converter's flag for it
is checked on CPU.

Run: ``python -m pytest -q -s tests/gpu/test_rl_export_on_gpus.py`` (the two-GPU cases need
two GPUs; ``-s`` prints each family's figures).
"""

import json
import os

import pytest
import torch

from megatron.packed_training.extra_args import is_importable
from megatron.packed_training.hf import import_hf
from tests.gpu.launch import assert_succeeded, torchrun
from tests.unit.hf_tiny import (
    tiny_deepseek_v3,
    tiny_llama,
    tiny_moonlight,
    tiny_nemotron_h,
    tiny_qwen3,
    tiny_qwen3_moe,
)

WORKER = os.path.join("tests", "gpu", "rl_export_worker.py")
SPREAD = {"initializer_range": 0.1}  # module doc
UNSCALED = {**SPREAD, "routed_scaling_factor": 1.0}
BUILDERS = {
    "llama": lambda folder: tiny_llama(folder, **SPREAD),
    "qwen3": lambda folder: tiny_qwen3(folder, **SPREAD),  # tied embedding, q / k norms
    "qwen3_moe": lambda folder: tiny_qwen3_moe(folder, **SPREAD),
    "deepseek_v3": lambda folder: tiny_deepseek_v3(folder, **UNSCALED),  # q-LoRA MLA
    "moonlight": lambda folder: tiny_moonlight(folder, **UNSCALED),  # MLA without q-LoRA
    "nemotron_h": lambda folder: tiny_nemotron_h(folder, **UNSCALED),  # Mamba, attention, MoE
}
FAMILIES = sorted(BUILDERS)
MOE = ("deepseek_v3", "moonlight", "nemotron_h", "qwen3_moe")
TP2 = ["--tensor-model-parallel-size", "2"]
EP2 = ["--expert-model-parallel-size", "2"]
LAYOUTS = [(family, "tp2") for family in FAMILIES] + [(family, "ep2") for family in MOE]
# The worker builds these on the TE-free spec (rl_export_worker.policy_flags: MLA families on
# TE's); with --sequence-parallel they need TE's (module doc).
TE_FREE_MOE = ("nemotron_h", "qwen3_moe")
ON_TE = ["--attention-backend=auto"]  # after the worker's own backend flag: it wins


def needs(family: str) -> None:
    """Skip what the machine cannot build: packed MLA runs on Transformer Engine attention,
    Mamba layers need mamba-ssm and causal-conv1d."""
    if family in ("deepseek_v3", "moonlight") and not is_importable("transformer_engine"):
        pytest.skip("packed multi-latent attention needs Transformer Engine (pip install -e .[te])")
    if family == "nemotron_h" and not (is_importable("mamba_ssm")
                                       and is_importable("causal_conv1d")):
        pytest.skip("needs mamba-ssm and causal-conv1d (pip install -e .[mamba])")


def backend_flags(family: str, layout: str) -> list:
    """The attention backend of a layout where it is not the worker's own: TE's spec for
    sequence parallelism (module doc)."""
    return ON_TE if layout == "tp2" and family in TE_FREE_MOE else []


def layout_flags(family: str, layout: str) -> list:
    """The worker's flags of a parallel layout (after ``--``)."""
    if layout == "tp2":  # megatron-core's MoE layer trains with TP only under SP
        return TP2 + (["--sequence-parallel"] if family in MOE else []) + \
            backend_flags(family, layout)
    return EP2


def needs_layout(family: str, layout: str) -> None:
    needs(family)
    if backend_flags(family, layout) and not is_importable("transformer_engine"):
        pytest.skip(f"{family} at {layout} runs --sequence-parallel, whose norms need "
                    f"Transformer Engine (pip install -e .[te])")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """family -> (Hugging Face folder, converted folder). Converted for TP 2: the vocabulary
    divisor pads TP 1 and TP 2 to the same rows, so one checkpoint loads at both."""
    cache = {}

    def get(family):
        if family not in cache:
            root = tmp_path_factory.mktemp(family)
            hf = BUILDERS[family](root / "hf")
            import_hf(hf, root / "megatron", tensor_parallel_size=2)
            cache[family] = (hf, str(root / "megatron"))
        return cache[family]
    return get


def run_worker(out, family: str, converted_folder: str, *, nproc: int = 1, hf=None,
               graphs: bool = True, flags=()) -> str:
    """The worker in a process of its own (one policy per process); its files in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    args = ["--family", family, "--converted", converted_folder, "--out", str(out),
            *(["--hf", hf] if hf else []), *([] if graphs else ["--no-graphs"])]
    proc = torchrun(WORKER, [*args, "--", *flags] if flags else args, nproc=nproc,
                    log=str(out / "worker.log"))
    assert_succeeded("the worker", proc.returncode, proc.stdout)
    return str(out)


def bucket_facts(out: str, rank: int) -> dict:
    with open(os.path.join(out, f"buckets.rank{rank}.json")) as f:
        return json.load(f)


def assert_buckets_hold_the_pairs(facts: dict) -> None:
    assert facts["buckets_equal_pairs"] and facts["buckets"] > 1, facts
    assert facts["unique_names"] == facts["pairs"] and facts["on_gpu"], facts


# ------------------------------------------------------------------ the engine's log-probs

@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_model_with_the_export_gives_the_policy_logprobs(converted, tmp_path,
                                                                      family):
    needs(family)
    hf, megatron = converted(family)
    out = run_worker(tmp_path / "run", family, megatron, hf=hf)
    with open(os.path.join(out, "result.json")) as f:
        result = json.load(f)
    rows = result["sequences"]
    print(f"\n{family}: log-probs on {result['stats']}; loading {result['loading']}")
    for row in rows:
        print(f"  length {row['length']}: cosine {row['cosine']:.6f} (eager "
              f"{row['eager_cosine']:.6f}; transformers bf16 against float32 "
              f"{row['engine_bf16_noise_cosine']:.6f}; control {row['control_cosine']:.4f}), "
              f"max |dlogprob| {row['max_abs']:.3e}, greedy decisions {row['decisive']} "
              f"({row['greedy_decisive']} greedy tokens), flips {row['greedy_flips']}")
    assert_buckets_hold_the_pairs(bucket_facts(out, 0))
    loading = result["loading"]
    # strict load_state_dict, or transformers' checkpoint loader with nothing to report
    assert loading == {"strict": True} or not any(loading.values()), loading
    for row in rows:
        assert row["cosine"] >= 0.999, row
        assert row["control_cosine"] < 0.99, row  # an unrelated model would fail the gate
        assert not row["greedy_flips"], row
    positions = sum(row["length"] - 1 for row in rows)
    assert sum(row["decisive"] for row in rows) >= positions // 3  # not vacuous
    assert sum(row["greedy_decisive"] for row in rows) >= 30  # the rollouts' greedy tokens


# ----------------------------------------------------------------------- parallel layouts

@pytest.fixture(scope="module")
def one_gpu_export(converted, tmp_path_factory):
    """(family, flags: an attention backend or none) -> the one-GPU export of its converted
    checkpoint (the host pairs)."""
    cache = {}

    def get(family, flags=()):
        key = (family, tuple(flags))
        if key not in cache:
            out = run_worker(tmp_path_factory.mktemp(f"{family}_one_gpu"), family,
                             converted(family)[1], graphs=False, flags=list(flags))
            cache[key] = torch.load(os.path.join(out, "export.rank0.pt"))
        return cache[key]
    return get


@pytest.mark.gpus(2)
@pytest.mark.parametrize("family, layout", LAYOUTS)
def test_parallel_export_equals_the_one_gpu_export_bit_for_bit(converted, one_gpu_export,
                                                               tmp_path, family, layout):
    """TP 2 (the experts' TP 2 with it: all-gathers along megatron-core's partition
    dimensions, fused QKV, SwiGLU halves and Mamba's in_proj sections) and EP 2 (routed
    experts broadcast from their rank): both ranks yield every pair, in the one-GPU order,
    bit for bit."""
    needs_layout(family, layout)
    expected = one_gpu_export(family, backend_flags(family, layout))
    out = run_worker(tmp_path / layout, family, converted(family)[1], nproc=2, graphs=False,
                     flags=layout_flags(family, layout))
    for rank in range(2):
        assert_buckets_hold_the_pairs(bucket_facts(out, rank))
        got = torch.load(os.path.join(out, f"export.rank{rank}.pt"))
        assert [name for name, _ in got] == [name for name, _ in expected], (layout, rank)
        for (name, tensor), (_, single) in zip(got, expected):
            assert tensor.dtype == single.dtype and tensor.shape == single.shape, name
            assert torch.equal(tensor, single), (layout, rank, name)
    print(f"{family} {layout}: {len(expected)} tensors equal the one-GPU export on both ranks")
