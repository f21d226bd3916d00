"""GRPO-style training of a small policy on the graphed packed step (docs/rl.md).

    python examples/rl/grpo_packed.py                  # eager, eager again, graphs; table + checks
    python examples/rl/grpo_packed.py --model hybrid --steps 10
    python examples/rl/grpo_packed.py --run graphs --out graphs.pt   # one run only

Each step of a run:

1. **Rollouts** (synthetic, on the host): ``--prompts`` prompts of random tokens, each with
   ``--group-size`` responses of random length; a response's reward is the share of its
   tokens in the lower half of the vocabulary. Advantages are normalised within each group
   (GRPO), on the response tokens; prompts carry loss weight 0. The sequences are packed
   into micro-batches of whole sequences (`pack_sequences`): their number and their
   sequence counts change from step to step.
2. **Reference log-probs**: the initial weights swapped into the policy in place
   (`PackedPolicy.swapped_weights`), log-probs on the forward-only graphs, swapped back.
3. **Policy log-probs** of the current weights (the "old" log-probs of the clipped ratio).
4. **Train step**: the clipped policy-gradient loss with a KL penalty to the reference
   (`losses.clipped_policy_loss`), one optimizer step.

Without ``--run`` the script runs three processes one after the other, ``eager``, ``eager``
again (the run-to-run noise) and ``graphs`` (local layer graphs for training, forward-only
graphs for log-probs), then prints each phase's time and tokens/s, eager against graphs, and
checks that (a) the graphs run's log-probs equal its eager log-probs on the same weights
(computed in the same process each step) and (b) the weights after the last step equal the
eager run's, each within the eager-against-eager difference (bitwise where that is 0).
Exit status 1 when a check fails, or at once, in one line, on a machine without a CUDA GPU.
The three runs use mamba-ssm's deterministic kernels
(``MAMBA_DETERMINISTIC=1``) unless the environment sets the variable: its default kernels
are not bitwise from one process to the next, so the hybrid's weights would part.
"""

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from functools import partial
from typing import Dict, List

import torch

# A difference this many times the eager-against-eager noise still passes (the noise is one
# sample of a nondeterministic kernel's spread); 0 noise asks for bitwise equality.
NOISE_SLACK = 4.0
TIMED_FROM = 2  # steps before this one are left out of the timings (warm-up, captures)
PHASES = ("reference log-probs", "policy log-probs", "train step")


def training_config(model: str, graphs: bool, steps: int, seq_length: int) -> dict:
    """The policy's training config, keyed by the command line's dest names
    (docs/config-api.md): a 4-layer model of hidden size 256, bf16, Adam."""
    config = {
        "hidden_size": 256, "num_attention_heads": 8, "group_query_attention": True,
        "num_query_groups": 4, "seq_length": seq_length,
        "max_position_embeddings": seq_length, "vocab_size": 1024,
        "normalization": "RMSNorm", "add_bias_linear": False, "hidden_dropout": 0.0,
        "attention_dropout": 0.0, "micro_batch_size": 1, "global_batch_size": 8,
        "train_iters": steps, "lr": 1e-4, "min_lr": 1e-5, "lr_decay_style": "cosine",
        "adam_beta2": 0.95, "calculate_per_token_loss": True, "bf16": True, "seed": 1234,
        "sft": True, "mock_data": True, "eval_iters": 0,
    }
    if model == "gpt":
        config |= {"num_layers": 4, "ffn_hidden_size": 1024, "swiglu": True,
                   "position_embedding_type": "rope"}
    else:
        config |= {"hybrid_layer_pattern": "M*-M", "mamba_head_dim": 32,
                   "mamba_num_groups": 2, "mamba_state_dim": 64,
                   "position_embedding_type": "none"}
    if graphs:
        config |= {"cuda_graph_impl": "local", "cuda_graph_max_packed_seqs": 16,
                   "cuda_graph_warmup_steps": 1}
    return config


