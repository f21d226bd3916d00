"""The graph plan (dispatch.plan_iteration, chunk slots) over every granularity and reason."""

from dataclasses import replace

import pytest

from megatron.packed_graphs.dispatch import (
    assign_chunk_slots,
    capture_capacities,
    micro_batch_reasons,
    plan_chunks,
    plan_iteration,
)
from megatron.packed_graphs.plan import (
    Granularity,
    GraphKey,
    GraphRuntimeConfig,
    Mode,
    Reason,
    StepGraphPlan,
    active_plan,
    graphs_bypassed,
    run_eager,
    running,
)

LOCAL = GraphRuntimeConfig(impl="local", capacity=8, warmup_iterations=2)
TE = replace(LOCAL, impl="transformer_engine")
PP = replace(LOCAL, warmup_iterations=0, capture_needs_all_micro_batches=True)
CHUNK = replace(LOCAL, granularity=Granularity.CHUNK, warmup_iterations=0, slots_per_chunk=(2, 1))
BANKS = GraphRuntimeConfig(impl="transformer_engine", granularity=Granularity.CP_BANK,
                           warmup_iterations=1, bank_capacities=((1, 4), (2, 6)))
LADDER = GraphRuntimeConfig(impl="local", capacity=64, ladder=(4, 16))
OFF = GraphRuntimeConfig()


def reasons(plans):
    return [p.reason for p in plans]


def shown(plans):
    """A graphed plan as (mode, capacity), an eager one as its reason."""
    return [(p.mode.value, p.key.capacity) if p.uses_graphs else p.reason.value for p in plans]


def test_disabled_runs_everything_eager_without_counting_fallbacks():
    for training in (True, False):
        plans = plan_iteration(OFF, 5, (), [3, 30], training=training)
        assert reasons(plans) == [Reason.DISABLED] * 2
        assert not any(p.is_fallback or p.uses_graphs for p in plans)


@pytest.mark.parametrize("config", [LOCAL, TE], ids=["local", "te"])
def test_layer_graphs_warm_up_then_capture_then_replay(config):
    assert reasons(plan_iteration(config, 0, (), [3, 4])) == [Reason.WARMUP] * 2
    assert reasons(plan_iteration(config, 1, (), [3, 4])) == [Reason.WARMUP] * 2
    assert shown(plan_iteration(config, 2, (), [3, 4])) == [("capture", 8)] * 2
    replay = plan_iteration(config, 3, {(1, 8)}, [8, 9])
    assert shown(replay) == [("replay", 8), "overflow"]
    assert replay[0].key == GraphKey(Granularity.LAYER, capacity=8, cp_size=1, slot=0)
    assert replay[1].is_fallback and replay[1].capacity is None


def test_the_key_carries_the_static_cp_size():
    config = replace(LOCAL, cp_size=2)
    assert plan_iteration(config, 9, {(2, 8)}, [3])[0].key.cp_size == 2
    # Graphs of another CP size do not serve this run's micro-batches.
    assert reasons(plan_iteration(config, 9, {(1, 8)}, [3])) == [Reason.OVERFLOW]


def test_evaluation_runs_eager_and_is_not_a_fallback():
    for iteration, captured in ((0, ()), (9, {(1, 8)})):
        plans = plan_iteration(LOCAL, iteration, captured, [3, 30], training=False)
        assert reasons(plans) == [Reason.EVAL] * 2
        assert not any(p.is_fallback for p in plans)


def test_pipeline_capture_waits_for_an_iteration_where_everything_fits():
    deferred = plan_iteration(PP, 0, (), [3, 9])
    assert reasons(deferred) == [Reason.DEFERRED] * 2 and deferred[0].is_fallback
    assert shown(plan_iteration(PP, 1, (), [3, 4])) == [("capture", 8)] * 2
    # Once captured, a single overflowing micro-batch falls back alone.
    assert shown(plan_iteration(PP, 2, {(1, 8)}, [3, 9])) == [("replay", 8), "overflow"]


