"""Expert parallelism under CUDA graphs (skipped without CUDA or with too few GPUs).

Each case trains the tiny GPT-MoE eager and with graphs, same seed and data, drop-and-pad
(the EP exchange is an equal-split all-to-all inside the graphs), and compares the curves:
lm loss and load-balancing loss within the tolerance of test_moe_graphs.py.

* EP = 2 and EP = 4 (data parallel 2 and 4), layer graphs;
* EP = 2 x TP = 2 with sequence parallelism (4 GPUs; sequence parallelism needs TE), and
  the same folded onto 2 GPUs with --expert-tensor-parallel-size 1 (each GPU holds half of
  the experts, whole, and attention is split over both);
* EP = 2 with PP = 2 under chunk graphs (4 GPUs: data parallel 2).
"""

import pytest

from megatron.packed_training.extra_args import is_importable
from tests.gpu import launch
from tests.gpu.launch import (
    CHUNK_GRAPHS,
    DROP_AND_PAD,
    LAYER_GRAPHS,
    TRAIN,
    assert_moe_follows_eager,
    run_training,
)

TINY_GPT_MOE = launch.TINY_GPT_MOE + DROP_AND_PAD
STEPS = 30
# Graphs on TE attention switch TE's RNG tracker on: the eager reference takes it too.
COMMON = TRAIN + (["--te-rng-tracker"] if is_importable("transformer_engine") else [])


def _compare(tmp_path, layout, graph_flags, nproc, global_batch, label):
    common = TINY_GPT_MOE + COMMON + layout + ["--train-iters", str(STEPS),
                                              "--global-batch-size", str(global_batch)]
    eager = run_training("pretrain_gpt.py", common, tmp_path, nproc=nproc, name="eager")
    graphs = run_training("pretrain_gpt.py", common + graph_flags, tmp_path, nproc=nproc,
                          name="graphs")
    assert len(eager) == len(graphs) == STEPS
    captured = [r for r in graphs if r.get("graph capture (s)")]
    assert len(captured) == 1, "captured once"
    assert all(r["load_balancing_loss"] > 0 for r in eager + graphs)
    assert_moe_follows_eager(eager, graphs, f"{label}, {captured[0]['graphs captured']} graphs")


@pytest.mark.gpus(2)
def test_ep2_layer_graphs_match_eager(tmp_path):
    _compare(tmp_path, ["--expert-model-parallel-size", "2"], LAYER_GRAPHS, nproc=2,
             global_batch=4, label="EP=2 layer graphs")


@pytest.mark.gpus(4)
def test_ep4_layer_graphs_match_eager(tmp_path):
    _compare(tmp_path, ["--expert-model-parallel-size", "4"], LAYER_GRAPHS, nproc=4,
             global_batch=8, label="EP=4 layer graphs")


@pytest.mark.gpus(4)
@pytest.mark.skipif(not is_importable("transformer_engine"),
                    reason="needs Transformer Engine (--sequence-parallel needs it)")
def test_ep2_with_tensor_and_sequence_parallelism_matches_eager(tmp_path):
    layout = ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
              "--sequence-parallel"]
    _compare(tmp_path, layout, LAYER_GRAPHS, nproc=4, global_batch=4,
             label="EP=2 x TP=2 + SP layer graphs")


@pytest.mark.gpus(2)
@pytest.mark.skipif(not is_importable("transformer_engine"),
                    reason="needs Transformer Engine (--sequence-parallel needs it)")
def test_ep2_folded_onto_tensor_parallel_ranks_matches_eager(tmp_path):
    layout = ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
              "--sequence-parallel", "--expert-tensor-parallel-size", "1"]
    _compare(tmp_path, layout, LAYER_GRAPHS, nproc=2, global_batch=4,
             label="EP=2 folded onto TP=2 + SP (expert TP 1) layer graphs")


@pytest.mark.gpus(4)
def test_ep2_with_pipeline_parallel_chunk_graphs_matches_eager(tmp_path):
    layout = ["--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    _compare(tmp_path, layout, CHUNK_GRAPHS, nproc=4, global_batch=8,
             label="EP=2 x PP=2 chunk graphs")
