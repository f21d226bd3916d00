"""Megatron-LM flags that change the training step train with graphs off and on, and graphed
runs follow the eager run of the same flags.

Each case trains one flag set eagerly and under the graph kinds that can honour it, from the
same seed on the same packed rows, and compares the loss curves:

* ``--recompute-granularity selective`` (core attention recomputed in backward);
* ``--overlap-grad-reduce --overlap-param-gather --use-distributed-optimizer`` at DP = 2,
  against the same run without the overlap: DDP then gathers parameters in forward
  pre-hooks, which a graph replay has to run for the modules it covers;
* ``--sequence-parallel`` at TP = 2;
* ``--use-rope-scaling`` (Llama 3.x frequencies);
* ``--moe-permute-fusion`` (TE's fused permutation, drop-and-pad MoE);
* ``--async-save --use-persistent-ckpt-worker --async-strategy mcore`` (Megatron-LM turns
  ``--async-save`` off without the persistent worker; its default strategy needs
  nvidia-resiliency-ext): the checkpoint resumes the uninterrupted curve.
"""

import pytest

from tests.gpu.launch import (
    CHUNK_GRAPHS,
    DROP_AND_PAD,
    LAYER_GRAPHS,
    TE,
    TE_GRAPHS,
    TINY_GPT,
    TINY_GPT_MOE,
    TRAIN,
    losses,
    run_training,
    train_then_resume,
)

STEPS = 12
COMMON = TRAIN + ["--train-iters", str(STEPS), "--global-batch-size", "4"]
FULL_ITERATION = ["--cuda-graph-impl", "full_iteration", "--cuda-graph-max-packed-seqs", "16",
                  "--cuda-graph-warmup-steps", "2", "--no-check-for-nan-in-loss-and-grad"]
# Graph replay against eager with the same flags; bf16 noise of a different kernel order.
TOLERANCE = 5e-3


def _needs_te():
    pytest.importorskip("transformer_engine.pytorch", reason="the flag needs Transformer Engine")


def _assert_follows(reference, runs):
    for name, run in runs.items():
        curve = losses(run)
        assert len(curve) == STEPS, name
        if name != "eager":  # the graphs were captured, and the comparison is not eager's
            assert any(r.get("graphs captured") or r.get("iteration graphs") for r in run), name
        worst = max(abs(a - b) for a, b in zip(curve, reference))
        print(f"{name}: max |dloss| {worst:.2e} over {STEPS} steps")
        assert worst < TOLERANCE, f"{name}: max |dloss| {worst:.2e}\n{curve}\n{reference}"


def _train_each(tmp_path, script, flags, graph_kinds, nproc=1):
    """Eager, then each graph kind, with ``flags``; returns (eager losses, {kind: records})."""
    eager = run_training(script, COMMON + flags, tmp_path, nproc=nproc, name="eager")
    assert losses(eager)[-1] < losses(eager)[0]
    runs = {kind: run_training(script, COMMON + flags + graph, tmp_path, nproc=nproc, name=kind)
            for kind, graph in graph_kinds.items()}
    return losses(eager), runs


def test_selective_recompute(tmp_path):
    reference, runs = _train_each(
        tmp_path, "pretrain_gpt.py", TINY_GPT + ["--recompute-granularity", "selective"],
        {"layer": LAYER_GRAPHS, "chunk": CHUNK_GRAPHS})
    _assert_follows(reference, runs)


def test_rope_scaling(tmp_path):
    reference, runs = _train_each(tmp_path, "pretrain_gpt.py", TINY_GPT + ["--use-rope-scaling"],
                                  {"layer": LAYER_GRAPHS, "full_iteration": FULL_ITERATION})
    _assert_follows(reference, runs)


def test_moe_permute_fusion(tmp_path):
    _needs_te()
    reference, runs = _train_each(
        tmp_path, "pretrain_gpt.py",
        TINY_GPT_MOE + DROP_AND_PAD + TE + ["--moe-permute-fusion", "--moe-grouped-gemm"],
        {"layer": LAYER_GRAPHS, "te": TE_GRAPHS})
    _assert_follows(reference, runs)


OVERLAPPED_MODEL = TINY_GPT + TE + ["--use-distributed-optimizer"]


@pytest.fixture(scope="module")
def without_overlap(tmp_path_factory):
    """The DP = 2 distributed-optimizer run without overlap, trained once for every kind."""
    _needs_te()
    return losses(run_training("pretrain_gpt.py", COMMON + OVERLAPPED_MODEL,
                               tmp_path_factory.mktemp("no_overlap"), nproc=2,
                               name="no_overlap"))


@pytest.mark.gpus(2)
@pytest.mark.parametrize("kind", ["eager", "layer", "chunk", "te", "full_iteration"])
def test_overlapped_reduce_and_gather_with_the_distributed_optimizer(tmp_path, kind,
                                                                     without_overlap):
    """DP = 2: the overlapped run equals the run without overlap, eager and under each graph
    kind (parameter shards another rank updated must arrive before a graph reads them)."""
    graphs = {"eager": [], "layer": LAYER_GRAPHS, "chunk": CHUNK_GRAPHS, "te": TE_GRAPHS,
              "full_iteration": FULL_ITERATION}[kind]
    overlap = ["--overlap-grad-reduce", "--overlap-param-gather"]
    run = run_training("pretrain_gpt.py", COMMON + OVERLAPPED_MODEL + overlap + graphs,
                       tmp_path, nproc=2, name=kind)
    _assert_follows(without_overlap, {kind: run})


@pytest.mark.gpus(2)
def test_sequence_parallel(tmp_path):
    _needs_te()  # megatron-core's sequence-parallel layer norms are TE's
    reference, runs = _train_each(
        tmp_path, "pretrain_gpt.py",
        TINY_GPT + TE + ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
        {"layer": LAYER_GRAPHS, "te": TE_GRAPHS}, nproc=2)
    _assert_follows(reference, runs)


@pytest.mark.parametrize("graphs", [[], LAYER_GRAPHS], ids=["eager", "layer"])
def test_async_save_resumes_the_uninterrupted_curve(tmp_path, graphs):
    """The asynchronous save at iteration 6 (finished by Megatron-LM at --exit-interval)
    resumes to the losses of one run to 12."""
    # Megatron-LM's default async strategy needs nvidia-resiliency-ext; "mcore" is its own.
    args = COMMON + TINY_GPT + graphs + ["--async-save", "--use-persistent-ckpt-worker",
                                         "--async-strategy", "mcore"]
    whole = losses(run_training("pretrain_gpt.py", args, tmp_path, name="whole"))
    first, second = train_then_resume("pretrain_gpt.py", args, tmp_path, save_interval=6,
                                      exit_interval=6)
    assert [r["iteration"] for r in second] == list(range(7, STEPS + 1))
    for resumed, reference in zip(losses(second), whole[6:]):
        assert abs(resumed - reference) < 2e-3, (losses(second), whole)
