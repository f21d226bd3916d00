"""The forward steps of the library API: per-token log-probs, and a loss of them.

Both are the training forward step (`PackedForwardStep`: stage on the device, model call)
with what a policy-gradient step adds: the micro-batch also carries its per-token loss
tensors and ``1 / temperature`` as tensors (`PolicyMicroBatch`), so that under graphs they
are graph inputs in static buffers (a forward-only graph's, or a full-iteration graph's,
where the loss runs inside the graph); the model is called without labels, and the
log-probs of each position's target are taken from its logits (`token_logprobs`).

* `LogProbStep`: forward only. Its output, `HeadOutputs` (float32 ``[1, S]`` log-probs and
  the extras it was built for: entropy, top-k log-probs and ids), is what a forward-only
  graph replays; its loss function copies it out for the caller. The log-prob head runs over
  vocabulary chunks (`chunked_head`): no float32 ``[S, V]`` tensor is made, so the graph's
  pool holds one chunk's temporaries, not the whole vocabulary's.
* `PolicyLossStep`: training. Its loss function calls the caller's ``loss_fn`` with
  `LossInputs` and returns megatron-core's ``(loss, num_tokens, report)``.

The graph runtime drives them as it drives the training step (runtime.py): ``stage``,
``run`` under the micro-batch's plan, ``graph_layout`` for forward-only captures.
"""

import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from megatron.core import parallel_state, tensor_parallel
from megatron.core.utils import get_pg_rank, get_pg_size

from megatron.packed_training.packed_step import PackedForwardStep, PackedMicroBatch
from megatron.packed_training.rl import layouts
from megatron.packed_training.rl.batches import SEQUENCE_IDS

INV_TEMPERATURE = "inv_temperature"  # the collated micro-batch's host key (a float)
LOGPROBS = "logprobs"  # the report keys of a LogProbStep micro-batch: its HeadOutputs' fields
ENTROPY = "entropy"
TOPK_LOGPROBS = "topk_logprobs"
TOPK_IDS = "topk_ids"
MAX_TOP_K = 64  # enough for distillation; the merge of candidates stays small
# Vocabulary columns per chunk of the log-prob head: at 8192 positions one float32 chunk is
# 256 MiB (the whole of a 151,936 vocabulary would be 4.6 GiB).
VOCAB_CHUNK = 8192
HEAD_FIELDS = (LOGPROBS, ENTROPY, TOPK_LOGPROBS, TOPK_IDS)  # HeadOutputs' fields, in order
METRIC_NAMES = "metric_names"  # a PolicyLossStep report's host list: the metrics after loss, count


@dataclass
class PolicyMicroBatch(PackedMicroBatch):
    """A staged micro-batch with the policy step's tensors (all on the compute device).

    ``inv_temperature``: float32 ``[1]``, ``1 / temperature``; ``loss_tensors``: name ->
    float32 ``[1, T]``, position aligned (layout of batches.lay_out), 0 on padding.
    """

    inv_temperature: Optional[Tensor] = None
    loss_tensors: Dict[str, Tensor] = dataclasses.field(default_factory=dict)


@dataclass
class LossInputs:
    """What a loss function sees for one micro-batch: position-aligned ``[T]`` tensors over
    the packed row (``T``: micro_batch_size x seq_length), all float32 on the device. Under
    context parallelism they are this CP rank's share of the row's positions (``T / CP``;
    `layouts.py`): token-level sums add up over the CP ranks, and `per_sequence_means`
    adds each sequence's sums over ``cp_group`` (the CP group; None: the rank holds the
    whole row).

    ``logprobs``: log-probability of each position's target under the policy at the call's
    temperature (differentiable; padding positions hold the log-prob of a pad token: their
    weight is 0). ``weights``: the loss weights (0 on padding and on a sequence's first
    token). ``tensors``: the micro-batch's per-token tensors by name (``advantages``,
    ``old_logprobs``, ...). ``sequence_ids``: each position's sequence within the
    micro-batch (0, 1, ... over the sequences of two or more tokens, in order; -1 on
    padding), float32, for per-sequence reductions.
    """

    logprobs: Tensor
    weights: Tensor
    tensors: Dict[str, Tensor]
    sequence_ids: Optional[Tensor] = None
    cp_group: object = None

    def __getitem__(self, name: str) -> Tensor:
        """``inputs["advantages"]``; a missing name raises naming the ones there are."""
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(f"the loss asks for per-token tensor {name!r}; the micro-batches "
                           f"carry {sorted(self.tensors)}. Add it to PackedSequences.tensors."
                           ) from None


