import math

from tools.soak import check_run, log_values, window_means, with_log_values


def _records(losses, allocated=100, reserved=200, grow_from=None):
    rows = []
    for i, loss in enumerate(losses, start=1):
        extra = 2**20 * 8 if grow_from and i >= grow_from else 0
        rows.append({"iteration": i, "lm_loss": loss, "grad_norm": 1.0,
                     "mem_allocated_bytes": allocated, "mem_reserved_bytes": reserved + extra})
    return rows


CHECK = dict(window=2, loss_atol=5e-3, memory_from=2, memory_slack_mib=0.0)


def test_window_means_drop_the_short_tail():
    assert window_means([1, 3, 5, 7, 9], 2) == [2.0, 6.0]


def test_identical_runs_pass():
    eager = _records([3.0, 2.9, 2.8, 2.7])
    assert check_run(eager, eager, **CHECK)["failures"] == []


def test_step_noise_that_averages_out_passes_and_a_drift_fails():
    eager = _records([3.0, 2.9, 2.8, 2.7])
    noisy = _records([3.004, 2.896, 2.804, 2.696])
    assert check_run(noisy, eager, **CHECK)["failures"] == []
    drifted = _records([3.0, 2.9, 2.82, 2.72])
    assert "windowed loss differs" in check_run(drifted, eager, **CHECK)["failures"][0]


def test_nan_and_memory_growth_fail():
    eager = _records([3.0, 2.9, 2.8, 2.7])
    nan = _records([3.0, math.nan, 2.8, 2.7])
    assert "NaN" in check_run(nan, eager, **CHECK)["failures"][0]
    growing = _records([3.0, 2.9, 2.8, 2.7], grow_from=4)
    row = check_run(growing, eager, **CHECK)
    assert row["reserved_growth_mib"] == 8.0
    assert any("mem_reserved_bytes grew by 8.0 MiB" in f for f in row["failures"])


# ------------------------------------------ grad norm and memory from Megatron-LM's log

def _log(norms, memory=None):
    """Megatron-LM's log of a run: one iteration line per step (grad norm as it prints it),
    memory reports ``{iteration: (allocated MB, reserved MB)}``."""
    lines = ["using world size: 1, data-parallel size: 1"]
    for i, norm in enumerate(norms, start=1):
        lines.append(f" [2026-01-01 00:00:0{i}.000000] iteration {i:8d}/{len(norms):8d} | "
                     f"consumed samples: {4 * i:12d} | elapsed time per iteration (ms): 99.0 | "
                     f"learning rate: 1.000000E-04 | global batch size:     4 | lm loss: "
                     f"3.000000E+00 | loss scale: 1.0 | grad norm: {norm} | number of skipped "
                     f"iterations:   0 | number of nan iterations:   0 |")
        if memory and i in memory:
            allocated, reserved = memory[i]
            lines.append(f"[Rank 0] (after {i} iterations) memory (MB) | allocated: "
                         f"{allocated:.2f} | max allocated: {allocated + 100:.2f} | reserved: "
                         f"{reserved:.2f} | max reserved: {reserved:.2f}")
    return "\n".join(lines) + "\n"


def _metrics_records(losses):
    return [{"iteration": i, "consumed_samples": 4 * i, "lm_loss": loss,
             "iteration_time_ms": 99.0, "tokens_per_sec": 1000.0}
            for i, loss in enumerate(losses, start=1)] + [
        {"split": "valid", "iteration": len(losses), "lm_loss": 9.0}]


def test_log_values_read_grad_norms_and_memory_reports():
    values = log_values(_log(["1.250", "nan", "0.750"], memory={2: (100.0, 200.0)}))
    assert values[1] == {"grad_norm": 1.25} and values[3] == {"grad_norm": 0.75}
    assert math.isnan(values[2]["grad_norm"])
    assert values[2]["mem_allocated_bytes"] == 100 * 2**20
    assert values[2]["mem_reserved_bytes"] == 200 * 2**20


def test_records_from_the_metrics_file_and_the_log_go_through_the_checks():
    losses = [3.0, 2.9, 2.8, 2.7]
    memory = {2: (100.0, 200.0), 4: (100.0, 200.0)}
    eager = with_log_values(_metrics_records(losses), _log(["1.0"] * 4, memory))
    assert len(eager) == 4  # the validation record is left out
    assert check_run(eager, eager, **CHECK)["failures"] == []
    grown = with_log_values(_metrics_records(losses),
                            _log(["1.0"] * 4, {2: (100.0, 200.0), 4: (100.0, 208.0)}))
    row = check_run(grown, eager, **CHECK)
    assert row["reserved_growth_mib"] == 8.0 and row["allocated_growth_mib"] == 0.0
    nan = with_log_values(_metrics_records(losses), _log(["1.0", "nan", "1.0", "1.0"], memory))
    assert "NaN or Inf loss or grad norm" in check_run(nan, eager, **CHECK)["failures"]
    unlogged = with_log_values(_metrics_records(losses), _log(["1.0"] * 2, memory))
    failures = check_run(unlogged, eager, **CHECK)["failures"]
    assert "no grad norm logged at 2 iterations (first: 3)" in failures
    assert "no mem_allocated_bytes at iteration 2" not in failures
    assert "no mem_reserved_bytes at iteration 4" in failures  # the last record: no report


def test_the_launch_asks_for_memory_at_memory_from_and_the_last_step(monkeypatch):
    """The soak's launch line passes the training parser, logs every iteration and has
    Megatron-LM report memory at --memory-from and at --steps."""
    import os
    from types import SimpleNamespace
    from unittest import mock

    import torch

    from megatron.packed_training.arguments import parse_args
    from tools.soak import launch_command

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    args = SimpleNamespace(steps=1000, memory_from=150, global_batch_size=4,
                           doc_length_median=512, extra_args="")
    cmd = launch_command("hybrid-small", "chunk-graphs", args, "/tmp/m.jsonl")
    at = next(i for i, w in enumerate(cmd) if w.endswith("pretrain_mamba.py"))
    with mock.patch.dict(os.environ, {"WORLD_SIZE": "1", "RANK": "0"}):
        parsed = parse_args(cmd[at + 1:], "hybrid")
    assert parsed.log_interval == 1 and parsed.log_memory_interval == 50
    assert 150 % parsed.log_memory_interval == 0 and 1000 % parsed.log_memory_interval == 0
    assert parsed.packed_graph_impl == "local" and parsed.cuda_graph_granularity == "chunk"
    assert parsed.train_iters == 1000 and parsed.eval_iters == 0