def make_rollouts(step: int, prompts: int, group_size: int, vocab: int, rank: int = 0) -> dict:
    """One step's synthetic rollouts (host tensors, deterministic in step and rank): per
    sequence its tokens, response mask, reward and group. Prompts of 16 to 64 tokens,
    responses of 8 to 256 (log-uniform)."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    tokens, masks, rewards, groups = [], [], [], []
    for group in range(prompts):
        prompt = torch.randint(1, vocab, (int(torch.randint(16, 65, (1,), generator=generator)),),
                               generator=generator)
        for _ in range(group_size):
            length = int(math.exp(torch.empty(1).uniform_(math.log(8), math.log(256),
                                                          generator=generator)))
            response = torch.randint(1, vocab, (length,), generator=generator)
            tokens.append(torch.cat([prompt, response]))
            masks.append(torch.cat([torch.zeros(len(prompt)), torch.ones(length)]))
            rewards.append((response < vocab // 2).float().mean().item())
            groups.append(group)
    return {"tokens": tokens, "masks": masks, "rewards": torch.tensor(rewards),
            "groups": torch.tensor(groups)}


def group_advantages(rewards: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """GRPO's advantage: each reward against its group's mean, over the group's standard
    deviation (+ 1e-6; a group of equal rewards gets 0, never NaN)."""
    advantages = torch.zeros_like(rewards)
    for group in groups.unique():
        members = groups == group
        values = rewards[members]
        spread = values.std(unbiased=False) if values.numel() > 1 else torch.tensor(0.0)
        advantages[members] = (values - values.mean()) / (spread + 1e-6)
    return advantages


def rollout_micro_batches(rollouts: dict, row_positions: int):
    """The rollouts packed into micro-batches: loss weights on the response tokens, the
    sequence's advantage on each of its tokens."""
    from megatron.packed_training.rl import pack_sequences

    advantages = group_advantages(rollouts["rewards"], rollouts["groups"])
    per_token = [mask * value for mask, value in zip(rollouts["masks"], advantages)]
    # At most 15 sequences a micro-batch: with its padding tail it fits the graph capacity of
    # 16, and the eager run packs the same micro-batches.
    return pack_sequences(rollouts["tokens"], row_positions, loss_weights=rollouts["masks"],
                          tensors={"advantages": per_token}, max_sequences=15)


class PhaseTimer:
    """Seconds and tokens per phase over the timed steps (the device synchronised around
    each phase, so a phase's time is its own)."""

    def __init__(self, timed_from: int):
        self.timed_from = timed_from
        self.totals: Dict[str, List[float]] = {phase: [0.0, 0] for phase in PHASES}

    @contextmanager
    def phase(self, name: str, step: int, tokens: int):
        torch.cuda.synchronize()
        start = time.perf_counter()
        yield
        torch.cuda.synchronize()
        if step >= self.timed_from:
            self.totals[name][0] += time.perf_counter() - start
            self.totals[name][1] += tokens


def max_difference(a: List[torch.Tensor], b: List[torch.Tensor]) -> float:
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))


