"""Graph memory as the log line reports it (both graph implementations measure alike)."""

import gc

import torch


def reserved_without_cache() -> int:
    """Bytes the CUDA caching allocator holds after releasing its free cache (syncs).

    A capture's growth of this number is what its graph pools and static buffers keep. Plain
    ``memory_reserved`` deltas are not: a capture (or a kernel autotuner inside it) may empty
    the cache, so they can come out negative.
    """
    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved()
