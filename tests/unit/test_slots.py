"""Slot model of chunk graphs against megatron-core's own schedule tables (CPU): the slot
counts, and the slots the plan hands out (dispatch.assign_chunk_slots), never in use twice."""

import random

import pytest

from megatron.core.pipeline_parallel.schedules import get_schedule_table
from megatron.packed_graphs.dispatch import assign_chunk_slots
from megatron.packed_graphs.plan import Granularity, GraphKey, Mode, Reason, StepGraphPlan
from megatron.packed_graphs.slots import (
    PipelineShape,
    in_flight_peaks,
    schedule_order,
    slot_counts,
)

SHAPES = [PipelineShape(pp, rank, vpp) for pp, vpp in ((1, 1), (2, 1), (4, 1), (2, 2), (4, 2), (4, 3))
          for rank in range(pp)]


def _replay_schedule(shape, num_microbatches, counts, graphed):
    """Walk the rank's order with the plan's slots (``graphed[mb]``: replayed, else eager);
    no slot may be taken while a micro-batch still holds it, and each backward finds its
    forward's slot."""
    table = get_schedule_table(num_microbatches, shape.num_model_chunks, shape.group_size)
    key = GraphKey(Granularity.CHUNK, 8)
    plans = [StepGraphPlan.graphed(Mode.REPLAY, key) if g else StepGraphPlan.eager(Reason.OVERFLOW)
             for g in graphed]
    slots = [[p.key.slot if p.key else None for p in assign_chunk_slots(plans, n)]
             for n in counts]
    forwards, backwards = iter(table), iter(table)
    held = [set() for _ in counts]
    for step in schedule_order(shape, num_microbatches):
        if step > 0:
            mb, chunk = next(forwards)
            assert chunk == step - 1
            slot = slots[chunk][mb]
            if slot is not None:
                assert slot not in held[chunk], (mb, chunk, slot)
                held[chunk].add(slot)
        else:
            mb, table_chunk = next(backwards)
            chunk = shape.num_model_chunks - 1 - table_chunk  # backward walks chunks in reverse
            assert chunk == -step - 1
            if slots[chunk][mb] is not None:
                held[chunk].remove(slots[chunk][mb])
    assert not any(held)


def test_one_f_one_b_needs_one_slot_per_stage_ahead():
    for pp in (1, 2, 4, 8):
        assert [slot_counts(PipelineShape(pp, r))[0] for r in range(pp)] == list(range(pp, 0, -1))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"pp{s.pp_size}r{s.pp_rank}v{s.num_model_chunks}")
def test_planned_slots_serve_every_micro_batch_count(shape):
    counts = slot_counts(shape)
    draw = random.Random(shape.pp_size * 100 + shape.pp_rank * 10 + shape.num_model_chunks)
    for num_microbatches in range(1, 40):
        if not shape.valid_microbatch_count(num_microbatches):
            continue
        _replay_schedule(shape, num_microbatches, counts, [True] * num_microbatches)
        # Eager micro-batches (overflow) take no slot, wherever they fall.
        _replay_schedule(shape, num_microbatches, counts,
                         [draw.random() < 0.7 for _ in range(num_microbatches)])
    # Captured once at saturation: a larger bound asks for no more slots.
    assert slot_counts(shape, max_microbatches=120) == counts


def test_one_slot_too_few_is_caught():
    shape = PipelineShape(4, 0)
    with pytest.raises(AssertionError):
        _replay_schedule(shape, 8, [slot_counts(shape)[0] - 1], [True] * 8)


def test_interleaved_first_stage_holds_more_of_its_first_chunk():
    assert slot_counts(PipelineShape(2, 0, 2)) == [4, 2]
    assert in_flight_peaks([1, 1, 2, -2, 1, -1, -2, -1, -1], 2) == [3, 1]
