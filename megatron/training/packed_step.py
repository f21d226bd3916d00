"""The per-micro-batch step for packed (THD) training: batch to GPU, model call, loss.

Shared by pretrain_gpt.py and pretrain_mamba.py. The micro-batch's rows are concatenated into
one THD stream ``[1, mbs * seq_length]``; its ``cu_seqlens`` is built on the host by the
data loader, so everything decided here (segment count, longest segment) is read without a
GPU->CPU sync.
"""

from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor

from megatron.packed_graphs.packed_seq import PackedBatchParams, build_packed_batch_params


@dataclass
class PackedMicroBatch:
    """One micro-batch on the GPU. Token tensors are ``[1, T]``; ``num_segments`` is host-side."""

    tokens: Tensor
    labels: Tensor
    loss_mask: Tensor
    position_ids: Tensor
    params: PackedBatchParams
    num_segments: int
    num_documents: int


def longest_segment(cu_seqlens_cpu: Tensor) -> int:
    """Longest segment of a host-side ``cu_seqlens``; no device involved."""
    return int((cu_seqlens_cpu[1:] - cu_seqlens_cpu[:-1]).max())


def to_device_micro_batch(batch: dict, *, with_seq_idx: bool, static_max_seqlen: bool,
                          device=None) -> PackedMicroBatch:
    """Move a collated micro-batch (see datasets.packing.collate_packed_rows) to the GPU.

    ``static_max_seqlen``: use the packed length T as ``max_seqlen`` (fixed across steps, as
    CUDA graphs need) instead of the true longest segment (tighter kernels in eager mode).
    """
    device = device or torch.device("cuda", torch.cuda.current_device())
    move = lambda t: t.reshape(1, -1).to(device, non_blocking=True)
    tokens, labels, position_ids = move(batch["tokens"]), move(batch["labels"]), move(batch["position_ids"])
    loss_mask = move(batch["loss_mask"])
    cu_seqlens_cpu = batch["cu_seqlens"]
    total_tokens = tokens.numel()
    max_seqlen = total_tokens if static_max_seqlen else longest_segment(cu_seqlens_cpu)
    params = build_packed_batch_params(
        cu_seqlens_cpu.to(device, non_blocking=True), position_ids, max_seqlen,
        with_seq_idx=with_seq_idx,
    )
    return PackedMicroBatch(tokens, labels, loss_mask, position_ids, params,
                            batch["num_segments"], batch["num_documents"])


def masked_lm_loss(loss_mask: Tensor, output_tensor: Tensor):
    """Sum of per-token losses over ``loss_mask`` and the token count (Megatron's 3-tuple).

    The schedule divides by the token count (or, with per-token loss, finalize_model_grads
    scales gradients by the global token count).
    """
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.reshape(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.cat([loss.detach().view(1), num_tokens.float().view(1)])
    return loss, num_tokens, {"lm loss": report}


class PackedForwardStep:
    """``forward_step_func`` for megatron-core's pipeline schedules, packed micro-batches."""

    def __init__(self, *, with_seq_idx: bool, static_max_seqlen: bool = False):
        self.with_seq_idx = with_seq_idx
        self.static_max_seqlen = static_max_seqlen
        self._micro_batches = 0
        self._documents = 0

    def pop_step_stats(self) -> dict:
        """Counters since the last call, for the iteration's log line and metrics record."""
        stats = {"docs per micro-batch": round(self._documents / max(self._micro_batches, 1), 2)}
        self._micro_batches = self._documents = 0
        return stats

    def __call__(self, data_iterator, model):
        mb = to_device_micro_batch(next(data_iterator), with_seq_idx=self.with_seq_idx,
                                   static_max_seqlen=self.static_max_seqlen)
        self._micro_batches += 1
        self._documents += mb.num_documents
        output = model(mb.tokens, mb.position_ids, None, labels=mb.labels,
                       packed_seq_params=mb.params)
        return output, partial(masked_lm_loss, mb.loss_mask)
