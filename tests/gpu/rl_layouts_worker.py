"""Worker of tests/gpu/test_rl_layouts.py: one policy at one parallel layout, in a process
group of its own. Run under torchrun:

    torchrun --nproc-per-node 1 tests/gpu/rl_layouts_worker.py --save CKPT --out pp1.pt
    torchrun --nproc-per-node 2 tests/gpu/rl_layouts_worker.py --pp 2 [--vpp 2] --load CKPT \
        --out pp2.pt
    torchrun --nproc-per-node 2 tests/gpu/rl_layouts_worker.py --cp 2 --load CKPT --out cp2.pt

A small GPT (4 layers, local layer graphs) built from the seed and saved (``--save``: the
reference, PP = CP = 1), or loaded from that checkpoint at another layout (``--load``,
weights only: dist_checkpointing reshards them). Every layout then runs the same calls on
the same micro-batches: log-probs (graphed where forward-only graphs run, and eager), a
GRPO step (clipped loss with KL, token normalization), log-probs, a step with a
sequence-normalized loss, log-probs. Rank 0 writes the results (``torch.save``: CPU
tensors and numbers) and whether every rank returned bitwise the same ones.
"""

import argparse
import os
import sys
from functools import partial

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from megatron.packed_training.rl import PackedPolicy, PackedSequences, PolicyConfig  # noqa: E402
from megatron.packed_training.rl.losses import clipped_policy_loss  # noqa: E402
from megatron.packed_training.rl.steps import LossInputs, per_sequence_means  # noqa: E402

ROW = 1024


def config(options) -> dict:
    layout = {"pipeline_model_parallel_size": options.pp,
              "context_parallel_size": options.cp}
    if options.vpp > 1:
        layout["num_virtual_stages_per_pipeline_rank"] = options.vpp
    if options.save:
        layout |= {"save": options.save, "save_interval": 1000}
    if options.load:
        layout |= {"load": options.load, "finetune": True}
    return layout | {
        "num_layers": 4, "ffn_hidden_size": 1024, "swiglu": True,
        "position_embedding_type": "rope", "hidden_size": 256, "num_attention_heads": 8,
        "group_query_attention": True, "num_query_groups": 4, "seq_length": ROW,
        "max_position_embeddings": ROW, "vocab_size": 1024, "normalization": "RMSNorm",
        "add_bias_linear": False, "hidden_dropout": 0.0, "attention_dropout": 0.0,
        "micro_batch_size": 1, "global_batch_size": 4, "train_iters": 20, "lr": 1e-3,
        "bf16": True, "seed": 1234, "calculate_per_token_loss": True, "sft": True,
        "mock_data": True, "eval_iters": 0, "cuda_graph_impl": "local",
        "cuda_graph_max_packed_seqs": 16, "cuda_graph_warmup_steps": 1}


def micro_batches(count: int, seed: int, vocab: int) -> list:
    """``count`` micro-batches of 2 to 10 sequences of 16 to 160 tokens that fit a row at
    CP 1 and at CP 2 (each sequence's positions padded to a multiple of 4), with loss
    weights, advantages and old and reference log-probs drawn on the host: the same on
    every rank and layout."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        lengths = torch.randint(16, 161, (int(torch.randint(2, 11, (1,), generator=generator)),),
                                generator=generator)
        while (-(-(lengths - 1) // 4) * 4).sum() > ROW:
            lengths = lengths[:-1]
        n = int(lengths.sum())
        draw = partial(torch.randn, n, generator=generator)
        tensors = {"advantages": draw(), "old_logprobs": -6.9 + 0.3 * draw(),
                   "ref_logprobs": -6.9 + 0.3 * draw()}
        out.append(PackedSequences(
            torch.randint(1, vocab, (n,), generator=generator).cuda(), lengths=lengths.tolist(),
            loss_weights=(torch.rand(n, generator=generator) > 0.3).float().cuda(),
            tensors={name: value.cuda() for name, value in tensors.items()}))
    return out


def sequence_loss(inputs: LossInputs):
    """Each sequence's mean of -advantage x log-prob, summed over sequences, and a metric."""
    per_token = -inputs.logprobs * inputs["advantages"]
    return per_sequence_means(per_token, inputs).sum(), {
        "advantage_sum": (inputs["advantages"] * inputs.weights).sum()}


def step(policy, mbs, loss_fn, normalization) -> dict:
    result = policy.train_step(mbs, loss_fn, normalization=normalization)
    return {"loss": result.loss.float().cpu(), "num_tokens": result.num_tokens.float().cpu(),
            "grad_norm": float(result.grad_norm), "stats": dict(result.stats),
            "metrics": {name: value.float().cpu() for name, value in result.metrics.items()}}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--vpp", type=int, default=1)
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--save")
    parser.add_argument("--load")
    parser.add_argument("--out", required=True)
    options = parser.parse_args()
    policy = PackedPolicy.build(PolicyConfig(config(options)))
    if options.save:
        from megatron.training.checkpointing import save_checkpoint

        save_checkpoint(1, policy.model, None, None, 0)
        torch.distributed.barrier()
        # The optimizer's main parameters from the model's bf16 weights, as a load sets them.
        policy.load_weights(policy.snapshot_weights())
    mbs = micro_batches(3, 0, policy.vocab_size)
    result = {"segment_multiple": policy.segment_multiple}
    result["logprobs"] = policy.logprobs(mbs)
    result["logprobs_stats"] = dict(policy.last_stats)
    result["eager"] = policy.logprobs(mbs, eager=True)
    grpo = partial(clipped_policy_loss, clip_low=0.2, clip_high=0.28, kl_coef=0.05)
    result["steps"] = [step(policy, mbs, grpo, "token")]
    result["after_token_step"] = policy.logprobs(mbs)
    result["steps"].append(step(policy, mbs, sequence_loss, "sequence"))
    result["after_sequence_step"] = policy.logprobs(mbs)

    # Every rank must hold the same results: compared bitwise through one all-gather.
    flat = torch.cat([t.reshape(-1).float() for key in ("logprobs", "eager", "after_token_step",
                                                        "after_sequence_step")
                      for t in result[key]]
                     + [torch.stack([s["loss"], s["num_tokens"]]).cuda()
                        for s in result["steps"]])
    world = torch.distributed.get_world_size()
    gathered = torch.empty(world * flat.numel(), dtype=flat.dtype, device=flat.device)
    torch.distributed.all_gather_into_tensor(gathered, flat)
    result["ranks_agree"] = bool(all(torch.equal(part, flat)
                                     for part in gathered.view(world, -1)))
    for key in ("logprobs", "eager", "after_token_step", "after_sequence_step"):
        result[key] = [t.cpu() for t in result[key]]
    if torch.distributed.get_rank() == 0:
        torch.save(result, options.out)
    torch.distributed.barrier()
    if options.cp == 1:
        # At CP > 1 the forward-only graphs captured TE's context-parallel exchanges, and
        # destroying their NCCL groups hangs (pytorch/pytorch#115388; docs/rl.md, "Layouts").
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
