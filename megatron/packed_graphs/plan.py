"""What one micro-batch does about CUDA graphs: the plan types, and the scope that carries a plan.

A `StepGraphPlan` is made on the host, before the schedule runs (`dispatch.plan_iteration`):
its *mode* (eager, capture, replay), its `GraphKey` (granularity, capacity, CP size, slot,
forward-only: which graph) and its *reason*. Training and forward-only passes (evaluation,
log-probs) are planned alike; a forward-only key names a graph of its own
(forward_graphs.py). The graph runtime (runtime.py) enters `running(plan)` around
each micro-batch's model call; the graphable modules (layers.py, chunk_graphs.py,
te_graphs.py) read it with `active_plan()` at megatron-core's dispatch site and nothing else.

The active plan is a context variable that only `running` sets, and resets in ``finally``:
outside a runtime's model call there is none, and modules keep megatron-core's own behaviour.

``grep -rn "Reason\\." megatron/`` finds every place a micro-batch is sent eager.
"""

import enum
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterator, Optional, Tuple


class Granularity(str, enum.Enum):
    """What one captured graph holds."""

    LAYER = "layer"  # one layer, forward and backward (local or TE implementation)
    CHUNK = "chunk"  # one pipeline model chunk per slot (local implementation)
    CP_BANK = "cp_bank"  # TE layer graphs, one bank per CP size (dynamic CP)
    # Every micro-batch of an iteration in one graph (full_iteration.py): a key granularity
    # only; the runtime's config names the per-micro-batch granularity its misses run with.
    FULL_ITERATION = "full_iteration"


class Mode(str, enum.Enum):
    EAGER = "eager"  # no graph: the modules run their plain forward
    CAPTURE = "capture"  # graphs for this key are captured in this iteration
    REPLAY = "replay"  # graphs for this key exist and replay


class Reason(str, enum.Enum):
    """Why a micro-batch runs as it does; every value but GRAPHED is an eager run."""

    GRAPHED = "graphed"  # captured for, or replays, the graph of its key
    WARMUP = "warmup"  # an eager iteration before capture (--cuda-graph-warmup-steps)
    OVERFLOW = "overflow"  # more packed segments than every captured capacity
    # Full-iteration graphs: the iteration has another micro-batch count than its graph (an
    # iteration's miss reason, never a micro-batch's: its micro-batches run layer graphs).
    MICRO_BATCH_COUNT = "micro_batch_count"
    DEFERRED = "deferred"  # PP > 1: an overflow in the would-be capture iteration postpones it
    SLOT_CAP = "slot_cap"  # chunk graphs: past the slots recorded in the capture iteration
    # A forward-only pass (evaluation, log-probs) where forward-only graphs cannot run: pipeline
    # parallelism, or an MoE layer that is not drop-and-pad (GraphRuntimeConfig.forward_graphs).
    EVAL = "eval"
    MOE_OVERFLOW_RERUN = "moe_overflow_rerun"  # rerun eager after an expert-capacity overflow
    # A caller asked for eager: `run_eager` (tools comparing graph and eager), or a whole pass
    # through `GraphRuntime.forced_eager` (e.g. eager reference log-probs).
    FORCED = "forced"
    HEALTH_CHECK = "health_check"  # the graph health check's eager pass (health_check.py)
    DISABLED = "disabled"  # --cuda-graph-impl none, or graphs turned off by the health check


# Eager runs that graphs would have run: the log line's "graph fallbacks".
FALLBACK_REASONS = frozenset({Reason.OVERFLOW, Reason.DEFERRED, Reason.SLOT_CAP,
                              Reason.MOE_OVERFLOW_RERUN})


