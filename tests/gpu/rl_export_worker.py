"""Worker of tests/gpu/test_rl_export_on_gpus.py: a policy's weights exported for an inference
engine, on GPUs, in a process of its own (one policy per process). Run under torchrun:

    torchrun --nproc-per-node 1 tests/gpu/rl_export_worker.py --family llama \
        --converted CONVERTED --hf HF --out OUT
    torchrun --nproc-per-node 2 tests/gpu/rl_export_worker.py --family qwen3_moe \
        --converted CONVERTED --out OUT -- --expert-model-parallel-size 2

Builds a `PackedPolicy` (bf16) from the converted checkpoint of a tiny Hugging Face model
(``--converted``: tools/convert_hf.py import's output, which names the family), exports its
weights with `PackedPolicy.export_weights` and writes, on every rank, ``export.rank<r>.pt``:
the pairs as ``[(name, tensor on the host)]``, and ``buckets.rank<r>.json``: whether the
``bucket_bytes`` export holds the same pairs bit for bit. Flags after ``--`` are added to the
policy's training flags (a parallel layout); ``--no-graphs`` leaves out the graph flags.

With ``--hf`` (one process): the engine's side too. The pairs go into a transformers model of
the family's config (``load_state_dict(strict=True)`` where transformers keeps the checkpoint's
names in memory, else its loader of a checkpoint's state dict, which must report nothing
missing, unexpected or mismatched); that model generates rollouts greedily from random
prompts, as an engine would; the policy's log-probs of them (forward-only graphs) are compared
with the transformers model's, each sequence run alone. ``result.json`` holds per sequence the
cosine of the two log-prob vectors, the largest difference, the same cosine against a model of
the same config that never got the weights (a control: the check can fail), transformers'
own bf16 noise (its log-probs against a float32 copy of the same model), and the greedy
comparison: at every position whose transformers margin is not a near tie (at least `TIE`
and twice the rollout's largest log-prob difference), whether the policy's greedy token (its
log-prob at temperature `COLD` above log 1/2) is the token exactly where transformers' greedy
token is.
"""

import argparse
import copy
import json
import math
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from megatron.packed_training.extra_args import is_importable  # noqa: E402
from megatron.packed_training.rl import PackedPolicy, PackedSequences, PolicyConfig  # noqa: E402
from tests.unit.hf_tiny import VOCAB, flags_of  # noqa: E402

# The policy's training flags besides the converted model's (nothing is trained).
POLICY = ["--sft", "--mock-data", "--bf16", "--seq-length", "256", "--micro-batch-size", "1",
          "--train-iters", "1", "--lr", "1e-4", "--eval-iters", "0", "--seed", "1234",
          "--calculate-per-token-loss", *(["--te-rng-tracker"] if is_importable(
              "transformer_engine") else [])]
# Log-probs on forward-only graphs, capacity 8 (one micro-batch holds 3 sequences).
FORWARD_GRAPHS = ["--cuda-graph-impl", "local", "--cuda-graph-max-packed-seqs", "8"]
# Forward-only graphs of MoE layers need drop-and-pad; a capacity of every token per expert
# (factor 2 at the tiny models' top-k / experts of 1/2) drops none: it routes as dropless does,
# as transformers does.
DROP_NOTHING = ["--moe-expert-capacity-factor=2", "--moe-pad-expert-input-to-capacity"]
MOE = ("qwen3_moe", "deepseek_v3", "moonlight", "nemotron_h")
MLA = ("deepseek_v3", "moonlight")  # packed MLA runs on Transformer Engine attention only
HYBRID = ("nemotron_h",)
# transformers keeps these families' checkpoint names in memory (its MoE models fuse their
# experts as they load a checkpoint: tests/unit/test_rl_export.py).
SAME_NAMES_IN_MEMORY = ("llama", "qwen3")

PROMPT, NEW = 6, 26  # rollout: a random prompt, then the engine's greedy tokens
LENGTHS = [[32, 21, 27], [16, 30, 25]]  # two micro-batches of three rollouts (cut)
COLD = 0.01  # the policy's greedy token: log-prob above log 1/2 at this temperature
TIE = 0.1  # transformers' logit margin below which bf16 may flip a greedy token
BUCKET_BYTES = 16_384  # several buckets of a tiny model


