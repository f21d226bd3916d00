"""The graph package's settings: frozen, typed, built once per run from the validated command
line (``megatron.packed_training.config.graph_settings_from_args``) and handed to the graph
runtime (`runtime.GraphRuntime.from_settings`), the MoE overflow monitor
(`moe_rerun.MoEOverflowRerun.from_settings`) and the optimizer graph
(`optimizer_graph.OptimizerGraph.install`). Nothing in megatron.packed_graphs reads the
command line's ``argparse.Namespace``; tests build these directly.

`GraphSettings` holds the run's graph flags and the batch and parallel facts the runtime
derives its plan from (`runtime.runtime_config`); `MoEGraphSettings`, `CPBanks` and
`HealthCheckConfig` the parts that only some runs have. docs/cuda-graphs.md and
docs/flags.md describe the flags behind each field.
"""

import math
from dataclasses import dataclass, field
from typing import Optional, Tuple

IMPLS = ("none", "local", "transformer_engine", "full_iteration")
ACTIONS = ("warn", "disable")


@dataclass(frozen=True)
class HealthCheckConfig:
    """Settings of the graph health check (docs/cuda-graphs.md, "Graph health check")."""

    interval: int = 0
    """Check at the end of every ``interval``-th training iteration; 0: never."""
    tolerance: float = 0.01
    """Largest relative difference of loss and of gradient norm that is not a divergence."""
    action: str = "warn"
    """On a divergence: 'warn' (log it, keep the graphs) or 'disable' (graphs off for the rest
    of the run)."""

    def __post_init__(self):
        if not isinstance(self.interval, int) or self.interval < 0:
            raise ValueError(f"--cuda-graph-check-interval is wrong: {self.interval}. Use 0 (no "
                             "check) or a positive number of iterations, e.g. 100.")
        if not (isinstance(self.tolerance, (int, float)) and math.isfinite(self.tolerance)
                and self.tolerance > 0):
            raise ValueError(f"--cuda-graph-check-tolerance is wrong: {self.tolerance}. Use a "
                             "positive relative difference, e.g. 0.01.")
        if self.action not in ACTIONS:
            raise ValueError(f"--cuda-graph-check-action is wrong: {self.action}. Use warn or "
                             "disable.")

    @property
    def enabled(self) -> bool:
        return self.interval > 0


@dataclass(frozen=True)
class MoEGraphSettings:
    """What the graph runtime and the overflow monitor need of a run's MoE layers."""

    dropless_graphs: bool = False
    """Dropless MoE layers of static shapes, graphed whole (--moe-dropless-graphs)."""
    capacity_overflow: str = "drop"
    """Tokens over an expert's capacity: 'drop' or 'rerun' (--moe-capacity-overflow)."""
    expert_capacity_factor: Optional[float] = None
    """Expert capacity over the even share (--moe-expert-capacity-factor); None: dropless."""
    pad_expert_input_to_capacity: bool = False
    """Every expert takes exactly its capacity of rows (--moe-pad-expert-input-to-capacity)."""


@dataclass(frozen=True)
class CPBanks:
    """Dynamic context parallelism (--dynamic-cp-sizes): one graph bank per CP size."""

    sizes: Tuple[int, ...]
    """The CP sizes micro-batches run at, ascending (--dynamic-cp-sizes)."""
    max_packed_seqs: Tuple[int, ...]
    """Each size's graph capacity (--dynamic-cp-max-packed-seqs; --cuda-graph-max-packed-seqs)."""
    tokens_per_rank: int
    """Positions of a micro-batch one rank holds at every size: --seq-length / the largest size."""

    def __post_init__(self):
        if not self.sizes or len(self.sizes) != len(self.max_packed_seqs):
            raise ValueError(f"dynamic CP banks are wrong: sizes {self.sizes}, capacities "
                             f"{self.max_packed_seqs}. Give one capacity per CP size.")


@dataclass(frozen=True)
class GraphSettings:
    """A run's CUDA-graph settings and the batch and parallel facts its graph runtime needs.

    ``impl`` is the run's graph implementation, the one name the runtime and everything built
    from these settings read. Megatron-LM's and megatron-core's own ``cuda_graph_impl``
    fields hold other values on purpose: ``args.cuda_graph_impl`` (Megatron-LM's training
    loop) is 'local' whenever graphs are on and 'none' otherwise, so the loop builds none of
    its own graph wrappers (full-iteration, TE helper, optimizer wrapper) and still installs
    the graph-safe RNG tracker: every graph decision is the runtime's. The model's
    ``TransformerConfig.cuda_graph_impl`` (read by the layers: megatron-core's, to build their
    graph managers, and this package's graph-safe layers) is this ``impl``, except 'local'
    under 'full_iteration': the layers carry local graphs for the iterations the iteration
    graph misses. Where upstream keys behaviour on its own field, megatron.packed_upstream
    makes up for it (DDP's stream, TE's fused weight-gradient flags, TE's capturable cross
    entropy). `GraphRuntimeConfig.impl` is the layer graphs' implementation derived from it.
    """

    impl: str = "none"
    """The graph implementation (--cuda-graph-impl; `IMPLS`); 'none': every layer runs eager."""
    granularity: str = "layer"
    """What one graph holds (--cuda-graph-granularity): 'layer', or 'chunk' (a model chunk)."""
    capacity: int = 0
    """The top capacity in packed sequences per micro-batch (--cuda-graph-max-packed-seqs)."""
    ladder: Tuple[int, ...] = ()
    """Smaller capacities below ``capacity``, ascending (--cuda-graph-capacity-ladder)."""
    warmup_steps: int = 0
    """Eager training iterations before the first capture (--cuda-graph-warmup-steps)."""
    optimizer_graph: bool = False
    """``optimizer.step`` captured and replayed (--optimizer-cuda-graph)."""
    micro_batch_size: int = 1
    """Packed rows per micro-batch (--micro-batch-size)."""
    seq_length: int = 0
    """Positions of one packed row (--seq-length)."""
    global_batch_size: int = 1
    """Packed rows per iteration over all data-parallel ranks (--global-batch-size)."""
    num_microbatches: int = 0
    """Micro-batches per iteration on each rank (global batch / (micro-batch x data-parallel))."""
    data_parallel_size: int = 1
    """Data-parallel ranks."""
    tensor_parallel_size: int = 1
    """Tensor-parallel ranks (--tensor-model-parallel-size)."""
    sequence_parallel: bool = False
    """Tensor-parallel ranks split the sequence between layers (--sequence-parallel)."""
    context_parallel_size: int = 1
    """The static context-parallel size (--context-parallel-size)."""
    pipeline_parallel_size: int = 1
    """Pipeline stages (--pipeline-model-parallel-size)."""
    overlap_param_gather: bool = False
    """DDP gathers parameters in forward pre-hooks (--overlap-param-gather)."""
    moe: Optional[MoEGraphSettings] = None
    """The MoE layers' settings; None: the model has no MoE layers (no --num-experts)."""
    cp_banks: Optional[CPBanks] = None
    """Dynamic CP's sizes and banks; None: a static CP size (no --dynamic-cp-sizes)."""
    health_check: HealthCheckConfig = field(default_factory=HealthCheckConfig)
    """The graph health check (--cuda-graph-check-interval / -tolerance / -action)."""

    def __post_init__(self):
        if self.impl not in IMPLS:
            raise ValueError(f"CUDA graph implementation is wrong: {self.impl}. Use "
                             f"{', '.join(IMPLS)}.")
