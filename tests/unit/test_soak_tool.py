import math

from tools.soak import check_run, window_means


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
