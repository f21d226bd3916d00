"""Megatron-style command line for packed-sequence (THD) GPT and hybrid Mamba training.

``build_parser(model)`` declares the flags, grouped as Megatron-LM groups them and spelled as
Megatron-LM spells them (the dest is argparse's default: ``--num-layers`` -> ``num_layers``).
``validate_args`` is the one place that rejects bad combinations and fills derived values; the
rules themselves live in ``argument_checks.py``, one small function per group. Every rejection
is a ``ValueError("<what> is wrong: <value>. <what to do>.")``; ``parse_args`` turns it into a
one-line ``<script>: error: <message>`` (exit code 2, `OneLineErrorParser`), as it does an
unknown flag, with the closest known flag.

Every flag, its default and its rule: docs/flags.md.
"""

import argparse
import difflib
import enum
import os
import re
import sys
from pathlib import Path

from megatron.packed_training import argument_checks as checks
from megatron.packed_training import megatron_flags
from megatron.packed_training.megatron_flags import add_megatron_flags

MODELS = ("gpt", "hybrid")

_FLAG = re.compile(r"--?[A-Za-z]")  # an option, not a negative number such as -1e-3


class OneLineErrorParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line, ``<prog>: error: <message>``
    (exit code 2), not the whole usage; an unknown flag names the closest known one:
    ``unrecognized argument --seq-lenght; did you mean --seq-length?``. Unknown flags are
    reported before any other error (a misspelt required flag is also "required")."""

    def parse_known_args(self, args=None, namespace=None):
        self._argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def parse_args(self, args=None, namespace=None):
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed

    def unknown_flags(self, argv) -> list[str]:
        """The options in ``argv`` this parser does not know (``--flag=value``: ``--flag``)."""
        return [token.split("=", 1)[0] for token in argv
                if isinstance(token, str) and _FLAG.match(token)
                and token.split("=", 1)[0] not in self._option_string_actions]

    def suggest(self, flag: str) -> str | None:
        """The known flag closest to ``flag`` (difflib), or None."""
        known = [option for option in self._option_string_actions if option.startswith("--")]
        close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
        return close[0] if close else None

    def unrecognized(self, flags) -> str:
        """``unrecognized argument --x; did you mean --y?`` (several: comma-separated)."""
        if len(flags) == 1:
            close = self.suggest(flags[0])
            fix = f"did you mean {close}?" if close else f"{self.prog} --help lists the flags"
            return f"unrecognized argument {flags[0]}; {fix}"
        described = []
        for flag in flags:
            close = self.suggest(flag)
            described.append(f"{flag} (did you mean {close}?)" if close else flag)
        return (f"unrecognized arguments {', '.join(described)}; {self.prog} --help lists "
                f"the flags")

    def error(self, message):
        unknown = self.unknown_flags(getattr(self, "_argv", []))
        if unknown:
            message = self.unrecognized(unknown)
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser(model: str) -> argparse.ArgumentParser:
    """Parser for ``model`` ("gpt" or "hybrid"); parses without validating."""
    checks.check_model_name(model)
    script = "pretrain_gpt.py" if model == "gpt" else "pretrain_mamba.py"
    parser = OneLineErrorParser(
        prog=script,
        description=f"Packed-sequence (THD) {model} training, optionally under CUDA graphs.",
        allow_abbrev=False,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_model_args(parser, model)
    _add_hybrid_args(parser)
    _add_moe_args(parser)
    _add_mla_args(parser)
    _add_parallelism_args(parser)
    _add_training_args(parser)
    _add_learning_rate_args(parser)
    _add_checkpointing_args(parser)
    _add_logging_args(parser)
    _add_data_args(parser)
    _add_tokenizer_args(parser)
    _add_attention_args(parser)
    _add_cuda_graph_args(parser)
    _add_distributed_args(parser)
    add_megatron_flags(parser)
    return parser


def _add_model_args(parser, model):
    g = parser.add_argument_group("model")
    g.add_argument("--qk-layernorm", action="store_true",
                   help="A norm (--normalization's kind) on each head's query and key, as in "
                        "Qwen3 and OLMo 2; with --multi-latent-attention on the query and "
                        "key/value latents instead (DeepSeek's latent norms).")
    g.add_argument("--num-layers", type=int, default=None,
                   help="Transformer layers. Required for gpt; for hybrid it defaults to the "
                        "length of --hybrid-override-pattern.")
    g.add_argument("--hidden-size", type=int, required=True, help="Model width.")
    g.add_argument("--ffn-hidden-size", type=int, default=None,
                   help="MLP inner width (default: 4 * hidden size).")
    g.add_argument("--num-attention-heads", type=int, required=True, help="Attention heads.")
    g.add_argument("--num-query-groups", type=int, default=None,
                   help="Key/value head groups for GQA (default: number of attention heads).")
    g.add_argument("--kv-channels", type=int, default=None,
                   help="Per-head projection width (default: hidden size / heads).")
    g.add_argument("--seq-length", type=int, required=True,
                   help="Tokens per packed sequence (per micro-batch sample).")
    g.add_argument("--max-position-embeddings", type=int, default=None,
                   help="Longest position the model supports (default: --seq-length).")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="Tokenizer vocabulary size (default: 32000, or the size of "
                        "--tokenizer-model when given).")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="Pad the vocabulary to a multiple of this times the TP size.")
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="RMSNorm")
    g.add_argument("--swiglu", action="store_true", help="SwiGLU MLP activation.")
    g.add_argument("--squared-relu", action="store_true",
                   help="Squared-ReLU MLP activation, relu(x)^2 (Nemotron-H's), in place of "
                        "GELU; Megatron's flag.")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="Separate input embedding and output projection weights.")
    g.add_argument("--cross-entropy-loss-fusion", action="store_true",
                   help="Compute the output layer's cross entropy in fused kernels (no fp32 "
                        "copy of the logits); Megatron's flag.")
    g.add_argument("--cross-entropy-fusion-impl", choices=["native", "te"], default=None,
                   help="The fused cross entropy's kernels: megatron-core's torch.compile'd "
                        "one ('native', the default) or Transformer Engine's Triton kernel "
                        "('te'). Needs --cross-entropy-loss-fusion.")
    g.add_argument("--position-embedding-type", choices=["rope", "none"],
                   default="rope" if model == "gpt" else "none")
    g.add_argument("--rotary-base", type=int, default=10000, help="RoPE base period.")
    g.add_argument("--rotary-percent", type=float, default=1.0,
                   help="Fraction of each head's channels that RoPE rotates.")
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--hidden-dropout", type=float, default=0.0)
    g.add_argument("--attention-dropout", type=float, default=0.0)
    g.add_argument("--norm-epsilon", "--layernorm-epsilon", dest="layernorm_epsilon",
                   type=float, default=1e-5,
                   help="Epsilon of every norm (Megatron's --norm-epsilon; "
                        "--layernorm-epsilon is its older spelling).")


def _add_hybrid_args(parser):
    g = parser.add_argument_group("hybrid", "Hybrid Mamba-Transformer (pretrain_mamba.py only).")
    g.add_argument("--hybrid-override-pattern", type=str, default=None,
                   help="One character per layer: 'M' Mamba, '*' attention, '-' MLP, 'E' MoE "
                        "(needs --num-experts), '+' multi-latent attention (needs "
                        "--multi-latent-attention).")
    g.add_argument("--hybrid-attention-ratio", type=float, default=0.0,
                   help="Megatron's older way to lay out a hybrid model: this fraction of "
                        "--num-layers as attention layers, evenly spaced (megatron-core's "
                        "pattern_from_ratios); instead of --hybrid-override-pattern.")
    g.add_argument("--hybrid-mlp-ratio", type=float, default=0.0,
                   help="With --hybrid-attention-ratio: this fraction of --num-layers as MLP "
                        "layers.")
    g.add_argument("--mamba-state-dim", type=int, default=128)
    g.add_argument("--mamba-head-dim", type=int, default=64)
    g.add_argument("--mamba-num-groups", type=int, default=8)
    g.add_argument("--mamba-num-heads", type=int, default=None,
                   help="Mamba heads (default: 2 * hidden size / --mamba-head-dim).")


def _add_moe_args(parser):
    g = parser.add_argument_group("mixture of experts", "MoE layers (docs/moe.md).")
    g.add_argument("--num-experts", type=int, default=None,
                   help="Routed experts per MoE layer. gpt: every layer's MLP is an MoE layer; "
                        "hybrid: the 'E' layers of the pattern.")
    g.add_argument("--moe-router-topk", type=int, default=2, help="Experts per token.")
    layer_freq = g.add_argument(
        "--moe-layer-freq", default=1,
        help="gpt: which layers are MoE, the others dense: N makes every N-th layer MoE (the "
             "first included), or one 0/1 per layer as a Python list expression, e.g. "
             "\"[0]*1+[1]*26\" for a dense first layer (hybrid models take theirs from the "
             "pattern's 'E').")
    layer_freq.list_literal = True  # a library config may give the list itself (config.py)
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None,
                   help="Inner width of each routed expert (default: --ffn-hidden-size).")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                   help="Inner width of the shared expert every token also passes (default: "
                        "no shared expert).")
    g.add_argument("--moe-router-load-balancing-type", default="aux_loss",
                   choices=["aux_loss", "seq_aux_loss", "none"],
                   help="Load-balancing loss; its weight is --moe-aux-loss-coeff.")
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0,
                   help="Weight of the load-balancing loss (0: computed for nothing, so off).")
    g.add_argument("--moe-z-loss-coeff", type=float, default=None,
                   help="Weight of the router z-loss (default: off).")
    g.add_argument("--moe-router-score-function", choices=["softmax", "sigmoid"],
                   default="softmax")
    g.add_argument("--moe-router-pre-softmax", action="store_true",
                   help="Softmax over all experts before the top-k choice, weights not "
                        "renormalised (DeepSeek-V2; needed for top-1 softmax routing). "
                        "Default: softmax over the chosen experts' logits.")
    g.add_argument("--moe-router-enable-expert-bias", action="store_true",
                   help="Aux-loss-free load balancing (DeepSeek-V3, Moonlight): a per-expert "
                        "bias added to the scores for the top-k choice only, moved toward "
                        "balance after every global batch by --moe-router-bias-update-rate. "
                        "Needs --moe-router-score-function sigmoid.")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3,
                   help="Step of the expert-bias update per global batch.")
    g.add_argument("--moe-router-num-groups", type=int, default=None,
                   help="Group-limited routing (DeepSeek-V2/V3): the experts form this many "
                        "equal groups and each token chooses within --moe-router-group-topk "
                        "of them (e.g. one group per EP rank or node).")
    g.add_argument("--moe-router-group-topk", type=int, default=None,
                   help="Groups each token may route to, with --moe-router-num-groups.")
    g.add_argument("--moe-router-topk-scaling-factor", type=float, default=None,
                   help="Multiplies the routed experts' weights (e.g. DeepSeek-V3's 2.5, "
                        "Moonlight's 2.446; default: 1).")
    g.add_argument("--moe-router-dtype", choices=["fp32", "fp64"], default=None,
                   help="Precision of the router's logits and scores (default: the model's).")
    g.add_argument("--moe-token-dispatcher-type", default="alltoall",
                   choices=["alltoall", *checks.REFUSED_DISPATCHERS],
                   help="alltoall (the only one this fork runs; the others sync with the host "
                        "on every layer).")
    g.add_argument("--moe-expert-capacity-factor", type=float, default=None,
                   help="Per-expert capacity, as a multiple of an even share of the routed "
                        "tokens; tokens over it are dropped (default: dropless).")
    g.add_argument("--moe-pad-expert-input-to-capacity", action="store_true",
                   help="Drop-and-pad: every expert gets exactly its capacity of rows (static "
                        "shapes, no host sync; needed for CUDA graphs).")
    g.add_argument("--moe-capacity-overflow", choices=["drop", "rerun"], default="drop",
                   help="Tokens over an expert's drop-and-pad capacity under CUDA graphs: drop "
                        "them, or rerun the micro-batches that overflowed eager and dropless "
                        "before the optimizer step, so no token is dropped.")
    g.add_argument("--moe-router-load-file", default=None, metavar="PATH",
                   help="With --moe-capacity-overflow rerun: write the measured peak expert "
                        "loads here (JSON) at the end of training, for "
                        "tools/capacity_advisor.py --moe-router-loads.")
    g.add_argument("--moe-grouped-gemm", action="store_true",
                   help="Transformer Engine's grouped GEMM for the local experts (TEGroupedMLP).")
    g.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="Expert parallelism: ranks that split the experts of a layer.")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="Tensor parallelism inside each expert (default: "
                        "--tensor-model-parallel-size). 1 with TP > 1 folds the attention's "
                        "TP ranks into expert parallelism (megatron-core's MoE parallel "
                        "folding).")


def _add_mla_args(parser):
    g = parser.add_argument_group(
        "multi-latent attention", "MLA (DeepSeek / Moonlight style), Transformer Engine "
        "attention only (docs/mla.md).")
    g.add_argument("--multi-latent-attention", action="store_true",
                   help="MLA self-attention: gpt: every layer; hybrid: the '+' layers.")
    g.add_argument("--q-lora-rank", type=int, default=None,
                   help="Rank of the compressed query (default: no query compression).")
    g.add_argument("--kv-lora-rank", type=int, default=32,
                   help="Rank of the compressed key/value latent.")
    g.add_argument("--qk-head-dim", type=int, default=128,
                   help="Per-head query/key width without the RoPE part.")
    g.add_argument("--qk-pos-emb-head-dim", type=int, default=64,
                   help="Per-head width of the decoupled RoPE part of query and key.")
    g.add_argument("--v-head-dim", type=int, default=128, help="Per-head value width.")
    g.add_argument("--rope-type", choices=["yarn", "rope"], default=None,
                   help="MLA RoPE kind (default: yarn, the only one packed MLA runs).")
    g.add_argument("--rotary-scaling-factor", type=float, default=1.0,
                   help="Yarn context-extension factor (1: plain RoPE frequencies).")
    g.add_argument("--original-max-position-embeddings", type=int, default=4096,
                   help="Yarn: the context length the frequencies were trained for.")
    g.add_argument("--beta-fast", type=float, default=32.0,
                   help="Yarn: rotations above which a channel keeps its frequency.")
    g.add_argument("--beta-slow", type=float, default=1.0,
                   help="Yarn: rotations below which a channel is fully interpolated.")
    g.add_argument("--mscale", type=float, default=1.0, help="Yarn attention-scale factor.")
    g.add_argument("--mscale-all-dim", type=float, default=0.0,
                   help="Yarn attention-scale factor applied to all channels.")
    g.add_argument("--mla-pad-v", choices=["always", "never"], default="always",
                   help="Packed data: pad V to the query head size before attention "
                        "(always, megatron-core's choice) or hand Transformer Engine the "
                        "narrower V (never; docs/mla.md, 'V padding').")


def _add_parallelism_args(parser):
    g = parser.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None,
                   help="Model chunks per pipeline rank (interleaved schedule).")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="Alternative to --virtual-pipeline-model-parallel-size: layers per "
                        "model chunk.")
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument("--dynamic-cp-sizes", type=int, nargs="+", default=None, metavar="C",
                   help="Dynamic context parallelism: CP sizes a packed micro-batch may take, "
                        "ascending powers of two up to the data-parallel size (e.g. 1 2 4). A "
                        "micro-batch of size C holds C x (--seq-length / max size) positions. "
                        "See docs/context-parallel.md.")
    g.add_argument("--dynamic-cp-max-packed-seqs", type=int, nargs="+", default=None,
                   metavar="N",
                   help="Graph capacity (packed documents) of each --dynamic-cp-sizes bank, one "
                        "per size (default: --cuda-graph-max-packed-seqs for every size).")
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="Shard optimizer state across data-parallel ranks.")


def _add_training_args(parser):
    g = parser.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="Samples per optimizer step (default: micro batch * data parallel).")
    g.add_argument("--rampup-batch-size", type=int, nargs=3, default=None,
                   metavar=("START", "INCREMENT", "SAMPLES"),
                   help="Batch-size ramp-up as in Megatron: START samples per step, growing by "
                        "INCREMENT up to --global-batch-size over SAMPLES samples.")
    g.add_argument("--train-iters", type=int, default=None,
                   help="Training iterations (or give --train-samples).")
    g.add_argument("--train-samples", type=int, default=None,
                   help="Megatron's sample-based length: --train-iters = this // "
                        "--global-batch-size (not with --rampup-batch-size).")
    g.add_argument("--manual-gc", action="store_true",
                   help="Turn Python's automatic garbage collection off and collect every "
                        "--manual-gc-interval iterations instead, so collection pauses never "
                        "land inside a step (as Megatron's --manual-gc).")
    g.add_argument("--manual-gc-interval", type=int, default=0, metavar="N",
                   help="With --manual-gc: collect every N iterations (0: only at start).")
    g.add_argument("--bf16", action="store_true", help="bf16 mixed precision.")
    g.add_argument("--fp16", action="store_true", help="Not supported by this fork.")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--clip-grad", type=float, default=1.0, help="Gradient norm clip.")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", action="store_false",
                   dest="check_for_nan_in_loss_and_grad",
                   help="Skip DDP's NaN/Inf check of every gradient bucket before the gradient "
                        "reduction (two host syncs per bucket and step).")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.95)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--optimizer-cuda-graph", action="store_true",
                   help="Capture the optimizer step (gradient norm, clipping, Adam, the update "
                        "of the model's weights) as one CUDA graph after the eager warm-up "
                        "(--cuda-graph-warmup-steps), with any --cuda-graph-impl; learning rate "
                        "and Adam's step count stay device tensors the schedule updates.")
    g.add_argument("--deterministic-mode", action="store_true",
                   help="Deterministic kernels, for bitwise comparisons.")
    g.add_argument("--calculate-per-token-loss", action=argparse.BooleanOptionalAction,
                   default=True, help="Average the loss over all tokens of the global batch.")


def _add_learning_rate_args(parser):
    g = parser.add_argument_group("learning rate")
    g.add_argument("--lr", type=float, required=True, help="Peak learning rate.")
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine", "WSD"],
                   default="cosine")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="Warm-up as a fraction of the decay length (Megatron's flag), instead "
                        "of --lr-warmup-iters or --lr-warmup-samples.")
    g.add_argument("--lr-warmup-init", type=float, default=0.0,
                   help="Learning rate at the start of the warm-up.")
    g.add_argument("--lr-warmup-samples", type=int, default=None,
                   help="With --train-samples: --lr-warmup-iters = this // --global-batch-size.")
    g.add_argument("--lr-decay-samples", type=int, default=None,
                   help="With --train-samples: --lr-decay-iters = this // --global-batch-size.")
    g.add_argument("--lr-decay-iters", type=int, default=None,
                   help="Default: --train-iters.")
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None,
                   help="WSD: iterations of the final decay phase.")
    g.add_argument("--lr-wsd-decay-style", default="linear",
                   choices=["linear", "cosine", "exponential", "minus_sqrt"])


def _add_checkpointing_args(parser):
    g = parser.add_argument_group("checkpointing")
    g.add_argument("--save", type=str, default=None, help="Checkpoint directory to write.")
    g.add_argument("--load", type=str, default=None, help="Checkpoint directory to read.")
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--no-save-optim", action="store_true",
                   help="Checkpoints leave out the optimizer and the LR scheduler (smaller; "
                        "load them with --no-load-optim or --finetune).")
    g.add_argument("--no-save-rng", action="store_true",
                   help="Checkpoints leave out the RNG states (load them with --no-load-rng "
                        "or --finetune).")
    g.add_argument("--finetune", action="store_true",
                   help="Load weights only and start again at iteration 0.")


def _add_logging_args(parser):
    g = parser.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=1)
    g.add_argument("--log-num-zeros-in-grad", action="store_true",
                   help="Count zero gradient entries each step (the log's `num zeros`).")
    g.add_argument("--eval-interval", type=int, default=0, help="0 = no evaluation.")
    g.add_argument("--eval-iters", type=int, default=10)
    g.add_argument("--exit-interval", type=int, default=None,
                   help="Stop after the iteration that is a multiple of this (checkpoint first "
                        "when --save is set); the LR schedule still spans --train-iters.")
    g.add_argument("--exit-duration-in-mins", type=float, default=None, metavar="MINUTES",
                   help="Stop once this many minutes have passed since training started "
                        "(checkpoint first when --save is set), e.g. before a Slurm time "
                        "limit. Checked at log lines, which wait for the GPU anyway: the run "
                        "may go up to --log-interval iterations past it.")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="On --exit-signal (SIGTERM by default), stop training and save a "
                        "checkpoint when --save is set, e.g. on Slurm's warning before a time "
                        "limit (sbatch --signal). Checked at log lines, like "
                        "--exit-duration-in-mins; every rank stops at the same iteration.")
    g.add_argument("--exit-signal", default=None, metavar="SIGNAL",
                   help="The signal --exit-signal-handler waits for: a name such as SIGTERM "
                        "or SIGUSR1 (TERM and USR1 also work, as sbatch --signal spells them).")
    g.add_argument("--tensorboard-dir", type=str, default=None)
    g.add_argument("--tensorboard-queue-size", type=int, default=None,
                   help="Events the TensorBoard writer queues before it writes them out "
                        "(default 1000, as Megatron's). Needs --tensorboard-dir.")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true",
                   help="Also log the validation perplexity, exp(loss), as 'lm loss validation "
                        "ppl' to TensorBoard and W&B (Megatron's flag and tag).")
    g.add_argument("--wandb-project", default="",
                   help="Weights & Biases project: the reporting rank logs what TensorBoard "
                        "gets (the log line's values, the validation loss) to a W&B run there. "
                        "Empty (the default) logs nothing to W&B.")
    g.add_argument("--wandb-exp-name", default="",
                   help="The W&B run's name; needed with --wandb-project.")
    g.add_argument("--wandb-save-dir", default="",
                   help="Where W&B keeps the run's local files (default: <--save>/wandb, else "
                        "./wandb).")
    g.add_argument("--profile", action="store_true",
                   help="Profile iterations [--profile-step-start, --profile-step-end): nsys "
                        "capture range (cudaProfilerStart/Stop) and GPU-busy time per iteration.")
    g.add_argument("--profile-step-start", type=int, default=10)
    g.add_argument("--profile-step-end", type=int, default=12)
    g.add_argument("--profile-trace-dir", type=str, default=None,
                   help="With --profile: also record host activity (Python frames, ops, CUDA "
                        "runtime calls) and keep each profiled iteration's Chrome trace here as "
                        "trace_iter<N>_rank<R>.json (read it with tools/step_gaps.py).")
    g.add_argument("--metrics-file", type=str, default=None,
                   help="JSON-lines file, one record of metrics per step.")


def _add_data_args(parser):
    g = parser.add_argument_group("data")
    g.add_argument("--sft", action="store_true",
                   help="Packed SFT: honour the per-token loss_mask in the data.")
    g.add_argument("--data-path", type=str, default=None,
                   help="JSONL file of pre-tokenized documents.")
    g.add_argument("--valid-data-path", type=str, default=None)
    g.add_argument("--split", default=None, metavar="TRAIN,VALID,TEST",
                   help="Take the validation documents from --data-path instead of "
                        "--valid-data-path: relative shares of its documents, in file order, "
                        "e.g. 98,2,0 (Megatron's flag; '/' also separates). This fork has no "
                        "test evaluation, so the test share is not read.")
    g.add_argument("--mock-data", action="store_true", help="Built-in synthetic packed data.")
    g.add_argument("--mock-doc-length-median", type=float, default=512,
                   help="Median mock document length in tokens.")
    g.add_argument("--mock-doc-length-sigma", type=float, default=1.0,
                   help="Log-normal sigma of mock document lengths.")
    g.add_argument("--num-workers", type=int, default=0,
                   help="Data-loader worker processes per data iterator, reading and collating "
                        "micro-batches ahead of the loop; worth it when reading rows is slow. "
                        "0 (default) reads them in the loop: cheaper for in-memory rows.")
    g.add_argument("--long-document-policy", choices=["truncate", "split", "reject"],
                   default=None,
                   help="A document with more training positions than a row holds: split "
                        "(default) cuts it into row-sized pieces, each packed as a document; "
                        "truncate keeps its first --seq-length + 1 tokens; reject stops the "
                        "run naming its file:line.")
    g.add_argument("--max-truncated-token-fraction", type=float, default=None,
                   help="With --long-document-policy truncate: stop before training when "
                        "truncation drops more than this fraction of a data file's tokens "
                        "(default 0.05).")
    g.add_argument("--reject-long-documents", action="store_true",
                   help="Older spelling of --long-document-policy reject.")


def _add_tokenizer_args(parser):
    g = parser.add_argument_group("tokenizer",
                                  "Chat data, rendered at start-up (docs/data-format.md).")
    g.add_argument("--tokenizer-type", type=str, default=None,
                   help="HuggingFaceTokenizer: read chat conversations ('messages' JSONL) with "
                        "--tokenizer-model; the vocabulary size is the tokenizer's.")
    g.add_argument("--tokenizer-model", type=str, default=None,
                   help="Local tokenizer folder (tokenizer.json, tokenizer_config.json with its "
                        "chat template) or tokenizer.json file; never downloaded.")


def _add_attention_args(parser):
    g = parser.add_argument_group("attention")
    g.add_argument("--attention-backend", choices=["auto", "te", "flash", "torch"], default="auto",
                   help="auto: Transformer Engine if importable, else flash-attn, else torch.")
    g.add_argument("--te-rng-tracker", action="store_true",
                   help="Use Transformer Engine's CUDA RNG tracker (needs TE; always on with "
                        "--cuda-graph-impl transformer_engine, and with any graph "
                        "implementation over TE attention).")


def _add_cuda_graph_args(parser):
    g = parser.add_argument_group("cuda graphs", "See docs/flags.md, 'Graph flags'.")
    g.add_argument("--cuda-graph-impl", default="none",
                   choices=["none", "local", "transformer_engine", "full_iteration",
                            *checks.REFUSED_GRAPH_IMPLS],
                   help="none, local, transformer_engine or full_iteration (a training "
                        "iteration as one graph, layer or chunk graphs where it misses).")
    g.add_argument("--cuda-graph-modules", nargs="+", default=None,
                   help="Parts of each layer to capture, CudaGraphModule names (attn, mlp, "
                        "mamba; moe_router, moe_preprocess: MoE layers in part), space- or "
                        "comma-separated (default: the whole layer).")
    g.add_argument("--cuda-graph-scope", nargs="+", default=None,
                   help="Deprecated spelling of --cuda-graph-modules.")
    g.add_argument("--cuda-graph-max-packed-seqs", type=int, nargs="?", const=50, default=0,
                   help="Graph capacity: packed documents per micro-batch (bare flag: 50; "
                        "0: off). Choose with tools/capacity_advisor.py.")
    g.add_argument("--cuda-graph-capacity-ladder", type=int, nargs="+", default=None,
                   metavar="N",
                   help="Smaller capacities below --cuda-graph-max-packed-seqs, ascending: each "
                        "micro-batch is padded to the smallest captured one that fits (PP=1).")
    g.add_argument("--cuda-graph-warmup-steps", type=int, default=3,
                   help="Eager steps before capture.")
    g.add_argument("--cuda-graph-granularity", choices=["layer", "chunk"], default="layer",
                   help="layer: a forward and a backward graph per layer; chunk: one graph pair "
                        "per pipeline model chunk and in-flight micro-batch (local impl; prefer "
                        "it with pipeline parallelism). With full_iteration: the graphs of the "
                        "iterations its graph misses.")
    g.add_argument("--cuda-graph-check-interval", type=int, default=0, metavar="N",
                   help="Graph health check: every N training iterations replay one graphed "
                        "micro-batch, run it eager too and compare loss and gradient norm "
                        "(0: off).")
    g.add_argument("--cuda-graph-check-tolerance", type=float, default=0.01,
                   help="Largest relative difference of the health check's loss and gradient "
                        "norm that is not a divergence.")
    g.add_argument("--cuda-graph-check-action", choices=["warn", "disable"], default="warn",
                   help="On a health-check divergence: warn (log both values and the graph) "
                        "or disable (CUDA graphs off for the rest of the run).")


def _add_distributed_args(parser):
    g = parser.add_argument_group("distributed")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], default="nccl")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10)


def validate_args(args: argparse.Namespace, model: str, world_size: int | None = None):
    """Reject bad combinations (``ValueError``) and fill derived values, in place; returns args.

    Derived: model, num_layers (hybrid), ffn_hidden_size, num_query_groups, kv_channels,
    max_position_embeddings, data_parallel_size, virtual_pipeline_model_parallel_size,
    global_batch_size, num_microbatches, lr_decay_iters, cuda_graph_modules (list of names;
    the deprecated cuda_graph_scope is dropped),
    dynamic_cp_tokens_per_rank, dynamic_cp_max_packed_seqs, vocab_size (32000 or the
    tokenizer's), padded_vocab_size. ``world_size`` defaults to ``$WORLD_SIZE`` (1 if unset).
    """
    checks.check_model_name(model)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", 1))
    args.model = model
    # Megatron flags of existing scripts: refused with the reason, or named in the log.
    args.megatron_flags_without_effect = megatron_flags.check(args, model)
    checks.check_hybrid(args, model)
    checks.check_model(args, model)
    checks.check_parallelism(args, model, world_size)
    checks.check_optimizer_graph(args)  # before check_training: fp16 gets the graph's reason
    checks.check_training(args)
    checks.check_training_length(args)
    checks.check_learning_rate(args)
    checks.check_checkpointing(args)
    checks.check_logging(args)
    checks.check_tokenizer(args)
    checks.check_data(args)
    checks.check_attention(args)
    checks.check_cuda_graphs(args)
    checks.check_moe(args, model)
    checks.check_mla(args, model)
    checks.check_dynamic_cp(args)
    checks.check_graph_health_check(args)
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    args.padded_vocab_size = -(-args.vocab_size // multiple) * multiple
    return args


def parse_args(argv=None, model: str = "gpt") -> argparse.Namespace:
    """Parse and validate; a bad flag or value exits with one error line and code 2."""
    parser = build_parser(model)
    args = parser.parse_args(argv)
    try:
        validate_args(args, model)
    except ValueError as err:
        parser.error(str(err))
    return args


def args_to_dict(args: argparse.Namespace) -> dict:
    """JSON-safe copy of ``args``, for checkpoints and logs."""
    return {name: _json_safe(value) for name, value in sorted(vars(args).items())}


def _json_safe(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (list, tuple, set)):
        return [_json_safe(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    return str(value)


def format_args(args: argparse.Namespace) -> str:
    """Megatron-style listing: a header, then sorted ``  name ....... value`` lines."""
    lines = ["------------------------ arguments ------------------------"]
    for name in sorted(vars(args), key=str.lower):
        lines.append(f"  {name} {'.' * max(48 - len(name), 3)} {getattr(args, name)}")
    lines.append("-------------------- end of arguments ---------------------")
    return "\n".join(lines)
