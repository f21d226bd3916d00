"""Loss functions for `PackedPolicy.train_step`: each maps `LossInputs` to the micro-batch's
loss summed over its weighted positions (the step divides by the token count).

They are plain functions of device tensors; under full-iteration graphs they run inside the
iteration graph, on the static per-token buffers. Bind settings with ``functools.partial``
once and pass the same object every step (a full-iteration graph keeps the loss function it
was captured with).
"""

import torch
from torch import Tensor

from megatron.packed_training.rl.steps import LossInputs


def negative_log_likelihood(inputs: LossInputs) -> Tensor:
    """Supervised fine-tuning: ``-sum(weights * logprobs)``."""
    return -(inputs.logprobs * inputs.weights).sum()


def clipped_policy_loss(inputs: LossInputs, *, clip_low: float = 0.2, clip_high: float = 0.2,
                        kl_coef: float = 0.0, advantages: str = "advantages",
                        old_logprobs: str = "old_logprobs",
                        ref_logprobs: str = "ref_logprobs") -> Tensor:
    """The PPO / GRPO clipped surrogate with an optional KL penalty to a reference policy.

    Per position, with ``r = exp(logprobs - old_logprobs)`` and advantage ``A``:
    ``-min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)``, plus ``kl_coef`` times the
    k3 estimate of KL(policy || reference), ``exp(ref - logprobs) - (ref - logprobs) - 1``
    (non-negative, unbiased). Summed over positions with their weights. Positions of weight
    0 (padding, prompts) enter no exponential, so they cannot turn the sum into inf or NaN.
    Reads the per-token tensors named ``advantages``, ``old_logprobs`` and, with
    ``kl_coef``, ``ref_logprobs``.
    """
    used = inputs.weights > 0
    log_ratio = torch.where(used, inputs.logprobs - inputs[old_logprobs], 0.0)
    ratio = torch.exp(log_ratio)
    advantage = inputs[advantages]
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = -torch.minimum(ratio * advantage, clipped * advantage)
    if kl_coef:
        to_reference = torch.where(used, inputs[ref_logprobs] - inputs.logprobs, 0.0)
        per_token = per_token + kl_coef * (torch.exp(to_reference) - to_reference - 1.0)
    return (per_token * inputs.weights).sum()