def token_logprobs(logits: Tensor, labels: Tensor, inv_temperature: Tensor) -> Tensor:
    """log p(label) of every position under ``softmax(logits / temperature)``: float32, the
    shape of ``labels``. ``logits`` ``[..., V / TP]`` is this rank's vocabulary shard
    (megatron-core's vocab-parallel cross entropy reduces over the tensor-parallel group);
    ``inv_temperature`` a ``[1]`` device tensor, so one graph serves every temperature.
    Differentiable; no host sync."""
    scaled = logits.float() * inv_temperature  # a new tensor: the cross entropy works in place
    return -tensor_parallel.vocab_parallel_cross_entropy(scaled, labels)


class LogProbStep(PackedForwardStep):
    """Forward step of per-token log-probs and their extras (forward only; see module doc).

    Under static context parallelism each CP rank stages and runs its share of the
    positions (its per-token loss tensors too); the policy gathers the log-probs back
    (`layouts.gather_cp_rows`). Refuses dynamic context parallelism."""

    # Whether the staged micro-batch carries the per-token loss tensors (a log-prob pass
    # needs none: its forward-only graphs take the same inputs whatever the call carries).
    carries_loss_tensors = False

    def __init__(self, *, entropy: bool = False, top_k: int = 0, vocab_chunk: int = VOCAB_CHUNK,
                 **kwargs):
        """``entropy``, ``top_k``: the extras `head` computes besides the log-probs (a
        forward-only graph holds them: one step, and its graphs, per set of extras);
        ``vocab_chunk``: vocabulary columns per chunk of the head (0: the whole shard, through
        megatron-core's cross entropy; log-probs only). The rest: `PackedForwardStep`'s."""
        super().__init__(**kwargs)
        self.entropy, self.top_k, self.vocab_chunk = check_head_options(entropy, top_k,
                                                                        vocab_chunk)

    def stage(self, batch: dict, capacity: Optional[int]) -> PolicyMicroBatch:
        if "cp_turn" in batch:
            raise ValueError("dynamic context parallelism is wrong for the library API: a "
                             "micro-batch came with a CP turn. Leave dynamic_cp_sizes unset "
                             "(static context_parallel_size runs).")
        staged = super().stage(batch, capacity)
        device = staged.tokens.device
        tensors = {}
        if self.carries_loss_tensors:
            tensors = {name: self._share(value, batch).to(device, non_blocking=True)
                       .reshape(1, -1) for name, value in batch.get("loss_tensors", {}).items()}
        inv = torch.tensor([batch.get(INV_TEMPERATURE, 1.0)], dtype=torch.float32)
        return PolicyMicroBatch(**{f.name: getattr(staged, f.name)
                                   for f in dataclasses.fields(PackedMicroBatch)},
                                inv_temperature=inv.to(device, non_blocking=True),
                                loss_tensors=tensors)

    def _share(self, values: Tensor, batch: dict) -> Tensor:
        """A ``[1, T]`` row tensor of ``batch``: this CP rank's positions under CP."""
        if self.cp_size == 1:
            return values
        return layouts.cp_share(values, batch["cu_seqlens"], self.cp_size,
                                parallel_state.get_context_parallel_rank())

    def logits(self, model, mb: PolicyMicroBatch) -> Tensor:
        """The model on ``mb``: logits ``[1, T, V / TP]`` (this rank's vocabulary shard); off
        the last pipeline stage, the chunk's hidden states for the next stage."""
        return model(mb.tokens, mb.position_ids, None, labels=None, packed_seq_params=mb.params)

    def logprobs(self, model, mb: PolicyMicroBatch) -> Tensor:
        """float32 ``[1, T]`` log-probs of each position's target, differentiable, through
        megatron-core's cross entropy on the whole shard (`token_logprobs`: the training
        path, `PolicyLossStep`); off the last pipeline stage, the hidden states."""
        logits = self.logits(model, mb)
        if not layouts.is_last_stage_chunk(model):
            return logits
        return token_logprobs(logits, mb.labels, mb.inv_temperature)

    def head(self, model, mb: PolicyMicroBatch):
        """Forward only: the log-probs and the extras this step was built for (`chunked_head`
        over the tensor-parallel group; ``vocab_chunk`` 0: the log-probs of `token_logprobs`);
        off the last pipeline stage, the hidden states. No host sync."""
        logits = self.logits(model, mb)
        if not layouts.is_last_stage_chunk(model):
            return logits
        if self.vocab_chunk == 0:
            return HeadOutputs(token_logprobs(logits, mb.labels, mb.inv_temperature))
        return chunked_head(logits, mb.labels, mb.inv_temperature, entropy=self.entropy,
                            top_k=self.top_k, chunk=self.vocab_chunk, group=tp_group())

    def run(self, model, mb: PolicyMicroBatch):
        return self.head(model, mb), report_logprobs


