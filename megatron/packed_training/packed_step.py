"""The per-micro-batch step for packed (THD) training: batch to GPU, model call, loss.

Shared by pretrain_gpt.py and pretrain_mamba.py. The micro-batch's rows are concatenated into
one THD stream ``[1, mbs * seq_length]``; its ``cu_seqlens`` is built on the host by the
data loader, so everything decided here (segment count, longest segment) is read without a
GPU->CPU sync.
"""

from dataclasses import dataclass
from functools import partial
from typing import Optional

import torch
from torch import Tensor

from megatron.core import parallel_state

from megatron.packed_graphs.capacity import pad_cu_seqlens
from megatron.packed_model.context_parallel import select_cp_tokens, thd_partition_index
from megatron.packed_model.dynamic_cp import CPTurn, dynamic_cp_group
from megatron.packed_graphs.packed_seq import (
    PackedBatchParams,
    build_packed_batch_params,
    build_seq_idx,
)


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


def to_device_micro_batch(batch: dict, *, with_seq_idx: bool, static_max_seqlen: bool,
                          capacity: Optional[int] = None, device=None,
                          cp_size: int = 1, cp_rank: int = 0,
                          with_padding_mask: bool = False) -> PackedMicroBatch:
    """Move a collated micro-batch (see datasets.packing.collate_packed_rows) to the GPU.

    ``static_max_seqlen``: use the packed length T as ``max_seqlen`` (fixed across steps, as
    CUDA graphs need) instead of the true longest segment (tighter kernels in eager mode).
    ``capacity``: pad ``cu_seqlens`` to ``capacity + 1`` entries (on the host, before the copy)
    so the micro-batch matches a captured graph; the caller checked that it fits.
    ``with_padding_mask`` (MoE models): the params carry the per-token ``padding_mask`` (bool
    ``[T]``, this rank's positions, True = no document) for the MoE router; dense models
    leave it None, so their graphs take no extra input.
    ``cp_size > 1``: keep this CP rank's ``T / cp`` positions (context_parallel.py); the
    params then carry the whole stream's CP-padded boundaries (as ``cu_seqlens_q`` and, the
    same tensor, ``cu_seqlens_q_padded``, which TE's CP path reads) and, for Mamba, the whole
    stream's ``seq_idx``. No host sync.
    """
    device = device or torch.device("cuda", torch.cuda.current_device())
    move = lambda t: t.reshape(1, -1).to(device, non_blocking=True)
    tokens, labels, position_ids = move(batch["tokens"]), move(batch["labels"]), move(batch["position_ids"])
    loss_mask = move(batch["loss_mask"])
    cu_seqlens_cpu = batch["cu_seqlens"]
    if capacity is not None:
        cu_seqlens_cpu = pad_cu_seqlens(cu_seqlens_cpu, capacity)
    cu_seqlens = cu_seqlens_cpu.to(device, non_blocking=True)
    total_tokens = tokens.numel()
    # The collate step measured the longest segment on the host already.
    max_seqlen = total_tokens if static_max_seqlen or cp_size > 1 else batch["max_seqlen"]
    streams = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask,
               "position_ids": position_ids}
    if with_padding_mask:
        streams["padding_mask"] = move(_padding_mask(batch))
    if cp_size > 1:
        index = thd_partition_index(cu_seqlens, total_tokens, cp_size, cp_rank)
        streams = select_cp_tokens(streams, index, tuple(streams))
        tokens, labels, loss_mask, position_ids = (
            streams[key] for key in ("tokens", "labels", "loss_mask", "position_ids"))
    params = build_packed_batch_params(cu_seqlens, position_ids, max_seqlen,
                                       with_seq_idx=with_seq_idx and cp_size == 1)
    if with_padding_mask:
        params.padding_mask = streams["padding_mask"].reshape(-1)
    if cp_size > 1:
        # Each document's CP padding sits after its last token, so with causal attention no
        # real token sees it: the padded boundaries serve as the documents' own (TE's
        # cu_seqlens and cu_seqlens_padded are one tensor, no padding between sequences).
        # Real boundaries (cu_seqlens_actual) made TE 2.11 return NaN gradients on a rank
        # whose chunks of a short document hold only padding.
        params.cu_seqlens_q_padded = params.cu_seqlens_kv_padded = cu_seqlens
        if with_seq_idx:
            # Mamba's CP all-to-all hands each rank the whole stream (for a share of the
            # heads): its seq_idx spans all T positions. Built here, not in the layer, so
            # graph captures read it from the micro-batch's values.
            params.seq_idx = build_seq_idx(cu_seqlens, total_tokens)
    return PackedMicroBatch(tokens, labels, loss_mask, position_ids, params,
                            batch["num_segments"], batch["num_documents"])


