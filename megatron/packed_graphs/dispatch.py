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
from typing import List, Sequence

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


def plan_iteration(settings: GraphSettings, iteration: int, captured: bool,
                   segment_counts: Sequence[int]) -> List[GraphDecision]:
    """Decisions for one training iteration's micro-batches (host only, no device work).

    ``iteration`` counts training iterations of this process from 0; ``captured`` says
    whether graphs exist already. Before capture, iterations below the warm-up count run
    eager; the first later iteration records graphs for every micro-batch that fits.
    """
    if not settings.enabled:
        return [GraphDecision(Reason.DISABLED)] * len(segment_counts)
    if not captured and iteration < settings.warmup_iterations:
        return [GraphDecision(Reason.WARMUP)] * len(segment_counts)
    fits = [fits_capacity(n, settings.capacity) for n in segment_counts]
    if not captured and settings.capture_needs_all_micro_batches and not all(fits):
        return [GraphDecision(Reason.DEFERRED)] * len(segment_counts)
    return [GraphDecision(Reason.GRAPHED if ok else Reason.OVERFLOW) for ok in fits]


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
