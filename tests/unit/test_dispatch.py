import pytest

from megatron.packed_graphs.dispatch import (
    GraphSettings,
    Reason,
    capture_capacities,
    cuda_graphs_bypassed,
    disable_cuda_graphs_this_step,
    plan_iteration,
)

ON = GraphSettings(enabled=True, capacity=8, warmup_iterations=2, capture_needs_all_micro_batches=False)
ON_PP = GraphSettings(enabled=True, capacity=8, warmup_iterations=0, capture_needs_all_micro_batches=True)


def reasons(settings, iteration, captured, counts):
    return [d.reason for d in plan_iteration(settings, iteration, captured, counts)]


def test_disabled_runs_everything_eager_without_counting_fallbacks():
    off = GraphSettings(False, 0, 0, False)
    decisions = plan_iteration(off, 5, (), [3, 30])
    assert [d.reason for d in decisions] == [Reason.DISABLED] * 2
    assert not any(d.is_fallback or d.graphed for d in decisions)


def test_warmup_iterations_are_eager_then_capture_then_replay():
    assert reasons(ON, 0, (), [3, 4]) == [Reason.WARMUP] * 2
    assert reasons(ON, 1, (), [3, 4]) == [Reason.WARMUP] * 2
    assert reasons(ON, 2, (), [3, 4]) == [Reason.GRAPHED] * 2  # capture iteration
    assert reasons(ON, 3, (8,), [8, 9]) == [Reason.GRAPHED, Reason.OVERFLOW]
    assert {d.capacity for d in plan_iteration(ON, 3, (8,), [1, 8])} == {8}


def test_pipeline_capture_waits_for_an_iteration_where_everything_fits():
    assert reasons(ON_PP, 0, (), [3, 9]) == [Reason.DEFERRED] * 2
    assert reasons(ON_PP, 1, (), [3, 4]) == [Reason.GRAPHED] * 2
    # Once captured, a single overflowing micro-batch falls back alone.
    assert reasons(ON_PP, 2, (8,), [3, 9]) == [Reason.GRAPHED, Reason.OVERFLOW]
    d = plan_iteration(ON_PP, 0, (), [9])[0]
    assert d.is_fallback and not d.graphed


LADDER = GraphSettings(enabled=True, capacity=64, warmup_iterations=0,
                       capture_needs_all_micro_batches=False, ladder=(4, 16))


def capacities(decisions):
    return [d.capacity if d.graphed else d.reason.value for d in decisions]


def test_capture_iteration_covers_the_top_capacity_first_then_as_many_rungs_as_fit():
    assert LADDER.capacities == (4, 16, 64)
    # The fullest micro-batch that fits takes the top; the emptiest the smallest rung.
    assert capacities(capture_capacities((4, 16, 64), [10, 3, 12, 2])) == [16, 16, 64, 4]
    # Too few micro-batches: the top first, then ascending.
    assert capacities(capture_capacities((4, 16, 64), [3])) == [64]
    assert capacities(capture_capacities((4, 16, 64), [3, 2])) == [64, 4]
    # A rung nothing fits is left out; an overflow stays eager.
    assert capacities(capture_capacities((4, 16, 64), [10, 12, 70])) == [16, 64, "overflow"]


def test_after_capture_each_micro_batch_takes_the_smallest_captured_capacity_that_fits():
    captured = (16, 64)  # rung 4 was not captured
    got = plan_iteration(LADDER, 9, captured, [1, 16, 17, 64, 65])
    assert capacities(got) == [16, 16, 64, 64, "overflow"]
    assert [d.is_fallback for d in got] == [False] * 4 + [True]


def test_bypass_context_nests_and_restores_on_error():
    assert not cuda_graphs_bypassed()
    with disable_cuda_graphs_this_step():
        with disable_cuda_graphs_this_step():
            assert cuda_graphs_bypassed()
        assert cuda_graphs_bypassed()
    with pytest.raises(RuntimeError):
        with disable_cuda_graphs_this_step():
            raise RuntimeError("boom")
    assert not cuda_graphs_bypassed()
