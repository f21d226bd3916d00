"""Dropless MoE with static shapes: MoE layers that whole-layer CUDA graphs capture and replay
whatever the routing (``--moe-dropless-graphs``; docs/moe.md).

Dropless dispatch drops no token, so each expert's share of a micro-batch varies. megatron-
core's dropless alltoall dispatcher sizes its buffers from those shares on the host (a device
read in every MoE layer), which a graph cannot hold; drop-and-pad fixes each expert's share
(its capacity) and drops what overflows it. Here the split stays on the device and only the
total is static: a micro-batch of ``T`` tokens routes at most ``T x top-k`` (token, expert)
slots, whatever their split over experts.

One MoE layer call (expert parallel size 1; with expert parallelism, below):

1. **Route** with megatron-core's router (the fork's `moe.PackedTopKRouter`: aux loss,
   z-loss, expert bias, group-limited routing unchanged). `DroplessMoELayer.route` takes the
   padding tail of the packed row out of the routing map: padding is never routed, so it
   takes no rows and no expert compute.
2. **Lay out** (`dropless_layout`): the experts' row buffer has a static ``R = T x top-k +
   experts x alignment + 1`` rows (`static_rows`). Each expert's group holds its routed slots
   in token order, padded with zero rows to the grouped-GEMM alignment (at least one unit:
   grouped_gemm.py says why); groups follow in expert order; the rows past the last group
   (padding tokens' unused slots and the alignment slack) are a tail no GEMM reads. Counts,
   group sizes, ends and every slot's row are computed with ``sum``, ``cumsum``, ``topk`` and
   ``scatter`` on the device.
3. **Dispatch** (`dispatch_rows`): a gather of the tokens (and their probabilities) into the
   rows. Its backward adds each token's row gradients in expert order (`_GatherTokens`), a
   fixed order: no atomics, the same bits on every replay.
4. **Experts**: `moe_experts.TorchGroupedMLP`, one grouped GEMM per linear over the device
   group sizes.
5. **Combine** (`combine_rows`): each token's rows gathered back and added in expert order;
   rows the layout did not fill are never read (torch's grouped GEMM leaves the tail
   unwritten). Its backward gives each row its token's gradient, a gather (`_SumSlots`).

No host read, no drop, no rerun. The results equal megatron-core's dropless alltoall path
(same permutation order, same additions in the same order): bit for bit on CPU, where the
grouped GEMM is a per-expert matmul loop (tests/unit/test_moe_dropless.py).

What it costs: the row buffer is sized for the worst case of the layout, ``T x top-k``
rows plus ``experts x alignment`` (megatron-core's dropless dispatch allocates ``T x top-k``
rows, drop-and-pad ``experts x capacity = T x top-k x factor``); compute covers the routed
rows and the alignment padding only. The layout adds a ``[T, experts]`` int64 cumsum per layer.

Expert parallelism (``P`` ranks) exchanges fixed-size blocks instead: every rank sends every
rank room for the worst case and the slot counts, the receiver regroups on the device
(`StaticDroplessDispatcher`; docs/moe.md, "Dropless MoE graphs and expert parallelism", says
why this design and what it costs). Expert tensor parallelism is not supported
(`check_dropless_config`).
"""

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from megatron.core.tensor_parallel import all_to_all
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

from megatron.packed_model.grouped_gemm import group_alignment
from megatron.packed_model.moe_experts import grouped_expert_refusals
from megatron.packed_model.refusals import refuse


@dataclass
class DroplessLayout:
    """Where every routed slot of a micro-batch sits in a static row buffer: the experts'
    rows (expert parallel size 1), or the rows this rank sends to each expert-parallel rank.

    ``T`` tokens, ``k`` = top-k, ``R`` rows; all device tensors, computed inside the layer
    (graph-owned under CUDA graphs).
    """

    slot_rows: Tensor  # [T, k] int64: row of token t's j-th routed expert (ascending experts)
    slot_valid: Tensor  # [T, k] bool: whether that slot is routed (padding tokens: none)
    slot_experts: Tensor  # [T, k] int64: the expert of each slot (0 where not routed)
    row_slots: Tensor  # [R] int64: the slot t * k + j each row holds; T * k for no slot
    row_tokens: Tensor  # [R] int64: the token t of each row's slot; T for no slot
    group_sizes: Tensor  # [E]: rows of each expert's group (aligned experts' rows, or counts)

    @property
    def num_rows(self) -> int:
        return self.row_slots.shape[0]


