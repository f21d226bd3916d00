"""--cross-entropy-loss-fusion: the fused cross entropy follows the unfused one, and trains the
same under graphs as eager.

megatron-core computes the loss inside the model, so the fused kernels run inside the
full-iteration graph; under layer graphs they run eager between the graphs. Each comparison
prints its max |dloss| (and max relative grad-norm difference where graphs are compared).

Megatron-LM refuses ``--cross-entropy-fusion-impl te`` ("stability issues"), so every case
runs the native implementation (the TE cases of the old fork's suite run it too).
"""

import pytest

from tests.gpu.launch import (
    LAYER_GRAPHS,
    TINY_GPT,
    TINY_HYBRID,
    TRAIN,
    find_host_syncs,
    losses,
    run_training,
)
from tests.gpu.test_full_iteration import (
    COMMON,
    GRAPH_REFERENCE,
    compare,
    counts,
    full_iteration,
)
from tests.gpu.test_parallel import assert_close_to_one_gpu, runs_from_one_start

FUSED = ["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "native"]


def script_and_model(kind: str):
    return ("pretrain_gpt.py", TINY_GPT) if kind == "gpt" else ("pretrain_mamba.py", TINY_HYBRID)


@pytest.mark.parametrize("kind", ["gpt", "hybrid"])
def test_fused_cross_entropy_follows_the_unfused_loss(tmp_path, kind):
    script, layers = script_and_model(kind)
    common = layers + TRAIN + ["--train-iters", "20", "--global-batch-size", "4"]
    unfused = run_training(script, common, tmp_path, name="unfused")
    fused_run = run_training(script, common + FUSED, tmp_path, name="fused")
    dloss = max(abs(u - f) for u, f in zip(losses(unfused), losses(fused_run)))
    print(f"{kind}: fused cross entropy vs unfused, eager: max |dloss| {dloss:.2e}")
    assert len(fused_run) == 20 and dloss < 5e-3, (losses(unfused), losses(fused_run))


@pytest.mark.parametrize("kind", ["gpt", "hybrid"])
def test_fused_cross_entropy_under_full_iteration_graphs_matches_eager(tmp_path, kind):
    """Capacity 9 of 4 micro-batches: iteration graphs and misses (layer graphs) both run."""
    script, layers = script_and_model(kind)
    common = layers + COMMON + FUSED + ["--train-iters", "30", "--global-batch-size", "4"]
    eager = run_training(script, common, tmp_path, name="eager")
    graphs = run_training(script, common + full_iteration(9, 2), tmp_path, name="full_iteration")
    n = counts(graphs)
    assert n["iteration graphs"] > 3 and n["iteration graph misses"] > 3, n
    compare(eager, graphs, f"{kind}, fused cross entropy", 5e-3, 1e-2)


def test_fused_cross_entropy_under_layer_graphs_matches_eager(tmp_path):
    common = TINY_HYBRID + COMMON + FUSED + ["--train-iters", "20", "--global-batch-size", "4"]
    eager = run_training("pretrain_mamba.py", common, tmp_path, name="eager")
    graphs = run_training("pretrain_mamba.py", common + LAYER_GRAPHS, tmp_path, name="graphs")
    compare(eager, graphs, "hybrid layer graphs, fused cross entropy", 5e-3, 1e-2)


def test_fused_cross_entropy_adds_no_host_sync_to_a_replayed_iteration(tmp_path):
    flags = TINY_HYBRID + COMMON + FUSED + ["--train-iters", "6", "--global-batch-size", "4",
                                            *full_iteration(16, 2)]
    out = find_host_syncs("pretrain_mamba.py", flags, tmp_path, iteration=5)
    assert "(0 inside the model)" in out, out[out.find("host syncs in iteration"):]


@pytest.mark.gpus(2)
def test_fused_cross_entropy_at_tp2_and_pp2_under_graphs_follows_one_gpu(tmp_path):
    """The vocabulary split over TP ranks (the fused kernels reduce across them inside the
    iteration graph) and the loss on the last pipeline stage, against one GPU, eager."""
    flags = TINY_GPT + GRAPH_REFERENCE + FUSED
    reference, results = runs_from_one_start(tmp_path, "pretrain_gpt.py", flags, {
        "tp2_full_iteration": ["--tensor-model-parallel-size", "2", *full_iteration(16, 2)],
        "pp2_layer_graphs": ["--pipeline-model-parallel-size", "2", *LAYER_GRAPHS],
    })
    assert_close_to_one_gpu(reference, results)
