"""Worker of tests/gpu/test_fp8_refit.py: an FP8 policy's quantized weights follow every weight
change, one policy per process. Run under torchrun:

    torchrun --nproc-per-node 1 tests/gpu/fp8_refit_worker.py --recipe tensorwise --out OUT.json

The small GPT of rl_policy_worker.py with ``--fp8-format e4m3`` and TE attention, forward-only
graphs captured at the first log-prob call. Then, each time comparing graphed log-probs with
eager ones (eager re-quantizes at every call's first micro-batch) and with the log-probs
before the change: a refit (`load_weights` of perturbed weights), a reference swap
(`swapped_weights` to the original weights, and out of it), and a GRPO-style training step.
A graph serving weights quantized before a change would give the old log-probs.
"""

import argparse
import json
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from megatron.packed_training.rl import PackedPolicy, PolicyConfig  # noqa: E402
from megatron.packed_training.rl.losses import negative_log_likelihood  # noqa: E402
from tests.gpu.rl_policy_worker import config, micro_batches  # noqa: E402


def compare(policy, mbs, before=None) -> dict:
    """Graphed against eager log-probs now, and how far both moved from ``before``."""
    graphed = policy.logprobs(mbs)
    stats = dict(policy.last_stats)
    eager = policy.logprobs(mbs, eager=True)
    row = {"max_graphed_vs_eager": max((g - e).abs().max().item()
                                       for g, e in zip(graphed, eager)),
           "forward_graphs": stats.get("forward graphs", 0),
           "finite": all(bool(torch.isfinite(g).all()) for g in graphed)}
    if before is not None:
        row["moved_eager"] = max((e - b).abs().max().item() for e, b in zip(eager, before))
        row["moved_graphed"] = max((g - b).abs().max().item() for g, b in zip(graphed, before))
    return row, eager


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", default="tensorwise")
    parser.add_argument("--out", required=True)
    options = parser.parse_args()
    settings = config("gpt") | {"fp8": "e4m3", "fp8_recipe": options.recipe, "lr": 1e-3,
                                "attention_backend": "auto", "te_rng_tracker": True}
    policy = PackedPolicy.build(PolicyConfig(settings, model="gpt"))
    mbs = micro_batches(3, 0, policy.vocab_size)
    result = {}
    result["start"], start = compare(policy, mbs)

    original = policy.snapshot_weights()
    generator = torch.Generator(device="cuda").manual_seed(7)
    perturbed = {name: value + 0.02 * torch.randn(value.shape, device=value.device,
                                                   dtype=value.dtype, generator=generator)
                 for name, value in original.tensors.items()}
    policy.load_weights(perturbed)
    result["after_refit"], refit = compare(policy, mbs, before=start)
    with policy.swapped_weights(original):
        result["inside_swap"], _ = compare(policy, mbs, before=refit)
        result["inside_swap_vs_start"] = max(
            (e - s).abs().max().item()
            for e, s in zip(policy.logprobs(mbs, eager=True), start))
    result["after_swap"], _ = compare(policy, mbs, before=refit)
    train = micro_batches(2, 11, policy.vocab_size, with_tensors=True)
    for _ in range(2):
        policy.train_step(train, negative_log_likelihood)
    result["after_steps"], _ = compare(policy, mbs, before=refit)
    with open(options.out, "w") as f:
        json.dump(result, f, indent=1)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
