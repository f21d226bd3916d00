"""Sleep and wake on one GPU: `PackedPolicy.offload` / `onload` (rl/offload.py, docs/rl.md
"Sharing the GPU with a rollout engine").

Each case runs `rl_offload_worker.py` twice, one process each (one policy per process),
sequentially (the offload run fills more than 90% of the GPU: do not run this file with
xdist beside other GPU work): ``offload`` (train 2 steps, offload, another tensor takes more
than 90% of the free memory and is filled, onload, train 2 steps) and ``resident`` (the
same calls, never offloaded). Checked, for GPT and the hybrid under layer graphs and
full-iteration graphs: losses, grad norms, log-probs and final weights bitwise equal; after
onload nothing is recaptured and every micro-batch replays; the offload released at least
90% of what PyTorch's allocator held; calls while offloaded, a second offload, onload while
the memory is held and a second onload are refused with their fix; graphs captured inside
the policy's memory allocate from their own pools. Each case prints its MiB and seconds and
the graph capture time of its first graphed step (what releasing and recapturing the graphs
would cost instead). The hybrid runs with mamba-ssm's deterministic kernels
(``MAMBA_DETERMINISTIC=1``), as examples/rl/grpo_packed.py compares its runs.
"""

import json
import os
from contextlib import nullcontext

import pytest

from megatron.packed_training.extra_args import is_importable
from tests.gpu.launch import assert_succeeded, torchrun

WORKER = os.path.join("tests", "gpu", "rl_offload_worker.py")
pytestmark = pytest.mark.skipif(
    not is_importable("torch_memory_saver"),
    reason="needs torch_memory_saver for PolicyConfig(offloadable=True): "
           "pip install -e \".[offload]\"")

CUBLAS_WORKSPACE_MIB = 34  # cuBLAS's workspace and a small block, outside the policy's memory
_RUNS: dict = {}  # (model, graphs, mode) -> the worker's JSON: a reference run serves twice


def run_worker(tmp_path, model: str, graphs: str, mode: str) -> dict:
    key = (model, graphs, mode)
    if key in _RUNS:
        return _RUNS[key]
    out = str(tmp_path / f"{model}-{graphs}-{mode}.json")
    preload = nullcontext()
    if mode != "plain":
        from torch_memory_saver import configure_subprocess

        preload = configure_subprocess()  # LD_PRELOAD for the process torchrun starts
    with preload:
        proc = torchrun(WORKER, ["--model", model, "--graphs", graphs, "--mode", mode,
                                 "--out", out], nproc=1, env={"MAMBA_DETERMINISTIC": "1"},
                        log=str(tmp_path / f"{model}-{graphs}-{mode}.log"))
    assert_succeeded("the worker", proc.returncode, proc.stdout)
    with open(out) as f:
        _RUNS[key] = json.load(f)
    return _RUNS[key]


def assert_same_training(a: dict, b: dict) -> None:
    for step, (x, y) in enumerate(zip(a["steps"], b["steps"]), start=1):
        for what in ("loss", "grad_norm", "old_logprobs"):
            assert x[what] == y[what], (step, what, x[what], y[what])
    assert a["logprobs_before"] == b["logprobs_before"]
    assert a["logprobs_after"] == b["logprobs_after"]
    differ = [name for name in a["weights"] if a["weights"][name] != b["weights"].get(name)]
    assert not differ and a["weights"].keys() == b["weights"].keys(), differ[:8]


CAPTURES = ("graphs captured", "iteration graph capture (s)", "forward graphs captured")


def captured(stats: dict) -> bool:
    return any(key in stats for key in CAPTURES)


@pytest.mark.parametrize("graphs", ["layer", "full"])
@pytest.mark.parametrize("model", ["gpt", "hybrid"])
def test_offload_and_onload_leave_training_bitwise_unchanged(tmp_path, model, graphs):
    offloaded = run_worker(tmp_path, model, graphs, "offload")
    reference = run_worker(tmp_path, model, graphs, "resident")
    memory = offloaded["memory"]
    first_graphed = offloaded["steps"][1]["stats"]
    capture_s = first_graphed.get("graph capture (s)",
                                  first_graphed.get("iteration graph capture (s)"))
    forward_capture_s = offloaded["steps"][0]["logprob_stats"].get("forward graph capture (s)")
    print(f"{model} {graphs}: reserved {memory['offload']['reserved_mib']} MiB, released "
          f"{memory['offload']['mib']} MiB in {memory['offload']['seconds']} s, onload "
          f"{memory['onload']['mib']} MiB in {memory['onload']['seconds']} s; capture at the "
          f"first graphed step {capture_s} s, forward-only graphs {forward_capture_s} s")
    print(json.dumps(memory, indent=1))

    assert_same_training(offloaded, reference)
    assert offloaded["logprobs_after"] == offloaded["logprobs_before"]  # same weights

    # Graphs existed at the offload, and replay after the onload: nothing captured again.
    assert captured(first_graphed), first_graphed
    assert offloaded["logprobs_after_stats"]["forward graphs"] == 3
    assert not captured(offloaded["logprobs_after_stats"])
    for step in offloaded["steps"][2:]:
        assert not captured(step["logprob_stats"]), step["logprob_stats"]
        stats = step["stats"]
        assert not captured(stats), stats
        if graphs == "full":
            assert stats.get("iteration graphs") == 1, stats
        else:
            assert stats["graph fallbacks"] == 0 and not any(
                key.startswith("eager") for key in stats), stats

    # The memory: at least 90% of what the allocator held went, and came back. Not counted:
    # what the process allocates outside the policy's memory by design, cuBLAS's workspace
    # (32 MiB on Hopper, rl/offload.py), which at these tiny models is ~12% of the total.
    gone, back = memory["offload"], memory["onload"]
    assert gone["mib"] >= 0.9 * (gone["reserved_mib"] - CUBLAS_WORKSPACE_MIB), gone
    assert back["mib"] >= 0.9 * memory["paused_mib"], (back, memory["paused_mib"])
    assert memory["held_mib"] >= 0.9 * memory["free_when_offloaded_mib"]
    refused = memory["refused"]
    assert "PackedPolicy.logprobs is refused: the policy is offloaded" in refused["logprobs"]
    assert "Call policy.onload() first" in refused["logprobs"]
    assert "offload is refused: the policy is offloaded already" in refused["offload"]
    assert "onload needs" in refused["onload_short"]
    assert "Release the rollout engine's memory first" in refused["onload_short"]
    assert "onload is refused: the policy is on the GPU" in refused["onload_twice"]
    routing = offloaded["routing"]
    assert routing["graph_in_its_pool"] and routing["eager_in_a_pool_of_its_own"], routing


def test_an_offloadable_policy_trains_as_a_plain_one(tmp_path):
    """Building offloadable changes where memory comes from and runs backward on the calling
    thread; the numbers stay the same."""
    assert_same_training(run_worker(tmp_path, "gpt", "layer", "resident"),
                         run_worker(tmp_path, "gpt", "layer", "plain"))
