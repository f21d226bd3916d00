"""FP8 training under every graph kind follows eager FP8, one GPU (docs/fp8.md).

Per model and recipe: an eager FP8 run, then the same run under one graph kind (local layer,
chunk, TE layer, full-iteration graphs), 6 iterations of 4 micro-batches (capture at
iteration 3), validation at iterations 3 and 6 and after training (forward-only graphs in the
graphed runs). Each graphed run is compared with eager FP8:

* training losses, every iteration: a graph that served weights quantized before the
  optimizer step (the weight cache) or ran its layers outside FP8 would differ from iteration
  4 on. The learning rate is high enough (3e-3) that stale weights move the loss by more than
  the tolerance;
* validation losses (forward-only graph replays after 3 and 6 optimizer steps: a graph
  re-quantizing nothing would evaluate the weights it was captured with).

Tolerances: GPT under local layer graphs is bitwise eager in BF16 (docs/cuda-graphs.md) and
FP8 GEMMs are deterministic, so its losses must be equal; other kinds within `DLOSS`; the
hybrids within `DLOSS_MAMBA`, the BF16 graph tests' tolerance (Mamba's backward kernels are
not bitwise run to run, and at this learning rate their noise has reached 3.5e-3 in six
steps). A stale weight copy moves the loss by a step's change, 1e-2 or more. One BF16 run per
model checks FP8 stays within `FP8_VS_BF16` of it. Delayed scaling runs under local and TE
layer graphs (chunk graphs refuse it at parse time: checked here too). Under a capacity ladder
the graphs of several capacities share one quantized copy of the weights per iteration.

The MoE and MLA models (drop-and-pad experts: TE's grouped GEMM for GPT, sequential TE linears
for the hybrid; MLA alone and with Moonlight-style MoE) follow eager FP8 under local layer,
chunk and TE layer graphs (MoE has no full-iteration graphs), losses and the load-balancing
loss within `DLOSS`. Megatron-LM's FP8 options (`FP8_OPTIONS`: the first and last layer in
BF16, FP8 weights kept by the distributed optimizer, the routed experts in BF16 through a
per-module precision file) follow eager under graphs too, and each must act: change eager
FP8's losses, or for the FP8 weights, hold the linear weights as TE FP8 tensors (a worker,
fp8_weight_types.py, builds the model). On two GPUs, tensor parallelism with sequence
parallelism (amaxes all-reduced over the ranks) under layer and chunk graphs. Select with
``-k``, e.g. ``-k "gpt and tensorwise"``.
"""

import json
import os

import pytest

from megatron.packed_training.extra_args import is_importable
from megatron.packed_training.metrics import read_metrics
from tests.gpu.launch import (
    CHUNK_GRAPHS,
    DROP_AND_PAD,
    LAYER_GRAPHS,
    REPO,
    TE,
    TE_GRAPHS,
    TINY_GPT,
    TINY_GPT_MOE,
    TINY_HYBRID,
    TINY_HYBRID_MOE,
    TRAIN,
    assert_succeeded,
    losses,
    run_training,
    torchrun,
)
from tests.gpu.test_mla_graphs import MOE as MLA_MOE
from tests.gpu.test_mla_graphs import TINY_MLA_GPT

pytestmark = pytest.mark.skipif(not is_importable("transformer_engine"),
                                reason="needs Transformer Engine (pip install -e '.[te]')")

MODELS = {"gpt": ("pretrain_gpt.py", TINY_GPT), "hybrid": ("pretrain_mamba.py", TINY_HYBRID)}
# Drop-and-pad MoE (whole-layer graphs need it) and MLA; TINY_MLA_GPT brings TE attention.
MOE_AND_MLA_MODELS = {
    "gpt-moe": ("pretrain_gpt.py", TINY_GPT_MOE + DROP_AND_PAD + ["--moe-grouped-gemm"]),
    "hybrid-moe": ("pretrain_mamba.py", TINY_HYBRID_MOE + DROP_AND_PAD),
    "mla": ("pretrain_gpt.py", TINY_MLA_GPT),
    "mla-moe": ("pretrain_gpt.py", TINY_MLA_GPT + MLA_MOE),
}
FULL_ITERATION = ["--cuda-graph-impl", "full_iteration", "--cuda-graph-max-packed-seqs", "16",
                  "--cuda-graph-warmup-steps", "2", "--no-check-for-nan-in-loss-and-grad"]
KINDS = {"layer": LAYER_GRAPHS, "chunk": CHUNK_GRAPHS, "te": TE_GRAPHS,
         "full_iteration": FULL_ITERATION}
STEPS = ["--train-iters", "6", "--global-batch-size", "4", "--lr", "3e-3",
         "--eval-interval", "3", "--eval-iters", "2"]
DLOSS = 2e-3
DLOSS_MAMBA = 5e-3
FP8_VS_BF16 = 0.1


def fp8(recipe):
    return ["--fp8-format", "e4m3", "--fp8-recipe", recipe]


