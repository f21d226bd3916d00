"""Pipeline and context parallel layouts of the library API (docs/rl.md, "Layouts").

`PackedPolicy` runs megatron-core's schedules as training does, at any pipeline (PP, with
virtual stages) and static context parallel (CP) size. What the layout changes is where a
call's results land; the functions here hand every rank the whole result:

* PP > 1: the schedule runs the loss function, so its reports exist, on the last stage
  only. `Layout.rows` and `step_totals` broadcast them over the pipeline group, one
  concatenated tensor per call whose size every rank knows from the call's layout.
* CP > 1: each CP rank runs its share of a micro-batch's positions (`thd_partition_index`:
  of every sequence, chunks ``r`` and ``2 CP - 1 - r``). `gather_cp_rows` all-gathers the
  shares and puts the positions back in row order. A loss function sees its rank's share;
  token sums add up over the data x context parallel group (megatron-core's gradient
  reduction, `finalize_model_grads`'s token count, `step_totals`), sequence sums through
  `cp_sequence_totals`.
* Virtual pipeline stages: megatron-core's interleaved schedule runs micro-batches in groups
  per stage (`schedule_count`); a call is padded with empty micro-batches to fit.

Each function issues one collective per layout dimension it crosses (`Layout.rows` at PP
and CP > 1: a broadcast and an all-gather; `step_totals`: an all-reduce, a broadcast at
PP > 1, and at a loss function's first step the metric names) and reads nothing back to
the host, unless its doc says otherwise.
"""

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from megatron.packed_model.context_parallel import thd_partition_index


@dataclass(frozen=True)
class Layout:
    """This rank's place in the model-parallel layout, as the library's calls need it.

    ``pipeline_group`` / ``pipeline_last_rank``: the pipeline group and the global rank of
    its last stage (None / 0 at PP = 1); ``cp_group``: the context parallel group (None at
    CP = 1); ``dp_cp_group``: the data x context parallel group the step's sums are reduced
    over (None: a world of one without megatron-core's parallel state); ``chunks``: model
    chunks of this rank (virtual stages); ``group_size``: micro-batches per virtual stage
    group of the interleaved schedule; ``device``: where received tensors are allocated.
    """

    pipeline_size: int = 1
    last_stage: bool = True
    pipeline_group: object = None
    pipeline_last_rank: int = 0
    cp_size: int = 1
    cp_group: object = None
    dp_cp_group: object = None
    chunks: int = 1
    group_size: int = 1
    device: torch.device = torch.device("cpu")

    @classmethod
    def current(cls, model: Sequence[torch.nn.Module], device: torch.device) -> "Layout":
        """From megatron-core's parallel state and the model chunks (host only)."""
        from megatron.core import parallel_state

        if not (torch.distributed.is_initialized()
                and parallel_state.model_parallel_is_initialized()):
            return cls(chunks=len(model), device=device)
        pipeline = parallel_state.get_pipeline_model_parallel_world_size()
        cp = parallel_state.get_context_parallel_world_size()
        group_size = pipeline
        if len(model) > 1:
            from megatron.core.utils import get_model_config

            group_size = getattr(get_model_config(model[0]),
                                 "microbatch_group_size_per_vp_stage", None) or pipeline
        return cls(
            pipeline_size=pipeline,
            last_stage=parallel_state.is_pipeline_last_stage(ignore_virtual=True),
            pipeline_group=parallel_state.get_pipeline_model_parallel_group() if pipeline > 1
            else None,
            pipeline_last_rank=parallel_state.get_pipeline_model_parallel_last_rank(),
            cp_size=cp, cp_group=parallel_state.get_context_parallel_group() if cp > 1 else None,
            dp_cp_group=parallel_state.get_data_parallel_group(with_context_parallel=True),
            chunks=len(model), group_size=group_size, device=device)

    @property
    def segment_multiple(self) -> int:
        """What each sequence's positions are padded to a multiple of: 2 x CP (1 at CP = 1)."""
        return 2 * self.cp_size if self.cp_size > 1 else 1

    def rows(self, shares: Sequence[Tensor], batches: Sequence[dict], row_positions: int,
             dtype: torch.dtype = torch.float32) -> Tensor:
        """Per-position results of a forward-only call, whole on every rank: ``[M, S]`` for
        the ``M`` laid-out ``batches`` (``S`` = ``row_positions``), in row order.

        ``shares``: the schedule's per-micro-batch outputs on this rank, each ``S / CP``
        values of ``dtype`` (this CP rank's positions); an empty list off the last pipeline
        stage, which receives them (one broadcast over the pipeline group). At CP > 1 one
        all-gather over the CP group (`gather_cp_rows`). No host sync."""
        count, local = len(batches), row_positions // self.cp_size
        if shares:
            flat = torch.cat([share.reshape(-1) for share in shares])
        else:  # off the last stage: received below
            flat = torch.empty(count * local, dtype=dtype, device=self.device)
        if self.pipeline_size > 1:
            flat = from_last_stage(flat, self.pipeline_group, self.pipeline_last_rank)
        if self.cp_size > 1:
            return gather_cp_rows(flat.view(count, local),
                                  [batch["cu_seqlens"] for batch in batches], row_positions,
                                  self.cp_group)
        return flat.view(count, row_positions)


