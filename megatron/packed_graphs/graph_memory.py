"""Graph memory as the log line reports it (every implementation measures alike), and the
capture of a whole callable into a graph: with a pool of its own (iteration and optimizer
graphs) or into a given pool (forward-only graphs)."""

import time
from typing import Any, Callable, Iterable, Optional, Tuple

import torch

from megatron.packed_upstream.graph_engine import reserved_without_cache


def capture_in_own_pool(body: Callable[[], Any], *, stream: Optional[torch.cuda.Stream] = None,
                        generators: Iterable = ()) -> Tuple[torch.cuda.CUDAGraph, Any, float, int]:
    """Capture ``body()`` into a new CUDA graph with a memory pool of its own (`capture_graph`
    into a new pool)."""
    return capture_graph(body, pool=torch.cuda.graph_pool_handle(), stream=stream,
                         generators=generators)


def capture_graph(body: Callable[[], Any], *, pool, stream: Optional[torch.cuda.Stream] = None,
                  generators: Iterable = ()) -> Tuple[torch.cuda.CUDAGraph, Any, float, int]:
    """Capture ``body()`` into a new CUDA graph whose allocations come from ``pool`` (a
    ``torch.cuda.graph_pool_handle()``; graphs sharing one must never replay while another's
    outputs are still needed).

    Syncs the device before and after; with torch.distributed, a barrier first, so every rank
    captures the same collectives at the same step. ``stream``: the capture stream (None:
    torch's side stream); ``generators``: RNG states the graph advances (dropout).
    ``thread_local`` capture: other threads (NCCL watchdog, data loader) may use CUDA meanwhile.

    Returns ``(graph, body's result, capture seconds, bytes the capture added)``: the growth
    of reserved memory, i.e. what ``pool`` had to grow by and the buffers kept (0 where the
    pool's free blocks sufficed). The capture only records: nothing of ``body`` has run until
    the first ``graph.replay()``, and the result's tensors are graph-owned (each replay
    overwrites them).
    """
    torch.cuda.synchronize()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    before = reserved_without_cache()
    start = time.perf_counter()
    graph = torch.cuda.CUDAGraph()
    for state in generators:
        graph.register_generator_state(state)
    with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
        result = body()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return graph, result, seconds, reserved_without_cache() - before