def _padding_mask(batch: dict) -> Tensor:
    """The micro-batch's bool padding mask (collate_packed_rows), on the host. A batch built
    without one (a single row) gets it from its segments: everything past the documents."""
    if "padding_mask" in batch:
        return batch["padding_mask"]
    if batch["tokens"].shape[0] != 1:
        raise ValueError("micro-batch is wrong: several rows and no padding_mask. Collate rows "
                         "with collate_packed_rows.")
    end = int(batch["cu_seqlens"][batch["num_documents"]])
    mask = torch.ones(batch["tokens"].shape, dtype=torch.bool)
    mask[:, :end] = False
    return mask


def dummy_micro_batch(num_positions: int) -> dict:
    """A collated micro-batch of one all-padding segment (loss mask 0, no document): the
    layout TE graph banks are captured with (its boundaries cover the whole buffer, so fused
    RoPE writes every position)."""
    zeros = torch.zeros(1, num_positions, dtype=torch.int64)
    return {"tokens": zeros, "labels": zeros, "loss_mask": zeros.float(),
            "position_ids": torch.arange(num_positions).unsqueeze(0),
            "cu_seqlens": torch.tensor([0, num_positions], dtype=torch.int32),
            "padding_mask": torch.ones(1, num_positions, dtype=torch.bool),
            "num_segments": 1, "num_documents": 0, "max_seqlen": num_positions}


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


def needs_padding_mask(args) -> bool:
    """Whether micro-batches carry the padding mask: MoE routers route no padding token
    (packed_model/moe.py) and FP8 holds padding rows at zero (packed_model/padding_rows.py)."""
    return getattr(args, "num_experts", None) is not None or bool(getattr(args, "fp8", None))