def test_capture_iteration_covers_the_top_capacity_first_then_as_many_rungs_as_fit():
    assert LADDER.capacities == (4, 16, 64)
    capacity = lambda counts: [p.capacity if p.uses_graphs else p.reason.value
                               for p in capture_capacities(LADDER, counts)]
    # The fullest micro-batch that fits takes the top; the emptiest the smallest rung.
    assert capacity([10, 3, 12, 2]) == [16, 16, 64, 4]
    # Too few micro-batches: the top first, then ascending.
    assert capacity([3]) == [64]
    assert capacity([3, 2]) == [64, 4]
    # A rung nothing fits is left out; an overflow stays eager.
    assert capacity([10, 12, 70]) == [16, 64, "overflow"]


def test_after_capture_each_micro_batch_takes_the_smallest_captured_capacity_that_fits():
    captured = {(1, 16), (1, 64)}  # rung 4 was not captured
    got = plan_iteration(LADDER, 9, captured, [1, 16, 17, 64, 65])
    assert [p.capacity for p in got[:4]] == [16, 16, 64, 64]
    assert [p.is_fallback for p in got] == [False] * 4 + [True]


def test_cp_banks_capture_every_bank_past_the_warm_up_and_replay_by_cp_size():
    sizes = [1, 2, 1, 2]
    assert reasons(plan_iteration(BANKS, 0, (), [3, 5, 5, 7], sizes)) == [Reason.WARMUP] * 4
    capture = plan_iteration(BANKS, 1, (), [3, 5, 5, 7], sizes)
    assert shown(capture) == [("capture", 4), ("capture", 6), "overflow", "overflow"]
    assert [p.key.cp_size for p in capture[:2]] == [1, 2]
    assert capture[1].key.granularity is Granularity.CP_BANK
    replay = plan_iteration(BANKS, 2, {(1, 4), (2, 6)}, [4, 6, 1], [1, 2, 2])
    assert shown(replay) == [("replay", 4), ("replay", 6), ("replay", 6)]


def test_chunk_capture_records_one_micro_batch_per_slot_and_caps_the_rest():
    plans = plan_iteration(CHUNK, 0, (), [3, 30, 4, 5])
    first, second = plan_chunks(CHUNK, plans, num_chunks=2)  # 2 slots, then 1
    assert [(p.reason.value, p.key.slot if p.key else None) for p in first] == [
        ("graphed", 0), ("overflow", None), ("graphed", 1), ("slot_cap", None)]
    assert reasons(second) == [Reason.GRAPHED, Reason.OVERFLOW, Reason.SLOT_CAP, Reason.SLOT_CAP]
    assert all(p.mode is Mode.CAPTURE for p in first + second if p.uses_graphs)
    # A micro-batch counts with the first chunk that ran it eager.
    assert micro_batch_reasons([first, second]) == [
        Reason.GRAPHED, Reason.OVERFLOW, Reason.SLOT_CAP, Reason.SLOT_CAP]
    assert StepGraphPlan.eager(Reason.SLOT_CAP).is_fallback


def test_chunk_replay_takes_slots_round_robin_skipping_eager_micro_batches():
    plans = plan_iteration(CHUNK, 5, {(1, 8)}, [3, 30, 4, 5, 6])
    assert [p.key.slot if p.key else "eager" for p in assign_chunk_slots(plans, 2)] == [
        0, "eager", 1, 0, 1]
    # Layer granularity: one plan list for every chunk, slot 0.
    layer = plan_chunks(LOCAL, plan_iteration(LOCAL, 5, {(1, 8)}, [3, 4]), num_chunks=2)
    assert layer[0] == layer[1] and {p.key.slot for p in layer[0]} == {0}


