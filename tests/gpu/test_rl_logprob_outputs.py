"""`PackedPolicy.logprobs` with entropy and top-k on the GPU (docs/rl.md "logprobs").

One policy per process: the test runs this file under torchrun as its worker (tensor
parallel size 1, and 2 on two GPUs), a small GPT with local layer graphs (capacity 8, ladder
4), the head in vocabulary chunks of 384 (1024 ids: several chunks, the last one short). The
worker writes, as JSON: graphed against eager on the same weights (log-probs, entropy, top-k
values and ids; bitwise); the plain call's log-probs against the extras call's (bitwise: the
same expression); entropy, log-probs and top-k against torch on the model's whole logits
(gathered over the tensor-parallel ranks), within float32 rounding; that each set of extras
captured forward-only graphs of its own; and the runtime's counters.

    torchrun --nproc-per-node 1 tests/gpu/test_rl_logprob_outputs.py --out result.json
"""

import argparse
import json
import os
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join("tests", "gpu", "test_rl_logprob_outputs.py")
TOP_K, CHUNK, TOLERANCE = 16, 384, 2e-5


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.gpus(2))])
def test_entropy_and_top_k_graphed_equal_eager_and_torch(tmp_path, tp):
    from tests.gpu.launch import assert_succeeded, torchrun

    out = str(tmp_path / "result.json")
    proc = torchrun(WORKER, ["--out", out, "--tp", str(tp)], nproc=tp)
    with open(str(tmp_path / "worker.log"), "w") as f:
        f.write(proc.stdout + proc.stderr)
    assert_succeeded(WORKER, proc.returncode, proc.stdout + proc.stderr)
    with open(out) as f:
        result = json.load(f)
    print(json.dumps(result, indent=1)[:3000])
    assert result["extras_captured"] == 2 and result["plain_captured"] == 2  # capacities 4, 8
    assert result["stats"]["forward graphs"] + result["stats"].get("eager overflow", 0) == 4
    assert "eager eval" not in result["stats"]
    assert result["graphed_equals_eager"], result
    assert result["plain_equals_extras"], result
    for name in ("logprobs", "entropy", "topk_logprobs", "topk_at_ids"):
        assert result["max_difference"][name] <= TOLERANCE, (name, result)
    # Values equal torch.topk's and each id points at its value, ids distinct: the top-k up
    # to the order of tied bf16 logits (ids_equal_fraction, printed: how many ids torch's are).
    assert result["ids_unique"] and result["first_tokens_zero"]


# -- the worker ----------------------------------------------------------------------------------

def config(tp: int) -> dict:
    return {"num_layers": 2, "ffn_hidden_size": 1024, "swiglu": True,
            "position_embedding_type": "rope", "hidden_size": 256, "num_attention_heads": 8,
            "group_query_attention": True, "num_query_groups": 4, "seq_length": 1024,
            "max_position_embeddings": 1024, "vocab_size": 1024, "normalization": "RMSNorm",
            "add_bias_linear": False, "hidden_dropout": 0.0, "attention_dropout": 0.0,
            "micro_batch_size": 1, "global_batch_size": 4, "train_iters": 20, "lr": 1e-4,
            "bf16": True, "seed": 1234, "calculate_per_token_loss": True, "sft": True,
            "mock_data": True, "eval_iters": 0, "tensor_model_parallel_size": tp,
            "cuda_graph_impl": "local", "cuda_graph_max_packed_seqs": 8,
            "cuda_graph_capacity_ladder": [4], "cuda_graph_warmup_steps": 1}


def micro_batches(count: int, vocab: int) -> list:
    """``count`` micro-batches of 2 to 12 sequences (some overflow capacity 8), the same on
    every rank (tensor parallel ranks run one micro-batch together)."""
    from megatron.packed_training.rl import PackedSequences

    generator = torch.Generator().manual_seed(5)
    out = []
    for _ in range(count):
        sequences = int(torch.randint(2, 13, (1,), generator=generator))
        lengths = torch.randint(16, 161, (sequences,), generator=generator)
        while lengths.sum() - sequences > 1024:
            lengths = lengths[:-1]
        tokens = torch.randint(1, vocab, (int(lengths.sum()),), generator=generator)
        out.append(PackedSequences(tokens.cuda(), lengths=lengths.tolist()))
    return out