def run(options) -> dict:
    """One run (``options.run`` eager or graphs); returns what the comparison reads."""
    from megatron.packed_training.rl import PackedPolicy, PolicyConfig
    from megatron.packed_training.rl.losses import clipped_policy_loss

    config = training_config(options.model, options.run == "graphs", options.steps,
                             options.seq_length)
    policy = PackedPolicy.build(PolicyConfig(config, model=options.model))
    rank = torch.distributed.get_rank()
    reference = policy.snapshot_weights()  # the initial policy
    loss_fn = partial(clipped_policy_loss, clip_low=0.2, clip_high=0.2,
                      kl_coef=options.kl_coef)  # bound once: the same object every step
    timer = PhaseTimer(TIMED_FROM)
    logprob_differences, eager_noise = [], []
    for step in range(options.steps):
        rollouts = make_rollouts(step, options.prompts, options.group_size,
                                 policy.vocab_size, rank)
        micro_batches = rollout_micro_batches(rollouts, policy.row_positions)
        tokens = sum(len(sequence) for sequence in rollouts["tokens"])
        with timer.phase("reference log-probs", step, tokens):
            with policy.swapped_weights(reference):
                reference_logprobs = policy.logprobs(micro_batches)
        with timer.phase("policy log-probs", step, tokens):
            old_logprobs = policy.logprobs(micro_batches)
        if options.run == "graphs":  # the same weights eager, twice: difference and noise
            eager = policy.logprobs(micro_batches, eager=True)
            logprob_differences.append(max_difference(old_logprobs, eager))
            eager_noise.append(max_difference(eager, policy.logprobs(micro_batches,
                                                                     eager=True)))
        for mb, old, ref in zip(micro_batches, old_logprobs, reference_logprobs):
            mb.tensors |= {"old_logprobs": old, "ref_logprobs": ref}
        with timer.phase("train step", step, tokens):
            result = policy.train_step(micro_batches, loss_fn)
        if rank == 0:
            counters = " | ".join(f"{k}: {v}" for k, v in result.stats.items())
            print(f"step {step} | micro-batches {len(micro_batches)} | reward "
                  f"{rollouts['rewards'].mean().item():.3f} | loss {result.loss.item():.5f} | "
                  f"{counters}", flush=True)
    weights = policy.snapshot_weights(torch.device("cpu"))
    return {"run": options.run, "model": options.model, "phases": timer.totals,
            "weights": weights.tensors, "logprob_difference": max(logprob_differences,
                                                                 default=None),
            "logprob_noise": max(eager_noise, default=None)}


def within_noise(difference: float, noise: float) -> bool:
    """Whether ``difference`` is within the run-to-run ``noise`` (`NOISE_SLACK` times it;
    bitwise when the noise is 0)."""
    return difference <= NOISE_SLACK * noise


def weight_difference(a: dict, b: dict) -> float:
    return max((a[name].float() - b[name].float()).abs().max().item() for name in a)


def worst_rounding_step(a: dict, b: dict) -> tuple:
    """``(steps, name, x, y)``: the largest difference of two weight sets in rounding steps of
    their dtype at each element's magnitude (a bf16 element of 0.1 moves in steps of 2^-11),
    with the tensor and the two values where it is (near 0 the steps are small, so an element
    that a few updates bring close to 0 gives the most steps for the least difference)."""
    worst = (0.0, "", 0.0, 0.0)
    for name in a:
        x, y = a[name].float().view(-1), b[name].float().view(-1)
        _, exponent = torch.frexp(x.abs())  # |x| = m * 2^e, m in [0.5, 1)
        spacing = torch.finfo(a[name].dtype).eps * torch.exp2(exponent.float() - 1)
        steps = (x - y).abs() / spacing.clamp_min(torch.finfo(a[name].dtype).tiny)
        most, at = steps.max(0)
        if most.item() > worst[0]:
            worst = (most.item(), name, x[at].item(), y[at].item())
    return worst


