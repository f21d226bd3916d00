"""Worker of tests/gpu/test_rl_offload.py: one small policy in a process of its own (one
policy per process), trained through an offload and onload or without one. Run under
torchrun, with torch_memory_saver's preload library for the offloadable modes:

    LD_PRELOAD=<torch_memory_saver_hook_mode_preload...so> torchrun --nproc-per-node 1 \\
        tests/gpu/rl_offload_worker.py --model gpt --graphs layer --mode offload --out r.json

Modes: ``offload`` (PolicyConfig(offloadable=True); after two steps: offload, fill more than
90% of the free GPU memory with a pattern in another tensor, onload refused while it is held,
free it, onload), ``resident`` (offloadable, never offloaded: the reference) and ``plain``
(built without offloadable). Every mode runs the same calls: per step, old log-probs
(forward-only graphs), then a train step with the clipped loss (warm-up, capture, replays);
log-probs of a fixed set before and after the point where ``offload`` leaves the GPU; the
final weights. Writes JSON: exact losses and grad norms (float.hex), SHA-256 of log-probs and
weights, the runtime's counters, and, for ``offload``, the two `MemoryMove` records, what was
refused while offloaded, and where a graph captured inside the policy's memory allocates.
"""

import argparse
import dataclasses
import hashlib
import json
import os
import sys
from functools import partial

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from megatron.packed_training.rl import (  # noqa: E402
    PackedPolicy,
    PackedSequences,
    PolicyConfig,
    policy_weights,
)
from megatron.packed_training.rl.losses import clipped_policy_loss  # noqa: E402

# Full-iteration graphs cannot hold DDP's NaN check (it reads gradient norms on the host).
GRAPHS = {"layer": {"cuda_graph_impl": "local"},
          "full": {"cuda_graph_impl": "full_iteration", "check_for_nan_in_loss_and_grad": False}}


def config(model: str, graphs: str) -> dict:
    shape = {"gpt": {"num_layers": 4, "ffn_hidden_size": 1024, "swiglu": True,
                     "position_embedding_type": "rope"},
             "hybrid": {"hybrid_layer_pattern": "M*-M*-", "mamba_head_dim": 32,
                        "mamba_num_groups": 2, "mamba_state_dim": 64,
                        "position_embedding_type": "none"}}[model]
    return shape | GRAPHS[graphs] | {
        "hidden_size": 256, "num_attention_heads": 8, "group_query_attention": True,
        "num_query_groups": 4, "seq_length": 1024, "max_position_embeddings": 1024,
        "vocab_size": 1024, "normalization": "RMSNorm", "add_bias_linear": False,
        "hidden_dropout": 0.0, "attention_dropout": 0.0, "micro_batch_size": 1,
        "global_batch_size": 4, "train_iters": 20, "lr": 1e-3, "bf16": True, "seed": 1234,
        "calculate_per_token_loss": True, "sft": True, "mock_data": True, "eval_iters": 0,
        "cuda_graph_max_packed_seqs": 8, "cuda_graph_warmup_steps": 1}