def schedule_count(count: int, pipeline_size: int, chunks: int, group_size: int) -> int:
    """Micro-batches to run for ``count`` given ones: ``count``, or with virtual stages
    (``chunks`` > 1) the least number from ``count`` up that megatron-core's interleaved
    schedule takes: at least ``group_size`` (micro-batches per virtual stage group) and a
    last group of none or at least ``pipeline_size``."""
    if chunks == 1:
        return count
    runs = max(count, group_size)
    while 0 < runs % group_size < pipeline_size:
        runs += 1
    return runs


def from_last_stage(tensor: Tensor, group, last_rank: int) -> Tensor:
    """``tensor`` of the pipeline's last stage (global rank ``last_rank``) on every stage of
    ``group``: one broadcast, in place (every stage passes a tensor of the same shape and
    dtype; off the last stage its values are overwritten)."""
    torch.distributed.broadcast(tensor, src=last_rank, group=group)
    return tensor


def cp_row_order(cu_seqlens: Tensor, row_positions: int, cp_size: int) -> Tensor:
    """int64 ``[S]``: the row position of each value of the CP ranks' shares concatenated in
    rank order (rank 0's ``S / CP`` positions, then rank 1's, ...). Host work on the
    host ``cu_seqlens`` (the row's CP-padded boundaries)."""
    return torch.cat([thd_partition_index(cu_seqlens, row_positions, cp_size, rank)
                      for rank in range(cp_size)])


def cp_share(values: Tensor, cu_seqlens: Tensor, cp_size: int, cp_rank: int) -> Tensor:
    """This CP rank's positions of a ``[1, S]`` (or ``[S]``) row: ``[1, S / CP]``, gathered
    where ``values`` is (the index is built on the host from ``cu_seqlens``)."""
    flat = values.reshape(-1)
    index = thd_partition_index(cu_seqlens, flat.numel(), cp_size, cp_rank)
    return flat.index_select(0, index.to(flat.device, non_blocking=True)).reshape(1, -1)


def gather_cp_rows(shares: Tensor, cu_seqlens: Sequence[Tensor], row_positions: int,
                   group) -> Tensor:
    """The CP ranks' shares of ``M`` rows, whole: ``shares`` ``[M, S / CP]`` (this rank's
    positions of each row, in `thd_partition_index` order) -> ``[M, S]`` in row order, the
    same on every rank of ``group``. ``cu_seqlens``: each row's boundaries, on the host.
    One all-gather; the inverse permutation is built on the host. No host sync."""
    cp_size = torch.distributed.get_world_size(group)
    count, local = shares.shape
    gathered = torch.empty(cp_size * count * local, dtype=shares.dtype, device=shares.device)
    torch.distributed.all_gather_into_tensor(gathered, shares.reshape(-1), group=group)
    # gathered is [CP, M, S / CP]; row m's values in rank order go to m * S + its order.
    order = torch.stack([cp_row_order(bounds, row_positions, cp_size).view(cp_size, local)
                         for bounds in cu_seqlens], dim=1)
    order = order + torch.arange(count).view(1, count, 1) * row_positions
    rows = torch.empty(count * row_positions, dtype=shares.dtype, device=shares.device)
    rows.index_copy_(0, order.reshape(-1).to(shares.device, non_blocking=True), gathered)
    return rows.view(count, row_positions)


