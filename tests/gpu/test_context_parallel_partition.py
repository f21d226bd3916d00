"""The CP partition index on the GPU: no host sync, and replayable inside a CUDA graph."""

import torch

from megatron.packed_model.context_parallel import thd_partition_index
from tests.unit.test_context_parallel import cu, reference_index

CP = 4
TOTAL = 2 * CP * 64
CAPACITY = 12


def _padded_cu(lengths):
    """cu_seqlens of ``lengths`` padded to CAPACITY segments (zero-length ones at the end)."""
    return cu(lengths + [0] * (CAPACITY - len(lengths))).cuda()


def test_partition_index_has_no_sync_and_replays_in_a_graph():
    first = [2 * CP * u for u in (10, 3, 20, 31)]
    second = [2 * CP * u for u in (1, 1, 1, 5, 7, 9, 40)]
    assert sum(first) == sum(second) == TOTAL
    static_cu, next_cu = _padded_cu(first), _padded_cu(second)  # host->device copies sync
    torch.cuda.set_sync_debug_mode("error")
    try:
        eager = thd_partition_index(static_cu, TOTAL, CP, 1)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up off the default stream, as capture needs
            thd_partition_index(static_cu, TOTAL, CP, 1)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_index = thd_partition_index(static_cu, TOTAL, CP, 1)
        static_cu.copy_(next_cu)
        graph.replay()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert eager.tolist() == reference_index(first, CP, 1)
    assert static_index.tolist() == reference_index(second, CP, 1)
