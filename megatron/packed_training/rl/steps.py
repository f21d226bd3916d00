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

from megatron.core import tensor_parallel

from megatron.packed_training.packed_step import PackedForwardStep, PackedMicroBatch

INV_TEMPERATURE = "inv_temperature"  # the collated micro-batch's host key (a float)
LOGPROBS = "logprobs"  # the report key of a LogProbStep micro-batch


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
    the packed row (``T``: micro_batch_size x seq_length), all float32 on the device.

    ``logprobs``: log-probability of each position's target under the policy at the call's
    temperature (differentiable; padding positions hold the log-prob of a pad token: their
    weight is 0). ``weights``: the loss weights (0 on padding and on a sequence's first
    token). ``tensors``: the micro-batch's per-token tensors by name (``advantages``,
    ``old_logprobs``, ...).
    """

    logprobs: Tensor
    weights: Tensor
    tensors: Dict[str, Tensor]

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

    Refuses context parallelism: each CP rank would hold a share of the positions, which the
    library does not gather back."""

    # Whether the staged micro-batch carries the per-token loss tensors (a log-prob pass
    # needs none: its forward-only graphs take the same inputs whatever the call carries).
    carries_loss_tensors = False

    def stage(self, batch: dict, capacity: Optional[int]) -> PolicyMicroBatch:
        if self.cp_size > 1 or "cp_turn" in batch:
            raise ValueError("context parallelism is wrong for the library API: the log-probs "
                             "of a micro-batch would be split over the CP ranks. Use "
                             "context_parallel_size 1.")
        staged = super().stage(batch, capacity)
        device = staged.tokens.device
        tensors = {}
        if self.carries_loss_tensors:
            tensors = {name: value.to(device, non_blocking=True).reshape(1, -1)
                       for name, value in batch.get("loss_tensors", {}).items()}
        inv = torch.tensor([batch.get(INV_TEMPERATURE, 1.0)], dtype=torch.float32)
        return PolicyMicroBatch(**{f.name: getattr(staged, f.name)
                                   for f in dataclasses.fields(PackedMicroBatch)},
                                inv_temperature=inv.to(device, non_blocking=True),
                                loss_tensors=tensors)

    def logprobs(self, model, mb: PolicyMicroBatch) -> Tensor:
        """The model on ``mb``: float32 ``[1, T]`` log-probs of each position's target."""
        logits = model(mb.tokens, mb.position_ids, None, labels=None,
                       packed_seq_params=mb.params)
        return token_logprobs(logits, mb.labels, mb.inv_temperature)

    def run(self, model, mb: PolicyMicroBatch):
        return self.logprobs(model, mb), report_logprobs


def report_logprobs(output: Tensor):
    """megatron-core's loss function of a forward-only micro-batch: no loss, and the
    log-probs copied out of the (possibly graph-owned) output for the caller."""
    zero = torch.zeros((), dtype=torch.float32, device=output.device)
    one = torch.ones((), dtype=torch.int, device=output.device)
    return zero, one, {LOGPROBS: output.detach().reshape(-1).clone()}


LossFunction = Callable[[LossInputs], Tensor]


class PolicyLossStep(LogProbStep):
    """Forward step of `train_step`: log-probs, then ``loss_fn`` of them.

    ``loss_fn(inputs: LossInputs) -> Tensor``: the micro-batch's loss, a 0-dim tensor, the
    **sum** over its positions (weighted, e.g. ``(per_token * inputs.weights).sum()``).
    megatron-core divides by the token count (with ``calculate_per_token_loss``, the global
    count over micro-batches and data-parallel ranks; else each micro-batch's, averaged over
    micro-batches). The token count is the number of positions of positive weight.
    """

    carries_loss_tensors = True

    def __init__(self, loss_fn: LossFunction, **kwargs):
        super().__init__(**kwargs)
        self.loss_fn = loss_fn

    def run(self, model, mb: PolicyMicroBatch):
        return self.logprobs(model, mb), partial(self.loss, mb)

    def loss(self, mb: PolicyMicroBatch, logprobs: Tensor):
        weights = mb.loss_mask.reshape(-1).float()
        inputs = LossInputs(logprobs.reshape(-1), weights,
                            {name: value.reshape(-1) for name, value in mb.loss_tensors.items()})
        loss = self.loss_fn(inputs)
        if not torch.is_tensor(loss) or loss.numel() != 1 or not loss.is_floating_point():
            shown = (f"shape {tuple(loss.shape)}, dtype {loss.dtype}" if torch.is_tensor(loss)
                     else f"a {type(loss).__name__}")
            raise ValueError(f"loss_fn's result is wrong: {shown}. Return the micro-batch's "
                             f"loss summed over its positions, a 0-dim floating tensor of "
                             f"the log-probs (e.g. (per_token * inputs.weights).sum()).")
        loss = loss.reshape(())
        num_tokens = (weights > 0).sum().to(torch.int)
        report = torch.cat([loss.detach().float().view(1), num_tokens.float().view(1)])
        return loss, num_tokens, {"loss": report}
