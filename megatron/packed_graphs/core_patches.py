"""Patches of megatron-core 0.16.1 behaviour that no subclass can reach. Applied once, explicitly.

Each patch is a named function: what it changes, why, and the upstream reference. All are
guarded by the exact megatron-core version; on another version `apply_core_patches` refuses
loudly so that a wheel upgrade re-examines every patch (tests/unit/test_core_patches.py fails
when upstream fixes a bug, telling us to drop its patch).
"""

import megatron.core
from megatron.core.pipeline_parallel import schedules
from megatron.core.transformer import cuda_graphs

PATCHED_VERSION = "0.16.1"

# The upstream functions as imported, before any patch (tests check the bugs are still there).
UPSTREAM_SET_WARMUP_END = cuda_graphs._set_warmup_end

# Filled by the capture-statistics patch: one entry per graph capture.
capture_log: list = []

_applied = False


def fix_warmup_flag_never_cleared() -> None:
    """0.16.1's ``cuda_graphs._set_warmup_end`` forgets to clear ``_IS_GRAPH_WARMUP``.

    After the first capture ``is_graph_warmup()`` stays True for the rest of training, which
    silently disables ``CheckpointWithoutOutput`` recomputation (tensor_parallel/random.py).
    Upstream fix: megatron-core main #3373 (e19fbe2e1d).
    """

    def _set_warmup_end():
        cuda_graphs._IS_GRAPH_WARMUP = False

    cuda_graphs._set_warmup_end = _set_warmup_end


def record_capture_statistics() -> None:
    """Keep what the schedules' end-of-iteration ``create_cudagraphs()`` measures.

    0.16.1's schedules call it and drop its return value (a dict of capture ``time`` in
    seconds and ``allocated_bytes`` / ``reserved_bytes`` of graph memory, or None when
    nothing was captured); we keep it for the log and the benchmark.
    """
    upstream = schedules.create_cudagraphs

    def create_cudagraphs():
        stats = upstream()
        if stats:
            capture_log.append(stats)
        return stats

    schedules.create_cudagraphs = create_cudagraphs


def apply_core_patches() -> None:
    """Apply every patch once. Raises on a megatron-core version these were not written for."""
    global _applied
    if _applied:
        return
    if megatron.core.__version__ != PATCHED_VERSION:
        raise RuntimeError(
            f"megatron.packed_graphs.core_patches targets megatron-core {PATCHED_VERSION}, "
            f"found {megatron.core.__version__}. Re-check each patch against the new version."
        )
    fix_warmup_flag_never_cleared()
    record_capture_statistics()
    _applied = True
