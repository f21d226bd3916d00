import pytest

from megatron.packed_graphs.dispatch import (
    GraphSettings,
    Reason,
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
    decisions = plan_iteration(off, 5, False, [3, 30])
    assert [d.reason for d in decisions] == [Reason.DISABLED] * 2
    assert not any(d.is_fallback or d.graphed for d in decisions)


def test_warmup_iterations_are_eager_then_capture_then_replay():
    assert reasons(ON, 0, False, [3, 4]) == [Reason.WARMUP] * 2
    assert reasons(ON, 1, False, [3, 4]) == [Reason.WARMUP] * 2
    assert reasons(ON, 2, False, [3, 4]) == [Reason.GRAPHED] * 2  # capture iteration
    assert reasons(ON, 3, True, [8, 9]) == [Reason.GRAPHED, Reason.OVERFLOW]


def test_pipeline_capture_waits_for_an_iteration_where_everything_fits():
    assert reasons(ON_PP, 0, False, [3, 9]) == [Reason.DEFERRED] * 2
    assert reasons(ON_PP, 1, False, [3, 4]) == [Reason.GRAPHED] * 2
    # Once captured, a single overflowing micro-batch falls back alone.
    assert reasons(ON_PP, 2, True, [3, 9]) == [Reason.GRAPHED, Reason.OVERFLOW]
    d = plan_iteration(ON_PP, 0, False, [9])[0]
    assert d.is_fallback and not d.graphed


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