def tp_group():
    """The tensor-parallel group the logits are vocabulary-sharded over (None: one rank)."""
    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_group()
    return None


def report_logprobs(output: "HeadOutputs"):
    """megatron-core's loss function of a forward-only micro-batch: no loss, and the outputs
    copied out of the (possibly graph-owned) head outputs for the caller: name -> ``[T]``
    (log-probs, entropy) or ``[T, k]`` (top-k), for the fields the step computes."""
    device = output.logprobs.device
    zero = torch.zeros((), dtype=torch.float32, device=device)
    one = torch.ones((), dtype=torch.int, device=device)
    report = {}
    for name, value in zip(HEAD_FIELDS, output):
        if value is not None:
            width = value.shape[-1:] if name in (TOPK_LOGPROBS, TOPK_IDS) else ()
            report[name] = value.detach().reshape(-1, *width).clone()
    return zero, one, report


# -- the chunked log-prob head -------------------------------------------------------------------

class HeadOutputs(NamedTuple):
    """What the forward-only head computes per position (``shape``: the labels'): float32
    ``logprobs``; float32 ``entropy`` of ``softmax(logits / temperature)``, or None;
    ``topk_logprobs`` float32 and ``topk_ids`` int64 ``[*shape, k]`` (largest first; global
    vocabulary ids), or None. A tuple of tensors: a graph returns it as its static output.
    Its fields are named as the report's keys (`HEAD_FIELDS`)."""

    logprobs: Tensor
    entropy: Optional[Tensor] = None
    topk_logprobs: Optional[Tensor] = None
    topk_ids: Optional[Tensor] = None


def check_head_options(entropy, top_k, vocab_chunk,
                       chunk_name: str = "vocab_chunk") -> Tuple[bool, int, int]:
    """The head's options, checked on the host: ValueError naming the value and the fix
    (``chunk_name``: what the caller calls the chunk size)."""
    if not isinstance(entropy, bool):
        raise ValueError(f"entropy is wrong: {entropy!r}. Pass True or False.")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 0 <= top_k <= MAX_TOP_K:
        raise ValueError(f"top_k is wrong: {top_k!r}. Pass an int from 0 (no top-k) to "
                         f"{MAX_TOP_K}.")
    if isinstance(vocab_chunk, bool) or not isinstance(vocab_chunk, int) or vocab_chunk < 0:
        raise ValueError(f"{chunk_name} is wrong: {vocab_chunk!r}. Pass a positive int "
                         f"(vocabulary columns per chunk), or 0 for the whole shard at once.")
    if vocab_chunk == 0 and (entropy or top_k):
        raise ValueError(f"{chunk_name} is wrong for entropy={entropy}, top_k={top_k}: 0 (the "
                         f"whole shard through megatron-core's cross entropy, log-probs only). "
                         f"Use a positive {chunk_name} (default {VOCAB_CHUNK}) for the extras.")
    return entropy, top_k, vocab_chunk