def static_rows(num_tokens: int, topk: int, num_experts: int, alignment: int) -> int:
    """``R``, rows of the experts' buffer for any routing of ``num_tokens`` tokens: every
    slot (``T x k``), each group's alignment padding (at most ``alignment`` rows per expert,
    one whole unit for an expert without tokens) and one spare row past the largest possible
    last group, which unrouted slots point at; rounded up to the alignment."""
    return buffer_rows(num_tokens * topk, num_experts, alignment)


def buffer_rows(slots: int, num_experts: int, alignment: int) -> int:
    """Rows of an expert buffer for up to ``slots`` routed rows over ``num_experts`` aligned
    groups, plus the spare row (`static_rows`)."""
    rows = slots + num_experts * alignment + 1
    return -(-rows // alignment) * alignment


def _aligned(counts: Tensor, alignment: int) -> Tensor:
    """Group sizes: ``counts`` rounded up to the alignment, at least one unit each."""
    return torch.clamp((counts + alignment - 1) // alignment, min=1) * alignment


def dropless_layout(routing_map: Tensor, topk: int, alignment: int) -> DroplessLayout:
    """The experts' `DroplessLayout` of ``routing_map`` (``[T, E]`` bool; at most ``topk``
    experts per token, megatron-core's top-k routing; a row of padding holds none): one group
    per expert, in expert order, aligned (`static_rows` rows).

    Within an expert, slots are in token order; a token's slots are in expert order: the
    order of megatron-core's dropless permutation. Device ops only, static shapes.
    """
    num_tokens, num_experts = routing_map.shape
    sizes = _aligned(routing_map.sum(dim=0), alignment)
    return _place_slots(routing_map, topk, sizes.cumsum(0) - sizes,
                        static_rows(num_tokens, topk, num_experts, alignment), sizes)


def send_capacity(num_tokens: int, topk: int, local_experts: int) -> int:
    """Rows one rank sends to each expert-parallel rank: a token routes at most
    ``min(topk, local_experts)`` slots to the experts of one rank."""
    return num_tokens * min(topk, local_experts)


def send_layout(routing_map: Tensor, topk: int, ep_size: int) -> DroplessLayout:
    """The rows this rank sends (``[ep_size x C, ...]``, `send_capacity` ``C``): block ``r``
    holds the slots routed to rank ``r``'s experts, grouped by expert (unaligned), in token
    order within an expert; the rest of a block is unused. ``group_sizes``: the slots per
    (global) expert, what the receiving ranks are told."""
    num_tokens, num_experts = routing_map.shape
    local_experts = num_experts // ep_size
    capacity = send_capacity(num_tokens, topk, local_experts)
    counts = routing_map.sum(dim=0)
    per_rank = counts.view(ep_size, local_experts)
    starts = (per_rank.cumsum(1) - per_rank
              + capacity * torch.arange(ep_size, device=counts.device).unsqueeze(1))
    return _place_slots(routing_map, topk, starts.view(-1), ep_size * capacity + 1, counts)


def _place_slots(routing_map: Tensor, topk: int, starts: Tensor, rows: int,
                 group_sizes: Tensor) -> DroplessLayout:
    """The layout of ``routing_map``'s slots when expert ``e``'s slots fill rows
    ``starts[e]`` on, in token order, in a buffer of ``rows`` rows whose last row is spare."""
    num_tokens, num_experts = routing_map.shape
    device = routing_map.device
    # Rank of each token among its expert's tokens (meaningful where routed), as [E, T]: a
    # scan along the innermost dim. Along dim 0 of [T, E], CUDA scans each expert's column
    # in one thread (0.8 ms per layer at 4096 tokens and 128 experts on an H200).
    ranks = (routing_map.t().contiguous().cumsum(dim=1) - 1).t()
    # Each token's experts in ascending order: the top-k of (E - e) over its routed experts;
    # a key of 0 is a slot the token does not route.
    keys = torch.topk(routing_map * torch.arange(num_experts, 0, -1, device=device), topk,
                      dim=1).values
    valid = keys > 0
    experts = torch.where(valid, num_experts - keys, 0)
    slot_rows = torch.where(valid, starts[experts] + ranks.gather(1, experts), rows - 1)
    no_slot = num_tokens * topk
    slot_ids = torch.arange(no_slot, device=device).view(num_tokens, topk)
    # Unrouted slots all write "no slot" into the spare row: one value, whichever write wins.
    row_slots = torch.full((rows,), no_slot, dtype=torch.int64, device=device).scatter_(
        0, slot_rows.view(-1), torch.where(valid, slot_ids, no_slot).view(-1))
    # Once per layer: the dispatch gathers with it, the combine's backward too.
    row_tokens = torch.div(row_slots, topk, rounding_mode="floor")
    return DroplessLayout(slot_rows, valid, experts, row_slots, row_tokens, group_sizes)


@dataclass
class ReceivedGroups:
    """Where the rows received from the expert-parallel ranks go among this rank's experts.

    Received rows ``[ep_size x C]``: block ``s`` from rank ``s``, its slots grouped by local
    expert (`send_layout`). Expert rows ``[R]``: one aligned group per local expert, holding
    its rows from rank 0, then rank 1, ...: the rows an expert-parallel-size-1 layer would
    give it for the same tokens.
    """

    expert_rows: Tensor  # [ep_size x C] int64: expert row of each received row, or the spare
    received: Tensor  # [ep_size x C] bool: whether a received row holds a slot
    source_rows: Tensor  # [R] int64: received row of each expert row; ep_size x C for none
    group_sizes: Tensor  # [local experts] int64: aligned, at least one unit


def receive_groups(counts: Tensor, capacity: int, alignment: int) -> ReceivedGroups:
    """The `ReceivedGroups` of ``counts`` (``[ep_size, local experts]``: the slots each rank
    sends each local expert), blocks of ``capacity`` rows. Device ops only, static shapes."""
    ep_size, local_experts = counts.shape
    device = counts.device
    received_rows = ep_size * capacity
    rows = buffer_rows(received_rows, local_experts, alignment)
    sizes = _aligned(counts.sum(dim=0), alignment)
    starts = sizes.cumsum(0) - sizes
    # Row o of block s belongs to the local expert whose range of the block holds it.
    ends = counts.cumsum(dim=1)
    offsets = torch.arange(capacity, device=device).expand(ep_size, capacity).contiguous()
    experts = torch.searchsorted(ends, offsets, right=True)
    received = experts < local_experts
    experts = experts.clamp(max=local_experts - 1)
    within = offsets - (ends - counts).gather(1, experts)
    earlier = counts.cumsum(dim=0) - counts  # rows of earlier ranks in each expert's group
    target = starts[experts] + earlier.gather(1, experts) + within
    expert_rows = torch.where(received, target, rows - 1).view(-1)
    source_rows = torch.full((rows,), received_rows, dtype=torch.int64, device=device).scatter_(
        0, expert_rows, torch.where(received.view(-1),
                                    torch.arange(received_rows, device=device), received_rows))
    return ReceivedGroups(expert_rows, received.view(-1), source_rows, sizes)


def _gather_or_zero(values: Tensor, index: Tensor) -> Tensor:
    """``values[index[r]]`` for each ``r`` (along dim 0), zero where ``index[r]`` is
    ``len(values)``: how rows are filled from tokens, slots or received rows, a row that holds
    none staying zero."""
    padded = torch.cat([values, values.new_zeros(1, *values.shape[1:])])
    return padded.index_select(0, index)


def _sum_slots(rows: Tensor, slot_rows: Tensor, slot_valid: Tensor) -> Tensor:
    """``[T, H]``: for each token the sum of its routed slots' rows, in slot (= expert) order
    (``(0 + r_1) + r_2 + ...``, as megatron-core's unpermutation adds them on CPU). Unrouted
    slots add nothing (a fill, not a product: the rows they point at may hold any value).

    One slot at a time, on contiguous ``[T, H]`` gathers, in place: no ``[T, top-k, H]``
    buffer and no strided kernels. Not differentiable itself (`_GatherTokens`, `_SumSlots`)."""
    total = None
    for j in range(slot_rows.shape[1]):
        row = rows.index_select(0, slot_rows[:, j]).masked_fill_(~slot_valid[:, j, None], 0)
        total = row if total is None else total.add_(row)
    return total


class _GatherTokens(torch.autograd.Function):
    """Dispatch, ``rows = _gather_or_zero(hidden, row_tokens)``. Backward: each token's
    gradient is the sum of its routed rows' gradients (`_sum_slots`), never with atomics: the
    same bits on every run."""

    @staticmethod
    def forward(ctx, hidden: Tensor, row_tokens: Tensor, slot_rows: Tensor,
                slot_valid: Tensor) -> Tensor:
        ctx.save_for_backward(slot_rows, slot_valid)
        return _gather_or_zero(hidden, row_tokens)

    @staticmethod
    def backward(ctx, grad_rows: Tensor):
        slot_rows, slot_valid = ctx.saved_tensors
        return _sum_slots(grad_rows, slot_rows, slot_valid), None, None, None


class _SumSlots(torch.autograd.Function):
    """Combine, ``tokens = _sum_slots(rows, ...)``, the transpose of `_GatherTokens`.
    Backward: each row's gradient is its token's (`_gather_or_zero`; zero for a row that holds
    no slot), a gather. Autograd's own backward of the row gather is an ``index_add_`` with
    atomics, in which every unrouted slot adds into the one spare row: 40.7 ms per step at
    Qwen3-30B-A3B's layer shapes on an H200, where drop-and-pad's unpermutation took 10.6 ms.
    The gradients are the same bits."""

    @staticmethod
    def forward(ctx, rows: Tensor, row_tokens: Tensor, slot_rows: Tensor,
                slot_valid: Tensor) -> Tensor:
        ctx.save_for_backward(row_tokens)
        return _sum_slots(rows, slot_rows, slot_valid)

    @staticmethod
    def backward(ctx, grad_tokens: Tensor):
        (row_tokens,) = ctx.saved_tensors
        return _gather_or_zero(grad_tokens, row_tokens), None, None, None


def dispatch_rows(hidden: Tensor, probs: Tensor, layout: DroplessLayout):
    """``(rows [R, H], row_probs [R])``: the tokens of ``hidden`` (``[T, H]``) and their
    routing probabilities (``probs`` ``[T, E]``) in the layout's rows; zero rows and zero
    probabilities where a row holds no slot. Differentiable in both."""
    rows = _GatherTokens.apply(hidden, layout.row_tokens, layout.slot_rows, layout.slot_valid)
    slot_probs = torch.where(layout.slot_valid, probs.gather(1, layout.slot_experts), 0)
    return rows, _gather_or_zero(slot_probs.view(-1), layout.row_slots)


def combine_rows(rows: Tensor, layout: DroplessLayout) -> Tensor:
    """``[T, H]``: each token's expert outputs (``rows``, already scaled by their
    probabilities) added in expert order; zero for a token routed nowhere. Differentiable in
    ``rows`` (`_SumSlots`)."""
    return _SumSlots.apply(rows, layout.row_tokens, layout.slot_rows, layout.slot_valid)


class StaticDroplessDispatcher(MoETokenDispatcher):
    """megatron-core's token-dispatcher interface for dropless MoE with static shapes (module
    doc); expert tensor parallel size 1.

    * Expert parallel size 1: `dropless_layout` lays the slots out for the experts directly;
      no communication.
    * Expert parallel size ``P`` > 1, a padded fixed-size exchange: each rank sends every
      rank a block of `send_capacity` rows (its slots for that rank's experts, the rest
      zero, `send_layout`) and the slot counts, both with equal-split all-to-alls (the
      exchange drop-and-pad captures in graphs); the receiving rank regroups the rows it got
      by local expert (`receive_groups`) on the device. The way back reverses it. Nothing is
      read on the host; the blocks hold every routing, so nothing is dropped. The price is
      static worst-case sizes: ``P x C`` rows in each direction (``C = T x min(top-k, local
      experts)``), about ``P`` times megatron-core's dropless traffic and row buffers.

    Per call it keeps its layouts and the input shape from ``dispatch_preprocess`` to
    ``combine_postprocess`` (as megatron-core's dispatchers keep theirs); under CUDA graphs
    these are tensors of the graph.
    """

    def __init__(self, num_local_experts: int, config, pg_collection):
        super().__init__(config=config, pg_collection=pg_collection)
        if self.tp_size != 1:
            raise ValueError(f"expert tensor parallel size {self.tp_size} is wrong for dropless "
                             "MoE graphs: each rank runs whole experts on its own tokens; use "
                             "--expert-tensor-parallel-size 1")
        self.num_local_experts = num_local_experts
        self.topk = config.moe_router_topk
        self.layout: Optional[DroplessLayout] = None  # the experts' rows, or the sent rows
        self.groups: Optional[ReceivedGroups] = None  # expert parallel: the received rows
        self.hidden_shape = None

    def dispatch_preprocess(self, hidden_states: Tensor, routing_map: Tensor, probs: Tensor):
        self.hidden_shape = hidden_states.shape
        hidden = hidden_states.view(-1, hidden_states.shape[-1])
        if self.ep_size == 1:
            self.layout = dropless_layout(routing_map, self.topk, group_alignment(hidden.dtype))
            return dispatch_rows(hidden, probs, self.layout)
        self.layout = send_layout(routing_map, self.topk, self.ep_size)
        rows, row_probs = dispatch_rows(hidden, probs, self.layout)
        return rows[:-1], row_probs[:-1]  # the spare row stays here

    def token_dispatch(self, rows: Tensor, row_probs: Tensor):
        if self.ep_size == 1:
            return rows, row_probs
        sent = self.layout.group_sizes.view(self.ep_size, self.num_local_experts)
        counts = torch.empty_like(sent)
        torch.distributed.all_to_all_single(counts, sent, group=self.ep_group)
        self.groups = receive_groups(counts, rows.shape[0] // self.ep_size,
                                     group_alignment(rows.dtype))
        return (all_to_all(self.ep_group, rows), all_to_all(self.ep_group, row_probs))

    def dispatch_postprocess(self, rows: Tensor, row_probs: Tensor):
        if self.ep_size == 1:
            return rows, self.layout.group_sizes, row_probs
        source = self.groups.source_rows  # a row past the received ones is zero
        rows, row_probs = _gather_or_zero(rows, source), _gather_or_zero(row_probs, source)
        return rows, self.groups.group_sizes, row_probs

    def combine_preprocess(self, rows: Tensor) -> Tensor:
        if self.ep_size == 1:
            return rows
        back = rows.index_select(0, self.groups.expert_rows)
        # Unfilled received rows point at the spare expert row, which may hold any value.
        return torch.where(self.groups.received.unsqueeze(-1), back, 0)

    def token_combine(self, rows: Tensor) -> Tensor:
        if self.ep_size == 1:
            return rows
        rows = all_to_all(self.ep_group, rows)
        return torch.cat([rows, rows.new_zeros(1, rows.shape[1])])  # the spare row again

    def combine_postprocess(self, rows: Tensor) -> Tensor:
        output = combine_rows(rows, self.layout).view(self.hidden_shape)
        self.layout = self.groups = None  # the call's tensors: autograd keeps what it needs
        return output

    def get_expert_zero_copy_buffers(self):
        """megatron-core asks every dispatcher (NCCL-EP zero copy): none here."""
        return None, None


def dropless_refusals(settings) -> list:
    """What dropless MoE graphs do not run, as ``(refused, flag, value, what to do)`` rules on
    ``settings``: a TransformerConfig here, the parsed arguments at parse time (which name these
    settings alike; extra_args.check_moe_dropless_graphs adds the rules only they can answer)."""
    s = settings
    return [
        (s.moe_expert_capacity_factor is not None, "--moe-expert-capacity-factor",
         s.moe_expert_capacity_factor, "Dropless MoE graphs route without a capacity: drop it "
         "(and --moe-pad-expert-input-to-capacity)"),
        (s.moe_pad_expert_input_to_capacity, "--moe-pad-expert-input-to-capacity", True,
         "Dropless MoE graphs pad no expert to a capacity: drop it"),
        (s.moe_token_dispatcher_type != "alltoall", "--moe-token-dispatcher-type",
         s.moe_token_dispatcher_type, "The static dropless dispatcher takes the place of "
         "alltoall: use --moe-token-dispatcher-type alltoall"),
        ((s.expert_tensor_parallel_size or 1) != 1, "--expert-tensor-parallel-size",
         s.expert_tensor_parallel_size, "Each rank runs whole experts on its own tokens: add "
         "--expert-tensor-parallel-size 1 (with tensor parallelism, --sequence-parallel splits "
         "the tokens)"),
        (s.moe_shared_expert_overlap, "--moe-shared-expert-overlap", True,
         "There is no token exchange to overlap with: drop it"),
        (s.moe_router_padding_for_quantization, "--moe-router-padding-for-quantization", True,
         "The grouped experts pad their groups themselves, in bf16: drop it"),
        (s.moe_latent_size is not None, "--moe-latent-size", s.moe_latent_size,
         "Not supported with dropless MoE graphs: drop it"),
        (s.overlap_moe_expert_parallel_comm, "--overlap-moe-expert-parallel-comm", True,
         "There is no expert-parallel exchange: drop it"),
        (s.overlap_dispatch_backward_with_experts_wgrad,
         "--overlap-dispatch-backward-with-experts-wgrad", True, "The grouped experts compute "
         "weight gradients in their backward: drop it"),
        *grouped_expert_refusals(s),
    ]


def check_dropless_config(config) -> None:
    """Refuse a TransformerConfig that dropless MoE graphs do not run (`dropless_refusals`)."""
    refuse(*dropless_refusals(config))


class DroplessMoELayer(MoELayer):
    """megatron-core's MoELayer with the static dropless dispatcher (module doc): the same
    router, shared experts and forward (route, dispatch, experts, combine); the experts come
    from the spec (`moe_experts.TorchGroupedMLP`). The padding tail of a packed row is taken
    out of the routing map before dispatch.

    megatron-core builds the dispatcher its config names (alltoall) in ``MoELayer.__init__``;
    it is replaced here before any call.
    """

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None,
                 is_mtp_layer: bool = False, name: Optional[str] = None):
        check_dropless_config(config)
        super().__init__(config=config, submodules=submodules, layer_number=layer_number,
                         pg_collection=pg_collection, is_mtp_layer=is_mtp_layer, name=name)
        self.token_dispatcher = StaticDroplessDispatcher(
            self.num_local_experts, config,
            pg_collection=pg_collection if pg_collection is not None else _default_groups())

    def route(self, hidden_states: Tensor, padding_mask: Optional[Tensor] = None):
        probs, routing_map = super().route(hidden_states, padding_mask)
        if padding_mask is not None:  # [S, B] with True = padding, as the router reads it
            routing_map = routing_map & ~padding_mask.reshape(-1, 1)
        return probs, routing_map


def _default_groups():
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    return get_default_pg_collection()
