"""The library API at pipeline (PP = 2, with and without virtual stages) and static context
parallel (CP = 2) layouts against PP = CP = 1 on the same weights (two GPUs).

`rl_layouts_worker.py` builds the reference policy (PP = CP = 1) from the seed and saves its
weights; each layout loads them (``load`` with ``finetune``: dist_checkpointing reshards
across stages). Every run makes the same calls on the same micro-batches: log-probs, a GRPO
step (clipped loss with KL, token normalization), log-probs, a sequence-normalized step
(`per_sequence_means`: sums over the CP group), log-probs. Checked: every rank of a layout
returns bitwise the same results (the last stage's broadcast, the CP gather), and they
equal the reference's within bf16 noise: the split of the layers over stages changes no
arithmetic, so PP is held to a tight bound; CP sums each sequence's attention in another
order. A wrong position order or a lost stage moves log-probs by ~0.4 on average (their
spread, checked).
"""

import os

import pytest
import torch

from tests.gpu.launch import REPO, assert_succeeded, torchrun

WORKER = os.path.join("tests", "gpu", "rl_layouts_worker.py")
LOGPROB_KEYS = ("logprobs", "after_token_step", "after_sequence_step")
# (mean, max) |difference| of log-probs to the reference, and the relative loss difference.
PP_TOLERANCE = (2e-3, 3e-2, 1e-3)
CP_TOLERANCE = (1e-2, 1.5e-1, 1e-2)


def run_worker(tmp_path, name: str, flags: list, nproc: int, env: dict | None = None) -> dict:
    out = tmp_path / f"{name}.pt"
    proc = torchrun(WORKER, [*flags, "--out", str(out)], nproc=nproc, env=env,
                    log=str(tmp_path / f"{name}.log"))
    assert_succeeded("the worker", proc.returncode, proc.stdout)
    return torch.load(out)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The PP = CP = 1 run and the folder of its saved weights."""
    tmp_path = tmp_path_factory.mktemp("rl_layouts")
    ckpt = str(tmp_path / "ckpt")
    return run_worker(tmp_path, "reference", ["--save", ckpt], nproc=1), ckpt


def differences(got: dict, want: dict, key: str) -> tuple:
    diffs = torch.cat([(g - w).abs() for g, w in zip(got[key], want[key])])
    return diffs.mean().item(), diffs.max().item()


def assert_equal_to_reference(got: dict, want: dict, tolerance: tuple, label: str) -> None:
    mean_bound, max_bound, loss_bound = tolerance
    assert got["ranks_agree"], f"{label}: the ranks returned different results"
    spread = torch.cat(want["logprobs"]).std().item()
    assert spread > 10 * mean_bound, f"reference log-probs spread {spread}: nothing to tell"
    for key in LOGPROB_KEYS:
        assert [t.shape for t in got[key]] == [t.shape for t in want[key]], key
        mean, worst = differences(got, want, key)
        print(f"{label} {key}: mean |d| {mean:.2e}, max |d| {worst:.2e}, bitwise "
              f"{all(torch.equal(g, w) for g, w in zip(got[key], want[key]))}")
        assert mean <= mean_bound and worst <= max_bound, (label, key, mean, worst)
    # The steps moved the log-probs far more than the layouts part them.
    moved = differences({"x": want["after_token_step"]}, {"x": want["logprobs"]}, "x")[0]
    assert moved > 3 * mean_bound, f"the token step moved the log-probs by {moved} only"
    for got_step, want_step in zip(got["steps"], want["steps"]):
        assert got_step["num_tokens"] == want_step["num_tokens"]
        loss, expected = got_step["loss"].item(), want_step["loss"].item()
        print(f"{label} loss {loss:.6f} vs {expected:.6f}, grad norm "
              f"{got_step['grad_norm']:.4f} vs {want_step['grad_norm']:.4f}")
        assert abs(loss - expected) <= loss_bound * max(abs(expected), 0.1), label
        assert sorted(got_step["metrics"]) == sorted(want_step["metrics"])
        for name, value in want_step["metrics"].items():
            assert torch.allclose(got_step["metrics"][name], value, rtol=loss_bound,
                                  atol=1e-4), (label, name)


@pytest.mark.gpus(2)
@pytest.mark.parametrize("name, flags", [
    ("pp2", ["--pp", "2"]),
    ("pp2_vpp2", ["--pp", "2", "--vpp", "2"]),  # 3 micro-batches a call: padded to 4
])
def test_pipeline_parallel_logprobs_and_grpo_steps_equal_one_stage(tmp_path, reference, name,
                                                                   flags):
    want, ckpt = reference
    got = run_worker(tmp_path, name, [*flags, "--load", ckpt], nproc=2)
    assert got["logprobs_stats"].get("eager eval", 0) > 0  # no forward-only graphs at PP > 1
    assert_equal_to_reference(got, want, PP_TOLERANCE, name)


@pytest.mark.gpus(2)
def test_context_parallel_logprobs_and_grpo_steps_equal_one_rank(tmp_path, reference):
    pytest.importorskip("transformer_engine.pytorch",
                        reason="context parallelism needs Transformer Engine "
                               "(pip install -e '.[te]')")
    want, ckpt = reference
    # te_patches: TE's THD context-parallel path without host syncs, as graphs need.
    path = os.pathsep.join(p for p in (os.path.join(REPO, "te_patches"),
                                       os.environ.get("PYTHONPATH")) if p)
    got = run_worker(tmp_path, "cp2", ["--cp", "2", "--load", ckpt], nproc=2,
                     env={"PYTHONPATH": path})
    assert got["segment_multiple"] == 4 and want["segment_multiple"] == 1
    assert got["logprobs_stats"]["forward graphs"] == 3  # forward-only graphs replay at CP 2
    # Graphs against eager at CP 2 on the same weights, as at CP 1.
    for label, run in (("cp2", got), ("reference", want)):
        mean, worst = differences(run, {"logprobs": run["eager"]}, "logprobs")
        print(f"{label} graphs vs eager: max |d| {worst:.2e}")
        assert worst <= 1e-2, (label, mean, worst)
    assert_equal_to_reference(got, want, CP_TOLERANCE, "cp2")
