"""Context parallelism on packed (THD) micro-batches: which tokens each CP rank keeps.

Megatron's THD layout for CP size ``cp``: every segment (document) is padded to a multiple of
``2 * cp`` positions and cut into ``2 * cp`` equal chunks; CP rank ``r`` keeps chunks ``r`` and
``2 * cp - 1 - r``, so every rank gets the same share of early (cheap) and late (expensive)
causal-attention work. Each rank therefore holds exactly ``S / cp`` positions of an
``S``-position stream, whatever the documents: a static shape, as graphs need.

Transformer Engine computes the same index with a CUDA kernel
(``tex.thd_get_partitioned_indices``); this is the torch version: no host sync, static output
shape, capturable in a CUDA graph, and runnable (and tested) without TE or a GPU. The padding
itself happens on the host, in the packer (``row_plan.plan_rows(segment_multiple=2 * cp)``).
"""

import torch
from torch import Tensor


def check_cp_rank(cp_size: int, cp_rank: int) -> None:
    """Raise ValueError unless ``0 <= cp_rank < cp_size``."""
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp rank is wrong: rank {cp_rank} of context-parallel size {cp_size}. "
                         f"It must lie in [0, {cp_size}).")


def thd_partition_index(cu_seqlens_padded: Tensor, total_tokens: int, cp_size: int,
                        cp_rank: int) -> Tensor:
    """Positions of a packed stream that CP rank ``cp_rank`` keeps, in order.

    Args:
        cu_seqlens_padded: int32/int64 ``[n + 1]`` segment boundaries of the stream, with
            ``cu_seqlens_padded[-1] == total_tokens`` and every segment length a multiple of
            ``2 * cp_size`` (zero-length capacity padding allowed). Not checked: checking a
            device tensor would sync with the host.
        total_tokens: host int ``S``, a multiple of ``2 * cp_size``.

    Returns int64 ``[S // cp_size]`` on ``cu_seqlens_padded``'s device: for each segment, its
    chunk ``cp_rank`` then its chunk ``2 * cp_size - 1 - cp_rank``. No host sync.
    """
    check_cp_rank(cp_size, cp_rank)
    if total_tokens % (2 * cp_size):
        raise ValueError(f"total tokens are wrong: {total_tokens} is not a multiple of 2 * cp = "
                         f"{2 * cp_size}. Pad the packed stream (--seq-length) to one.")
    bounds = cu_seqlens_padded.to(torch.int64)
    local_bounds = bounds // cp_size  # each segment keeps length / cp positions on every rank
    local = torch.arange(total_tokens // cp_size, device=bounds.device, dtype=torch.int64)
    # Segment of each kept position; with repeated bounds (empty segments) `right=True` picks
    # the non-empty segment that actually holds the position.
    segment = torch.searchsorted(local_bounds, local, right=True) - 1
    offset = local - local_bounds[segment]
    chunk = (bounds[1:] - bounds[:-1])[segment] // (2 * cp_size)
    in_first_chunk = offset < chunk
    within = torch.where(in_first_chunk, cp_rank * chunk + offset,
                         (2 * cp_size - 1 - cp_rank) * chunk + offset - chunk)
    return bounds[segment] + within


def select_cp_tokens(micro_batch: dict, index: Tensor,
                     keys=("tokens", "labels", "loss_mask", "position_ids")) -> dict:
    """This rank's share of a micro-batch: ``keys`` (``[mbs, S]`` tensors, flattened as one
    stream of ``mbs * S`` positions) gathered at ``index`` into ``[1, S * mbs // cp]``.
    Other entries are passed through unchanged. No host sync."""
    out = dict(micro_batch)
    for key in keys:
        out[key] = micro_batch[key].reshape(-1).index_select(0, index).unsqueeze(0)
    return out
