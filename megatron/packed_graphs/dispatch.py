"""The one graph-or-eager decision: a `StepGraphPlan` for every micro-batch of an iteration.

Pure host functions of the frozen `GraphRuntimeConfig`, the iteration number, what has been
captured and the micro-batches' segment counts (and CP sizes): no device work, no state.
The runtime (runtime.py) calls them before the schedule runs; every pipeline stage and
virtual chunk reads the same micro-batches, so every stage makes the same choice.

``grep -rn "Reason\\." megatron/`` finds every fallback.
"""

from typing import Collection, List, Optional, Sequence, Tuple

from megatron.packed_graphs.capacity import fits_capacity
from megatron.packed_graphs.plan import (
    Granularity,
    GraphKey,
    GraphRuntimeConfig,
    Mode,
    Reason,
    StepGraphPlan,
)

# What has been captured: (CP size, capacity) pairs.
Captured = Collection[Tuple[int, int]]


def plan_iteration(config: GraphRuntimeConfig, iteration: int, captured: Captured,
                   segment_counts: Sequence[int], cp_sizes: Optional[Sequence[int]] = None,
                   *, training: bool = True, graphs_off: bool = False,
                   forward_captured: Captured = (), forced: bool = False) -> List[StepGraphPlan]:
    """Plans for one iteration's micro-batches, in order (one per micro-batch).

    ``iteration`` counts training iterations of this process from 0; ``captured`` holds the
    (CP size, capacity) pairs graphs exist for (empty before capture); ``cp_sizes`` is each
    micro-batch's CP size under dynamic CP (default: the static size). Before capture,
    iterations below the warm-up count run eager; the first later iteration captures graphs
    for every micro-batch that fits (`capture_capacities`; CP banks: every bank). After
    capture each micro-batch replays the smallest captured capacity of its CP size that
    fits, or runs eager. ``graphs_off``: graphs were turned off for the rest of the run (the
    health check's disable action): everything runs eager, as without graphs. Chunk slots are
    assigned per chunk afterwards (`plan_chunks`).

    A forward-only pass (``training=False``: evaluation, log-probs) is planned by
    `plan_forward_only` against ``forward_captured``, the forward-only graphs that exist.
    ``forced``: a caller asked for an eager pass (a reference to compare graphs with).
    """
    n = len(segment_counts)
    sizes = list(cp_sizes) if cp_sizes is not None else [config.cp_size] * n
    if not config.enabled or graphs_off:
        return [StepGraphPlan.eager(Reason.DISABLED)] * n
    if forced:
        return [StepGraphPlan.eager(Reason.FORCED)] * n
    if not training:
        return plan_forward_only(config, forward_captured, segment_counts, sizes)
    if captured:
        return [_smallest_fit(config, count, size, captured, Mode.REPLAY)
                for count, size in zip(segment_counts, sizes)]
    if iteration < config.warmup_iterations:
        return [StepGraphPlan.eager(Reason.WARMUP)] * n
    if config.granularity is Granularity.CP_BANK:
        # Every bank is captured in this iteration, whatever this rank's micro-batches are.
        return [_smallest_fit(config, count, size, config.bank_capacities, Mode.CAPTURE)
                for count, size in zip(segment_counts, sizes)]
    fits = [fits_capacity(count, config.capacity) for count in segment_counts]
    if config.capture_needs_all_micro_batches and not all(fits):
        return [StepGraphPlan.eager(Reason.DEFERRED)] * n
    return capture_capacities(config, segment_counts)


def plan_forward_only(config: GraphRuntimeConfig, captured: Captured,
                      segment_counts: Sequence[int], cp_sizes: Sequence[int]
                      ) -> List[StepGraphPlan]:
    """Plans for a forward-only pass (the runtime checked that graphs are on).

    Without forward-only graphs (`GraphRuntimeConfig.forward_graphs`) every micro-batch runs
    eager (`Reason.EVAL`). Otherwise each micro-batch gets the smallest forward bank of its
    CP size that fits (`GraphRuntimeConfig.forward_banks`): REPLAY when ``captured`` holds it,
    CAPTURE before (the runtime then captures every bank first, on every rank alike), or
    eager (`Reason.OVERFLOW`). No warm-up iterations: a capture warms itself up.
    """
    if not config.forward_graphs:
        return [StepGraphPlan.eager(Reason.EVAL)] * len(segment_counts)
    plans = []
    for count, size in zip(segment_counts, cp_sizes):
        fitting = [capacity for bank_size, capacity in config.forward_banks
                   if bank_size == size and fits_capacity(count, capacity)]
        if not fitting:
            plans.append(StepGraphPlan.eager(Reason.OVERFLOW))
            continue
        key = GraphKey.forward(min(fitting), size)
        mode = Mode.REPLAY if (size, key.capacity) in captured else Mode.CAPTURE
        plans.append(StepGraphPlan.graphed(mode, key))
    return plans


