
from megatron.packed_training.checkpointing import latest_iteration
from megatron.packed_training.metrics import MetricsLogger, read_metrics

import pytest


def _record(i):
    return {"iteration": i, "consumed_samples": 4 * i, "global_batch_size": 4, "lm_loss": 2.5,
            "grad_norm": 1.0, "num_zeros": 0, "learning_rate": 1e-4, "iteration_time_ms": 10.0,
            "tokens_per_sec": 1000.0, "mem_allocated_bytes": 1, "mem_max_allocated_bytes": 2,
            "extra_log": {"graph fallbacks": 1}}


def test_log_line_and_metrics_file(cpu_dist, tmp_path, capsys):
    path = tmp_path / "m.jsonl"
    logger = MetricsLogger(str(path), None, train_iters=10)
    logger.log_train(_record(1))
    logger.log_valid(1, 2.25)
    logger.log_valid(2, 2.0, {"eager eval": 8})
    logger.close()
    line = capsys.readouterr().out
    assert "iteration        1/      10" in line and "lm loss: 2.500000E+00" in line
    assert "graph fallbacks: 1" in line and "tokens/s: 1000" in line
    train = read_metrics(str(path))
    assert train[0]["lm_loss"] == 2.5 and train[0]["graph fallbacks"] == 1
    assert read_metrics(str(path), split="valid") == [
        {"split": "valid", "iteration": 1, "lm_loss": 2.25},
        {"split": "valid", "iteration": 2, "lm_loss": 2.0, "eager eval": 8}]
    assert "validation loss at iteration 2 | lm loss value: 2.000000E+00 | eager eval: 8 |" in line


def test_tensorboard_gets_the_values_and_the_validation_perplexity(cpu_dist, tmp_path):
    """Real event files, read back: Megatron's tags, the validation perplexity with
    --log-validation-ppl-to-tensorboard, the writer's queue from --tensorboard-queue-size."""
    import math

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = MetricsLogger(None, str(tmp_path / "tb"), train_iters=10,
                           tensorboard_queue_size=5, validation_ppl=True)
    assert logger._tb.max_queue == 5
    logger.log_train(_record(1))
    logger.log_valid(1, 2.25)
    logger.log_valid(2, 40.0)  # the exponent is capped at 20, as in Megatron
    logger.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)]
               for tag in events.Tags()["scalars"]}
    assert scalars["lm loss"] == [(1, 2.5)] and scalars["throughput/tokens-per-sec"] == [(1, 1000)]
    assert scalars["lm loss validation"] == [(1, 2.25), (2, 40.0)]
    ppl = scalars["lm loss validation ppl"]
    assert ppl[0][1] == pytest.approx(math.exp(2.25)) and ppl[1][1] == pytest.approx(math.exp(20))


def test_validation_perplexity_is_off_by_default(cpu_dist, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = MetricsLogger(None, str(tmp_path / "tb"), train_iters=10)
    assert logger._tb.max_queue == 1000  # Megatron's default
    logger.log_valid(1, 2.25)
    logger.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert events.Tags()["scalars"] == ["lm loss validation"]


def test_wandb_gets_what_tensorboard_gets(cpu_dist, tmp_path, monkeypatch):
    """A real W&B run, offline: the training values under Megatron's tags, the validation loss
    in its iteration's row, and the arguments as the run's config."""
    wandb = pytest.importorskip("wandb", reason="wandb is in the test extra (pip install .[test])")
    from argparse import Namespace

    from megatron.packed_training.metrics import wandb_run_settings

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    args = Namespace(wandb_project="sft", wandb_exp_name="hybrid-graphs", wandb_save_dir="",
                     save=str(tmp_path / "ckpt"), lr=1e-4)
    settings = wandb_run_settings(args)
    assert settings["dir"] == str(tmp_path / "ckpt" / "wandb")
    logger = MetricsLogger(None, None, train_iters=10, wandb_run=settings)
    run = logger._wandb
    assert (run.project, run.name, run.config["lr"]) == ("sft", "hybrid-graphs", 1e-4)
    logger.log_train(_record(1))
    logger.log_train(_record(2) | {"lm_loss": 2.0, "load_balancing_loss": 0.5})
    logger.log_valid(2, 2.25)
    logger.log_train(_record(3))  # commits iteration 2's row
    summary = dict(run.summary)
    assert summary["_step"] == 2 and summary["lm loss"] == 2.0
    assert summary["lm loss validation"] == 2.25 and summary["load_balancing_loss"] == 0.5
    assert summary["throughput/tokens-per-sec"] == 1000.0 and summary["learning-rate"] == 1e-4
    logger.close()
    assert wandb.run is None  # finished
    assert list((tmp_path / "ckpt" / "wandb" / "wandb").glob("offline-run-*/run-*.wandb"))


def test_wandb_is_off_without_a_project():
    from argparse import Namespace

    from megatron.packed_training.metrics import wandb_run_settings

    assert wandb_run_settings(Namespace(wandb_project="", wandb_exp_name="", wandb_save_dir="",
                                        save=None)) is None


def test_latest_iteration(tmp_path):
    assert latest_iteration(str(tmp_path)) is None
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("120\n")
    assert latest_iteration(str(tmp_path)) == 120
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("release")
    with pytest.raises(ValueError, match="is not an iteration number"):
        latest_iteration(str(tmp_path))


def test_tensorboard_scalars_use_megatron_tags(cpu_dist, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = MetricsLogger(None, str(tmp_path), train_iters=10)
    logger.log_train(_record(1))
    logger.log_train(_record(2))
    logger.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert {"lm loss", "grad-norm", "iteration-time"} <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("lm loss")] == [1, 2]


def test_interval_timer_means_over_the_interval_and_sums_fallbacks(monkeypatch):
    from megatron.packed_training import metrics

    clock = iter([100.0, 100.3, 200.0])
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(clock))
    timer = metrics.IntervalTimer()  # starts at t=100
    timer.add(4, 4000, {"graph fallbacks": 1, "docs per micro-batch": 8.0, "graph capture (s)": 0.5})
    timer.add(4, 4000, {"graph fallbacks": 2, "docs per micro-batch": 9.0, "eager overflow": 2})
    timer.add(4, 4000, {"graph fallbacks": 0, "docs per micro-batch": 7.0, "eager overflow": 1})
    assert timer.timing() == pytest.approx(  # t=100.3: 0.3 s for 3 iterations
        {"iteration_time_ms": 100.0, "tokens_per_sec": 12 * 1000 / 0.3})
    assert timer.stats == {"graph fallbacks": 3, "docs per micro-batch": 7.0,
                           "graph capture (s)": 0.5, "eager overflow": 3}
    timer.restart()  # t=200
    assert (timer.iterations, timer.samples, timer.stats) == (0, 0, {})
