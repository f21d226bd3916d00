"""Megatron-LM flags that training scripts carry, beyond the ones this fork's parser defines.

A Megatron launch script passes flags that ask for what this fork always does (megatron-core
models, no linear biases, fp32 gradient reduction, ...). They are accepted and change
nothing (`ALREADY`); the start-up log names them with the reason. Flags for features this
fork does not have are refused with the reason and what to do (`REFUSED`), never silently
ignored. Some Megatron flags are implemented where their features live: --train-samples and
the sample-based LR flags (argument_checks.check_training_length), --hybrid-attention-ratio
and --hybrid-mlp-ratio (argument_checks.check_hybrid), --manual-gc and
--exit-duration-in-mins (training.py).

A flag with values is accepted only with those that state this fork's behaviour
(``--ckpt-format torch_dist``, megatron-core's own hybrid stack for ``--spec``); any other is
refused, naming the accepted ones.
"""

import argparse
from dataclasses import dataclass
from typing import List, Optional, Tuple


@dataclass(frozen=True)
class MegatronFlag:
    """One Megatron flag and ``why`` it changes nothing here (`ALREADY`) or is refused, with
    what to do (`REFUSED`). ``nargs``: its values (None: a switch); ``values``: for an
    `ALREADY` flag with values, the ones accepted (each as typed, space-joined); ``models``:
    the scripts it is accepted in."""

    flag: str
    why: str
    nargs: Optional[int] = None
    values: Tuple[str, ...] = ()
    models: Tuple[str, ...] = ("gpt", "hybrid")

    @property
    def dest(self) -> str:
        return "megatron_" + self.flag.lstrip("-").replace("-", "_")


# megatron-core's own hybrid stack spec (0.16 and 0.19 names), which this fork's is built on.
HYBRID_STACK_SPECS = ("megatron.core.models.mamba.mamba_layer_specs mamba_stack_spec",
                      "megatron.core.models.hybrid.hybrid_layer_specs hybrid_stack_spec")

ALREADY = (
    MegatronFlag("--use-mcore-models", "this fork builds megatron-core models only"),
    MegatronFlag("--disable-bias-linear", "this fork's linear layers have no biases"),
    MegatronFlag("--group-query-attention", "--num-query-groups alone sets the key/value groups"),
    MegatronFlag("--no-create-attention-mask-in-dataloader",
                 "packed micro-batches carry document boundaries, never a mask"),
    MegatronFlag("--no-masked-softmax-fusion",
                 "attention runs in Transformer Engine, flash-attn or PyTorch's varlen kernel, "
                 "never in the masked-softmax fusion"),
    MegatronFlag("--no-bias-dropout-fusion", "the bias-dropout fusion is never used here"),
    MegatronFlag("--no-gradient-accumulation-fusion",
                 "weight gradients are added into main_grad by a separate kernel here"),
    MegatronFlag("--accumulate-allreduce-grads-in-fp32",
                 "gradients are always accumulated and reduced in fp32 here"),
    MegatronFlag("--use-checkpoint-opt_param-scheduler",
                 "--load always restores the learning-rate schedule from the checkpoint"),
    MegatronFlag("--no-async-tensor-model-parallel-allreduce",
                 "Megatron deprecated it; there is nothing to turn off"),
    MegatronFlag("--log-throughput",
                 "the log line always reports throughput, as tokens/s (not TFLOP/s)"),
    MegatronFlag("--ckpt-format", "checkpoints are megatron-core distributed checkpoints",
                 nargs=1, values=("torch_dist",)),
    MegatronFlag("--timing-log-level",
                 "this fork keeps no Megatron timers; the log line times each interval",
                 nargs=1, values=("0",)),
    MegatronFlag("--spec", "pretrain_mamba.py builds megatron-core's hybrid stack, packed",
                 nargs=2, values=HYBRID_STACK_SPECS, models=("hybrid",)),
)

_NO_RECOMPUTE = "Activation recomputation is not supported here; drop it"
_HF_TOKENIZER = ("This fork tokenizes with --tokenizer-type HuggingFaceTokenizer --tokenizer-model "
                 "DIR, or reads rows tokenized already")
_NO_WANDB = ("Weights & Biases logging is not built in; use --tensorboard-dir or "
             "--metrics-file")