def capture_capacities(config: GraphRuntimeConfig,
                       segment_counts: Sequence[int]) -> List[StepGraphPlan]:
    """Plans for the capture iteration: record as many ladder capacities as possible.

    A capacity is captured only if a micro-batch of this iteration is padded to it. The top
    capacity comes first (it bounds the fallback rate), taking the fullest micro-batch that
    fits; then each smaller capacity, ascending, takes the emptiest micro-batch left that fits
    (greedy, which covers the most capacities). The rest go to the smallest capacity that fits.
    """
    capacities = config.capacities
    plans: List[Optional[StepGraphPlan]] = [None] * len(segment_counts)
    left = sorted(range(len(segment_counts)), key=lambda i: segment_counts[i])  # emptiest first

    def fitting(capacity):
        return [i for i in left if fits_capacity(segment_counts[i], capacity)]

    def take(i, capacity):
        plans[i] = StepGraphPlan.graphed(Mode.CAPTURE, _key(config, capacity, config.cp_size))
        left.remove(i)

    for i in fitting(capacities[-1])[-1:]:
        take(i, capacities[-1])
    for rung in capacities[:-1]:
        for i in fitting(rung)[:1]:
            take(i, rung)
    pairs = [(config.cp_size, capacity) for capacity in capacities]
    for i in left:
        plans[i] = _smallest_fit(config, segment_counts[i], config.cp_size, pairs, Mode.CAPTURE)
    return plans


def _key(config: GraphRuntimeConfig, capacity: int, cp_size: int) -> GraphKey:
    return GraphKey(config.granularity, capacity, cp_size)


def _smallest_fit(config: GraphRuntimeConfig, count: int, cp_size: int, captured: Captured,
                  mode: Mode) -> StepGraphPlan:
    for capacity in sorted(c for size, c in captured if size == cp_size):
        if fits_capacity(count, capacity):
            return StepGraphPlan.graphed(mode, _key(config, capacity, cp_size))
    return StepGraphPlan.eager(Reason.OVERFLOW)


def assign_chunk_slots(plans: Sequence[StepGraphPlan], slots: int) -> List[StepGraphPlan]:
    """One model chunk's plans with its slots (chunk granularity; ``slots``: the chunk's S).

    A chunk's backward passes run in the order of its forward passes, and at most S of its
    micro-batches are in flight, so the k-th graphed micro-batch of an iteration replays
    slot ``k mod S``: no slot is taken twice at once. In the capture iteration the first S
    graphed micro-batches record one runner each; the rest run eager (`Reason.SLOT_CAP`).
    """
    out, graphed = [], 0
    for plan in plans:
        if not plan.uses_graphs:
            out.append(plan)
        elif plan.mode is Mode.CAPTURE and graphed >= slots:
            out.append(StepGraphPlan.eager(Reason.SLOT_CAP))
        else:
            out.append(plan.with_slot(graphed % slots))
            graphed += 1
    return out


def plan_chunks(config: GraphRuntimeConfig, plans: Sequence[StepGraphPlan],
                num_chunks: int) -> List[List[StepGraphPlan]]:
    """The iteration's plans per model chunk (every chunk runs the same micro-batches).

    Chunk granularity gives each chunk its own slots (`assign_chunk_slots`); otherwise every
    chunk follows the same plans.
    """
    if (config.granularity is Granularity.CHUNK and config.enabled
            and not any(plan.forward_only for plan in plans)):
        return [assign_chunk_slots(plans, config.slots_per_chunk[chunk])
                for chunk in range(num_chunks)]
    return [list(plans) for _ in range(num_chunks)]


def micro_batch_reasons(plans_per_chunk: Sequence[Sequence[StepGraphPlan]]) -> List[Reason]:
    """Each micro-batch's reason for the statistics: the first chunk's that ran it eager, else
    GRAPHED (chunks differ only where a chunk ran out of capture slots)."""
    return [next((p.reason for p in column if not p.uses_graphs), Reason.GRAPHED)
            for column in zip(*plans_per_chunk)]
