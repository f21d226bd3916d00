"""The forward steps of the library API: per-token log-probs, and a loss of them.

Both are the training forward step (`PackedForwardStep`: stage on the device, model call)
with what a policy-gradient step adds: the micro-batch also carries its per-token loss
tensors and ``1 / temperature`` as tensors (`PolicyMicroBatch`), so that under graphs they
are graph inputs in static buffers (a forward-only graph's, or a full-iteration graph's,
where the loss runs inside the graph); the model is called without labels, and the
log-probs of each position's target are taken from its logits (`token_logprobs`).

* `LogProbStep`: forward only. Its output, float32 ``[1, S]`` log-probs, is what a
  forward-only graph replays; its loss function copies it out for the caller.
* `PolicyLossStep`: training. Its loss function calls the caller's ``loss_fn`` with
  `LossInputs` and returns megatron-core's ``(loss, num_tokens, report)``.

The graph runtime drives them as it drives the training step (runtime.py): ``stage``,
``run`` under the micro-batch's plan, ``graph_layout`` for forward-only captures.
"""

import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import Callable, Dict, Optional

import torch
from torch import Tensor

from megatron.core import parallel_state, tensor_parallel

from megatron.packed_training.packed_step import PackedForwardStep, PackedMicroBatch
from megatron.packed_training.rl import layouts
from megatron.packed_training.rl.batches import SEQUENCE_IDS

INV_TEMPERATURE = "inv_temperature"  # the collated micro-batch's host key (a float)
LOGPROBS = "logprobs"  # the report key of a LogProbStep micro-batch
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
    micro-batch (0, 1, ...; -1 on padding), float32, for per-sequence reductions.
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
    """Forward step of per-token log-probs (forward only; see module doc).

    Under static context parallelism each CP rank stages and runs its share of the
    positions (its per-token loss tensors too); the policy gathers the log-probs back
    (`layouts.gather_cp_rows`). Refuses dynamic context parallelism."""

    # Whether the staged micro-batch carries the per-token loss tensors (a log-prob pass
    # needs none: its forward-only graphs take the same inputs whatever the call carries).
    carries_loss_tensors = False

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

    def logprobs(self, model, mb: PolicyMicroBatch) -> Tensor:
        """The model on ``mb``: float32 ``[1, T]`` log-probs of each position's target; off
        the last pipeline stage, the chunk's hidden states for the next stage."""
        logits = model(mb.tokens, mb.position_ids, None, labels=None,
                       packed_seq_params=mb.params)
        if not layouts.is_last_stage_chunk(model):
            return logits
        return token_logprobs(logits, mb.labels, mb.inv_temperature)

    def run(self, model, mb: PolicyMicroBatch):
        return self.logprobs(model, mb), report_logprobs


def report_logprobs(output: Tensor):
    """megatron-core's loss function of a forward-only micro-batch: no loss, and the
    log-probs copied out of the (possibly graph-owned) output for the caller."""
    zero = torch.zeros((), dtype=torch.float32, device=output.device)
    one = torch.ones((), dtype=torch.int, device=output.device)
    return zero, one, {LOGPROBS: output.detach().reshape(-1).clone()}


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