def vocab_chunks(width: int, chunk: int) -> List[Tuple[int, int]]:
    """``[lo, hi)`` column ranges covering ``width`` columns, ``chunk`` at most each."""
    return [(lo, min(lo + chunk, width)) for lo in range(0, width, chunk)]


def chunked_head(logits: Tensor, labels: Tensor, inv_temperature: Tensor, *,
                 entropy: bool = False, top_k: int = 0, chunk: int = VOCAB_CHUNK,
                 group=None) -> HeadOutputs:
    """Log-probs of ``labels`` (and the entropy, the top-k log-probs and ids) under
    ``softmax(logits / temperature)``, forward only, over vocabulary chunks of ``chunk``
    columns: every float32 temporary is ``[positions, chunk]``, none ``[positions, V]``.

    ``logits`` ``[..., V / TP]`` (any float dtype, not modified) is this rank's shard of the
    vocabulary, columns ``rank * V / TP`` on, over ``group`` (a process group of TP ranks, or
    None: one rank); ``labels`` ``[...]`` int64 global vocabulary ids; ``inv_temperature``
    a ``[1]`` float32 tensor. Returns `HeadOutputs` shaped like ``labels``; top-k ids are
    global. Collectives over ``group`` (where it has more than one rank): a MAX all-reduce,
    a SUM all-reduce and, with ``top_k``, an all-gather of each rank's candidates. No host
    sync.

    Two passes, as megatron-core's vocab-parallel cross entropy: the row maximum (and the
    top-k candidates), then the sums of ``exp(x - max)`` (and of ``exp(x - max) (x - max)``,
    for the entropy). The log-prob is the same expression; with one chunk per shard it is
    bitwise megatron-core's, with several the sum of exponentials is added chunk by chunk
    (equal within float32 rounding).
    """
    width = logits.shape[-1]
    flat = logits.reshape(-1, width)
    start = get_pg_rank(group) * width
    local = labels.reshape(-1) - start
    owned = (local >= 0) & (local < width)
    spans = vocab_chunks(width, chunk)

    # Pass 1: the row maximum of the scaled logits (and the top-k candidates), per chunk.
    row_max, candidates = None, None
    for lo, hi in spans:
        x = flat[:, lo:hi] * inv_temperature  # float32 [T, C]: the one upcast of the chunk
        chunk_max = x.amax(dim=-1)
        row_max = chunk_max if row_max is None else torch.maximum(row_max, chunk_max)
        if top_k:
            candidates = merge_top_k(candidates, x.topk(min(top_k, hi - lo), dim=-1),
                                     start + lo, top_k)
    all_reduce(row_max, torch.distributed.ReduceOp.MAX, group)

    # Pass 2: the label's shifted logit, the sums over exponentials, per chunk.
    label = sum_exp = sum_ex = None
    for lo, hi in spans:
        x = flat[:, lo:hi] * inv_temperature
        x -= row_max.unsqueeze(-1)
        here = owned & (local >= lo) & (local < hi)
        picked = x.gather(-1, (local - lo).clamp(0, hi - lo - 1).unsqueeze(-1)).squeeze(-1)
        label = torch.where(here, picked, 0.0 if label is None else label)
        if entropy:
            e = torch.exp(x)
            chunk_ex = x.mul_(e).sum(dim=-1)
            sum_ex = chunk_ex if sum_ex is None else sum_ex + chunk_ex
        else:
            e = torch.exp_(x)  # in place: one chunk-sized temporary
        chunk_exp = e.sum(dim=-1)
        sum_exp = chunk_exp if sum_exp is None else sum_exp + chunk_exp
    sums = torch.stack([label, sum_exp] + ([sum_ex] if entropy else []))
    all_reduce(sums, torch.distributed.ReduceOp.SUM, group)
    log_sum = torch.log(sums[1])
    logprobs = -(log_sum - sums[0]).reshape(labels.shape)
    entropies = (log_sum - sums[2] / sums[1]).reshape(labels.shape) if entropy else None
    values = ids = None
    if top_k:
        values, ids = gather_top_k(candidates, top_k, group)
        values = ((values - row_max.unsqueeze(-1)) - log_sum.unsqueeze(-1)).reshape(
            *labels.shape, top_k)
        ids = ids.reshape(*labels.shape, top_k)
    return HeadOutputs(logprobs, entropies, values, ids)


