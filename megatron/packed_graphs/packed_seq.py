"""Packed-sequence (THD) metadata for one micro-batch.

`PackedBatchParams` extends megatron-core's `PackedSeqParams` with ``position_ids`` (int64
``[T]``): document-local positions, so the TE-free RoPE is a gather instead of the upstream
THD RoPE that reads ``cu_seqlens`` back to the host.

Upstream's ``seq_idx`` field (int32 ``[1, T]``, the document index of every token, which
Mamba's conv and scan kernels need to keep documents apart) is filled here by
`build_seq_idx`, without a host sync. Upstream's own ``__post_init__`` precompute runs only
when ``total_tokens`` is set, and then syncs; this module never sets it, so
``dataclasses.replace`` (megatron-core's CUDA-graph tree_map) does no tensor work.
"""

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from megatron.core.packed_seq_params import PackedSeqParams


@dataclass
class PackedBatchParams(PackedSeqParams):
    """PackedSeqParams plus per-token positions and the padding mask (see module doc)."""

    position_ids: Optional[Tensor] = None
    padding_mask: Optional[Tensor] = None
    """bool ``[T]``, True on positions that hold no document (row padding), for the MoE
    router (packed_model/moe.py); None = no padding information."""


def build_seq_idx(cu_seqlens: Tensor, total_tokens: int) -> Tensor:
    """Document index of every token, ``[1, total_tokens]`` int32, on ``cu_seqlens``' device.

    ``cu_seqlens`` (int32 ``[n + 1]``, ``cu_seqlens[-1] == total_tokens``) may contain
    zero-length segments (capacity padding); they get an index and no tokens.
    No host sync: ``output_size`` tells ``repeat_interleave`` the result length.
    """
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    doc_ids = torch.arange(lengths.numel(), device=cu_seqlens.device, dtype=torch.int32)
    seq_idx = torch.repeat_interleave(doc_ids, lengths, output_size=total_tokens)
    return seq_idx.unsqueeze(0)


def build_packed_batch_params(
    cu_seqlens: Tensor, position_ids: Tensor, max_seqlen: int, *, with_seq_idx: bool = True
) -> PackedBatchParams:
    """THD params for a micro-batch of ``T = position_ids.numel()`` tokens.

    Args:
        cu_seqlens: int32 ``[n + 1]`` on the compute device; ``cu_seqlens[-1] == T``.
        position_ids: int64 ``[T]`` (or ``[1, T]``) document-local positions, same device.
        max_seqlen: host int, an upper bound of the longest segment. Graph runs pass a fixed
            value (the packed length) so it never changes between steps.
        with_seq_idx: build the Mamba ``seq_idx`` (hybrid models only).

    No host sync.
    """
    position_ids = position_ids.reshape(-1)
    total_tokens = position_ids.numel()
    return PackedBatchParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        max_seqlen_q=max_seqlen,
        max_seqlen_kv=max_seqlen,
        position_ids=position_ids,
        seq_idx=build_seq_idx(cu_seqlens, total_tokens) if with_seq_idx else None,
    )