@dataclass(frozen=True)
class GraphKey:
    """Which graph a micro-batch uses.

    ``capacity``: its ``cu_seqlens`` is padded to ``capacity + 1`` entries; ``cp_size``: the
    CP size baked into the graph (the static size, or the micro-batch's under dynamic CP);
    ``slot``: chunk granularity, which of the chunk's runners (0 for other granularities).
    ``forward_only``: a forward-only graph (forward_graphs.py): the model chunk's whole
    forward pass and output head, no backward, captured apart from the training graphs;
    its granularity is always CHUNK.
    """

    granularity: Granularity
    capacity: int
    cp_size: int = 1
    slot: int = 0
    forward_only: bool = False

    def __post_init__(self):
        if self.forward_only and (self.granularity is not Granularity.CHUNK or self.slot):
            raise ValueError(f"forward-only graph key is wrong: {self}. A forward-only graph "
                             f"holds a whole model chunk: granularity chunk, slot 0.")

    @classmethod
    def forward(cls, capacity: int, cp_size: int = 1) -> "GraphKey":
        """The key of the forward-only graph of ``capacity`` (and CP size)."""
        return cls(Granularity.CHUNK, capacity, cp_size, forward_only=True)


@dataclass(frozen=True)
class StepGraphPlan:
    """One micro-batch's graph plan (host only). A key exactly when it is graphed."""

    mode: Mode
    reason: Reason
    key: Optional[GraphKey] = None

    def __post_init__(self):
        graphed = self.reason is Reason.GRAPHED
        if graphed != (self.mode is not Mode.EAGER) or graphed != (self.key is not None):
            raise ValueError(f"inconsistent graph plan: {self}")

    @classmethod
    def eager(cls, reason: Reason) -> "StepGraphPlan":
        return cls(Mode.EAGER, reason)

    @classmethod
    def graphed(cls, mode: Mode, key: GraphKey) -> "StepGraphPlan":
        return cls(mode, Reason.GRAPHED, key)

    @property
    def uses_graphs(self) -> bool:
        return self.mode is not Mode.EAGER

    @property
    def forward_only(self) -> bool:
        """Whether this micro-batch replays (or captures) a forward-only graph."""
        return self.key is not None and self.key.forward_only

    @property
    def is_fallback(self) -> bool:
        """An eager run that graphs would have done (counted in the log line)."""
        return self.reason in FALLBACK_REASONS

    @property
    def capacity(self) -> Optional[int]:
        """The capacity to pad ``cu_seqlens`` to; None when eager (no padding)."""
        return None if self.key is None else self.key.capacity

    def with_slot(self, slot: int) -> "StepGraphPlan":
        key = self.key
        return StepGraphPlan(self.mode, self.reason,
                             GraphKey(key.granularity, key.capacity, key.cp_size, slot,
                                      key.forward_only))


