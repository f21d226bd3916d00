"""Evaluation on forward-only graphs in Megatron-LM's loop (``--eval-interval``), one GPU.

An eager run and a graphed run of the same training with validation every 5 iterations:

* the graphed run's validation passes (at iterations 5 and 10, and after training: one
  record each) replay forward-only graphs (``forward graphs``), the first pass captures
  them (one per capacity of the ladder, with the extra memory logged), only overflow runs
  eager, and ``eager eval`` never shows;
* its validation loss equals the eager run's: bitwise for GPT, whose training under local
  layer graphs is bitwise eager's (docs/cuda-graphs.md), so both evaluate the same weights;
  within 2e-3 for the hybrid (Mamba's kernels are not bitwise run to run) and the MoE hybrid;
* TE layer graphs and chunk graphs evaluate on forward-only graphs as well.
"""

import os

import pytest

from megatron.packed_training.extra_args import is_importable
from megatron.packed_training.metrics import read_metrics
from tests.gpu.launch import (
    DROP_AND_PAD,
    TINY_GPT,
    TINY_HYBRID,
    TINY_HYBRID_MOE,
    TRAIN,
    run_training,
)

# Capacity 8 with a ladder: median-128-token documents in 1024-token rows fit now and then
# overflow, so both paths of a validation pass run.
GRAPHS = ["--cuda-graph-impl", "local", "--cuda-graph-max-packed-seqs", "8",
          "--cuda-graph-capacity-ladder", "4", "--cuda-graph-warmup-steps", "2"]
EVAL = ["--train-iters", "10", "--global-batch-size", "4", "--eval-interval", "5",
        "--eval-iters", "3"]
MODELS = {"gpt": ("pretrain_gpt.py", TINY_GPT), "hybrid": ("pretrain_mamba.py", TINY_HYBRID),
          "hybrid-moe": ("pretrain_mamba.py", TINY_HYBRID_MOE + DROP_AND_PAD)}


def validation(tmp_path, script, flags, name):
    run_training(script, flags, tmp_path, name=name)
    return read_metrics(os.path.join(str(tmp_path), f"{name}.jsonl"), split="valid")


@pytest.mark.parametrize("model", ["gpt", "hybrid", "hybrid-moe"])
def test_validation_replays_forward_graphs_and_equals_eager(tmp_path, model):
    script, shape = MODELS[model]
    eager = validation(tmp_path, script, shape + TRAIN + EVAL, "eager")
    graphs = validation(tmp_path, script, shape + TRAIN + EVAL + GRAPHS, "graphs")
    print(f"{model}: validation eager {[r['lm_loss'] for r in eager]}, graphs "
          f"{[r['lm_loss'] for r in graphs]}; first pass {graphs[0]}")
    assert [r["iteration"] for r in graphs] == [r["iteration"] for r in eager]
    # train()'s passes at 5 and 10, then pretrain()'s after training: each its own record.
    assert [r["iteration"] for r in graphs] == [5, 10, 10]
    assert graphs[0]["forward graphs captured"] == 2  # capacities 4 and 8
    assert "forward graph capture (s)" in graphs[0] and "forward graph memory (MiB)" in graphs[0]
    assert not any("forward graphs captured" in r for r in graphs[1:])
    for record in graphs:
        assert "eager eval" not in record
        assert record["forward graphs"] + record.get("eager overflow", 0) == 3 * 4
    assert sum(r["forward graphs"] for r in graphs) > 0
    for e, g in zip(eager, graphs):
        if model == "gpt":
            assert g["lm_loss"] == e["lm_loss"], (eager, graphs)
        else:
            assert abs(g["lm_loss"] - e["lm_loss"]) < 2e-3, (eager, graphs)


@pytest.mark.parametrize("variant", [
    "chunk",
    pytest.param("te", marks=pytest.mark.skipif(
        not is_importable("transformer_engine"), reason="needs Transformer Engine"))])
def test_other_training_graphs_evaluate_on_forward_graphs(tmp_path, variant):
    flags = {"chunk": ["--cuda-graph-impl", "local", "--cuda-graph-granularity", "chunk",
                       "--cuda-graph-max-packed-seqs", "8", "--cuda-graph-warmup-steps", "2"],
             "te": ["--attention-backend", "auto", "--te-rng-tracker", "--cuda-graph-impl",
                    "transformer_engine", "--cuda-graph-max-packed-seqs", "8",
                    "--cuda-graph-warmup-steps", "2"]}[variant]
    eager_flags = flags[:3] if variant == "te" else []  # TE's attention and RNG tracker alike
    eager = validation(tmp_path, "pretrain_gpt.py", TINY_GPT + TRAIN + EVAL + eager_flags,
                       "eager")
    graphs = validation(tmp_path, "pretrain_gpt.py", TINY_GPT + TRAIN + EVAL + flags, "graphs")
    assert graphs[0]["forward graphs captured"] == 1
    assert all("eager eval" not in r and r["forward graphs"] > 0 for r in graphs)
    for e, g in zip(eager, graphs):
        assert abs(g["lm_loss"] - e["lm_loss"]) < 2e-3, (eager, graphs)
