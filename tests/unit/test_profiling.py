from megatron.packed_training.profiling import StepProfiler, kernel_intervals_from_trace, merged_busy_us


def test_overlapping_kernels_count_once():
    assert merged_busy_us([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17
    assert merged_busy_us([]) == 0


def test_kernel_intervals_come_from_kernel_events_only():
    trace = {"traceEvents": [
        {"cat": "kernel", "ts": 100.0, "dur": 5.0},
        {"cat": "cuda_runtime", "ts": 90.0, "dur": 50.0},
        {"cat": "kernel", "ts": 103.0, "dur": 4.0},
    ]}
    assert kernel_intervals_from_trace(trace) == [(100.0, 105.0), (103.0, 107.0)]
    assert merged_busy_us(kernel_intervals_from_trace(trace)) == 7.0


def test_profiler_outside_its_range_does_nothing():
    profiler = StepProfiler(enabled=True, start=10, end=12)
    profiler.begin(3)
    assert profiler.finish(3) == {}
    assert StepProfiler(False, 1, 2).finish(1) == {}