def train_and_validate(tmp_path, script, flags, name, nproc=1):
    train = run_training(script, flags, tmp_path, name=name, nproc=nproc)
    valid = read_metrics(os.path.join(str(tmp_path), f"{name}.jsonl"), split="valid")
    return train, valid


def assert_follows(eager, graphs, *, exact, label, tolerance=DLOSS):
    (train_e, valid_e), (train_g, valid_g) = eager, graphs
    assert len(train_g) == len(train_e) and len(valid_g) == len(valid_e) == 3
    dtrain = max(abs(e - g) for e, g in zip(losses(train_e), losses(train_g)))
    dvalid = max(abs(e - g) for e, g in zip(losses(valid_e), losses(valid_g)))
    print(f"{label}: max |dloss| train {dtrain:.2e}, valid {dvalid:.2e}")
    if exact:
        assert losses(train_g) == losses(train_e), (losses(train_e), losses(train_g))
        assert losses(valid_g) == losses(valid_e), (losses(valid_e), losses(valid_g))
    assert dtrain < tolerance, (losses(train_e), losses(train_g))
    assert dvalid < tolerance, (losses(valid_e), losses(valid_g))
    if "load_balancing_loss" in train_e[0]:  # MoE: the router saw the same scores
        daux = max(abs(e["load_balancing_loss"] - g["load_balancing_loss"])
                   for e, g in zip(train_e, train_g))
        print(f"{label}: max |d load-balancing loss| {daux:.2e}")
        assert daux < tolerance, [(e["load_balancing_loss"], g["load_balancing_loss"])
                                  for e, g in zip(train_e, train_g)]


def assert_graphs_follow(tmp_path, script, common, eager, kinds, label, exact_kind=None,
                         nproc=1):
    """Train ``common`` under each of ``kinds`` (KINDS names) and compare with ``eager``: the
    graphs captured, validation replayed forward-only graphs, losses within `DLOSS` (the
    hybrids' `DLOSS_MAMBA`; equal under ``exact_kind``)."""
    tolerance = DLOSS_MAMBA if script == "pretrain_mamba.py" else DLOSS
    for kind in kinds:
        graphs = train_and_validate(tmp_path, script, common + KINDS[kind], kind, nproc=nproc)
        assert any(r.get("graph capture (s)") or r.get("iteration graphs")
                   for r in graphs[0]), f"{kind}: nothing was captured"
        assert any(r.get("forward graphs") for r in graphs[1]), f"{kind}: validation eager"
        assert_follows(eager, graphs, exact=(kind == exact_kind), label=f"{label} {kind}",
                       tolerance=tolerance)


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
@pytest.mark.parametrize("model", ["gpt", "hybrid"])
def test_fp8_graphs_follow_eager_fp8(tmp_path, model, recipe):
    script, shape = MODELS[model]
    common = shape + TRAIN + TE + STEPS + fp8(recipe)
    eager = train_and_validate(tmp_path, script, common, "eager")
    if recipe == "tensorwise":
        bf16 = run_training(script, shape + TRAIN + TE + STEPS, tmp_path, name="bf16")
        gap = max(abs(a - b) for a, b in zip(losses(eager[0]), losses(bf16)))
        print(f"{model}: max |FP8 - BF16| {gap:.3f}")
        assert gap < FP8_VS_BF16, (losses(eager[0]), losses(bf16))
    assert_graphs_follow(tmp_path, script, common, eager, list(KINDS), f"{model} {recipe}",
                         exact_kind="layer" if model == "gpt" else None)


@pytest.mark.parametrize("model, recipe", [("gpt-moe", "tensorwise"), ("gpt-moe", "blockwise"),
                                           ("hybrid-moe", "tensorwise"), ("mla", "tensorwise"),
                                           ("mla-moe", "blockwise")])
def test_fp8_moe_and_mla_graphs_follow_eager_fp8(tmp_path, model, recipe):
    script, shape = MOE_AND_MLA_MODELS[model]
    common = shape + TRAIN + TE + STEPS + fp8(recipe)
    eager = train_and_validate(tmp_path, script, common, "eager")
    assert_graphs_follow(tmp_path, script, common, eager, ["layer", "chunk", "te"],
                         f"{model} {recipe}")


# Megatron-LM's FP8 options: (model, flags, graph kinds). ``--first-last-layers-bf16``: one
# layer at each end in BF16, which every graph kind must capture outside FP8;
# ``--fp8-param-gather``: the distributed optimizer keeps FP8 weights, which the graphs must
# read after each step (that it acts is `test_fp8_param_gather_holds_the_weights_in_fp8`: on one
# GPU its losses have equalled those without it); the per-module precision file that keeps
# the routed experts in BF16.
FP8_OPTIONS = {
    "first_last_layers_bf16": ("gpt", ["--first-last-layers-bf16"], list(KINDS)),
    "fp8_param_gather": ("gpt", ["--fp8-param-gather"], ["layer", "chunk", "full_iteration"]),
    "moe_experts_bf16": ("gpt-moe", ["--te-precision-config-file", os.path.join(
        REPO, "examples", "fp8", "moe_experts_bf16.yaml")], ["layer", "chunk", "te"]),
}


