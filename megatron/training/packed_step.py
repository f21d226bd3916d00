"""The per-micro-batch step for packed (THD) training: batch to GPU, model call, loss.

Shared by pretrain_gpt.py and pretrain_mamba.py. The micro-batch's rows are concatenated into
one THD stream ``[1, mbs * seq_length]``; its ``cu_seqlens`` is built on the host by the
data loader, so everything decided here (segment count, longest segment) is read without a
GPU->CPU sync.
"""

from contextlib import nullcontext
from dataclasses import dataclass, replace
from functools import partial
from typing import Dict, List, Optional

import torch
from torch import Tensor

from megatron.core import parallel_state

from megatron.packed_graphs import core_patches
from megatron.packed_graphs.capacity import pad_cu_seqlens
from megatron.packed_graphs.context_parallel import select_cp_tokens, thd_partition_index
from megatron.packed_graphs.dynamic_cp import CPTurn, dynamic_cp_group
from megatron.packed_graphs.dispatch import (
    GraphDecision,
    GraphSettings,
    Reason,
    disable_cuda_graphs_this_step,
    plan_iteration,
)
from megatron.packed_graphs.packed_seq import (
    PackedBatchParams,
    build_packed_batch_params,
    build_seq_idx,
)
from megatron.packed_graphs.te_graphs import TELayerGraphs


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


def graph_settings_from_args(args) -> GraphSettings:
    """Host-static CUDA-graph settings of a training run (validated CLI arguments)."""
    return GraphSettings(
        enabled=args.cuda_graph_impl != "none",
        capacity=args.cuda_graph_max_packed_seqs,
        warmup_iterations=args.cuda_graph_warmup_steps,
        capture_needs_all_micro_batches=args.pipeline_model_parallel_size > 1,
        ladder=tuple(args.cuda_graph_capacity_ladder),
    )