REFUSED = (
    MegatronFlag("--overlap-grad-reduce",
                 "Overlapping the gradient reduction with the backward is not supported here: "
                 "gradients are reduced after the backward (inside the graph with "
                 "--cuda-graph-impl full_iteration); drop the flag"),
    MegatronFlag("--overlap-param-gather",
                 "Overlapping the parameter all-gather with the forward is not supported here; "
                 "drop the flag (--use-distributed-optimizer still shards the optimizer)"),
    MegatronFlag("--recompute-granularity",
                 "Activation recomputation is not supported here; drop it (lower "
                 "--micro-batch-size or raise parallelism to save memory)",
                 nargs=1),
    MegatronFlag("--recompute-method", _NO_RECOMPUTE, nargs=1),
    MegatronFlag("--recompute-num-layers", _NO_RECOMPUTE, nargs=1),
    MegatronFlag("--use-torch-fsdp2",
                 "FSDP is not supported here; use --use-distributed-optimizer to shard the "
                 "optimizer state"),
    MegatronFlag("--split",
                 "This fork reads validation data from its own file; give --valid-data-path "
                 "and drop --split", nargs=1),
    MegatronFlag("--vocab-file", _HF_TOKENIZER, nargs=1),
    MegatronFlag("--merge-file", _HF_TOKENIZER, nargs=1),
    MegatronFlag("--log-params-norm", "Not implemented here; drop it"),
    MegatronFlag("--apply-layernorm-1p",
                 "Zero-centred norm weights are not supported here; drop it"),
    MegatronFlag("--moe-permute-fusion",
                 "Transformer Engine's fused token permutation has not been verified under "
                 "packed CUDA graphs here; drop it"),
    MegatronFlag("--wandb-project", _NO_WANDB, nargs=1),
    MegatronFlag("--wandb-exp-name", _NO_WANDB, nargs=1),
)


def add_megatron_flags(parser: argparse.ArgumentParser) -> None:
    """The group of `ALREADY` and `REFUSED` flags (values are checked by `check`)."""
    g = parser.add_argument_group(
        "megatron compatibility",
        "Megatron-LM flags of existing scripts: accepted where this fork already behaves so "
        "(no effect), refused with the reason otherwise (docs/flags.md).")
    for entry in ALREADY:
        accepted = " or ".join(entry.values)
        _add(g, entry, f"Accepted with {accepted} only, no effect: {entry.why}." if accepted
             else f"Accepted, no effect: {entry.why}.")
    for entry in REFUSED:
        _add(g, entry, f"Refused. {entry.why}.")


def _add(group, entry: MegatronFlag, text: str) -> None:
    if entry.nargs is None:
        group.add_argument(entry.flag, dest=entry.dest, action="store_true", help=text)
    else:
        group.add_argument(entry.flag, dest=entry.dest, default=None, nargs=entry.nargs,
                           help=text)


def _as_typed(value) -> Optional[str]:
    """A given flag's value as typed (a switch: "True"); None when not given."""
    if value is None or value is False:
        return None
    return "True" if value is True else " ".join(map(str, value))


def check(args: argparse.Namespace, model: str) -> List[str]:
    """Refuse what `REFUSED` names and an `ALREADY` flag with another value or in another
    script (ValueError, in the `argument_checks.fail` shape); return the given `ALREADY`
    flags, each with its reason, for the start-up log."""
    from megatron.training.argument_checks import fail

    for entry in REFUSED:
        typed = _as_typed(getattr(args, entry.dest, None))
        if typed is not None:
            fail(entry.flag, typed, entry.why)
    given = []
    for entry in ALREADY:
        typed = _as_typed(getattr(args, entry.dest, None))
        if typed is None:
            continue
        if model not in entry.models:
            fail(entry.flag, typed, f"It is for {' and '.join(entry.models)} models; run "
                                    "pretrain_mamba.py, or drop the flag")
        if entry.values and typed not in entry.values:
            accepted = " or ".join(entry.values)
            fail(entry.flag, typed, f"This fork runs as {entry.flag} {accepted}: {entry.why}; "
                                    f"use that or drop the flag")
        given.append(f"{entry.flag} ({entry.why})")
    return given