class PackedForwardStep:
    """Packed micro-batches for megatron-core's pipeline schedules: host -> device, model call.

    Called as Megatron-LM calls a forward step, ``step(data_iterator, model)``, it runs the
    next micro-batch eager (``cu_seqlens`` unpadded). Under the graph runtime
    (megatron/packed_graphs/runtime.py) the runtime drives it instead: it plans each
    micro-batch, calls `stage` with the capacity the plan pads ``cu_seqlens`` to (None: eager)
    and `run` under the plan. What it knows of graphs is one host constant: with a graph
    implementation, ``max_seqlen`` is the packed length for every micro-batch
    (``static_max_seqlen``), the value graphs were captured with.
    """

    def __init__(self, *, with_seq_idx: bool, static_max_seqlen: bool = False, cp_size: int = 1,
                 dynamic_cp_tokens_per_rank: int = 0, with_padding_mask: bool = False,
                 device: Optional[torch.device] = None):
        self.with_seq_idx = with_seq_idx
        self.device = device  # None: the current CUDA device
        # Graphs on: max_seqlen is the packed length for every micro-batch (a host constant).
        self.static_max_seqlen = static_max_seqlen
        # MoE routers and FP8's zero padding rows (padding_rows.py) read the padding mask
        self.with_padding_mask = with_padding_mask
        self.cp_size = cp_size
        self.dynamic_cp_tokens_per_rank = dynamic_cp_tokens_per_rank  # dynamic CP: per rank

    @classmethod
    def from_args(cls, args, *, with_seq_idx: bool) -> "PackedForwardStep":
        return cls(with_seq_idx=with_seq_idx, static_max_seqlen=args.packed_graph_impl != "none",
                   cp_size=args.context_parallel_size,
                   dynamic_cp_tokens_per_rank=getattr(args, "dynamic_cp_tokens_per_rank", 0),
                   with_padding_mask=needs_padding_mask(args))

    def __call__(self, data_iterator, model):
        """Megatron-LM's forward-step contract: the next collated micro-batch of
        ``data_iterator``, staged on the device and run eager; ``(output, loss_func)``."""
        return self.run(model, self.stage(next(data_iterator), None))

    def stage(self, batch: dict, capacity: Optional[int]) -> PackedMicroBatch:
        """``batch`` on the device; ``cu_seqlens`` padded to ``capacity`` + 1 entries unless
        None. Dynamic CP: this rank's share of the micro-batch's CP group (``cp_turn``)."""
        turn: Optional[CPTurn] = batch.get("cp_turn")  # dynamic CP: the micro-batch's group
        if turn is not None:
            cp_size = turn.cp_size
            cp_rank = parallel_state.get_data_parallel_rank(with_context_parallel=True) - \
                turn.first_rank
        else:
            cp_size = self.cp_size
            cp_rank = parallel_state.get_context_parallel_rank() if cp_size > 1 else 0
        mb = to_device_micro_batch(
            batch, with_seq_idx=self.with_seq_idx, static_max_seqlen=self.static_max_seqlen,
            capacity=capacity, device=self.device, cp_size=cp_size, cp_rank=cp_rank,
            with_padding_mask=self.with_padding_mask)
        if turn is not None:
            mb.params.local_cp_size, mb.params.cp_group = cp_size, dynamic_cp_group(cp_size)
        return mb

    def bank_layout(self, cp_size: int, capacity: int) -> PackedBatchParams:
        """Params laid out like a graphed micro-batch of CP size ``cp_size`` (the capture
        input of that size's TE graph bank under dynamic CP)."""
        return self.graph_layout(cp_size, capacity).params

    def graph_layout(self, cp_size: int, capacity: int,
                     like: Optional[dict] = None) -> PackedMicroBatch:
        """A micro-batch staged like a graphed one of CP size ``cp_size`` at ``capacity``: one
        all-padding segment (loss mask 0) over the positions of the collated micro-batch
        ``like`` or, under dynamic CP, ``cp_size`` x tokens per rank with this rank's block
        of that size as its CP group. Forward-only graphs and dynamic CP's TE banks are
        captured with it."""
        return self.stage(self.layout_batch(cp_size, like), capacity)

    def layout_batch(self, cp_size: int, like: Optional[dict] = None) -> dict:
        """The collated micro-batch `graph_layout` stages: `dummy_micro_batch`, with the
        turn of this rank's block of ``cp_size`` under dynamic CP."""
        if self.dynamic_cp_tokens_per_rank:
            rank = parallel_state.get_data_parallel_rank(with_context_parallel=True)
            turn = CPTurn(micro_batch=0, cp_size=cp_size, first_rank=rank - rank % cp_size)
            return dummy_micro_batch(cp_size * self.dynamic_cp_tokens_per_rank) | {"cp_turn": turn}
        if like is None:
            raise ValueError("graph layout is wrong: no micro-batch to take the length from. "
                             "Pass like= (a collated micro-batch) without dynamic CP.")
        return dummy_micro_batch(like["tokens"].numel())

    def run(self, model, mb: PackedMicroBatch):
        """The model on a staged micro-batch: ``(output, loss_func)`` for the schedule."""
        output = model(mb.tokens, mb.position_ids, None, labels=mb.labels,
                       packed_seq_params=mb.params)
        return output, partial(masked_lm_loss, mb.loss_mask)