def whole_logits_reference(policy, mbs, temperature: float) -> list:
    """torch on the model's whole logits (eval mode, gathered over TP), token aligned:
    ``(log_softmax [N, V], label log-probs [N], entropy [N])`` per micro-batch."""
    from megatron.core import tensor_parallel

    from megatron.packed_graphs.forward_graphs import eval_mode

    step = policy._head_step(False, 0)
    out = []
    with torch.no_grad(), eval_mode(policy.model):
        for batch in policy._prepare(mbs, temperature):
            staged = step.stage(batch, None)
            logits = step.logits(policy.model[0], staged)
            whole = tensor_parallel.gather_from_tensor_model_parallel_region(logits)[0]
            log_p = torch.log_softmax(whole.float() * (1.0 / temperature), dim=-1)
            layout = batch["layout"]
            rows = log_p[:layout.targets.numel()]
            per_token = log_p.new_zeros((layout.num_tokens, log_p.shape[-1]))
            per_token.index_copy_(0, layout.targets.to(log_p.device), rows)
            label = log_p.gather(-1, staged.labels[0].unsqueeze(-1)).squeeze(-1)
            entropy = -(log_p.exp() * log_p).sum(-1)
            out.append((per_token, layout.to_tokens(label), layout.to_tokens(entropy)))
    return out


def predicted(firsts, outputs) -> torch.Tensor:
    """bool ``[N]``: the tokens that are predicted (all but each sequence's first)."""
    keep = torch.ones(outputs.logprobs.shape[0], dtype=torch.bool, device=firsts.device)
    keep[firsts] = False
    return keep


def worst(pairs) -> float:
    return max((a.float() - b.float()).abs().max().item() for a, b in pairs)


def checks(policy, mbs: list, temperature: float = 0.8) -> dict:
    """The worker's measurements on ``mbs`` (module doc)."""
    head = {"entropy": True, "top_k": TOP_K, "temperature": temperature}
    graphed = policy.logprobs(mbs, **head)
    extras_captured = policy.last_stats.get("forward graphs captured", 0)
    stats = dict(policy.last_stats)
    eager = policy.logprobs(mbs, eager=True, **head)
    plain = policy.logprobs(mbs, temperature=temperature)
    plain_captured = policy.last_stats.get("forward graphs captured", 0)
    fields = ("logprobs", "entropy", "topk_logprobs", "topk_ids")
    reference = whole_logits_reference(policy, mbs, temperature)
    top = [log_p.topk(TOP_K, dim=-1) for log_p, _, _ in reference]
    firsts = [torch.tensor([0, *torch.tensor(mb.lengths).cumsum(0)[:-1].tolist()],
                           device=out.logprobs.device) for mb, out in zip(mbs, graphed)]
    return {
        "stats": stats, "extras_captured": extras_captured, "plain_captured": plain_captured,
        "graphed_equals_eager": all(torch.equal(getattr(g, name), getattr(e, name))
                                    for g, e in zip(graphed, eager) for name in fields),
        "plain_equals_extras": all(torch.equal(p, g.logprobs) for p, g in zip(plain, graphed)),
        "max_difference": {
            "logprobs": worst((g.logprobs, r[1]) for g, r in zip(graphed, reference)),
            "entropy": worst((g.entropy, r[2]) for g, r in zip(graphed, reference)),
            "topk_logprobs": worst((g.topk_logprobs, t.values) for g, t in zip(graphed, top)),
            # What the returned ids point at is what the values say.
            "topk_at_ids": worst((g.topk_logprobs, r[0].gather(-1, g.topk_ids))
                                 for g, r in zip(graphed, reference))},
        "ids_equal_fraction": (sum(int(g.topk_ids.eq(t.indices)[predicted(f, g)].sum())
                                   for g, t, f in zip(graphed, top, firsts))
                               / sum(int(predicted(f, g).sum()) * TOP_K
                                     for g, f in zip(graphed, firsts))),
        "ids_unique": all(bool((g.topk_ids[predicted(f, g)].sort(dim=-1).values
                                .diff(dim=-1) > 0).all()) for g, f in zip(graphed, firsts)),
        "first_tokens_zero": all(bool(g.entropy[f].eq(0).all() and g.topk_ids[f].eq(0).all())
                                 for g, f in zip(graphed, firsts)),
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--tp", type=int, default=1)
    options = parser.parse_args()
    sys.path.insert(0, REPO)
    from megatron.packed_training.rl import PackedPolicy, PolicyConfig

    policy = PackedPolicy.build(PolicyConfig(config(options.tp), model="gpt"))
    policy.logprob_vocab_chunk = CHUNK
    result = {"tp": options.tp} | checks(policy, micro_batches(4, policy.vocab_size))
    if torch.distributed.get_rank() == 0:
        with open(options.out, "w") as f:
            json.dump(result, f, indent=1)
    torch.distributed.barrier()
    if options.tp == 1:
        # At TP > 1 the forward-only graphs captured the tensor-parallel all-reduces, and
        # destroying their NCCL groups hangs (pytorch/pytorch#115388; docs/rl.md, "Layouts").
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