def policy_flags(family: str, converted: str, extra: list, graphs: bool = True) -> list:
    backend = "--attention-backend=auto" if family in MLA else "--attention-backend=local"
    return [*POLICY, *flags_of(converted), f"--pretrained-checkpoint={converted}", backend,
            *(DROP_NOTHING if family in MOE else []), *(FORWARD_GRAPHS if graphs else []),
            *extra]


def build_policy(family: str, converted: str, extra: list, graphs: bool) -> PackedPolicy:
    from megatron.packed_training.arguments import parse_args

    world = int(os.environ.get("WORLD_SIZE", "1"))
    flags = policy_flags(family, converted, ["--global-batch-size", str(world), *extra],
                         graphs)
    model = "hybrid" if family in HYBRID else "gpt"
    args = parse_args(flags, model, raise_on_error=True)
    return PackedPolicy.build(PolicyConfig(args, model=model))


# ------------------------------------------------------------------------------- the export

def export_and_save(policy: PackedPolicy, out: str) -> list:
    """The policy's export (device pairs); this rank's copy on the host in ``out``, and whether
    the bucketed export holds the same pairs, in order, bit for bit."""
    rank = torch.distributed.get_rank()
    pairs = list(policy.export_weights())
    names = [name for name, _ in pairs]
    buckets = list(policy.export_weights(bucket_bytes=BUCKET_BYTES))
    flat = [pair for bucket in buckets for pair in bucket]
    same = ([name for name, _ in flat] == names
            and all(torch.equal(a, b) for (_, a), (_, b) in zip(flat, pairs)))
    facts = {"buckets_equal_pairs": same, "buckets": len(buckets),
             "unique_names": len(set(names)),
             "pairs": len(pairs), "on_gpu": all(t.is_cuda for _, t in pairs),
             "dtypes": sorted({str(t.dtype) for _, t in pairs})}
    torch.save([(name, tensor.detach().cpu()) for name, tensor in pairs],
               os.path.join(out, f"export.rank{rank}.pt"))
    with open(os.path.join(out, f"buckets.rank{rank}.json"), "w") as f:
        json.dump(facts, f)
    return pairs


# ------------------------------------------------------------------------ the engine's side