def test_every_reason_is_planned_somewhere():
    planned = set()
    for config, iteration, captured, counts, sizes, training in [
            (OFF, 0, (), [1], None, True), (LOCAL, 0, (), [1], None, True),
            (LOCAL, 0, (), [1], None, False), (PP, 0, (), [1, 99], None, True),
            (LOCAL, 9, {(1, 8)}, [1, 99], None, True), (BANKS, 1, (), [1], [2], True)]:
        planned |= set(reasons(plan_iteration(config, iteration, captured, counts, sizes,
                                              training=training)))
    planned |= set(reasons(assign_chunk_slots(plan_iteration(CHUNK, 0, (), [1, 1]), 1)))
    # Planned by callers of a plan instead: reruns and the health check's eager pass (the
    # runtime) and tools (run_eager); an iteration graph's miss (full_iteration.py).
    assert set(Reason) - planned == {Reason.MOE_OVERFLOW_RERUN, Reason.HEALTH_CHECK,
                                     Reason.FORCED, Reason.MICRO_BATCH_COUNT}


def test_graphs_turned_off_run_everything_eager_as_disabled():
    """After the health check's disable action: past capture, training and evaluation alike."""
    for training in (True, False):
        plans = plan_iteration(LOCAL, 9, {(1, 8)}, [3, 30], training=training, graphs_off=True)
        assert reasons(plans) == [Reason.DISABLED] * 2
        assert not any(p.is_fallback or p.uses_graphs for p in plans)
    assert shown(plan_iteration(LOCAL, 9, {(1, 8)}, [3], graphs_off=False)) == [("replay", 8)]


def test_a_plan_is_graphed_with_a_key_or_eager_without_one():
    key = GraphKey(Granularity.LAYER, 8)
    with pytest.raises(ValueError, match="inconsistent graph plan"):
        StepGraphPlan(Mode.EAGER, Reason.GRAPHED, key)
    with pytest.raises(ValueError, match="inconsistent graph plan"):
        StepGraphPlan(Mode.REPLAY, Reason.OVERFLOW, key)
    with pytest.raises(ValueError, match="inconsistent graph plan"):
        StepGraphPlan(Mode.REPLAY, Reason.GRAPHED)
    assert StepGraphPlan.graphed(Mode.REPLAY, key).with_slot(3).key.slot == 3


def test_full_iteration_is_a_key_granularity_not_a_config_one():
    with pytest.raises(ValueError, match="CUDA graph granularity is wrong: full_iteration. "
                                         "It names the graph of a whole iteration"):
        GraphRuntimeConfig(impl="local", capacity=8, granularity=Granularity.FULL_ITERATION)


def test_config_refusals():
    with pytest.raises(ValueError, match="CUDA graph capacity is wrong: 0. Set "
                                         "--cuda-graph-max-packed-seqs"):
        GraphRuntimeConfig(impl="local")
    with pytest.raises(ValueError, match="CUDA graph implementation is wrong: cudnn"):
        GraphRuntimeConfig(impl="cudnn", capacity=8)
    with pytest.raises(ValueError, match="CUDA graph banks are wrong"):
        GraphRuntimeConfig(impl="transformer_engine", granularity=Granularity.CP_BANK)
    with pytest.raises(ValueError, match="CUDA graph banks are wrong"):
        GraphRuntimeConfig(impl="transformer_engine", capacity=8, bank_capacities=((1, 8),))


def test_the_plan_scope_nests_and_restores_on_error():
    graphed = StepGraphPlan.graphed(Mode.REPLAY, GraphKey(Granularity.LAYER, 8))
    assert active_plan() is None and not graphs_bypassed()
    with running(graphed):
        assert active_plan() is graphed and not graphs_bypassed()
        with run_eager():
            assert graphs_bypassed() and active_plan().reason is Reason.FORCED
        assert active_plan() is graphed
    with pytest.raises(RuntimeError):
        with run_eager(Reason.EVAL):
            raise RuntimeError("boom")
    assert active_plan() is None
