"""Single-GPU training runs of the real scripts on Megatron-LM's training loop: loss falls,
resume (Megatron-LM's checkpoints) continues the curve, Megatron-LM launch lines and flags
(--exit-signal-handler, --exit-duration-in-mins, --squared-relu, --no-save-optim) work as
there."""

import statistics

import pytest

from megatron.packed_training.extra_args import is_importable
from tests.gpu.launch import (
    LAYER_GRAPHS,
    TINY_GPT,
    TINY_GPT_MOE,
    TINY_HYBRID,
    TRAIN,
    losses,
    run_training,
    train_then_resume,
)


@pytest.mark.parametrize("kind", ["gpt", "hybrid"])
def test_loss_falls_over_200_steps(tmp_path, kind):
    script, model = ("pretrain_gpt.py", TINY_GPT) if kind == "gpt" else ("pretrain_mamba.py", TINY_HYBRID)
    records = run_training(script, model + TRAIN + ["--train-iters", "200",
                                                   "--global-batch-size", "4"], tmp_path, name=kind)
    curve = losses(records)
    assert len(curve) == 200
    first, last = statistics.mean(curve[:10]), statistics.mean(curve[-10:])
    # Mock documents follow a learnable stride pattern; a working model gets well below the
    # uniform-guess loss ln(1024) = 6.93 within 200 steps.
    assert last < first - 2.0, (first, last)
    assert all(r["tokens_per_sec"] > 0 for r in records)


def test_resume_matches_uninterrupted_run(tmp_path):
    """Megatron-LM's checkpoint at iteration 10 (--exit-interval with --save), --load to 20:
    the same iterations, samples, learning rates and losses as one run to 20 (the same
    --train-iters, so the same schedule, in all three runs)."""
    common = TINY_GPT + TRAIN + ["--global-batch-size", "4", "--train-iters", "20"]
    full = run_training("pretrain_gpt.py", common, tmp_path, name="full")
    first, second = train_then_resume("pretrain_gpt.py", common, tmp_path, save_interval=10,
                                      exit_interval=10)
    assert [r["iteration"] for r in first] == list(range(1, 11))
    assert [r["iteration"] for r in second] == list(range(11, 21))
    assert second[0]["consumed_samples"] == 44
    # Same weights, optimizer state, LR schedule, RNG and data position: the resumed curve is
    # the uninterrupted one, up to FlashAttention's non-deterministic backward accumulation.
    for resumed, reference in zip(second, full[10:]):
        assert abs(resumed["lm_loss"] - reference["lm_loss"]) < 2e-3, (resumed, reference)
        assert resumed["learning_rate"] == pytest.approx(reference["learning_rate"])


def test_a_checkpoint_without_optimizer_and_rng_loads_with_the_matching_flags(tmp_path):
    """--no-save-optim --no-save-rng: a smaller checkpoint, which --load reads with
    --no-load-optim --no-load-rng; training continues at the next iteration from the trained
    weights."""
    common = TINY_GPT + TRAIN + ["--global-batch-size", "4", "--train-iters", "8"]
    first_half = ["--save-interval", "4", "--exit-interval", "4"]
    full, slim = tmp_path / "full", tmp_path / "slim"
    first = run_training("pretrain_gpt.py", common + first_half + ["--save", full], tmp_path,
                         name="full")
    run_training("pretrain_gpt.py", common + first_half + ["--save", slim, "--no-save-optim",
                                                           "--no-save-rng"], tmp_path,
                 name="slim")
    size = {d: sum(f.stat().st_size for f in d.rglob("*") if f.is_file()) for d in (full, slim)}
    print(f"checkpoint bytes: full {size[full]}, without optimizer and RNG {size[slim]}")
    assert size[slim] < 0.5 * size[full]  # bf16 weights without fp32 main params and moments
    resumed = run_training("pretrain_gpt.py", common + ["--load", slim, "--no-load-optim",
                                                        "--no-load-rng"], tmp_path,
                           name="resumed")
    assert [r["iteration"] for r in resumed] == [5, 6, 7, 8]
    assert resumed[0]["lm_loss"] < first[0]["lm_loss"] - 0.2  # it starts from trained weights


def test_megatron_launch_flags_train_as_in_megatron(tmp_path):
    """A Megatron-style line: --train-samples and --lr-warmup-samples set the length and the
    warm-up in iterations, --manual-gc runs. Then --exit-duration-in-mins (whole minutes in
    Megatron-LM, checked after every iteration) stops a long second run a minute after its
    start, with a checkpoint, and --load continues from it."""
    import os

    common = TINY_GPT + TRAIN + [
        "--global-batch-size", "4", "--lr-warmup-samples", "8", "--manual-gc",
        "--manual-gc-interval", "5", "--use-mcore-models", "--disable-bias-linear",
        "--group-query-attention", "--ckpt-format", "torch_dist"]
    records = run_training("pretrain_gpt.py", common + ["--train-samples", "48"], tmp_path,
                           name="samples")
    assert [r["iteration"] for r in records] == list(range(1, 13))  # 48 // 4
    assert records[0]["learning_rate"] < records[2]["learning_rate"]  # warming up for 2

    ckpt, length = tmp_path / "ckpt", 4 * 100_000  # samples: far more than a minute's worth
    stopped = run_training("pretrain_gpt.py", common + [
        "--train-samples", str(length), "--exit-duration-in-mins", "1", "--save", str(ckpt),
        "--save-interval", "1000000"], tmp_path, name="deadline")
    last = stopped[-1]["iteration"]
    assert [r["iteration"] for r in stopped] == list(range(1, last + 1)) and last < length // 4
    assert "exiting program after" in (tmp_path / "deadline.log").read_text()
    assert os.path.isdir(ckpt / f"iter_{last:07d}")
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(last)
    resumed = run_training("pretrain_gpt.py", common + [
        "--train-samples", str(length), "--load", str(ckpt), "--exit-interval", "1"], tmp_path,
        name="resumed")
    assert [r["iteration"] for r in resumed] == [last + 1]