@pytest.mark.parametrize("option", list(FP8_OPTIONS))
def test_megatron_fp8_options_act_and_follow_eager_under_graphs(tmp_path, option):
    model, flags, kinds = FP8_OPTIONS[option]
    script, shape = (MODELS | MOE_AND_MLA_MODELS)[model]
    common = shape + TRAIN + TE + STEPS + fp8("tensorwise") + ["--use-distributed-optimizer"]
    plain = run_training(script, common, tmp_path, name="plain")
    eager = train_and_validate(tmp_path, script, common + flags, "eager")
    if option != "fp8_param_gather":
        assert losses(eager[0]) != losses(plain), f"{option} changed nothing"
    assert max(abs(a - b) for a, b in zip(losses(eager[0]), losses(plain))) < FP8_VS_BF16
    assert_graphs_follow(tmp_path, script, common + flags, eager, kinds, option)


def test_fp8_param_gather_holds_the_weights_in_fp8(tmp_path):
    """With ``--fp8-param-gather`` the fork's GPT holds its linear weights as TE FP8 tensors
    (megatron-core builds the layers under TE's quantized-model init), the norms in BF16."""
    out = os.path.join(str(tmp_path), "weights.json")
    proc = torchrun("tests/gpu/fp8_weight_types.py", [out], nproc=1)
    assert_succeeded("tests/gpu/fp8_weight_types.py", proc.returncode, proc.stdout + proc.stderr)
    with open(out) as f:
        types = json.load(f)
    linears = {name: kind for name, kind in types.items()
               if name.endswith(".weight") and ("linear_" in name)}
    assert linears and all(kind == "Float8Tensor" for kind in linears.values()), types
    assert all(kind == "Parameter" for name, kind in types.items() if "norm" in name), types


@pytest.mark.gpus(2)
@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_fp8_graphs_follow_eager_under_tensor_and_sequence_parallelism(tmp_path, recipe):
    """TP = 2 with --sequence-parallel: each rank quantizes its half of the row's positions
    (padding included, held at zero) and TE all-reduces the amaxes over the two ranks; the
    graphs capture that all-reduce, and must follow eager."""
    script, shape = MODELS["gpt"]
    common = shape + TRAIN + TE + STEPS + fp8(recipe) + [
        "--tensor-model-parallel-size", "2", "--sequence-parallel"]
    eager = train_and_validate(tmp_path, script, common, "eager", nproc=2)
    assert_graphs_follow(tmp_path, script, common, eager, ["layer", "chunk"],
                         f"gpt {recipe} TP = 2", nproc=2)


def test_quantized_weights_are_shared_by_the_capacity_ladder(tmp_path):
    """Local layer graphs at several capacities: an iteration's micro-batches replay different
    capacities' graphs, and only the first re-quantizes the weights; the later ones, in other
    graphs, must read that copy (a stale or separate one would leave eager from iteration 4)."""
    script, shape = MODELS["gpt"]
    common = shape + TRAIN + TE + STEPS + fp8("tensorwise")
    eager = train_and_validate(tmp_path, script, common, "eager")
    ladder = train_and_validate(tmp_path, script, common + [
        "--cuda-graph-impl", "local", "--cuda-graph-max-packed-seqs", "16",
        "--cuda-graph-capacity-ladder", "4", "8", "--cuda-graph-warmup-steps", "2"], "ladder")
    captured = [r["graph capacities"] for r in ladder[0] if r.get("graph capacities")]
    assert captured and len(captured[-1].split(",")) >= 2, captured
    assert_follows(eager, ladder, exact=False, label="gpt tensorwise ladder")


@pytest.mark.parametrize("kind", ["layer", "te"])
def test_delayed_scaling_under_layer_graphs(tmp_path, kind):
    script, shape = MODELS["gpt"]
    common = shape + TRAIN + TE + STEPS + fp8("delayed")
    eager = train_and_validate(tmp_path, script, common, "eager")
    graphs = train_and_validate(tmp_path, script, common + KINDS[kind], kind)
    assert all("forward graphs" not in r for r in graphs[1])  # forward passes run eager
    assert_follows(eager, graphs, exact=False, label=f"gpt delayed {kind}")


def test_delayed_scaling_is_refused_under_chunk_graphs(tmp_path):
    script, shape = MODELS["gpt"]
    proc = torchrun(script, shape + TRAIN + TE + STEPS + fp8("delayed") + CHUNK_GRAPHS,
                    nproc=1)
    assert proc.returncode != 0
    assert "--fp8-recipe is wrong for --cuda-graph-impl local --cuda-graph-granularity chunk" \
        in proc.stdout + proc.stderr
