"""Slot model of chunk graphs against megatron-core's own schedule tables (CPU)."""

import pytest

from megatron.core.pipeline_parallel.schedules import get_schedule_table
from megatron.packed_graphs.slots import (
    GraphSlots,
    PipelineShape,
    in_flight_peaks,
    schedule_order,
    slot_counts,
)

SHAPES = [PipelineShape(pp, rank, vpp) for pp, vpp in ((1, 1), (2, 1), (4, 1), (2, 2), (4, 2), (4, 3))
          for rank in range(pp)]


def _replay_schedule(shape, num_microbatches, slots):
    """Walk the rank's order; each backward must release the slot its own forward took."""
    table = get_schedule_table(num_microbatches, shape.num_model_chunks, shape.group_size)
    forwards, backwards = iter(table), iter(table)
    held = {}
    for step in schedule_order(shape, num_microbatches):
        if step > 0:
            mb, chunk = next(forwards)
            assert chunk == step - 1
            held[(mb, chunk)] = slots.acquire(chunk)
        else:
            mb, table_chunk = next(backwards)
            chunk = shape.num_model_chunks - 1 - table_chunk  # backward walks chunks in reverse
            assert chunk == -step - 1
            assert slots.release(chunk) == held.pop((mb, chunk))
    assert not held


def test_one_f_one_b_needs_one_slot_per_stage_ahead():
    for pp in (1, 2, 4, 8):
        assert [slot_counts(PipelineShape(pp, r))[0] for r in range(pp)] == list(range(pp, 0, -1))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"pp{s.pp_size}r{s.pp_rank}v{s.num_model_chunks}")
def test_slots_serve_every_micro_batch_count_fifo(shape):
    counts = slot_counts(shape)
    slots = GraphSlots(counts)
    for num_microbatches in range(1, 40):
        if not shape.valid_microbatch_count(num_microbatches):
            continue
        slots.reset()  # once per iteration, as the training loop does
        _replay_schedule(shape, num_microbatches, slots)
    # Captured once at saturation: a larger bound asks for no more slots.
    assert slot_counts(shape, max_microbatches=120) == counts


def test_interleaved_first_stage_holds_more_of_its_first_chunk():
    assert slot_counts(PipelineShape(2, 0, 2)) == [4, 2]
    assert in_flight_peaks([1, 1, 2, -2, 1, -1, -2, -1, -1], 2) == [3, 1]


def test_allocator_refuses_overrun_and_unmatched_backward():
    slots = GraphSlots([1])
    assert slots.acquire(0) == 0
    with pytest.raises(RuntimeError, match="all 1 graph slots are in flight"):
        slots.acquire(0)
    assert slots.release(0) == 0
    with pytest.raises(RuntimeError, match="backward without a forward"):
        slots.release(0)