def report(results: Dict[str, dict]) -> tuple:
    """The table and the checks of a comparison: ``(text, passed)``. Each check passes within
    the run-to-run noise (bitwise where that is 0); a weights difference names its worst
    element (`worst_rounding_step`)."""
    eager, graphs = results["eager"], results["graphs"]
    lines = ["| phase | eager (ms/step) | graphs (ms/step) | eager tokens/s | graphs tokens/s "
             "| speedup |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    timed = eager.get("timed_steps", 1)
    for phase in PHASES:
        (e_s, e_tokens), (g_s, g_tokens) = eager["phases"][phase], graphs["phases"][phase]
        e_rate, g_rate = e_tokens / max(e_s, 1e-9), g_tokens / max(g_s, 1e-9)
        lines.append(f"| {phase} | {1000 * e_s / timed:.1f} | {1000 * g_s / timed:.1f} | "
                     f"{e_rate:,.0f} | {g_rate:,.0f} | {g_rate / max(e_rate, 1e-9):.2f}x |")
    lp, lp_noise = graphs["logprob_difference"], graphs["logprob_noise"]
    weights, noise = (weight_difference(run["weights"], eager["weights"])
                      for run in (graphs, results["eager again"]))
    steps, tensor, ours, theirs = worst_rounding_step(graphs["weights"], eager["weights"])
    at = (f" ({steps:.3g} rounding steps at {tensor}: {ours:.4g} against eager's {theirs:.4g})"
          if steps else "")
    checks = [  # (name, difference, noise, passed, note)
        ("log-probs, graphs against eager on the same weights", lp, lp_noise,
         within_noise(lp, lp_noise), ""),
        ("weights after the last step, graphs against eager", weights, noise,
         within_noise(weights, noise), at)]
    for name, difference, noise, ok, note in checks:
        lines.append(f"{'ok  ' if ok else 'FAIL'} {name}: max |difference| {difference:.3g}"
                     f"{note}, eager against eager {noise:.3g}")
    passed = all(ok for *_, ok, _ in checks)
    return "\n".join(lines), passed


def free_port() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


def compare(options, argv: List[str]) -> int:
    """The three runs, each a process of its own (one policy per process), and the report."""
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, mode in (("eager", "eager"), ("eager again", "eager"), ("graphs", "graphs")):
            out = os.path.join(tmp, f"{name.replace(' ', '_')}.pt")
            # Mamba's default kernels reduce with atomics and pick their configs by timing:
            # two processes' weights part after a few Adam steps, graphs or not. Its
            # deterministic kernels make the comparison bitwise (MAMBA_DETERMINISTIC=0: off).
            env = dict(os.environ, MASTER_PORT=free_port())
            env.setdefault("MAMBA_DETERMINISTIC", "1")
            print(f"== {name} run", flush=True)
            code = subprocess.call([sys.executable, os.path.abspath(__file__), *argv,
                                    "--run", mode, "--out", out], env=env)
            if code:
                print(f"grpo_packed: the {name} run failed (exit {code})", file=sys.stderr)
                return code
            results[name] = torch.load(out, weights_only=False)
            results[name]["timed_steps"] = options.steps - TIMED_FROM
    text, passed = report(results)
    print(f"\n{options.model}, {options.steps} steps ({options.steps - TIMED_FROM} timed), "
          f"{options.prompts} prompts x {options.group_size} responses per step\n{text}")
    return 0 if passed else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("gpt", "hybrid"), default="gpt")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--group-size", type=int, default=4, help="responses per prompt")
    parser.add_argument("--seq-length", type=int, default=1024, help="positions of a packed row")
    parser.add_argument("--kl-coef", type=float, default=0.05)
    parser.add_argument("--run", choices=("eager", "graphs"), default=None,
                        help="one run only (what the comparison starts); needs --out")
    parser.add_argument("--out", default=None, help="with --run: where its results go")
    argv = sys.argv[1:] if argv is None else list(argv)
    options = parser.parse_args(argv)
    if options.steps <= TIMED_FROM:
        parser.error(f"--steps is wrong: {options.steps}. Give more than {TIMED_FROM}: the "
                     f"first {TIMED_FROM} steps are left out of the timings.")
    if options.run is not None and options.out is None:
        parser.error("--out is wrong: missing. --run writes its results there.")
    if not torch.cuda.is_available():  # before any run starts: one line, status 1
        print("examples/rl/grpo_packed.py: needs a CUDA GPU (torch.cuda.is_available() is "
              "False): the policy trains and computes log-probs on the GPU; run it on a GPU "
              "machine", file=sys.stderr)
        return 1
    if options.run is None:
        return compare(options, argv)
    results = run(options)
    if torch.distributed.get_rank() == 0:
        torch.save(results, options.out)
        print(json.dumps({"run": options.run, "logprob_difference": results[
            "logprob_difference"]}), flush=True)
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