def micro_batches(seed: int, vocab: int, count: int = 4) -> list:
    """``count`` micro-batches of 2 to 6 sequences of 16 to 160 tokens: every one fits
    capacity 8 (the padding tail is one more segment), so every step past the warm-up is
    graphed; ``count`` 4 is the full-iteration graph's micro-batch count."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        lengths = torch.randint(16, 161, (int(torch.randint(2, 7, (1,), generator=generator)),),
                                generator=generator)
        n = int(lengths.sum())
        out.append(PackedSequences(
            torch.randint(1, vocab, (n,), generator=generator).cuda(),
            lengths=lengths.tolist(),
            loss_weights=(torch.rand(n, generator=generator) > 0.3).float().cuda(),
            tensors={"advantages": torch.randn(n, generator=generator).cuda()}))
    return out


def digest(tensors) -> str:
    h = hashlib.sha256()
    for tensor in tensors:
        h.update(tensor.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def exact(value):
    return None if value is None else float(value).hex()


def train(policy, step: int, loss_fn) -> dict:
    batch = micro_batches(100 + step, policy.vocab_size)
    old = policy.logprobs(batch)
    logprob_stats = dict(policy.last_stats)
    for mb, lp in zip(batch, old):
        mb.tensors["old_logprobs"] = lp
    result = policy.train_step(batch, loss_fn)
    return {"loss": exact(result.loss), "grad_norm": exact(result.grad_norm),
            "old_logprobs": digest(old), "stats": result.stats, "logprob_stats": logprob_stats}


def capture_routing(policy) -> dict:
    """Where allocations land inside the policy's memory: a tensor of a graph captured there
    comes from the graph's own pool (not the region's, whose blocks later calls reuse), and
    an eager tensor from the region's pool (not the default one)."""
    with policy.memory.resident("probe"):
        x = torch.ones(1 << 20, device="cuda")
        eager = x * 3
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = x * 2 + 1
    pools = {}
    for segment in torch.cuda.memory_snapshot():
        start, size = segment["address"], segment["total_size"]
        for name, tensor in (("graph", out), ("eager", eager)):
            if start <= tensor.data_ptr() < start + size:
                pools[name] = tuple(segment["segment_pool_id"])
    return {"graph_in_its_pool": pools.get("graph") == tuple(graph.pool()),
            "eager_in_a_pool_of_its_own": pools.get("eager") not in (None, (0, 0)),
            "pools": {k: list(v) for k, v in pools.items()}}


def leave_and_return(policy, probe: list) -> dict:
    """Offload; what is refused meanwhile; more than 90% of the free memory filled by
    another tensor; onload refused while it is held; onload."""
    gone = policy.offload()
    refused = {}
    for name, call in (("logprobs", lambda: policy.logprobs(probe)),
                       ("offload", policy.offload)):
        try:
            call()
            refused[name] = None
        except RuntimeError as error:
            refused[name] = str(error)
    free, total = torch.cuda.mem_get_info()
    held = free - policy.memory.paused_bytes // 2  # onload then has half of what it needs
    stress = torch.empty(held, dtype=torch.uint8, device="cuda").fill_(0x5A)
    torch.cuda.synchronize()
    try:
        policy.onload()
        refused["onload_short"] = None
    except RuntimeError as error:
        refused["onload_short"] = str(error)
    del stress
    torch.cuda.empty_cache()
    back = policy.onload()
    try:
        policy.onload()
        refused["onload_twice"] = None
    except RuntimeError as error:
        refused["onload_twice"] = str(error)
    return {"offload": dataclasses.asdict(gone), "onload": dataclasses.asdict(back),
            "free_when_offloaded_mib": round(free / 2**20, 1),
            "held_mib": round(held / 2**20, 1), "total_mib": round(total / 2**20, 1),
            "paused_mib": round(policy.memory.paused_bytes / 2**20, 1), "refused": refused}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=("gpt", "hybrid"), required=True)
    parser.add_argument("--graphs", choices=tuple(GRAPHS), required=True)
    parser.add_argument("--mode", choices=("offload", "resident", "plain"), required=True)
    parser.add_argument("--out", required=True)
    options = parser.parse_args()
    policy = PackedPolicy.build(PolicyConfig(config(options.model, options.graphs),
                                             model=options.model,
                                             offloadable=options.mode != "plain"))
    loss_fn = partial(clipped_policy_loss, clip_low=0.2, clip_high=0.28)
    probe = micro_batches(7, policy.vocab_size, count=3)
    result = {"steps": [train(policy, step, loss_fn) for step in (1, 2)]}
    before = policy.logprobs(probe)
    result["logprobs_before"] = digest(before)
    if options.mode == "offload":
        result["memory"] = leave_and_return(policy, probe)
    result["logprobs_after"] = digest(policy.logprobs(probe))
    result["logprobs_after_stats"] = dict(policy.last_stats)
    result["steps"] += [train(policy, step, loss_fn) for step in (3, 4)]
    weights = policy_weights(policy.model)
    result["weights"] = {name: digest([tensor]) for name, tensor in weights.items()}
    if options.mode == "offload":
        result["routing"] = capture_routing(policy)
    if torch.distributed.get_rank() == 0:
        with open(options.out, "w") as f:
            json.dump(result, f, indent=1)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