class PackedForwardStep:
    """``forward_step_func`` for megatron-core's pipeline schedules, packed micro-batches.

    Per training iteration the loop calls `begin_iteration` with the iteration's micro-batches
    (graph plan, host only), runs the schedule, then `end_iteration` (log counters).
    Micro-batches that never went through `begin_iteration` (evaluation) run eager.
    """

    def __init__(self, *, with_seq_idx: bool, graphs: GraphSettings, cp_size: int = 1,
                 dynamic_cp_capacities: Optional[Dict[int, int]] = None,
                 dynamic_cp_tokens_per_rank: int = 0, with_padding_mask: bool = False):
        self.with_seq_idx = with_seq_idx
        self.with_padding_mask = with_padding_mask  # MoE models: the router's padding mask
        self.graphs = graphs
        self.cp_size = cp_size
        # Dynamic CP: graph capacity of every CP size's bank, and each rank's positions.
        self.dynamic_cp_capacities = dynamic_cp_capacities or {}
        self.dynamic_cp_tokens_per_rank = dynamic_cp_tokens_per_rank
        # --cuda-graph-impl transformer_engine: captured here, before the schedule of the
        # first graphed iteration (the local implementation captures inside the schedule).
        self.te_graphs: Optional[TELayerGraphs] = None
        self._te_capture_stats: dict = {}
        self._cp_stats: dict = {}  # dynamic CP: the iteration's CP sizes and rounds
        self._iteration = 0
        self._captured: tuple = ()  # capacities graphs were captured for
        self._decisions: List[GraphDecision] = []
        self._micro_batches = 0
        self._documents = 0

    @classmethod
    def from_args(cls, args, *, with_seq_idx: bool) -> "PackedForwardStep":
        sizes = args.dynamic_cp_sizes or []
        return cls(with_seq_idx=with_seq_idx, graphs=graph_settings_from_args(args),
                   cp_size=args.context_parallel_size,
                   dynamic_cp_capacities=dict(zip(sizes, args.dynamic_cp_max_packed_seqs or [])),
                   dynamic_cp_tokens_per_rank=args.dynamic_cp_tokens_per_rank,
                   with_padding_mask=getattr(args, "num_experts", None) is not None)

    def begin_iteration(self, micro_batches_per_chunk: List[List[dict]]) -> None:
        """Plan graph replay for this iteration; every chunk's list holds the same micro-batches."""
        batches = micro_batches_per_chunk[0]
        if self.dynamic_cp_capacities:
            self._cp_stats = {"cp micro-batches": batches[0]["cp_mix"],
                              "cp rounds": batches[0]["cp_rounds"]}
            self._decisions = self._plan_dynamic_cp(batches)
        else:
            self._decisions = self._plan(batches)
        for chunk_batches in micro_batches_per_chunk:
            for batch, decision in zip(chunk_batches, self._decisions):
                batch["graph_decision"] = decision

    def _plan(self, batches: List[dict]) -> List[GraphDecision]:
        """Static layouts: `plan_iteration`; TE graphs are captured with the iteration's first
        graphed micro-batch as the layout."""
        decisions = plan_iteration(self.graphs, self._iteration, self._captured,
                                   [batch["num_segments"] for batch in batches])
        if self.te_graphs is not None and not self._captured:
            first_graphed = next(((batch, decision) for batch, decision in
                                  zip(batches, decisions) if decision.graphed), None)
            if first_graphed is not None:
                params = self._to_device(*first_graphed).params
                self._te_capture_stats = self.te_graphs.capture([params])
                self._captured = (self.graphs.capacity,)
        return decisions

    def _plan_dynamic_cp(self, batches: List[dict]) -> List[GraphDecision]:
        """Dynamic CP: each micro-batch against its CP size's bank. The banks are captured
        at the first iteration past the warm-up on every rank alike (captures run the groups'
        collectives), whatever this rank's own micro-batches are."""
        if (self.te_graphs is not None and not self.te_graphs.captured
                and self._iteration >= self.graphs.warmup_iterations):
            self._te_capture_stats = self.te_graphs.capture(
                [self._bank_layout(size) for size in sorted(self.dynamic_cp_capacities)])
            self._captured = tuple(sorted(set(self.dynamic_cp_capacities.values())))
        decisions = []
        for batch in batches:
            capacity = self.dynamic_cp_capacities[batch["cp_turn"].cp_size]
            captured = (capacity,) if self._captured else ()
            settings = replace(self.graphs, capacity=capacity, ladder=())
            decisions += plan_iteration(settings, self._iteration, captured,
                                        [batch["num_segments"]])
        return decisions

    def _bank_layout(self, cp_size: int):
        """Params laid out like a graphed micro-batch of CP size ``cp_size`` (capture input)."""
        rank = parallel_state.get_data_parallel_rank(with_context_parallel=True)
        turn = CPTurn(micro_batch=0, cp_size=cp_size, first_rank=rank - rank % cp_size)
        batch = dummy_micro_batch(cp_size * self.dynamic_cp_tokens_per_rank) | {"cp_turn": turn}
        graphed = GraphDecision(Reason.GRAPHED, self.dynamic_cp_capacities[cp_size])
        return self._to_device(batch, graphed).params

    def end_iteration(self) -> dict:
        """Counters of the iteration just run, for its log line and metrics record."""
        stats = {"docs per micro-batch": round(self._documents / max(self._micro_batches, 1), 2)}
        stats |= self._cp_stats | self._te_capture_stats
        self._te_capture_stats = {}
        if self.graphs.enabled:
            stats["graph fallbacks"] = sum(d.is_fallback for d in self._decisions)
            if not self._captured and any(d.graphed for d in self._decisions):
                # The schedule captured at the end of this iteration, one set per capacity.
                self._captured = tuple(sorted({d.capacity for d in self._decisions if d.graphed}))
                if self.graphs.ladder:
                    stats["graph capacities"] = ",".join(map(str, self._captured))
                if core_patches.capture_log:
                    capture = core_patches.capture_log[-1]
                    stats["graph capture (s)"] = round(capture["time"], 2)
                    stats["graph memory (MiB)"] = round(capture["graph_reserved_bytes"] / 2**20, 1)
                    stats["graphs captured"] = capture["graphs"]
            elif not self._captured:
                stats["cuda graphs"] = self._decisions[0].reason.value if self._decisions else "-"
        self._iteration += 1
        self._micro_batches = self._documents = 0
        return stats

    def _to_device(self, batch: dict, decision: GraphDecision) -> PackedMicroBatch:
        turn: Optional[CPTurn] = batch.get("cp_turn")  # dynamic CP: the micro-batch's group
        if turn is not None:
            cp_size = turn.cp_size
            cp_rank = parallel_state.get_data_parallel_rank(with_context_parallel=True) - \
                turn.first_rank
        else:
            cp_size = self.cp_size
            cp_rank = parallel_state.get_context_parallel_rank() if cp_size > 1 else 0
        mb = to_device_micro_batch(
            batch, with_seq_idx=self.with_seq_idx, static_max_seqlen=self.graphs.enabled,
            capacity=decision.capacity if decision.graphed else None,
            cp_size=cp_size, cp_rank=cp_rank, with_padding_mask=self.with_padding_mask)
        if turn is not None:
            mb.params.local_cp_size, mb.params.cp_group = cp_size, dynamic_cp_group(cp_size)
        return mb

    def __call__(self, data_iterator, model):
        batch = next(data_iterator)
        decision = batch.get("graph_decision", GraphDecision(Reason.DISABLED))
        mb = self._to_device(batch, decision)
        if decision.graphed and self.te_graphs is not None:
            mb.params = self.te_graphs.load(mb.params)
        self._micro_batches += 1
        self._documents += mb.num_documents
        eager = self.graphs.enabled and not decision.graphed
        with disable_cuda_graphs_this_step() if eager else nullcontext():
            output = model(mb.tokens, mb.position_ids, None, labels=mb.labels,
                           packed_seq_params=mb.params)
        return output, partial(masked_lm_loss, mb.loss_mask)
