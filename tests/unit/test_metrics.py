"""metrics.IntervalTimer: the runtime's per-interval time, throughput and counters. The log line
and metrics file around it (RuntimeLog): tests/unit/test_runtime_log.py; the loss, learning
rate, MoE losses, memory, TensorBoard and W&B are Megatron-LM's own logging now."""

import pytest


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
