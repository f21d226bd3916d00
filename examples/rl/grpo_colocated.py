"""GRPO with generation on the policy's GPU: a Hugging Face model stands in for the engine.

    python tools/convert_hf.py import Qwen3-0.6B qwen3-converted
    python examples/rl/grpo_colocated.py qwen3-converted --iterations 4
    LD_PRELOAD=.../torch_memory_saver_hook_mode_preload...so \\
        python examples/rl/grpo_colocated.py qwen3-converted --offload

(``--offload`` without the library in LD_PRELOAD stops at the build with the command that
finds its path.)

The policy (`PackedPolicy`) is built from the converted checkpoint's launch flags
(``megatron_flags.txt``) and the Hugging Face model from its ``config.json``, both on one GPU
in bf16. The Hugging Face model's weights all come from the policy: where vLLM or SGLang would
take ``export_weights``'s pairs, the example copies them into the model's tensors by name.
Each iteration:

1. **refit**: ``policy.export_weights`` -> the Hugging Face model, in place;
2. **offload** (``--offload``): the policy's GPU memory to pinned host memory
   (``policy.offload``, a policy built with ``PolicyConfig(offloadable=True)``);
3. **generate**: ``model.generate`` samples ``--group-size`` responses for each of
   ``--prompts`` random prompts, and the generator's log-probs of its samples (an engine
   returns them with the tokens);
4. **score**: the verifiable reward of grpo_packed.py (the share of a response's tokens in
   the lower half of the vocabulary), GRPO advantages, the rollouts packed;
5. **onload** (``--offload``);
6. **reference / policy log-probs**: the initial weights (a host copy) swapped in, then the
   current ones; the policy's against the generator's log-probs of the same tokens;
7. **train**: one step of the clipped policy loss with a KL penalty to the reference.

Every phase prints one line: its seconds, ``torch.cuda.memory_allocated`` and
``memory_reserved``, and the device's free memory (``torch.cuda.mem_get_info``), in MiB.
One GPU, one process. Exit status 1, in one line, without a CUDA GPU.
"""

import argparse
import os
import sys
import time
from contextlib import contextmanager
from functools import partial
from types import SimpleNamespace
from typing import Dict, List, Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from grpo_packed import rollout_micro_batches  # noqa: E402  (the rewards' advantages, packing)

FLAGS_FILE = "megatron_flags.txt"  # tools/convert_hf.py import writes it
MIB = 1 << 20
COLUMNS = ("iter", "phase", "seconds", "allocated MiB", "reserved MiB", "free MiB", "")
WIDTHS = (4, 20, 8, 13, 12, 9, 0)


# -- the policy --------------------------------------------------------------------------------

def read_flags(checkpoint: str) -> List[str]:
    """The launch flags of a converted checkpoint (one token a line; they load it through
    ``--pretrained-checkpoint``). Raises ValueError for a folder without them."""
    path = os.path.join(checkpoint, FLAGS_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"checkpoint is wrong: {checkpoint} has no {FLAGS_FILE}. Give the "
                         f"folder tools/convert_hf.py import wrote (python tools/convert_hf.py "
                         f"import HF_FOLDER {checkpoint}).")
    with open(path) as f:
        return [line.strip() for line in f if line.strip()]


def training_flags(options) -> List[str]:
    """What a launch line adds to the model's flags: sizes, optimizer, bf16, layer graphs of
    capacity 16 (`rollout_micro_batches` packs at most 15 sequences a micro-batch)."""
    return ["--seq-length", str(options.seq_length), "--micro-batch-size", "1",
            "--global-batch-size", "8", "--train-iters", str(options.iterations),
            "--lr", str(options.lr), "--lr-decay-style", "constant", "--bf16",
            "--calculate-per-token-loss", "--sft", "--mock-data", "--eval-iters", "0",
            "--seed", str(options.seed), "--cuda-graph-impl", "local",
            "--cuda-graph-max-packed-seqs", "16", "--cuda-graph-warmup-steps", "1"]


