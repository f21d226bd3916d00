"""Worker of tests/gpu/test_rl_checkpoint.py: `PackedPolicy.save`, a resume from it, and
`weights_from_checkpoint`, one policy per process. Run under torchrun:

    torchrun --nproc-per-node 1 tests/gpu/rl_checkpoint_worker.py --phase straight \
        --checkpoint CKPT --out DIR
    torchrun --nproc-per-node 1 tests/gpu/rl_checkpoint_worker.py --phase resume \
        --checkpoint CKPT --out DIR

``straight``: the small GPT policy of rl_policy_worker.py trains steps 1 and 2, saves to
CKPT, trains step 3; then reads CKPT's weights (on the GPU and on the host) and swaps them in.
``resume``: a policy built with ``load: CKPT`` trains step 3. Both write DIR/<phase>.json
(losses, iterations, the log-prob checks) and DIR/<phase>.pt (the weights after step 3, the
optimizer state at the checkpoint: after the save, or after the load). Training runs in the
graph runtime's eager warm-up in both processes (a fresh process warms up again: an eager
step 3 is what both compute); log-probs replay forward-only graphs.
"""

import argparse
import json
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from megatron.packed_training.rl import PackedPolicy, PolicyConfig, policy_weights  # noqa: E402
from megatron.packed_training.rl.losses import negative_log_likelihood  # noqa: E402
from tests.gpu.rl_policy_worker import bitwise, config, micro_batches  # noqa: E402

STEPS = 3
SAVED_AFTER = 2


def batch(step: int, vocab: int) -> list:
    """Step ``step``'s micro-batches (with loss weights), the same in every process."""
    return micro_batches(2, 300 + step, vocab, with_tensors=True)


def host_state(value):
    """A nested optimizer state dict with its tensors on the host."""
    if torch.is_tensor(value):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {key: host_state(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [host_state(item) for item in value]
    return value


def host_weights(policy) -> dict:
    return {name: value.detach().cpu() for name, value in policy_weights(policy.model).items()}


def straight(policy, loss_fn, checkpoint: str, vocab: int) -> tuple:
    from megatron.training.global_vars import get_args

    result = {"iteration_at_build": policy.iteration, "losses": []}
    probe = micro_batches(3, 500, vocab)
    saved = {}
    for step in range(1, STEPS + 1):
        result["losses"].append(policy.train_step(batch(step, vocab), loss_fn).loss.item())
        if step == SAVED_AFTER:
            before = get_args().save
            policy.save(checkpoint)
            result["args_save_restored"] = get_args().save == before
            saved["optimizer"] = host_state(policy.optimizer.state_dict())
            at_save = policy.logprobs(probe)
            at_save_weights = host_weights(policy)
    result["iteration"] = policy.iteration
    saved["weights"] = host_weights(policy)
    after = policy.logprobs(probe)
    store = policy.weights_from_checkpoint(checkpoint)
    host = policy.weights_from_checkpoint(checkpoint, device=torch.device("cpu"))
    with policy.swapped_weights(store):
        swapped = policy.logprobs(probe)
        result["swapped_stats"] = dict(policy.last_stats)
    with policy.swapped_weights(host):
        swapped_host = policy.logprobs(probe)
    result["reference"] = {
        "store_is_the_saved_weights": bitwise(
            [store.tensors[name].cpu() for name in at_save_weights],
            list(at_save_weights.values())),
        "host_store_on_the_host": {t.device.type for t in host.tensors.values()} == {"cpu"},
        "swapped_equals_at_save": bitwise(swapped, at_save),
        "host_swapped_equals_at_save": bitwise(swapped_host, at_save),
        "trained_on_differs": not bitwise(after, at_save),
        "back_equals_own": bitwise(policy.logprobs(probe), after)}
    # The iteration argument numbers the checkpoint.
    policy.save(checkpoint + "_numbered", iteration=10)
    with open(os.path.join(checkpoint, "latest_checkpointed_iteration.txt")) as f:
        result["tracker"] = f.read().strip()
    with open(os.path.join(checkpoint + "_numbered", "latest_checkpointed_iteration.txt")) as f:
        result["numbered_tracker"] = f.read().strip()
    return result, saved


def resume(policy, loss_fn, vocab: int) -> tuple:
    result = {"iteration_at_build": policy.iteration}
    saved = {"optimizer": host_state(policy.optimizer.state_dict())}
    result["losses"] = [policy.train_step(batch(step, vocab), loss_fn).loss.item()
                        for step in range(SAVED_AFTER + 1, STEPS + 1)]
    result["iteration"] = policy.iteration
    saved["weights"] = host_weights(policy)
    return result, saved


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", choices=("straight", "resume"), required=True)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--out", required=True)
    options = parser.parse_args()
    # Warm-up past the last step: every process trains eagerly (module doc).
    training = config("gpt") | {"cuda_graph_warmup_steps": STEPS + 1}
    if options.phase == "resume":
        training["load"] = options.checkpoint
    policy = PackedPolicy.build(PolicyConfig(training))
    loss_fn = negative_log_likelihood
    if options.phase == "straight":
        result, saved = straight(policy, loss_fn, options.checkpoint, policy.vocab_size)
    else:
        result, saved = resume(policy, loss_fn, policy.vocab_size)
    if torch.distributed.get_rank() == 0:
        torch.save(saved, os.path.join(options.out, f"{options.phase}.pt"))
        with open(os.path.join(options.out, f"{options.phase}.json"), "w") as f:
            json.dump(result, f, indent=1)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
