"""Graph slots for chunk-granularity CUDA graphs: how many, and which one a micro-batch uses.

A chunk graph (one pipeline model chunk, forward and backward) holds its activations in its
own static memory from its forward replay until its backward replay. A pipeline schedule
keeps several micro-batches of a chunk in flight at once, so each chunk needs one graph pair
per in-flight micro-batch: a *slot*. The number of slots is a property of the schedule
(pipeline size and rank, virtual chunks, micro-batch group size), not of the micro-batch
count: it grows with the count and then saturates, so graphs captured at the saturated
count serve every count.

Slot counts are read off megatron-core's own schedule (`get_pp_rank_microbatches`,
`get_schedule_table`, and the fwd/bwd order the TE graph helper uses), computed once at
start-up (`GraphRuntime.from_settings`). Which slot a micro-batch takes is part of its graph plan
(`dispatch.assign_chunk_slots`): a chunk's backward passes run in the order of its forward
passes in both 1F1B and interleaved schedules, so the k-th graphed forward takes slot
``k mod S``.
"""

from dataclasses import dataclass
from types import SimpleNamespace
from typing import List, Optional

from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches, get_schedule_table
from megatron.core.transformer.cuda_graphs import convert_schedule_table_to_order


@dataclass(frozen=True)
class PipelineShape:
    """This rank's place in the pipeline schedule (host-static)."""

    pp_size: int
    pp_rank: int
    num_model_chunks: int = 1  # virtual pipeline size, 1 without interleaving
    microbatch_group_size: Optional[int] = None  # megatron-core's default: pp_size

    @property
    def group_size(self) -> int:
        return self.microbatch_group_size or self.pp_size

    def valid_microbatch_count(self, num_microbatches: int) -> bool:
        """Interleaved schedules need whole micro-batch groups (megatron-core asserts it)."""
        return self.num_model_chunks == 1 or num_microbatches % self.group_size == 0


def schedule_order(shape: PipelineShape, num_microbatches: int) -> List[int]:
    """This rank's compute order: +c = forward of chunk c, -c = backward of chunk c (1-based)."""
    if shape.pp_size == 1:
        return [1, -1] * num_microbatches
    # megatron-core reads the pipeline shape from a communicator; a plain view of ours will do.
    view = SimpleNamespace(
        pp_group=SimpleNamespace(size=lambda: shape.pp_size, rank=lambda: shape.pp_rank),
        virtual_pipeline_model_parallel_size=(
            shape.num_model_chunks if shape.num_model_chunks > 1 else None),
    )
    _, _, num_warmup, _ = get_pp_rank_microbatches(
        num_microbatches, shape.num_model_chunks, shape.group_size, p2p_communicator=view)
    table = get_schedule_table(num_microbatches, shape.num_model_chunks, shape.group_size)
    return convert_schedule_table_to_order(num_warmup, shape.num_model_chunks, table)


def in_flight_peaks(order: List[int], num_model_chunks: int) -> List[int]:
    """Most micro-batches of each chunk between forward and backward at any point of ``order``."""
    current, peak = [0] * num_model_chunks, [0] * num_model_chunks
    for step in order:
        chunk = abs(step) - 1
        current[chunk] += 1 if step > 0 else -1
        peak[chunk] = max(peak[chunk], current[chunk])
    return peak


def slot_counts(shape: PipelineShape, max_microbatches: Optional[int] = None) -> List[int]:
    """Slots per chunk that serve every micro-batch count up to ``max_microbatches``.

    The default bound is past saturation (the warm-up of any rank is below
    ``2 * pp_size + num_model_chunks * group_size``).
    """
    bound = max_microbatches or 4 * shape.pp_size + 2 * shape.num_model_chunks * shape.group_size
    slots = [1] * shape.num_model_chunks
    for count in range(1, bound + 1):
        if shape.valid_microbatch_count(count):
            slots = [max(a, b) for a, b in
                     zip(slots, in_flight_peaks(schedule_order(shape, count), shape.num_model_chunks))]
    return slots
