"""examples/rl/grpo_packed.py on CPU: the synthetic rollouts, GRPO advantages and their
micro-batches, the comparison's table and checks, and its three runs (with the runs stood
in for: each needs a GPU; tests/gpu/test_rl_policy.py runs the script)."""

import os
import subprocess
import sys

import pytest
import torch

from megatron.packed_training.rl.batches import lay_out_all
from tests.unit.scripts import load_script

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "examples", "rl", "grpo_packed.py")


@pytest.fixture(scope="module")
def example():
    return load_script("examples", "rl", "grpo_packed.py")


def test_rollouts_vary_in_length_and_repeat_for_a_step(example):
    first = example.make_rollouts(0, prompts=4, group_size=3, vocab=1024)
    again = example.make_rollouts(0, prompts=4, group_size=3, vocab=1024)
    other = example.make_rollouts(1, prompts=4, group_size=3, vocab=1024)
    assert len(first["tokens"]) == 12 and first["groups"].tolist() == [0] * 3 + [1] * 3 + \
        [2] * 3 + [3] * 3
    assert all(torch.equal(a, b) for a, b in zip(first["tokens"], again["tokens"]))
    assert len({len(t) for t in first["tokens"]}) > 3  # varying lengths
    assert [len(t) for t in first["tokens"]] != [len(t) for t in other["tokens"]]
    for tokens, mask, reward in zip(first["tokens"], first["masks"], first["rewards"]):
        response = tokens[mask.bool()]
        assert 8 <= len(response) <= 256 and 16 <= len(tokens) - len(response) <= 64
        assert reward.item() == pytest.approx((response < 512).float().mean().item())
    # A group's prompt is shared by its responses.
    prompt = lambda i: first["tokens"][i][~first["masks"][i].bool()]  # noqa: E731
    assert torch.equal(prompt(0), prompt(2)) and not torch.equal(prompt(0), prompt(3))


def test_group_advantages_are_normalised_per_group_and_zero_for_equal_rewards(example):
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 0.2, 0.4])
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    advantages = example.group_advantages(rewards, groups)
    torch.testing.assert_close(advantages, torch.tensor([1.0, -1.0, 0.0, 0.0, -1.0, 1.0]),
                               rtol=0, atol=1e-4)


def test_rollouts_become_micro_batches_that_fit_a_row(example):
    rollouts = example.make_rollouts(3, prompts=8, group_size=4, vocab=1024)
    micro_batches = example.rollout_micro_batches(rollouts, row_positions=1024)
    assert len(micro_batches) > 1
    batches = lay_out_all(micro_batches, 1024)  # checked as the policy checks them
    total = sum(len(t) for t in rollouts["tokens"])
    assert sum(mb.tokens.numel() for mb in micro_batches) == total
    weights = sum(mb.loss_weights.sum().item() for mb in micro_batches)
    assert weights == sum(m.sum().item() for m in rollouts["masks"])
    for mb, batch in zip(micro_batches, batches):
        # Advantages only where the loss weighs: on response tokens.
        assert (mb.tensors["advantages"][mb.loss_weights == 0] == 0).all()
        assert batch["num_documents"] == len(mb.lengths)


def results(example, graphs_lp=0.0, noise_lp=0.0, graphs_weight=0.0, noise_weight=0.0):
    base = {name: torch.zeros(3) for name in ("a", "b")}
    phases = {phase: [1.0, 10_000] for phase in example.PHASES}
    fast = {phase: [0.2, 10_000] for phase in example.PHASES}
    return {"eager": {"phases": phases, "weights": base, "timed_steps": 4},
            "eager again": {"phases": phases, "weights": {"a": base["a"] + noise_weight,
                                                          "b": base["b"]}},
            "graphs": {"phases": fast, "weights": {"a": base["a"] + graphs_weight,
                                                   "b": base["b"]},
                       "logprob_difference": graphs_lp, "logprob_noise": noise_lp}}


