"""One decision per micro-batch: replay CUDA graphs, or run eager, and why.

`plan_iteration` decides on the host, before the schedule runs, for every micro-batch of a
training iteration; the decision travels with the micro-batch, so every pipeline stage and
virtual chunk (which all read the same micro-batches) makes the same choice. Inside the
model the graphable layers only *read* it, through `cuda_graphs_bypassed()`, at megatron-
core's single dispatch site (`GraphableMegatronModule.__call__`, see layers.py).

``grep -n "Reason\\." megatron/`` finds every fallback.
"""

import enum
from contextlib import contextmanager
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from megatron.packed_graphs.capacity import fits_capacity


class Reason(str, enum.Enum):
    GRAPHED = "graphed"  # replays (or, in the capture iteration, is recorded for capture)
    OVERFLOW = "overflow"  # more packed segments than --cuda-graph-max-packed-seqs
    WARMUP = "warmup"  # an eager iteration before capture (--cuda-graph-warmup-steps)
    DEFERRED = "deferred"  # capture postponed: an overflow in the would-be capture iteration
    DISABLED = "disabled"  # --cuda-graph-impl none


@dataclass(frozen=True)
class GraphDecision:
    reason: Reason
    capacity: Optional[int] = None  # graphed: pad cu_seqlens to this many segments

    @property
    def graphed(self) -> bool:
        return self.reason is Reason.GRAPHED

    @property
    def is_fallback(self) -> bool:
        """An eager micro-batch that graphs would have run (counted in the log line)."""
        return self.reason in (Reason.OVERFLOW, Reason.DEFERRED)


@dataclass(frozen=True)
class GraphSettings:
    """Host-static graph settings, from the CLI (see docs/cuda-graphs.md)."""

    enabled: bool
    capacity: int
    warmup_iterations: int
    # With pipeline parallelism megatron-core hands out graph runners round-robin in call
    # order; the capture iteration must record every micro-batch, so it may not overflow.
    capture_needs_all_micro_batches: bool
    # Smaller capacities below `capacity`, ascending (--cuda-graph-capacity-ladder; PP=1).
    ladder: Tuple[int, ...] = ()

    @property
    def capacities(self) -> Tuple[int, ...]:
        """Every capacity a graph may be captured for, ascending; `capacity` is the last."""
        return tuple(self.ladder) + (self.capacity,)


def plan_iteration(settings: GraphSettings, iteration: int, captured: Sequence[int],
                   segment_counts: Sequence[int]) -> List[GraphDecision]:
    """Decisions for one training iteration's micro-batches (host only, no device work).

    ``iteration`` counts training iterations of this process from 0; ``captured`` holds the
    capacities graphs exist for (empty before capture). Before capture, iterations below the
    warm-up count run eager; the first later iteration records graphs for every micro-batch
    that fits (see `capture_capacities`). After capture each micro-batch is padded to the
    smallest captured capacity that fits it, or runs eager.
    """
    n = len(segment_counts)
    if not settings.enabled:
        return [GraphDecision(Reason.DISABLED)] * n
    if captured:
        return [_smallest_fit(count, captured) for count in segment_counts]
    if iteration < settings.warmup_iterations:
        return [GraphDecision(Reason.WARMUP)] * n
    fits = [fits_capacity(count, settings.capacity) for count in segment_counts]
    if settings.capture_needs_all_micro_batches and not all(fits):
        return [GraphDecision(Reason.DEFERRED)] * n
    return capture_capacities(settings.capacities, segment_counts)


def capture_capacities(capacities: Sequence[int],
                       segment_counts: Sequence[int]) -> List[GraphDecision]:
    """Capacities for the capture iteration: record as many ladder capacities as possible.

    A capacity is captured only if a micro-batch of this iteration is padded to it. The top
    capacity comes first (it bounds the fallback rate), taking the fullest micro-batch that
    fits; then each smaller capacity, ascending, takes the emptiest micro-batch left that fits
    (greedy, which covers the most capacities). The rest go to the smallest capacity that fits.
    """
    decisions: List[Optional[GraphDecision]] = [None] * len(segment_counts)
    left = sorted(range(len(segment_counts)), key=lambda i: segment_counts[i])  # emptiest first

    def fitting(capacity):
        return [i for i in left if fits_capacity(segment_counts[i], capacity)]

    def take(i, capacity):
        decisions[i] = GraphDecision(Reason.GRAPHED, capacity)
        left.remove(i)

    for i in fitting(capacities[-1])[-1:]:
        take(i, capacities[-1])
    for rung in capacities[:-1]:
        for i in fitting(rung)[:1]:
            take(i, rung)
    for i in left:
        decisions[i] = _smallest_fit(segment_counts[i], capacities)
    return decisions


def _smallest_fit(count: int, capacities: Sequence[int]) -> GraphDecision:
    for capacity in sorted(capacities):
        if fits_capacity(count, capacity):
            return GraphDecision(Reason.GRAPHED, capacity)
    return GraphDecision(Reason.OVERFLOW)


_bypass_depth = 0


@contextmanager
def disable_cuda_graphs_this_step():
    """Run the enclosed model calls eager (no graph replay, no graph recording)."""
    global _bypass_depth
    _bypass_depth += 1
    try:
        yield
    finally:
        _bypass_depth -= 1


def cuda_graphs_bypassed() -> bool:
    return _bypass_depth > 0
