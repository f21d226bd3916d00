"""The graph runtime in real training (one GPU): what it logs, and the sync finder with TE graphs.

* Every eager micro-batch shows with its reason: warm-up and overflow in the training records;
  evaluation (Megatron-LM's evaluate(), through the same runtime) replays forward-only graphs,
  its overflow eager, counted in the validation records, never in a training iteration's
  numbers.
* tools/find_host_syncs.py trains with TE layer graphs: the runtime captures them (the forward
  step the tool used to wrap no longer receives them as an attribute), and a replayed
  iteration has no host sync inside the model.
"""

import os

import pytest

from megatron.packed_training.extra_args import is_importable
from megatron.packed_training.metrics import read_metrics
from tests.gpu.launch import TINY_GPT, TRAIN, find_host_syncs, run_training

# Capacity 7 with median-128-token documents in 1024-token rows: some micro-batches overflow.
GRAPHS = ["--cuda-graph-impl", "local", "--cuda-graph-max-packed-seqs", "7",
          "--cuda-graph-warmup-steps", "2"]


def test_eager_reasons_are_logged_and_evaluation_stays_apart(tmp_path):
    args = TINY_GPT + TRAIN + GRAPHS + ["--train-iters", "12", "--global-batch-size", "4",
                                        "--eval-interval", "5", "--eval-iters", "2"]
    train = run_training("pretrain_gpt.py", args, tmp_path, name="graphs")
    valid = read_metrics(os.path.join(str(tmp_path), "graphs.jsonl"), split="valid")

    assert [r["eager warmup"] for r in train[:2]] == [4, 4]
    assert train[2]["graphs captured"] > 0 and "eager warmup" not in train[2]
    # Past the warm-up, every fallback is an overflow, counted under its reason.
    assert [r.get("eager overflow", 0) for r in train[2:]] == [r["graph fallbacks"]
                                                               for r in train[2:]]
    assert sum(r["graph fallbacks"] for r in train[2:]) > 0  # both paths ran
    assert not any("eager eval" in r or "forward graphs" in r for r in train)
    # Megatron-LM's validation passes at iterations 5 and 10, of 2 x 4 micro-batches each
    # (and its pass after the last iteration, at 12, where the metrics file records it), on
    # forward-only graphs captured at the first, overflow eager.
    passes = [(r["iteration"], r["forward graphs"] + r.get("eager overflow", 0)) for r in valid]
    assert passes[:2] == [(5, 8), (10, 8)] and passes[2:] in ([], [(12, 8)])
    assert not any("eager eval" in r for r in valid)
    assert valid[0]["forward graphs captured"] == 1 and "forward graph memory (MiB)" in valid[0]
    assert not any("forward graphs captured" in r for r in valid[1:])


@pytest.mark.skipif(not is_importable("transformer_engine"), reason="needs Transformer Engine")
def test_sync_finder_trains_with_te_graphs(tmp_path):
    flags = TINY_GPT + TRAIN + [
        "--train-iters", "5", "--global-batch-size", "2", "--attention-backend", "auto",
        "--te-rng-tracker", "--cuda-graph-impl", "transformer_engine",
        "--cuda-graph-max-packed-seqs", "32", "--cuda-graph-warmup-steps", "2",
        "--no-check-for-nan-in-loss-and-grad"]
    out = find_host_syncs("pretrain_gpt.py", flags, tmp_path, iteration=5)
    assert "graphs captured: 8" in out, out[-6000:]  # 4 layers, forward + backward
    assert "(0 inside the model)" in out, out[out.find("host syncs in iteration"):]
