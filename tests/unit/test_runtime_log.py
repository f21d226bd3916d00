"""The graph runtime's log beside Megatron-LM's (metrics.RuntimeLog), on CPU in a one-rank world:
the per-interval line, the metrics file, evaluation records."""

from argparse import Namespace

import pytest
import torch

from megatron.packed_training.metrics import RuntimeLog, read_metrics, reduced_lm_loss


@pytest.fixture
def calculator():
    from megatron.core import num_microbatches_calculator as calc

    calc.init_num_microbatches_calculator(0, None, 4, 1, 1)
    yield
    calc.destroy_num_microbatches_calculator()


def args(tmp_path, **more):
    return Namespace(iteration=0, metrics_file=str(tmp_path / "m.jsonl"), log_interval=2,
                     train_iters=3, seq_length=8, consumed_train_samples=0, num_experts=None,
                     moe_expert_capacity_factor=None, packed_profile=False, profile_step_start=10,
                     profile_step_end=12, profile_trace_dir=None, **more)


def losses(*pairs):
    return [{"lm loss": torch.tensor([s, n])} for s, n in pairs]


def test_the_loss_is_token_weighted_over_micro_batches(cpu_dist):
    assert float(reduced_lm_loss(losses((6.0, 2.0), (2.0, 2.0)))) == pytest.approx(2.0)
    assert reduced_lm_loss([]) is None  # off the last pipeline stage


def test_a_line_and_a_record_per_log_interval_and_at_the_end(cpu_dist, calculator, tmp_path,
                                                             capsys):
    log = RuntimeLog(args(tmp_path))
    for iteration, eager in enumerate((2, 0, 1), start=1):
        stats = {"docs per micro-batch": 3.0, "graph fallbacks": eager}
        if eager:
            stats["eager overflow"] = eager
        log("train", stats, losses((4.0 * iteration, 4.0)))
    lines = [l for l in capsys.readouterr().out.splitlines() if "packed graphs" in l]
    assert len(lines) == 2  # iterations 2 and 3 (the last)
    assert "iteration        2 |" in lines[0] and "eager overflow: 2" in lines[0]
    assert "graph fallbacks: 2" in lines[0]  # summed over the interval
    records = read_metrics(args(tmp_path).metrics_file)
    assert [r["iteration"] for r in records] == [2, 3]
    assert records[0]["lm_loss"] == pytest.approx(2.0) and records[1]["lm_loss"] == 3.0
    assert records[0]["consumed_samples"] == 4 and records[1]["eager overflow"] == 1


def test_an_evaluation_is_reported_once_it_has_ended(cpu_dist, calculator, tmp_path, capsys):
    log = RuntimeLog(args(tmp_path))
    log("train", {}, losses((1.0, 1.0)))
    for _ in range(2):  # two evaluation iterations
        log("valid", {"eager eval": 4}, losses((3.0, 1.0)))
    log("train", {}, losses((1.0, 1.0)))
    valid = read_metrics(args(tmp_path).metrics_file, split="valid")
    assert valid == [{"split": "valid", "iteration": 1, "lm_loss": 3.0, "eager eval": 8}]
    assert "validation at iteration 1 | eager eval: 8 |" in capsys.readouterr().out


def test_dynamic_cp_throughput_counts_the_samples_own_positions(cpu_dist, calculator, tmp_path,
                                                                monkeypatch):
    """Dynamic CP samples hold CP size x tokens per rank positions: the runtime reports the
    iteration's, and the log's tokens/s counts them instead of samples x --seq-length."""
    from megatron.packed_graphs.runtime import ITERATION_POSITIONS

    log = RuntimeLog(args(tmp_path))  # a record at iterations 2 and 3
    monkeypatch.setattr(log.interval, "timing", lambda: {"tokens_per_sec": log.interval.positions})
    log("train", {"cp turns": 3, ITERATION_POSITIONS: 20}, losses((1.0, 1.0)))
    log("train", {}, losses((1.0, 1.0)))
    log("train", {"cp turns": 1, ITERATION_POSITIONS: 12}, losses((1.0, 1.0)))
    records = read_metrics(args(tmp_path).metrics_file)
    assert [r["tokens_per_sec"] for r in records] == [20 + 4 * 8, 12]  # else 4 samples x 8
    assert records[1]["cp turns"] == 1 and ITERATION_POSITIONS not in records[1]


def test_training_and_evaluation_counters_reach_tensorboard(cpu_dist, calculator, tmp_path,
                                                            monkeypatch):
    from megatron.training import global_vars

    scalars = []

    class Writer:  # what the log calls of Megatron-LM's TensorBoard writer
        def add_scalar(self, tag, value, step):
            scalars.append((tag, value, step))

    monkeypatch.setattr(global_vars, "_GLOBAL_TENSORBOARD_WRITER", Writer())
    log = RuntimeLog(args(tmp_path))
    log("train", {"graph fallbacks": 1}, losses((1.0, 1.0)))
    log("valid", {"eager eval": 4}, losses((3.0, 1.0)))
    log("train", {"graph fallbacks": 0}, losses((1.0, 1.0)))
    assert ("packed-graphs/validation eager eval", 4, 1) in scalars
    assert ("packed-graphs/graph fallbacks", 1, 2) in scalars