def merge_top_k(best: Optional[Tuple[Tensor, Tensor]], found, offset: int,
                k: int) -> Tuple[Tensor, Tensor]:
    """The ``k`` largest of ``best`` (values, global ids) and of a chunk's ``found`` topk
    (ids local to the chunk, which starts at global id ``offset``)."""
    values, ids = found.values, found.indices + offset
    if best is not None:
        values, ids = torch.cat([best[0], values], dim=-1), torch.cat([best[1], ids], dim=-1)
    top = values.topk(min(k, values.shape[-1]), dim=-1)
    return top.values, ids.gather(-1, top.indices)


def gather_top_k(local: Tuple[Tensor, Tensor], k: int, group) -> Tuple[Tensor, Tensor]:
    """The ``k`` largest over the ranks of ``group`` of each rank's candidates (values,
    global ids): an all-gather of them, then one top-k."""
    values, ids = local
    size = get_pg_size(group)
    if size > 1:
        values = torch.cat(all_gathered(values, group), dim=-1)
        ids = torch.cat(all_gathered(ids, group), dim=-1)
    top = values.topk(k, dim=-1)
    return top.values, ids.gather(-1, top.indices)


def all_reduce(tensor: Tensor, op, group) -> None:
    """In place over ``group``; nothing where it has one rank (or is None)."""
    if get_pg_size(group) > 1:
        torch.distributed.all_reduce(tensor, op=op, group=group)


def all_gathered(tensor: Tensor, group) -> List[Tensor]:
    """Every rank's ``tensor`` (same shape on each), in rank order."""
    out = [torch.empty_like(tensor) for _ in range(get_pg_size(group))]
    torch.distributed.all_gather(out, tensor.contiguous(), group=group)
    return out


LossFunction = Callable[[LossInputs], object]
LOSS_NORMALIZATIONS = ("token", "sequence")


def per_sequence_means(per_token: Tensor, inputs: LossInputs) -> Tensor:
    """Each sequence's weighted mean of ``per_token`` (``[T]``): float32 ``[T]``, one value per
    sequence id (sequences without weight: 0). Device work only. Under context parallelism
    (``inputs.cp_group``) the sums and counts are added over the CP group first (one
    all-reduce, differentiable) and each sequence's mean is kept on one CP rank (0 on the
    others), so that ``.sum()`` adds up to the sum over sequences across the group."""
    ids = inputs.sequence_ids.clamp(min=0).long()
    size = per_token.numel()  # at most one sequence per position: no host read of the count
    sums = torch.zeros(size, dtype=torch.float32, device=per_token.device).index_add(
        0, ids, (per_token * inputs.weights).float())
    counts = torch.zeros(size, dtype=torch.float32, device=per_token.device).index_add(
        0, ids, inputs.weights.float())
    if inputs.cp_group is not None:
        sums, counts = layouts.cp_sequence_totals(sums, counts, inputs.cp_group)
    means = torch.where(counts > 0, sums / counts.clamp(min=1e-12), 0.0)
    if inputs.cp_group is not None:
        means = layouts.owned_by_this_cp_rank(means, inputs.cp_group)
    return means