def model_kind(flags: Sequence[str]) -> str:
    """``hybrid`` for a converted model that pretrain_mamba.py builds (it has a layer
    pattern), else ``gpt``."""
    return "hybrid" if any(f.startswith("--hybrid-layer-pattern") for f in flags) else "gpt"


def build_policy(options):
    from megatron.packed_training.arguments import parse_args
    from megatron.packed_training.rl import PackedPolicy, PolicyConfig

    kind = model_kind(options.flags)
    args = parse_args([*training_flags(options), *options.flags], kind, raise_on_error=True)
    # hf_config unset: the family comes from the config.json beside the checkpoint.
    config = PolicyConfig(args, model=kind, offloadable=options.offload)
    return PackedPolicy.build(config)


# -- the generator -----------------------------------------------------------------------------

def build_generator(checkpoint: str):
    """The Hugging Face model of ``checkpoint``'s config.json on the GPU in bf16, eval mode.
    Its initial weights are random: the first refit overwrites every one."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(checkpoint)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.eval()


@torch.no_grad()
def refit(model: torch.nn.Module, exported) -> int:
    """Copy ``exported`` (``policy.export_weights``'s ``(name, tensor)`` pairs, or lists of
    them) into ``model``'s tensors of those names, in place; returns the number of tensors.
    Each pair is used at once (a tensor may alias the policy's live parameter). Raises
    ValueError for a name the model lacks, or a tensor of the model that received nothing
    (a tied output layer counts as its embedding's)."""
    state = model.state_dict()  # the parameters' own storage
    filled = set()
    for item in exported:
        for name, tensor in (item if isinstance(item, list) else [item]):
            if name not in state:
                raise ValueError(f"refit is wrong: the export names {name}, which "
                                 f"{type(model).__name__} does not have. Build the generator "
                                 f"from the policy's config.json.")
            state[name].copy_(tensor)
            filled.add(state[name].data_ptr())
    missing = sorted(name for name, tensor in state.items() if tensor.data_ptr() not in filled)
    if missing:
        raise ValueError(f"refit is wrong: the export left {len(missing)} tensors of "
                         f"{type(model).__name__} unset ({', '.join(missing[:4])}, ...). Build "
                         f"the generator from the policy's config.json.")
    return len(filled)


def split_responses(generated: torch.Tensor, prompt_length: int, eos_ids: Sequence[int]
                    ) -> List[torch.Tensor]:
    """The responses of ``generate``'s ``[B, prompt_length + new]`` output: each row's new
    tokens up to and with its first end-of-sequence token (what follows it is padding)."""
    responses = []
    for row in generated[:, prompt_length:]:
        ends = torch.isin(row, torch.tensor(list(eos_ids), device=row.device)).nonzero()
        responses.append(row[: int(ends[0]) + 1] if len(ends) else row)
    return responses


@torch.no_grad()
def sampling_logprobs(model, sequences: Sequence[torch.Tensor], temperature: float
                      ) -> List[torch.Tensor]:
    """The generator's log-prob of each token of each sequence under softmax(logits /
    temperature), token aligned as the policy's (0 at the first token). One sequence at a
    time: the ``[length, vocabulary]`` logits of one only."""
    out = []
    for tokens in sequences:
        logits = model(tokens[None]).logits[0, :-1].float() / temperature
        picked = torch.log_softmax(logits, dim=-1).gather(-1, tokens[1:, None])[:, 0]
        out.append(torch.cat([picked.new_zeros(1), picked]))
    return out


def reward(response: torch.Tensor, vocab: int) -> float:
    """grpo_packed.py's verifiable reward: the share of the response's tokens below
    ``vocab // 2``."""
    return (response < vocab // 2).float().mean().item()


def rollouts(model, options, iteration: int, vocab: int) -> Dict[str, object]:
    """One iteration's rollouts: ``--prompts`` random prompts of ``--prompt-length`` tokens,
    ``--group-size`` samples each (full softmax at ``--temperature``: no top-k or top-p), as
    grpo_packed.py's rollouts (host tensors) plus ``logprobs``, the generator's log-probs."""
    generator = torch.Generator().manual_seed(options.seed + iteration)
    prompts = torch.randint(0, vocab, (options.prompts, options.prompt_length),
                            generator=generator).to(model.device)
    eos = model.generation_config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    generated = model.generate(
        prompts.repeat_interleave(options.group_size, dim=0),
        attention_mask=torch.ones_like(prompts).repeat_interleave(options.group_size, dim=0),
        do_sample=True, temperature=options.temperature, top_k=0, top_p=1.0,
        max_new_tokens=options.max_new_tokens, pad_token_id=eos[0] if eos else 0)
    responses = split_responses(generated, options.prompt_length, eos)
    sequences = [torch.cat([prompts[i // options.group_size], response])
                 for i, response in enumerate(responses)]
    return {"tokens": [s.cpu() for s in sequences],
            "masks": [torch.cat([torch.zeros(options.prompt_length), torch.ones(len(r))])
                      for r in responses],
            "rewards": torch.tensor([reward(r.cpu(), vocab) for r in responses]),
            "groups": torch.arange(options.prompts).repeat_interleave(options.group_size),
            "logprobs": sampling_logprobs(model, sequences, options.temperature)}


# -- the loop ----------------------------------------------------------------------------------

def by_sequence(micro_batches, values: Sequence[torch.Tensor]) -> Dict[int, torch.Tensor]:
    """Per-micro-batch token-aligned ``values`` (log-probs) back to the packed sequences,
    keyed by their index in the list `pack_sequences` took."""
    out = {}
    for mb, value in zip(micro_batches, values):
        for index, part in zip(mb.indices, torch.split(value, list(mb.lengths))):
            out[index] = part
    return out


def mismatch(policy_lp: Dict[int, torch.Tensor], generator_lp: Sequence[torch.Tensor],
             masks: Sequence[torch.Tensor]) -> tuple:
    """(mean, max) of |policy - generator| log-probs over the response tokens."""
    gaps = torch.cat([(policy_lp[i].float().cpu() - generator_lp[i].float().cpu()).abs()[
        masks[i].bool()] for i in range(len(masks))])
    return gaps.mean().item(), gaps.max().item()


def phase_line(cells: Sequence[object]) -> str:
    return "  ".join(f"{c:<{w}}" if i < 2 else f"{c:>{w}}"
                     for i, (c, w) in enumerate(zip(cells, WIDTHS))).rstrip()


def memory_mib() -> tuple:
    """(allocated, reserved, free) device memory in MiB."""
    free, _ = torch.cuda.mem_get_info()
    return (torch.cuda.memory_allocated() // MIB, torch.cuda.memory_reserved() // MIB,
            free // MIB)


@contextmanager
def phase(iteration: int, name: str):
    """Times the block (the device synchronised around it) and prints its line; the block
    may set the yielded ``note.text``, the end of the line."""
    note = SimpleNamespace(text="")
    torch.cuda.synchronize()
    start = time.perf_counter()
    yield note
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    print(phase_line((iteration, name, f"{seconds:.3f}", *memory_mib(), note.text)), flush=True)


def train(options) -> None:
    from megatron.packed_training.rl.losses import clipped_policy_loss

    policy = build_policy(options)
    model = build_generator(options.checkpoint)
    vocab = model.config.vocab_size  # the tokens a response may hold (the policy's is padded)
    reference = policy.snapshot_weights(torch.device("cpu"))  # the start; no GPU memory
    loss_fn = partial(clipped_policy_loss, clip_low=0.2, clip_high=0.28,
                      kl_coef=options.kl_coef)  # bound once: the same object every step
    print(phase_line(COLUMNS), flush=True)
    for it in range(options.iterations):
        with phase(it, "refit") as note:
            note.text = f"{refit(model, policy.export_weights(options.bucket_mib * MIB))} tensors"
        if options.offload:
            with phase(it, "offload") as note:
                moved = policy.offload()  # every policy call is refused until onload
                note.text = f"{moved.mib:.0f} MiB released"
        with phase(it, "generate") as note:
            batch = rollouts(model, options, it, vocab)
            torch.cuda.empty_cache()  # the engine's sleep: its cache goes back to the device
            note.text = f"{sum(len(t) for t in batch['tokens'])} tokens"
        with phase(it, "score") as note:
            micro_batches = rollout_micro_batches(batch, policy.row_positions)
            note.text = (f"reward {batch['rewards'].mean().item():.3f}, "
                            f"{len(micro_batches)} micro-batches")
        if options.offload:
            with phase(it, "onload") as note:
                note.text = f"{policy.onload().mib:.0f} MiB back"
        with phase(it, "reference log-probs"):
            with policy.swapped_weights(reference):
                ref = policy.logprobs(micro_batches, temperature=options.temperature)
        with phase(it, "policy log-probs") as note:
            old = policy.logprobs(micro_batches, temperature=options.temperature)
            mean, most = mismatch(by_sequence(micro_batches, old), batch["logprobs"],
                                  batch["masks"])
            note.text = f"|policy - generator| mean {mean:.4f}, max {most:.4f}"
        for mb, o, r in zip(micro_batches, old, ref):
            mb.tensors |= {"old_logprobs": o, "ref_logprobs": r}
        with phase(it, "train") as note:
            result = policy.train_step(micro_batches, loss_fn, temperature=options.temperature)
            note.text = f"loss {result.loss.item():.5f}, grad norm {float(result.grad_norm):.4f}"


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a folder tools/convert_hf.py import wrote")
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per iteration")
    parser.add_argument("--group-size", type=int, default=4, help="samples per prompt")
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seq-length", type=int, default=1024, help="positions of a packed row")
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--kl-coef", type=float, default=0.05)
    parser.add_argument("--bucket-mib", type=int, default=256,
                        help="export_weights' bucket size (MiB)")
    parser.add_argument("--offload", action="store_true",
                        help="release the policy's GPU memory while the generator runs (needs "
                             "torch_memory_saver's preload library in LD_PRELOAD)")
    parser.add_argument("--seed", type=int, default=1234)
    options = parser.parse_args(argv)
    try:
        options.flags = read_flags(options.checkpoint)
    except ValueError as err:
        parser.error(str(err))
    for name in ("iterations", "prompts", "group_size", "prompt_length", "max_new_tokens",
                 "bucket_mib"):
        if getattr(options, name) < 1:
            parser.error(f"--{name.replace('_', '-')} is wrong: {getattr(options, name)}. "
                         f"Give 1 or more.")
    if options.group_size < 2:
        parser.error(f"--group-size is wrong: {options.group_size}. GRPO compares a prompt's "
                     f"samples with each other: give 2 or more.")
    if options.temperature <= 0:
        parser.error(f"--temperature is wrong: {options.temperature}. Give a positive number "
                     f"(1.0: the model's own distribution).")
    longest = options.prompt_length + options.max_new_tokens
    if longest - 1 > options.seq_length:
        parser.error(f"--seq-length is wrong: {options.seq_length}. A sequence of "
                     f"--prompt-length + --max-new-tokens = {longest} tokens takes {longest - 1} "
                     f"positions of a packed row: give --seq-length {longest - 1} or more.")
    return options


def main(argv=None) -> int:
    options = parse(argv)
    if not torch.cuda.is_available():
        print("examples/rl/grpo_colocated.py: needs a CUDA GPU (torch.cuda.is_available() is "
              "False): the policy and the generator run on the GPU; run it on a GPU machine",
              file=sys.stderr)
        return 1
    train(options)
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
