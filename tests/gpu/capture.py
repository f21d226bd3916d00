"""Capture a test's step in a CUDA graph the way the graph engines do, for tests that check
a module captures without host syncs and replays other documents."""

import torch


def capture_without_host_sync(step, warmup: int = 2):
    """Run ``step()`` ``warmup`` times on a side stream (cuDNN plans, workspaces, lazily built
    tables), then capture one call in a CUDA graph with every RNG generator of megatron-core's
    tracker registered (TE's fused attention advances its offset) and host syncs raising.

    Returns ``(graph, outputs)``: ``outputs`` is what the captured call returned, in the
    graph's static memory (each ``graph.replay()`` rewrites it)."""
    from megatron.core.tensor_parallel.random import get_all_rng_states

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    for state in get_all_rng_states().values():
        graph.register_generator_state(state)
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            outputs = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return graph, outputs
