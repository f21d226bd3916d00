"""Megatron-LM flags that training scripts carry, beyond the ones this fork's parser defines.

A Megatron launch script passes flags that ask for what this fork always does (megatron-core
models, no linear biases, fp32 gradient reduction, ...). They are accepted and change
nothing (`ALREADY`); the start-up log names them with the reason. Flags for features this
fork does not have are refused with the reason and what to do (`REFUSED`), never silently
ignored. Some Megatron flags are implemented where their features live: --train-samples and
the sample-based LR flags (argument_checks.check_training_length), --hybrid-attention-ratio
and --hybrid-mlp-ratio (argument_checks.check_hybrid), --manual-gc and
--exit-duration-in-mins (training.py).

A flag with a value is accepted only with the value that states this fork's behaviour
(``--ckpt-format torch_dist``); any other value is refused, naming the one accepted.
"""

import argparse
from dataclasses import dataclass
from typing import List, Optional


@dataclass(frozen=True)
class MegatronFlag:
    """One Megatron flag: ``value`` is the only value accepted (None: a switch), ``why``
    says why it changes nothing here (`ALREADY`) or why it is refused and what to do."""

    flag: str
    why: str
    value: Optional[str] = None
    nargs: Optional[int] = None  # values of a refused flag (None: a switch or one value)

    @property
    def dest(self) -> str:
        return "megatron_" + self.flag.lstrip("-").replace("-", "_")


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
    MegatronFlag("--log-throughput", "the log line reports tokens/s"),
    MegatronFlag("--ckpt-format", "checkpoints are megatron-core distributed checkpoints",
                 value="torch_dist"),
    MegatronFlag("--timing-log-level",
                 "this fork keeps no Megatron timers; the log line times each interval",
                 value="0"),
)

REFUSED = (
    MegatronFlag("--overlap-grad-reduce",
                 "Overlapping the gradient reduction with the backward is not supported here: "
                 "gradients are reduced after the backward (inside the graph with "
                 "--cuda-graph-impl full_iteration); drop the flag"),
    MegatronFlag("--overlap-param-gather",
                 "Overlapping the parameter all-gather with the forward is not supported here; "
                 "drop the flag (--use-distributed-optimizer still shards the optimizer)"),
    MegatronFlag("--recompute-granularity",
                 "Activation recomputation is not supported with packed CUDA graphs here; "
                 "drop it (lower --micro-batch-size or raise parallelism to save memory)",
                 nargs=1),
    MegatronFlag("--recompute-method", "Activation recomputation is not supported here; drop it",
                 nargs=1),
    MegatronFlag("--recompute-num-layers",
                 "Activation recomputation is not supported here; drop it", nargs=1),
    MegatronFlag("--use-torch-fsdp2",
                 "FSDP is not supported here; use --use-distributed-optimizer to shard the "
                 "optimizer state"),
    MegatronFlag("--split",
                 "This fork reads validation data from its own file; give --valid-data-path "
                 "and drop --split", nargs=1),
    MegatronFlag("--vocab-file",
                 "This fork tokenizes with --tokenizer-type HuggingFaceTokenizer "
                 "--tokenizer-model DIR, or reads rows tokenized already", nargs=1),
    MegatronFlag("--merge-file",
                 "This fork tokenizes with --tokenizer-type HuggingFaceTokenizer "
                 "--tokenizer-model DIR, or reads rows tokenized already", nargs=1),
    MegatronFlag("--spec",
                 "This fork builds its own packed layer specs on megatron-core's "
                 "(docs/architecture.md); drop --spec", nargs=2),
    MegatronFlag("--log-params-norm", "Not implemented here; drop it"),
    MegatronFlag("--apply-layernorm-1p",
                 "Zero-centred norm weights are not supported here; drop it"),
    MegatronFlag("--moe-permute-fusion",
                 "Transformer Engine's fused token permutation has not been verified under "
                 "packed CUDA graphs here; drop it"),
    MegatronFlag("--wandb-project",
                 "Weights & Biases logging is not built in; use --tensorboard-dir or "
                 "--metrics-file", nargs=1),
    MegatronFlag("--wandb-exp-name",
                 "Weights & Biases logging is not built in; use --tensorboard-dir or "
                 "--metrics-file", nargs=1),
)


def add_megatron_flags(parser: argparse.ArgumentParser) -> None:
    """The group of `ALREADY` and `REFUSED` flags (values are checked by `check`)."""
    g = parser.add_argument_group(
        "megatron compatibility",
        "Megatron-LM flags of existing scripts: accepted where this fork already behaves so "
        "(no effect), refused with the reason otherwise (docs/flags.md).")
    for entry in ALREADY:
        if entry.value is None:
            g.add_argument(entry.flag, dest=entry.dest, action="store_true",
                           help=f"Accepted, no effect: {entry.why}.")
        else:
            g.add_argument(entry.flag, dest=entry.dest, default=None, metavar=entry.value,
                           help=f"Accepted with {entry.value} only, no effect: {entry.why}.")
    for entry in REFUSED:
        if entry.nargs is None:
            g.add_argument(entry.flag, dest=entry.dest, action="store_true",
                           help=f"Refused. {entry.why}.")
        else:
            g.add_argument(entry.flag, dest=entry.dest, default=None, nargs=entry.nargs,
                           help=f"Refused. {entry.why}.")


def check(args: argparse.Namespace) -> List[str]:
    """Refuse what `REFUSED` names and a wrong value of an `ALREADY` flag (ValueError, in the
    `argument_checks.fail` shape); return the given `ALREADY` flags, each with its reason."""
    from megatron.training.argument_checks import fail

    for entry in REFUSED:
        value = getattr(args, entry.dest, None)
        if value not in (None, False):
            shown = True if value is True else " ".join(map(str, value))
            fail(entry.flag, shown, entry.why)
    given = []
    for entry in ALREADY:
        value = getattr(args, entry.dest, None)
        if value in (None, False):
            continue
        if entry.value is not None and str(value) != entry.value:
            fail(entry.flag, value, f"This fork runs as {entry.flag} {entry.value}: "
                                    f"{entry.why}; use {entry.value} or drop the flag")
        given.append(f"{entry.flag} ({entry.why})")
    return given