def test_the_report_tabulates_each_phase_and_checks_against_the_noise(example):
    text, passed = example.report(results(example))
    assert passed
    assert "| train step | 250.0 | 50.0 | 10,000 | 50,000 | 5.00x |" in text
    assert "ok   weights after the last step, graphs against eager: max |difference| 0" in text
    _, passed = example.report(results(example, graphs_lp=1e-7))  # deterministic: bitwise
    assert not passed
    text, passed = example.report(results(example, graphs_weight=3e-3, noise_weight=1e-3))
    assert passed  # within 4 x the eager-against-eager difference
    text, passed = example.report(results(example, graphs_weight=5e-3, noise_weight=1e-3))
    assert not passed and "FAIL weights after the last step" in text


def test_a_weights_difference_names_its_worst_element(example):
    base = {"a": torch.tensor([0.1, -0.1, 0.0], dtype=torch.bfloat16)}
    out = results(example)
    out["eager"]["weights"] = out["eager again"]["weights"] = base
    # 0.1 moves in bf16 steps of 2^-11: one step apart, beyond a noise of 0
    out["graphs"]["weights"] = {"a": torch.tensor([0.1 + 2 ** -11, -0.1, 0.0]).to(torch.bfloat16)}
    assert example.worst_rounding_step(out["graphs"]["weights"], base)[:2] == (1.0, "a")
    text, passed = example.report(out)
    assert not passed and "FAIL weights after the last step, graphs against eager: max " \
        "|difference| 0.000488 (1 rounding steps at a: 0.1006 against eager's 0.1001)" in text


def test_the_comparison_runs_eager_twice_then_graphs_and_fails_with_a_check(example,
                                                                           monkeypatch, capsys):
    launched = []

    def call(cmd, env):
        mode, out = cmd[cmd.index("--run") + 1], cmd[cmd.index("--out") + 1]
        launched.append((mode, env["MASTER_PORT"], env["MAMBA_DETERMINISTIC"]))
        which = {"eager": "eager" if len(launched) == 1 else "eager again"}.get(mode, mode)
        torch.save(results(example, graphs_weight=1.0)[which], out)
        return 0

    monkeypatch.setattr(subprocess, "call", call)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU machine
    monkeypatch.delenv("MAMBA_DETERMINISTIC", raising=False)
    assert example.main(["--steps", "6"]) == 1  # the weights differ: a failed check
    assert [mode for mode, *_ in launched] == ["eager", "eager", "graphs"]
    # every run with Mamba's deterministic kernels, unless the environment says otherwise
    assert {deterministic for *_, deterministic in launched} == {"1"}
    out = capsys.readouterr().out
    assert "gpt, 6 steps (4 timed)" in out and "FAIL weights after the last step" in out
    launched.clear()
    monkeypatch.setenv("MAMBA_DETERMINISTIC", "0")
    example.main(["--steps", "6"])
    assert {deterministic for *_, deterministic in launched} == {"0"}


def test_a_failed_run_stops_the_comparison(example, monkeypatch, capsys):
    monkeypatch.setattr(subprocess, "call", lambda cmd, env: 3)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU machine
    assert example.main([]) == 3
    assert "the eager run failed (exit 3)" in capsys.readouterr().err


@pytest.mark.parametrize("argv, match", [(["--steps", "2"], "--steps is wrong: 2"),
                                         (["--run", "graphs"], "--out is wrong: missing")])
def test_bad_arguments(example, argv, match, capsys):
    with pytest.raises(SystemExit):
        example.main(argv)
    assert match in capsys.readouterr().err


NO_GPU = ("examples/rl/grpo_packed.py: needs a CUDA GPU (torch.cuda.is_available() is False): "
          "the policy trains and computes log-probs on the GPU; run it on a GPU machine")


@pytest.mark.slow
def test_without_a_cuda_gpu_it_says_so_in_one_line(tmp_path):
    """The script as a user runs it on a machine without a GPU (none visible here): one line,
    exit status 1, and none of the three runs started."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    run = subprocess.run([sys.executable, SCRIPT], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert (run.returncode, run.stdout, run.stderr.splitlines()) == (1, "", [NO_GPU])


@pytest.mark.parametrize("argv", [[], ["--run", "graphs", "--out", "x.pt"]])
def test_no_run_starts_without_a_cuda_gpu(example, monkeypatch, capsys, argv):
    launched = []
    monkeypatch.setattr(subprocess, "call", lambda cmd, env: launched.append(cmd) or 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(example, "run", lambda options: launched.append(options))
    assert example.main(argv) == 1
    assert capsys.readouterr().err.splitlines() == [NO_GPU] and launched == []