def cp_sequence_totals(sums: Tensor, counts: Tensor, group) -> Tuple[Tensor, Tensor]:
    """Per-sequence ``sums`` (differentiable) and ``counts`` of this CP rank's positions ->
    the whole sequences', added over the CP ``group``: one all-reduce, whose backward
    all-reduces the gradient (`torch.distributed.nn.functional.all_reduce`)."""
    from torch.distributed.nn.functional import all_reduce

    both = all_reduce(torch.stack([sums, counts.to(sums.dtype)]), group=group)
    return both[0], both[1]


def owned_by_this_cp_rank(per_sequence: Tensor, group) -> Tensor:
    """``per_sequence`` (one value per sequence id) kept where this CP rank counts the
    sequence (id mod CP = its rank), 0 elsewhere: summed over the CP group, each sequence
    counts once."""
    ids = torch.arange(per_sequence.numel(), device=per_sequence.device)
    mine = ids % torch.distributed.get_world_size(group) == torch.distributed.get_rank(group)
    return torch.where(mine, per_sequence, torch.zeros_like(per_sequence))


def sequence_count(weights: Tensor, sequence_ids: Tensor, cp_group=None) -> Tensor:
    """int ``[]``: the sequences with a position of positive weight (a scatter: no host
    read). Under CP (``cp_group``) each rank holds a share of a sequence's positions: the
    per-sequence weights are added over the group first (one all-reduce) and each sequence
    counted by one rank."""
    per_sequence = torch.zeros_like(weights).index_add(0, sequence_ids.clamp(min=0).long(),
                                                       weights)
    if cp_group is not None:
        torch.distributed.all_reduce(per_sequence, group=cp_group)
        per_sequence = owned_by_this_cp_rank(per_sequence, cp_group)
    return (per_sequence > 0).sum().to(torch.int)


def step_totals(losses: list, layout: Layout, names: Optional[List[str]],
                name_key: str) -> Tuple[Tensor, List[str]]:
    """A train step's sums ``[2 + K]`` (loss, count, the K metrics) over its micro-batches and
    the data x context parallel ranks, on every rank, and the metric names.

    ``losses``: the schedule's reports (``"loss"``: this micro-batch's ``[2 + K]`` sums;
    ``name_key``: the metric names), empty off the last pipeline stage. ``names``: the
    metric names of an earlier step with the same loss function, or None: at PP > 1 the
    last stage then sends them (an object broadcast: a host sync, once per loss function).
    One all-reduce over the data x context parallel group (last stage); at PP > 1 one
    broadcast over the pipeline group."""
    total, known = None, names
    if losses:  # the last pipeline stage
        total = torch.stack([report["loss"].reshape(-1) for report in losses]).sum(dim=0)
        sent = list(losses[0][name_key])
        if layout.pipeline_size > 1 and known is not None and sent != known:
            raise ValueError(f"loss_fn's metrics are wrong: {sent}, earlier steps of this loss "
                             f"gave {known}. With pipeline parallelism a loss function returns "
                             f"the same metrics every step; return each one always (0 where "
                             f"it does not apply).")
        names = sent
        if layout.dp_cp_group is not None:
            torch.distributed.all_reduce(total, group=layout.dp_cp_group)
    if layout.pipeline_size == 1:
        return total, names
    if known is None:  # every stage alike: the last sends, the others receive
        box = [names]
        torch.distributed.broadcast_object_list(box, src=layout.pipeline_last_rank,
                                                group=layout.pipeline_group)
        names = box[0]
    if total is None:
        total = torch.empty(2 + len(names), dtype=torch.float32, device=layout.device)
    return from_last_stage(total, layout.pipeline_group, layout.pipeline_last_rank), names


def is_last_stage_chunk(model: torch.nn.Module) -> bool:
    """Whether ``model`` (a chunk, possibly wrapped in DDP / Float16Module) ends in the
    output layer, so that it gives logits rather than a stage's hidden states."""
    from megatron.core.utils import get_attr_wrapped_model

    try:
        return get_attr_wrapped_model(model, "post_process") is not False
    except RuntimeError:  # a module without megatron-core's stage flags: the whole model
        return True
