"""The library API on one GPU (megatron.packed_training.rl, docs/rl.md).

* `rl_policy_worker.py` (a process per policy): log-probs on forward-only graphs equal eager
  log-probs on the same weights, bitwise for GPT, within the eager-against-eager noise for the
  hybrid, for 1, 3 and 6 micro-batches with overflow counted; the swap test (reference weights
  swapped in place change the replayed log-probs exactly as eager, and swapping back restores
  them bitwise); a refit; a second temperature replays the same graphs; train steps with the
  clipped loss replay the training graphs past the warm-up; a NaN advantage and a too long
  micro-batch are refused naming the tensor and the fix.
* examples/rl/grpo_packed.py: eager, eager again and graphs runs, its checks pass (log-probs
  and trained weights within the eager-against-eager noise) and it prints the table.
"""

import json
import math
import os
import subprocess
import sys

import pytest

from tests.gpu.launch import REPO, STREAM_MISMATCH_WARNING, assert_succeeded, torchrun

WORKER = os.path.join("tests", "gpu", "rl_policy_worker.py")


def run_worker(tmp_path, model: str) -> dict:
    out = str(tmp_path / f"{model}.json")
    proc = torchrun(WORKER, ["--model", model, "--out", out], nproc=1)
    with open(str(tmp_path / f"{model}.log"), "w") as f:
        f.write(proc.stdout + proc.stderr)
    assert_succeeded("the worker", proc.returncode, proc.stdout + proc.stderr)
    with open(out) as f:
        return json.load(f)


@pytest.mark.parametrize("model", ["gpt", "hybrid"])
def test_the_policy_on_graphs_equals_eager(tmp_path, model):
    result = run_worker(tmp_path, model)
    print(json.dumps(result, indent=1)[:4000])
    calls = result["calls"]
    assert calls[0]["stats"]["forward graphs captured"] == 2  # capacities 4 and 8
    for call in calls:
        stats = call["stats"]
        assert call["finite"] and call["first_tokens_zero"]
        assert "eager eval" not in stats
        assert stats["forward graphs"] + stats.get("eager overflow", 0) == call["count"]
        if model == "gpt":
            assert call["bitwise"], call
        else:
            assert call["max_difference"] <= 4 * call["eager_noise"], call
    assert sum(call["stats"].get("eager overflow", 0) for call in calls) > 0  # both paths ran
    swap = result["swap"]
    assert swap["swapped_differs"] and swap["back_equals_own"]
    if model == "gpt":
        assert swap["swapped_equals_eager"] and result["refit_equals_eager"]
        assert result["temperature"]["equals_eager"]
    assert not result["temperature"]["captured_again"]
    train = result["train"]
    assert all(math.isfinite(step["loss"]) and step["grad_norm"] > 0 for step in train)
    assert train[0]["stats"]["eager warmup"] > 0  # --cuda-graph-warmup-steps 1
    assert train[1]["stats"]["graphs captured"] > 0
    for step in train[2:]:  # replays; only overflow runs eager
        assert step["stats"]["graph fallbacks"] == step["stats"].get("eager overflow", 0)
    errors = result["errors"]
    assert "micro-batch 0: advantages is wrong: it holds NaN" in errors["nan"]
    assert "more than a packed row's 1024" in errors["long"]


@pytest.mark.parametrize("model", ["gpt", "hybrid"])
def test_the_grpo_example_passes_its_checks(tmp_path, model):
    # One stream, so that a run's warnings follow its "== <name> run" header.
    proc = subprocess.run([sys.executable, os.path.join(REPO, "examples", "rl", "grpo_packed.py"),
                           "--model", model, "--steps", "6"], cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=1800)
    output = proc.stdout
    with open(str(tmp_path / "grpo.log"), "w") as f:
        f.write(output)
    print(output[-3000:])  # the report: table and checks
    assert_succeeded("the GRPO example", proc.returncode, output)
    assert "| train step |" in output and "| reference log-probs |" in output
    assert output.count("ok  ") == 2 and "FAIL" not in output
    # DDP on the stream backward runs on (megatron_ddp.ddp_on_the_process_stream)
    runs_warned = [part.split(" run", 1)[0] if i else "(before the runs)"
                   for i, part in enumerate(output.split("== "))
                   if STREAM_MISMATCH_WARNING in part]
    assert not runs_warned, f"runs with the stream-mismatch warning: {runs_warned}"