class PolicyLossStep(LogProbStep):
    """Forward step of `train_step`: log-probs, then ``loss_fn`` of them.

    ``loss_fn(inputs: LossInputs)`` returns the micro-batch's loss, a 0-dim tensor, or
    ``(loss, {name: 0-dim device tensor})`` with metrics. Both are **sums**, as megatron-core
    divides by a count (with ``calculate_per_token_loss``, the policy's default, the global
    count over micro-batches and data-parallel ranks; else each micro-batch's, averaged over
    micro-batches), and `PackedPolicy.train_step` divides the metrics by the same count:

    * ``normalization="token"``: the loss summed over positions (weighted, e.g.
      ``(per_token * inputs.weights).sum()``); the count is the positions of positive weight.
    * ``normalization="sequence"``: the loss summed over sequences of each sequence's mean
      (`per_sequence_means`, then ``.sum()``: GSPO / Dr. GRPO style); the count is the
      sequences with a position of positive weight.
    """

    carries_loss_tensors = True

    def __init__(self, loss_fn: LossFunction, normalization: str = "token", **kwargs):
        super().__init__(**kwargs)
        if normalization not in LOSS_NORMALIZATIONS:
            raise ValueError(f"normalization is wrong: {normalization!r}. Use one of "
                             f"{', '.join(LOSS_NORMALIZATIONS)}.")
        self.loss_fn, self.normalization = loss_fn, normalization

    def run(self, model, mb: PolicyMicroBatch):
        return self.logprobs(model, mb), partial(self.loss, mb)

    def loss(self, mb: PolicyMicroBatch, logprobs: Tensor):
        weights = mb.loss_mask.reshape(-1).float()
        tensors = {name: value.reshape(-1) for name, value in mb.loss_tensors.items()}
        sequence_ids = tensors.pop(SEQUENCE_IDS, None)
        cp_group = parallel_state.get_context_parallel_group() if self.cp_size > 1 else None
        inputs = LossInputs(logprobs.reshape(-1), weights, tensors, sequence_ids, cp_group)
        loss, metrics = self._checked(self.loss_fn(inputs), logprobs.device)
        if self.normalization == "token":
            num_tokens = (weights > 0).sum().to(torch.int)
        else:  # sequences with a weighted position (a scatter: no host read)
            num_tokens = layouts.sequence_count(weights, sequence_ids, cp_group)
        values = [loss.detach().float().view(1), num_tokens.float().view(1)]
        values += [metrics[name].detach().float().view(1) for name in sorted(metrics)]
        return loss, num_tokens, {"loss": torch.cat(values), METRIC_NAMES: sorted(metrics)}

    @staticmethod
    def _checked(result, device) -> tuple:
        """``(loss, metrics)`` of a loss function's result; ValueError naming what is wrong."""
        loss, metrics = result if isinstance(result, tuple) and len(result) == 2 else (result, {})
        if not torch.is_tensor(loss) or loss.numel() != 1 or not loss.is_floating_point():
            shown = (f"shape {tuple(loss.shape)}, dtype {loss.dtype}" if torch.is_tensor(loss)
                     else f"a {type(loss).__name__}")
            raise ValueError(f"loss_fn's result is wrong: {shown}. Return the micro-batch's "
                             f"loss summed over its positions, a 0-dim floating tensor of "
                             f"the log-probs (e.g. (per_token * inputs.weights).sum()), or "
                             f"(loss, {{name: 0-dim tensor}}) with metrics.")
        if not isinstance(metrics, dict):
            raise ValueError(f"loss_fn's metrics are wrong: a {type(metrics).__name__}. "
                             f"Return (loss, {{name: 0-dim device tensor}}).")
        for name, value in metrics.items():
            if (not isinstance(name, str) or not torch.is_tensor(value) or value.numel() != 1
                    or value.device != device):
                shown = (f"shape {tuple(value.shape)} on {value.device}"
                         if torch.is_tensor(value) else f"a {type(value).__name__}")
                raise ValueError(f"loss_fn's metric {name!r} is wrong: {shown}. Give a 0-dim "
                                 f"tensor on {device}, summed over the micro-batch like the "
                                 f"loss (a float would read the device back: a host sync).")
        return loss.reshape(()), metrics