def test_sigterm_to_torchrun_saves_and_stops_with_the_exit_signal_handler(tmp_path):
    """Slurm's warning signal as it reaches a torchrun job: SIGTERM to torchrun, which passes
    it to the ranks. With --exit-signal-handler Megatron-LM stops after the iteration it sees
    the signal in, saves, and --load continues from that checkpoint."""
    import os
    import signal
    import subprocess
    import time

    from megatron.packed_training.metrics import read_metrics
    from tests.gpu.launch import REPO, torchrun_command

    def lines_written():  # complete lines only: the file is being written
        return metrics.read_text().count("\n") if metrics.exists() else 0

    ckpt, metrics = tmp_path / "ckpt", tmp_path / "signal.jsonl"
    common = TINY_GPT + TRAIN + ["--global-batch-size", "4", "--train-iters", "2000"]
    cmd = torchrun_command("pretrain_gpt.py", common + [
        "--exit-signal-handler", "--save", str(ckpt), "--save-interval", "10000",
        "--metrics-file", str(metrics)], nproc=1)
    with open(tmp_path / "signal.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.time() + 600
        while time.time() < deadline and proc.poll() is None and lines_written() < 5:
            time.sleep(0.2)
        assert proc.poll() is None, (tmp_path / "signal.log").read_text()[-4000:]
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    stopped = read_metrics(str(metrics))[-1]["iteration"]
    assert 0 < stopped < 2000
    assert "exiting program after receiving SIGTERM" in (tmp_path / "signal.log").read_text()
    assert os.path.isdir(ckpt / f"iter_{stopped:07d}")
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(stopped)
    resumed = run_training("pretrain_gpt.py",
                           common + ["--load", str(ckpt), "--exit-interval", "1"],
                           tmp_path, name="resumed")
    assert [r["iteration"] for r in resumed] == [stopped + 1]


def test_squared_relu_hybrid_trains_under_layer_graphs_like_eager(tmp_path):
    """Nemotron-H's MLP activation (--squared-relu): the hybrid trains, and local layer graphs
    follow eager within the graph tests' tolerance."""
    common = TINY_HYBRID + TRAIN + ["--squared-relu", "--global-batch-size", "4",
                                    "--train-iters", "20"]
    eager = run_training("pretrain_mamba.py", common, tmp_path, name="eager")
    graphs = run_training("pretrain_mamba.py", common + LAYER_GRAPHS, tmp_path, name="graphs")
    dloss = max(abs(e - g) for e, g in zip(losses(eager), losses(graphs)))
    print(f"squared-ReLU hybrid, layer graphs vs eager: max |dloss| {dloss:.2e}")
    assert dloss < 5e-3, (losses(eager), losses(graphs))
    curve = losses(eager)
    assert statistics.mean(curve[-5:]) < statistics.mean(curve[:5])  # it learns


@pytest.mark.skipif(not is_importable("transformer_engine"),
                    reason="needs Transformer Engine (--transformer-impl transformer_engine)")
def test_a_megatron_moe_launch_line_trains(tmp_path):
    """The extra flags of a Megatron-LM MoE script: --transformer-impl picks the TE spec,
    --lr-warmup-fraction and --lr-warmup-init shape the warm-up (3 of 12 iterations, from
    1e-4; the rates of Megatron-LM's log line)."""
    records = run_training("pretrain_gpt.py", TINY_GPT_MOE + TRAIN + [
        "--global-batch-size", "4", "--train-iters", "12", "--transformer-impl",
        "transformer_engine", "--norm-epsilon", "1e-6", "--lr-warmup-fraction", "0.25",
        "--lr-warmup-init", "1e-4", "--attention-softmax-in-fp32", "--moe-token-drop-policy",
        "probs", "--optimizer", "adam", "--dataloader-type", "single"], tmp_path, name="moe")
    assert [r["iteration"] for r in records] == list(range(1, 13))
    rates = [r["learning_rate"] for r in records]
    assert 1e-4 < rates[0] < rates[1] < rates[2] and max(rates) == pytest.approx(1e-3, rel=0.02)
    assert rates[-1] < rates[3]  # decaying after the warm-up
    assert losses(records)[-1] < losses(records)[0]
