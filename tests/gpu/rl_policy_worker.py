"""Worker of tests/gpu/test_rl_policy.py: the library API on one GPU, in a process of its own
(one policy per process). Run under torchrun:

    torchrun --nproc-per-node 1 tests/gpu/rl_policy_worker.py --model gpt --out result.json

Builds a small policy with local layer graphs (capacity 8, ladder 4) and writes what the test
asserts, as JSON: for calls of several micro-batch counts (some overflowing), whether graphed
log-probs equal eager ones on the same weights bitwise and the runtime's counters; the swap
test (reference weights swapped in: graphed == eager, != the policy's own; swapped back: the
policy's own again, bitwise); a refit; temperature; train steps (losses, counters); and the
errors of bad input.
"""

import argparse
import json
import os
import sys
from functools import partial

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from megatron.packed_training.rl import PackedPolicy, PackedSequences, PolicyConfig  # noqa: E402
from megatron.packed_training.rl.losses import clipped_policy_loss  # noqa: E402


def config(model: str) -> dict:
    shape = {"gpt": {"num_layers": 4, "ffn_hidden_size": 1024, "swiglu": True,
                     "position_embedding_type": "rope"},
             "hybrid": {"hybrid_layer_pattern": "M*-M*-M-", "mamba_head_dim": 32,
                        "mamba_num_groups": 2, "mamba_state_dim": 64,
                        "position_embedding_type": "none"}}[model]
    return shape | {
        "hidden_size": 256, "num_attention_heads": 8, "group_query_attention": True,
        "num_query_groups": 4, "seq_length": 1024, "max_position_embeddings": 1024,
        "vocab_size": 1024, "normalization": "RMSNorm", "add_bias_linear": False,
        "hidden_dropout": 0.0, "attention_dropout": 0.0, "micro_batch_size": 1,
        "global_batch_size": 4, "train_iters": 20, "lr": 1e-4, "bf16": True, "seed": 1234,
        "calculate_per_token_loss": True, "sft": True, "mock_data": True, "eval_iters": 0,
        "cuda_graph_impl": "local", "cuda_graph_max_packed_seqs": 8,
        "cuda_graph_capacity_ladder": [4], "cuda_graph_warmup_steps": 1}


def micro_batches(count: int, seed: int, vocab: int, with_tensors: bool = False) -> list:
    """``count`` micro-batches of 2 to 12 sequences of 16 to 160 tokens (some overflow
    capacity 8 with the padding segment)."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        sequences = int(torch.randint(2, 13, (1,), generator=generator))
        lengths = torch.randint(16, 161, (sequences,), generator=generator)
        while lengths.sum() - sequences > 1024:
            lengths = lengths[:-1]
        n = int(lengths.sum())
        tokens = torch.randint(1, vocab, (n,), generator=generator).cuda()
        tensors = {}
        weights = None
        if with_tensors:
            weights = (torch.rand(n, generator=generator) > 0.3).float().cuda()
            tensors = {"advantages": torch.randn(n, generator=generator).cuda()}
        out.append(PackedSequences(tokens, lengths=lengths.tolist(), loss_weights=weights,
                                   tensors=tensors))
    return out


def bitwise(a: list, b: list) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=("gpt", "hybrid"), required=True)
    parser.add_argument("--out", required=True)
    options = parser.parse_args()
    policy = PackedPolicy.build(PolicyConfig(config(options.model), model=options.model))
    vocab = policy.vocab_size
    result = {"calls": []}

    # Log-probs: graphed against eager on the same weights, any micro-batch count.
    for call, count in enumerate((3, 1, 6)):
        mbs = micro_batches(count, call, vocab)
        graphed = policy.logprobs(mbs)
        stats = dict(policy.last_stats)
        eager = policy.logprobs(mbs, eager=True)
        again = policy.logprobs(mbs, eager=True)
        result["calls"].append({
            "count": count, "bitwise": bitwise(graphed, eager),
            "max_difference": max((g - e).abs().max().item() for g, e in zip(graphed, eager)),
            "eager_noise": max((a - e).abs().max().item() for a, e in zip(again, eager)),
            "stats": stats, "finite": all(bool(torch.isfinite(g).all()) for g in graphed),
            "first_tokens_zero": all(
                bool(g[torch.tensor([0, *torch.tensor(mb.lengths).cumsum(0)[:-1].tolist()])]
                     .eq(0).all()) for g, mb in zip(graphed, mbs))})

    # The swap test: reference weights (the policy's, perturbed) swapped in place.
    mbs = micro_batches(4, 10, vocab)
    own = policy.logprobs(mbs)
    reference = policy.snapshot_weights()
    generator = torch.Generator(device="cuda").manual_seed(7)
    for tensor in reference.tensors.values():
        tensor.add_(0.05 * torch.randn(tensor.shape, generator=generator, device="cuda",
                                       dtype=torch.float32).to(tensor.dtype))
    with policy.swapped_weights(reference):
        swapped = policy.logprobs(mbs)
        swapped_eager = policy.logprobs(mbs, eager=True)
    back = policy.logprobs(mbs)
    result["swap"] = {"swapped_equals_eager": bitwise(swapped, swapped_eager),
                      "swapped_differs": not bitwise(swapped, own),
                      "back_equals_own": bitwise(back, own)}

    # Temperature: another value replays the same graphs.
    hot = policy.logprobs(mbs, temperature=0.7)
    hot_stats = dict(policy.last_stats)
    result["temperature"] = {"equals_eager": bitwise(hot, policy.logprobs(mbs, temperature=0.7,
                                                                          eager=True)),
                             "captured_again": "forward graphs captured" in hot_stats}

    # Training: old and reference log-probs as per-token tensors, a clipped loss with KL.
    loss_fn = partial(clipped_policy_loss, kl_coef=0.05)
    result["train"] = []
    for step in range(4):
        batch = micro_batches(3 + step % 2, 100 + step, vocab, with_tensors=True)
        old = policy.logprobs(batch)
        with policy.swapped_weights(reference):
            ref = policy.logprobs(batch)
        for mb, o, r in zip(batch, old, ref):
            mb.tensors |= {"old_logprobs": o, "ref_logprobs": r}
        out = policy.train_step(batch, loss_fn)
        result["train"].append({"loss": out.loss.item(), "stats": out.stats,
                                "grad_norm": float(out.grad_norm)})

    # A refit: the reference weights loaded; graphs replay them as eager runs them.
    policy.load_weights(reference)
    result["refit_equals_eager"] = bitwise(policy.logprobs(mbs),
                                           policy.logprobs(mbs, eager=True))

    # Bad input: a NaN advantage, a too long micro-batch.
    errors = {}
    nan = micro_batches(1, 200, vocab, with_tensors=True)
    nan[0].tensors |= {"old_logprobs": torch.zeros_like(nan[0].loss_weights)}
    nan[0].tensors["advantages"][5] = float("nan")
    nan[0].loss_weights[5] = 1.0
    for name, call in (("nan", lambda: policy.train_step(nan, loss_fn)),
                       ("long", lambda: policy.logprobs([PackedSequences(
                           torch.ones(2000, dtype=torch.long, device="cuda"), lengths=[2000])]))):
        try:
            call()
            errors[name] = None
        except ValueError as error:
            errors[name] = str(error)
    result["errors"] = errors
    if torch.distributed.get_rank() == 0:
        with open(options.out, "w") as f:
            json.dump(result, f, indent=1)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