def engine_model(hf: str, family: str, pairs: list):
    """(a transformers model holding the exported pairs, a control model of the same config
    that never got them, transformers' loading report), bf16 on the GPU."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(hf)
    torch.manual_seed(0)
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).cuda().eval()
    control = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).cuda().eval()
    tensors = dict(pairs)
    if family in SAME_NAMES_IN_MEMORY:
        aliases = tied_aliases(fresh)  # a tied lm_head: its source's tensor
        fresh.load_state_dict({**tensors, **{alias: tensors[source]
                                             for alias, source in aliases.items()}},
                              strict=True)
        return fresh, control, {"strict": True}
    on_host = {name: tensor.cpu() for name, tensor in tensors.items()}
    loaded, info = type(fresh).from_pretrained(None, config=config, state_dict=on_host,
                                               output_loading_info=True, dtype=torch.bfloat16)
    return loaded.cuda().eval(), control, {key: sorted(map(str, value))
                                           for key, value in info.items()}


def tied_aliases(model) -> dict:
    """{name: the name it is tied to} of a transformers model's state dict."""
    first, aliases = {}, {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        source = first.setdefault(id(tensor), name)
        if source != name:
            aliases[name] = source
    return aliases


@torch.no_grad()
def rollouts(model, count: int, seed: int = 0) -> torch.Tensor:
    """``count`` rollouts of the engine: random prompts of `PROMPT` tokens, then `NEW` greedy
    tokens (whole forward passes: the tiny model needs no cache). ``[count, PROMPT + NEW]``."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (count, PROMPT), generator=generator).cuda()
    for _ in range(NEW):
        logits = model(ids, use_cache=False).logits[:, -1]
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    return ids


@torch.no_grad()
def engine_logprobs(model, sequence: torch.Tensor) -> tuple:
    """One sequence alone: (log-prob of each token given the ones before it, 0 at the first:
    the policy's alignment; whether it is the greedy token; the margin of that decision:
    top-1 minus top-2 logit where it is, top-1 minus its logit where not). float32 ``[L]``."""
    logits = model(sequence[None], use_cache=False).logits[0, :-1].float()
    following = sequence[1:, None]
    logprobs = logits.log_softmax(-1).gather(1, following)[:, 0]
    top = logits.topk(2, dim=-1).values
    mine = logits.gather(1, following)[:, 0]
    greedy = logits.argmax(-1) == sequence[1:]
    margin = torch.where(greedy, top[:, 0] - top[:, 1], top[:, 0] - mine)
    zero = torch.zeros(1, device=sequence.device)
    # The first token follows nothing: no greedy decision (margin -inf: never decisive).
    return (torch.cat([zero, logprobs]), torch.cat([zero.bool(), greedy]),
            torch.cat([zero - math.inf, margin]))


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a[1:].double(), b[1:].double(), dim=0).item()


def compare(policy: PackedPolicy, engine, control) -> dict:
    """The policy's log-probs of the engine's rollouts against the engine's (module doc), and
    the engine's own bf16 noise: its log-probs against its float32 copy (the same weights)."""
    engine32 = copy.deepcopy(engine).float()
    sequences = rollouts(engine, sum(len(lengths) for lengths in LENGTHS))
    micro_batches, cut = [], []
    for lengths in LENGTHS:
        chosen = [sequences[len(cut) + i, :n] for i, n in enumerate(lengths)]
        cut += chosen
        micro_batches.append(PackedSequences(torch.cat(chosen), lengths=lengths))
    graphed = split(policy.logprobs(micro_batches), LENGTHS)
    stats = dict(policy.last_stats)
    eager = split(policy.logprobs(micro_batches, eager=True), LENGTHS)
    cold = split(policy.logprobs(micro_batches, temperature=COLD), LENGTHS)
    rows = []
    for sequence, mine, mine_eager, mine_cold in zip(cut, graphed, eager, cold):
        theirs, greedy, margin = engine_logprobs(engine, sequence)
        reference, _, _ = engine_logprobs(control, sequence)
        exact, _, _ = engine_logprobs(engine32, sequence)
        policy_greedy = mine_cold > math.log(0.5)
        # A decision bf16 may flip: a margin within the rollout's noise (twice its largest
        # log-prob difference: an MoE routing flip moves a logit by more than TIE).
        largest = (mine - theirs).abs().max().item()
        decisive = margin >= max(TIE, 2 * largest)
        flips = (decisive & (policy_greedy != greedy)).nonzero()[:, 0].tolist()
        rows.append({
            "length": len(sequence), "cosine": cosine(mine, theirs),
            "eager_cosine": cosine(mine_eager, theirs),
            "control_cosine": cosine(mine, reference),
            "engine_bf16_noise_cosine": cosine(theirs, exact),
            "max_abs": largest,
            "mean_abs": (mine - theirs).abs().mean().item(),
            "decisive": int(decisive.sum()), "greedy_decisive": int((decisive & greedy).sum()),
            "greedy_flips": flips,
            "flip_margins": [margin[i].item() for i in flips]})
    return {"sequences": rows, "stats": stats}


def split(per_micro_batch: list, lengths: list) -> list:
    return [part for values, sizes in zip(per_micro_batch, lengths)
            for part in values.split(sizes)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", required=True,
                        choices=("llama", "qwen3", "qwen3_moe", "deepseek_v3", "moonlight",
                                 "nemotron_h"))
    parser.add_argument("--converted", required=True, help="tools/convert_hf.py import output")
    parser.add_argument("--hf", help="the Hugging Face folder: compare with transformers")
    parser.add_argument("--out", required=True, help="an existing folder for the results")
    parser.add_argument("--no-graphs", action="store_true",
                        help="no graph flags (an export only: nothing runs the model)")
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="-- then more training flags")
    options = parser.parse_args()
    extra = options.extra[1:] if options.extra[:1] == ["--"] else options.extra
    policy = build_policy(options.family, options.converted, extra,
                          graphs=not options.no_graphs)
    pairs = export_and_save(policy, options.out)
    if options.hf is not None:
        if torch.distributed.get_world_size() != 1:
            raise ValueError("--hf compares one process's policy with transformers: run it "
                             "with --nproc-per-node 1")
        engine, control, loading = engine_model(options.hf, options.family, pairs)
        result = {"loading": loading, **compare(policy, engine, control)}
        with open(os.path.join(options.out, "result.json"), "w") as f:
            json.dump(result, f, indent=1)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
