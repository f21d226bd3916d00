"""The graph health check (--cuda-graph-check-interval) in real training on one GPU.

* Healthy graphs (local layer, local chunk, TE layer) never fire over 20 iterations checked
  every 5; the check's eager pass is counted, its device time logged, and training with the
  check follows the same loss curve as training without it.
* Dropout: both passes draw from the same restored RNG states, so a healthy replay agrees.
* A corrupted graph (tests/gpu/health_check_worker.py adds noise to the first layer's
  static output buffer after every replay, from iteration 4 on) fires at the next check and
  logs both values and the graph key; with ``warn`` training goes on with graphs (firing at
  every check), with ``disable`` every later micro-batch runs eager and training goes on.
"""

import math
import os

import pytest

from megatron.packed_training.extra_args import is_importable
from tests.gpu.launch import TINY_GPT, TRAIN, losses, run_training

GRAPHS = ["--cuda-graph-impl", "local", "--cuda-graph-max-packed-seqs", "32",
          "--cuda-graph-warmup-steps", "2"]
COMMON = TINY_GPT + TRAIN + ["--global-batch-size", "4"]  # 4 micro-batches per iteration
CHECK = ["--cuda-graph-check-interval", "5"]
VARIANTS = {
    "local-layer": GRAPHS,
    "local-chunk": GRAPHS + ["--cuda-graph-granularity", "chunk"],
    "te-layer": ["--attention-backend", "auto", "--te-rng-tracker",
                 "--cuda-graph-impl", "transformer_engine", "--cuda-graph-max-packed-seqs", "32",
                 "--cuda-graph-warmup-steps", "2"],
}
WORKER = os.path.join("tests", "gpu", "health_check_worker.py")


def checks(records):
    """(iteration, largest relative difference, device ms) of every checked iteration."""
    return [(r["iteration"], r["graph check rel diff"], r["graph check (ms)"])
            for r in records if "graph check rel diff" in r]


@pytest.mark.parametrize("variant", [
    "local-layer", "local-chunk",
    pytest.param("te-layer", marks=pytest.mark.skipif(
        not is_importable("transformer_engine"), reason="needs Transformer Engine"))])
def test_healthy_graphs_never_fire(tmp_path, variant):
    records = run_training("pretrain_gpt.py", COMMON + VARIANTS[variant] + CHECK
                           + ["--train-iters", "20"], tmp_path, name=variant)
    found = checks(records)
    print(f"{variant}: (iteration, rel diff, check ms) {found}")
    assert [iteration for iteration, _, _ in found] == [5, 10, 15, 20]
    assert all(difference <= 0.01 for _, difference, _ in found), found
    assert all(ms > 0 for _, _, ms in found)
    assert records[-1]["graph checks"] == 4 and records[-1]["graph check divergences"] == 0
    assert [r.get("eager health_check", 0) for r in records] == [
        int(r["iteration"] % 5 == 0) for r in records]
    # From the first replaying iteration on, only overflow runs eager (in the capture
    # iteration, chunk granularity runs the micro-batches beyond its slots eager: slot_cap).
    assert all(r.get("graph fallbacks", 0) == r.get("eager overflow", 0) for r in records[3:])
    assert not any("eager disabled" in r for r in records)


def test_the_check_does_not_change_training(tmp_path):
    flags = COMMON + GRAPHS + ["--train-iters", "15"]
    plain = run_training("pretrain_gpt.py", flags, tmp_path, name="plain")
    checked = run_training("pretrain_gpt.py", flags + CHECK, tmp_path, name="checked")
    assert len(checks(checked)) == 3
    # Same curve up to FlashAttention's non-deterministic backward accumulation (as a resumed
    # run against an uninterrupted one, tests/gpu/test_training.py).
    for a, b in zip(losses(checked), losses(plain)):
        assert abs(a - b) < 2e-3, (losses(checked), losses(plain))


def test_with_dropout_a_healthy_replay_agrees(tmp_path):
    records = run_training("pretrain_gpt.py", COMMON + GRAPHS + CHECK + [
        "--hidden-dropout", "0.1", "--train-iters", "10"],
        tmp_path, name="dropout")
    found = checks(records)
    print(f"dropout: (iteration, rel diff, check ms) {found}")
    assert len(found) == 2 and records[-1]["graph check divergences"] == 0, found


def test_a_corrupted_graph_fires_and_warn_trains_on_with_graphs(tmp_path):
    records = run_training(WORKER, COMMON + GRAPHS + CHECK + ["--train-iters", "12"], tmp_path,
                           name="corrupt_warn", env={"CORRUPT_GRAPH_FROM": "4"})
    log = (tmp_path / "corrupt_warn.log").read_text()
    assert "corrupted 1 captured forward graph(s) of layer 1 at iteration 4" in log
    found = checks(records)
    print(f"corrupted, warn: (iteration, rel diff, check ms) {found}")
    assert [iteration for iteration, _, _ in found] == [5, 10]
    assert all(difference > 0.01 for _, difference, _ in found), found
    assert records[-1]["graph check divergences"] == 2
    line = next(line for line in log.splitlines() if "graph health check at iteration 5" in line)
    print(line)
    assert "graph (layer, capacity 32, cp 1, slot 0) diverged from eager" in line
    assert "loss replayed" in line and "grad norm replayed" in line
    assert "training goes on with graphs (--cuda-graph-check-action warn)" in line
    assert not any("eager disabled" in r for r in records)


def test_a_corrupted_graph_with_disable_trains_on_eager(tmp_path):
    records = run_training(WORKER, COMMON + GRAPHS + CHECK + [
        "--cuda-graph-check-action", "disable", "--train-iters", "12"], tmp_path,
        name="corrupt_disable", env={"CORRUPT_GRAPH_FROM": "4"})
    log = (tmp_path / "corrupt_disable.log").read_text()
    assert "CUDA graphs are off for the rest of the run" in log
    assert [iteration for iteration, _, _ in checks(records)] == [5]  # no check once off
    assert records[-1]["graph checks"] == 1 and records[-1]["graph check divergences"] == 1
    # Iterations 6 to 12: every micro-batch eager (disabled), none a fallback; training goes on.
    assert [r.get("eager disabled", 0) for r in records[5:]] == [4] * 7
    assert all(r["graph fallbacks"] == 0 for r in records[5:])
    assert [r["iteration"] for r in records] == list(range(1, 13))
    assert all(math.isfinite(loss) for loss in losses(records))
    print(f"corrupted, disable: losses {losses(records)}")
