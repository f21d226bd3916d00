"""Checkpoints of the RL library on one GPU (`PackedPolicy.save`, ``load``,
`PackedPolicy.weights_from_checkpoint`; docs/rl.md "Checkpoints").

`rl_checkpoint_worker.py`, a process per policy: a small GPT policy trains two steps, saves
through Megatron-LM's save_checkpoint, trains a third; a fresh process builds the policy with
``load`` at that checkpoint and trains the third step. The resumed policy counts on from
iteration 2, holds the saved optimizer state exactly, and its third step gives the same loss
and the same weights, bitwise. In the first process, the checkpoint's weights read back (on
the GPU and on the host) are the weights at the save, and swapped in they give the log-probs
the policy gave then, bitwise, on the same forward-only graphs; ``args.save`` is as it was
after the save; ``iteration=`` numbers a checkpoint.
"""

import json
import os

import torch

from tests.gpu.launch import assert_succeeded, torchrun

WORKER = os.path.join("tests", "gpu", "rl_checkpoint_worker.py")


def run_worker(tmp_path, phase: str, checkpoint) -> tuple:
    """The worker's ``phase`` in a process of its own: its JSON result and its tensors."""
    proc = torchrun(WORKER, ["--phase", phase, "--checkpoint", str(checkpoint),
                             "--out", str(tmp_path)], nproc=1,
                    log=str(tmp_path / f"{phase}.log"))
    assert_succeeded("the worker", proc.returncode, proc.stdout)
    with open(tmp_path / f"{phase}.json") as f:
        result = json.load(f)
    return result, torch.load(tmp_path / f"{phase}.pt", weights_only=False)


def flat(state, prefix="") -> dict:
    """{path: value} of a nested state dict (tensors and plain values)."""
    if isinstance(state, (list, tuple)):
        state = dict(enumerate(state))
    if not isinstance(state, dict):
        return {prefix: state}
    return {path: value for key, item in state.items()
            for path, value in flat(item, f"{prefix}{key}/").items()}


def differences(a: dict, b: dict) -> list:
    """The paths where two flat dicts differ (a tensor bitwise, with its dtype)."""
    if sorted(a) != sorted(b):
        return [f"paths: {sorted(set(a) ^ set(b))[:5]}"]
    return [path for path in a
            if (torch.is_tensor(a[path]) and not (a[path].dtype == b[path].dtype
                                                  and torch.equal(a[path], b[path])))
            or (not torch.is_tensor(a[path]) and a[path] != b[path])]


def test_a_saved_policy_resumes_bitwise_and_its_weights_are_a_reference(tmp_path):
    checkpoint = tmp_path / "ckpt"
    straight, straight_tensors = run_worker(tmp_path, "straight", checkpoint)
    resumed, resumed_tensors = run_worker(tmp_path, "resume", checkpoint)
    print(json.dumps({"straight": straight, "resumed": resumed}, indent=1))

    # Megatron-LM's layout: the tracker and the iteration's torch_dist folder.
    assert straight["tracker"] == "2" and straight["numbered_tracker"] == "10"
    assert (checkpoint / "iter_0000002" / "metadata.json").is_file()
    assert straight["args_save_restored"]
    assert straight["iteration_at_build"] == 0 and straight["iteration"] == 3

    # The resume: iteration, optimizer state, then the step itself.
    assert resumed["iteration_at_build"] == 2 and resumed["iteration"] == 3
    optimizer = differences(flat(straight_tensors["optimizer"]), flat(resumed_tensors["optimizer"]))
    assert not optimizer, optimizer[:10]
    assert resumed["losses"] == straight["losses"][2:], (resumed["losses"], straight["losses"])
    weights = differences(straight_tensors["weights"], resumed_tensors["weights"])
    assert not weights, weights[:10]

    # The checkpoint's weights as a reference model, swapped into the trained policy.
    assert all(straight["reference"].values()), straight["reference"]
    assert straight["swapped_stats"]["forward graphs"] > 0  # replayed, not eager