@dataclass(frozen=True)
class GraphRuntimeConfig:
    """Host-static CUDA-graph settings of a run, frozen: what the runtime plans with, derived
    once from the run's `settings.GraphSettings` (`runtime.runtime_config`).

    See docs/cuda-graphs.md for the flags behind each field.
    """

    # The layer graphs' implementation: `GraphSettings.impl`, with 'full_iteration' as
    # "local" and ``full_iteration`` set (its misses run local layer or chunk graphs).
    impl: str = "none"  # "none" | "local" | "transformer_engine"
    granularity: Granularity = Granularity.LAYER
    capacity: int = 0  # the top capacity (--cuda-graph-max-packed-seqs)
    warmup_iterations: int = 0  # eager training iterations before capture
    # Smaller capacities below `capacity`, ascending (--cuda-graph-capacity-ladder; PP=1).
    ladder: Tuple[int, ...] = ()
    # With pipeline parallelism megatron-core hands out graph runners round-robin in call
    # order; the capture iteration must record every micro-batch, so it may not overflow.
    capture_needs_all_micro_batches: bool = False
    cp_size: int = 1  # static context-parallel size (key of every static layout)
    # Dynamic CP: (CP size, capacity) of every graph bank, ascending sizes.
    bank_capacities: Tuple[Tuple[int, int], ...] = ()
    # Chunk granularity: slots of each model chunk on this rank (one entry per virtual chunk).
    slots_per_chunk: Tuple[int, ...] = (1,)
    tokens_per_rank: int = 0  # TE capture: positions one rank's layers see per micro-batch
    # Full-iteration graphs (full_iteration.py): an iteration of `iteration_micro_batches`
    # micro-batches that all fit `capacity` on every rank is one graph; other iterations run
    # per micro-batch under `granularity` (local layer or chunk graphs, eager on overflow).
    full_iteration: bool = False
    iteration_micro_batches: int = 0
    # Forward-only passes (evaluation, log-probs) replay forward-only graphs, one per capacity
    # (and CP bank): PP = 1 and every layer capturable whole (forward_graphs.py); otherwise
    # they run eager (Reason.EVAL).
    forward_graphs: bool = False

    def __post_init__(self):
        if self.granularity is Granularity.FULL_ITERATION:
            raise ValueError("CUDA graph granularity is wrong: full_iteration. It names the "
                             "graph of a whole iteration, not a granularity of its own; set "
                             "full_iteration=True with the layer or chunk granularity that "
                             "iterations the graph cannot take run with.")
        if self.full_iteration and (self.impl != "local" or self.ladder
                                    or self.granularity not in (Granularity.LAYER,
                                                                Granularity.CHUNK)
                                    or self.iteration_micro_batches < 1):
            raise ValueError(f"full-iteration graph settings are wrong: impl {self.impl}, "
                             f"granularity {self.granularity.value}, ladder {self.ladder}, "
                             f"{self.iteration_micro_batches} micro-batches. They need the "
                             f"local impl with layer or chunk granularity, no ladder and a "
                             f"positive micro-batch count.")
        if self.impl not in ("none", "local", "transformer_engine"):
            raise ValueError(f"CUDA graph implementation is wrong: {self.impl}. Use none, local "
                             f"or transformer_engine.")
        if self.enabled and self.granularity is not Granularity.CP_BANK and self.capacity < 1:
            raise ValueError(f"CUDA graph capacity is wrong: {self.capacity}. Set "
                             f"--cuda-graph-max-packed-seqs to a positive count.")
        if self.forward_graphs and not self.enabled:
            raise ValueError("forward-only graph settings are wrong: forward graphs with "
                             "--cuda-graph-impl none. They need a graph implementation.")
        if (self.granularity is Granularity.CP_BANK) != bool(self.bank_capacities):
            raise ValueError(f"CUDA graph banks are wrong: {self.bank_capacities}. CP banks "
                             f"need one capacity per CP size (--dynamic-cp-sizes), and only "
                             f"they do.")

    @property
    def enabled(self) -> bool:
        return self.impl != "none"

    @property
    def capacities(self) -> Tuple[int, ...]:
        """Every capacity a static-layout graph may be captured for, ascending."""
        return tuple(self.ladder) + (self.capacity,)

    @property
    def forward_banks(self) -> Tuple[Tuple[int, int], ...]:
        """(CP size, capacity) of every forward-only graph, in capture order: each CP bank's
        capacity under dynamic CP, else every capacity of the ladder at the static CP size."""
        if self.bank_capacities:
            return tuple(self.bank_capacities)
        return tuple((self.cp_size, capacity) for capacity in self.capacities)


_active_plan: ContextVar[Optional[StepGraphPlan]] = ContextVar("packed_graph_plan", default=None)


@contextmanager
def running(plan: StepGraphPlan) -> Iterator[StepGraphPlan]:
    """The model calls in this block run under ``plan`` (the runtime enters it per micro-batch)."""
    token = _active_plan.set(plan)
    try:
        yield plan
    finally:
        _active_plan.reset(token)


def run_eager(reason: Reason = Reason.FORCED):
    """The model calls in this block run eager for ``reason`` (no replay, no recording)."""
    return running(StepGraphPlan.eager(reason))


def active_plan() -> Optional[StepGraphPlan]:
    """The plan of the micro-batch being run; None outside a runtime's model call."""
    return _active_plan.get()


def graphs_bypassed() -> bool:
    """Whether the running micro-batch was planned eager (no plan: not bypassed)."""
    plan = _active_plan.get()
    return plan is not None and plan.mode is Mode.EAGER


def in_iteration_graph() -> bool:
    """Whether the running micro-batch is part of a whole-iteration graph (full_iteration.py):
    its layers and chunks run their plain forward inside it, with no graph of their own."""
    plan = _active_plan.get()
    return plan is not None and plan.key is not None and \
        plan.key.granularity is Granularity.FULL_ITERATION
