"""Fixed-capacity packed metadata: the static-shape half of the CUDA-graph contract.

A captured graph replays fixed shapes, but every packed micro-batch holds a different number
of documents. ``cu_seqlens`` is therefore padded to ``capacity + 1`` entries by repeating its
last value: the extra entries are zero-length documents that no kernel reads. The decision is
taken on the host, from the packer's own segment count, before anything reaches the GPU.
"""

import torch
from torch import Tensor


def fits_capacity(num_segments: int, capacity: int) -> bool:
    """Whether a micro-batch of ``num_segments`` packed segments can replay a graph."""
    return 0 < num_segments <= capacity


def pad_cu_seqlens(cu_seqlens: Tensor, capacity: int) -> Tensor:
    """``cu_seqlens`` ``[n + 1]`` -> ``[capacity + 1]``, repeating the last offset.

    Works on any device; on a host tensor it costs no device work at all.
    Raises ValueError when ``n > capacity`` (the caller runs that micro-batch eager).
    """
    num_segments = cu_seqlens.numel() - 1
    if num_segments > capacity:
        raise ValueError(
            f"micro-batch has {num_segments} packed segments, more than the graph capacity "
            f"{capacity} (--cuda-graph-max-packed-seqs); it must run eager."
        )
    pad = cu_seqlens[-1:].expand(capacity - num_segments)
    return torch.cat([cu_seqlens, pad])
