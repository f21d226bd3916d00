"""Benchmark packed training: step time, tokens/s and peak memory, one table per run.

Each (preset, variant) trains with the real script (torchrun pretrain_*.py) for --steps
iterations; the first --warmup iterations (compilation, autotuning, graph capture) are left
out of the medians. All rows of a table come from the same invocation on the same machine.

    python tools/benchmark.py --presets hybrid-small gpt-small --steps 30
    python tools/benchmark.py --presets sweep --variants eager layer-graphs --profile
    python tools/benchmark.py --presets gpt-16x1024x4096 --variants eager layer-graphs \
        --profile --keep-traces /tmp/traces
    python tools/benchmark.py --presets hybrid-small --variants eager --capacities 16 64 256 1024
    python tools/benchmark.py --presets hybrid-small --variants eager layer-graphs te-layer-graphs
    python tools/benchmark.py --variants eager layer-graphs chunk-graphs --nproc 2 \
        --pipeline-model-parallel-size 2
    python tools/benchmark.py --presets gpt-small --variants eager te-layer-graphs --nproc 2 \
        --dynamic-cp-sets 1 2 1,2 --tokens-per-rank 2048
    python tools/benchmark.py --presets hybrid-small --from-metrics eager=runs/eager.jsonl \
        layer-graphs=runs/graphs.jsonl --warmup 10 --log-interval 10
    python tools/benchmark.py --presets moe --variants eager layer-graphs chunk-graphs --profile
    python tools/benchmark.py --presets moe --variants eager layer-graphs --nproc 4 \
        --expert-model-parallel-size 4 --global-batch-size 16 --moe-experts sequential grouped-gemm
    python tools/benchmark.py --presets mla --variants eager te-layer-graphs chunk-graphs \
        --moe-experts grouped-gemm --profile

--mode logprobs measures forward-only throughput instead of training: each (preset, variant)
runs tools/logprobs_benchmark.py under torchrun, which builds the policy of the library API
(megatron.packed_training.rl) from the same flags and times ``--steps`` log-prob calls (the
first ``--warmup`` left out), each over ``--global-batch-size`` / data-parallel micro-batches
of synthetic documents. A variant with a graph implementation replays forward-only graphs;
``eager`` runs without graphs. The table's step is one call, its graph memory and capture
the forward-only graphs', its fallback rate the micro-batches run eager for overflow:

    python tools/benchmark.py --mode logprobs --presets logprobs --variants eager layer-graphs \
        --global-batch-size 8

--from-metrics trains nothing: it tabulates the metrics files of finished runs (one row per
VARIANT=FILE, speedup against the row named eager), as examples/local/train_hybrid_synthetic.sh
does after its eager reference and graphed runs.

--dynamic-cp-sets runs every preset and variant once per set of dynamic CP sizes (a row
label ``preset cp1,2``), with ``--seq-length`` = tokens per rank x the set's largest size, so
every set holds the same positions per rank: a single-size set measures one graph bank.

--profile profiles the last two iterations of every run (excluded from the step-time median;
with --mode logprobs, the last two calls run once more) and reports the GPU-busy time of a
step (union of its kernel intervals) and the ratio step time / GPU-busy time: 1.0 is the
physical limit, a launch-bound step is far above it. With --mode logprobs it also prints,
below the table, each row's top host functions of one more call (cProfile, by own time).
--keep-traces DIR (with --profile) also records host activity in those iterations and keeps
their Chrome traces in ``DIR/<preset>/<variant>/trace_iter<N>_rank<R>.json`` (spaces of a
row label become ``_``): tools/kernel_time_diff.py compares two variants' GPU time per
kernel, tools/step_gaps.py names the host code a step waits on.

MoE presets (group ``moe``) train drop-and-pad MoE layers, the mode CUDA graphs capture
(docs/moe.md). --expert-model-parallel-size applies to them only (row label ``ep<N>``);
--moe-experts grouped-gemm runs them again with TE attention and TE's grouped GEMM experts
(row label ``grouped-gemm``; needs Transformer Engine). A table with an MoE row adds two
columns: the dropped-token fraction (mean of the metrics file's moe_dropped_token_fraction
over the timed steps) and the rerun rate (micro-batches rerun eager after a capacity
overflow, per micro-batch, from "eager moe_overflow_rerun"); "-" where the run does not
write the key.

MoE modes (``--moe-modes``, MoE presets only; the variant column names any but the default):
``drop-and-pad`` (default) the preset's capacity factor, padded (``--moe-capacity-factor``
overrides it); ``dropless`` megatron-core's dropless alltoall (no capacity; eager only: it reads
token counts on the host in every MoE layer); ``dropless-graphs`` ``--moe-dropless-graphs``
(static-shape dropless layers, graphed whole); ``rerun`` drop-and-pad with
``--moe-capacity-overflow rerun`` (graph variants only). Combinations training refuses
(``dropless`` under graphs, ``rerun`` eager) are left out. Speedups of an MoE preset are
against its ``eager dropless`` row where the table has one (what dropless training runs
without graphs), else its ``eager`` row. ``--moe-routers skewed`` runs the MoE presets again
with ``--moe-router-skew 0.5`` (about half the routed slots to an eighth of the experts; row
label ``skewed``) next to the default ``balanced`` (randomly initialised) router:

    python tools/benchmark.py --presets qwen3-30b-a3b-layers --variants eager layer-graphs \
        te-layer-graphs --moe-modes dropless dropless-graphs drop-and-pad \
        --moe-routers balanced skewed --profile

Qwen3-MoE presets (group ``qwen3-moe``): ``qwen3-30b-a3b-layers``, four layers of
Qwen3-30B-A3B's shapes (hidden 2048, 32 heads / 4 query groups of 128, qk-layernorm, 128
experts top-8 of width 768, TE attention and TE's grouped GEMM: needs Transformer Engine), and
``qwen3-moe-small`` (hidden 512, 64 experts top-8 of width 256, TE-free like group ``moe``).

--precisions runs every preset and variant once per precision: ``bf16`` (the default) and
``fp8-tensorwise``, ``fp8-blockwise``, ``fp8-delayed`` (``--fp8-format e4m3 --fp8-recipe
<recipe>``: the linear layers' GEMMs in FP8 on Transformer Engine, which such a row needs
installed; ``--attention-backend auto`` is added where the preset names no TE attention
backend), and for MoE presets ``fp8-tensorwise-bf16-experts`` (tensorwise with the routed
experts in BF16: ``--te-precision-config-file examples/fp8/moe_experts_bf16.yaml``). With
more than ``bf16`` every row's label ends in its precision and the table adds
*vs bf16*, tokens/s against the bf16 row of the same preset and variant (*speedup* stays
against eager at the row's own precision); below the table, the fastest variant of each
precision per preset, against the fastest bf16 one. A preset whose positions per rank
(micro-batch x sequence / CP ranks) are not a multiple of 16 (128 blockwise), or whose
Mamba input projection width is not a multiple of 16, is refused before any run (the
training parser's rules, megatron/packed_training/fp8_flags.py). Dropless-graphs MoE rows stay bf16 (their
experts run in BF16); full-iteration rows of an MoE preset are left out at every precision
(training refuses MoE inside full-iteration graphs). Group ``fp8``: ``qwen3-8b-layers``
(Qwen3-8B's layer shapes, 4 layers), ``nemotron-h-8b-layers`` (Nemotron-H-8B's, 7 layers
``M-M-M*-``) and ``qwen3-30b-a3b-layers``, all at sequence 8192 but the last (4096):

    python tools/benchmark.py --presets fp8 --variants eager layer-graphs full-iteration \
        --precisions bf16 fp8-tensorwise fp8-blockwise --steps 15 --warmup 5 --profile

MLA presets (group ``mla``: ``moonlight-small``, a Moonlight-shaped MLA + MoE model,
docs/mla.md) run on Transformer Engine attention whatever the variant. They are MoE presets
too (64 experts; --moe-experts and --expert-model-parallel-size apply), outside the TE-free
group ``moe``.

Runs are launched in Megatron-LM's command line (the scripts run Megatron-LM's parser and
loop). ``--attention-backend auto`` is Transformer Engine where it is importable, so a row
that needs TE (an MLA preset, grouped-gemm experts, te-layer-graphs) fails at once, without
training, where TE is not importable. Every run carries the old fork's defaults that the
presets were measured with (``FORK_NUMERICS``; each preset its position embedding, query
groups and FFN width), no evaluation (``--eval-iters 0``) and Megatron-LM's memory report at
the last step (``--log-memory-interval``): *peak mem* is the largest "max allocated" that
report prints (the metrics file holds no memory; ``--from-metrics`` shows "-" unless the file
is an older one with ``mem_max_allocated_bytes``).

Prints a Markdown table, headed by the machine (the visible GPUs, from nvidia-smi), the date,
the installed torch / megatron-core / TE / mamba-ssm and the command; --json FILE also
writes the rows. A configuration that fails
(training exits non-zero, or leaves no metrics) does not stop the others: its row shows the
error, its log tail goes to stderr, and the exit status is 1.

Each run starts torchrun with ``--standalone``: the rendezvous store binds a free port
itself, so several benchmarks can share one machine without a port race. On a machine
without a CUDA GPU (or with fewer than --nproc visible) it starts none: one line says so, and
the exit status is 1.
"""

import argparse
import collections
import datetime
import importlib.metadata
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

HYBRID_PATTERN_16 = "M-M-M*-M-M-M*-M-"  # 7 Mamba, 2 attention, 7 MLP layers
# Nemotron-H-like: hybrid-small with every MLP an MoE layer (7 Mamba, 2 attention, 7 MoE).
HYBRID_MOE_PATTERN_16 = HYBRID_PATTERN_16.replace("-", "E")
# Nemotron-H-8B's pattern opens "M-M-M-M*-": three Mamba-MLP pairs and attention, short.
NEMOTRON_H_PATTERN_7 = "M-M-M*-"

# Drop-and-pad MoE (alltoall dispatcher, every expert padded to its capacity): static shapes
# and no host read, so graphs capture whole MoE layers. capacity factor x top-k <= experts.
# SequentialMLP experts; --moe-experts grouped-gemm adds GROUPED_GEMM.
MOE = ["--num-experts", "16", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "1024",
       "--moe-token-dispatcher-type", "alltoall", "--moe-expert-capacity-factor", "1.25",
       "--moe-pad-expert-input-to-capacity", "--moe-aux-loss-coeff", "1e-2"]
# Grouped GEMM experts come with the TE layer spec: TE attention (auto: TE, which such a row
# needs installed; `needs_transformer_engine`).
GROUPED_GEMM = ["--attention-backend", "auto", "--moe-grouped-gemm"]
MOE_EXPERTS = {"sequential": [], "grouped-gemm": GROUPED_GEMM}

# What the old fork's parser defaulted to and every benchmark in docs/benchmarks.md trained
# with, as Megatron-LM's flags (upstream's defaults: LayerNorm, linear biases, dropout 0.1,
# Adam beta2 0.999, linear decay, the loss averaged per micro-batch). Part of COMMON.
FORK_NUMERICS = ["--normalization", "RMSNorm", "--disable-bias-linear", "--hidden-dropout", "0",
                 "--attention-dropout", "0", "--adam-beta2", "0.95", "--lr-decay-style",
                 "cosine", "--calculate-per-token-loss"]


def flag_value(flags: list, flag: str):
    """The last value of ``flag`` in ``flags``; None when absent."""
    at = [i for i, word in enumerate(flags) if word == flag]
    return flags[at[-1] + 1] if at else None


def gpt_preset(*flags: str) -> tuple:
    """A pretrain_gpt.py preset: ``flags`` plus the old fork's model defaults that Megatron-LM
    spells out: RoPE, positions up to --seq-length, query groups only with
    --group-query-attention, and with --swiglu the 4 x hidden FFN width (Megatron-LM shrinks a
    SwiGLU FFN to 2/3 of it)."""
    flags = list(flags)
    shape = ["--position-embedding-type", "rope",
             "--max-position-embeddings", flag_value(flags, "--seq-length")]
    if "--num-query-groups" in flags:
        shape.append("--group-query-attention")
    if "--swiglu" in flags and "--ffn-hidden-size" not in flags:
        shape += ["--ffn-hidden-size", str(4 * int(flag_value(flags, "--hidden-size")))]
    return "pretrain_gpt.py", flags + shape


def hybrid_preset(*flags: str) -> tuple:
    """A pretrain_mamba.py preset: ``flags`` (the layers from --hybrid-layer-pattern, which
    sets the layer count) plus the old fork's model defaults: no position embedding (the Mamba
    layers carry position), positions up to --seq-length, query groups only with
    --group-query-attention."""
    flags = list(flags)
    shape = ["--position-embedding-type", "none",
             "--max-position-embeddings", flag_value(flags, "--seq-length")]
    if "--num-query-groups" in flags:
        shape.append("--group-query-attention")
    return "pretrain_mamba.py", flags + shape


PRESETS = {
    # The foundation's default small configs (the eager baseline of docs/benchmarks.md).
    "hybrid-small": hybrid_preset(
        "--hybrid-layer-pattern", HYBRID_PATTERN_16, "--hidden-size", "1024",
        "--num-attention-heads", "16", "--num-query-groups", "8", "--seq-length", "4096"),
    "gpt-small": gpt_preset(
        "--num-layers", "16", "--hidden-size", "1024", "--num-attention-heads", "16",
        "--num-query-groups", "8", "--swiglu", "--seq-length", "4096"),
    # Size sweep from launch-bound to GPU-bound (layers x hidden x tokens).
    "gpt-8x512x2048": gpt_preset(
        "--num-layers", "8", "--hidden-size", "512", "--num-attention-heads", "8",
        "--swiglu", "--seq-length", "2048"),
    "gpt-16x1024x4096": gpt_preset(
        "--num-layers", "16", "--hidden-size", "1024", "--num-attention-heads", "16",
        "--swiglu", "--seq-length", "4096"),
    "gpt-24x2048x4096": gpt_preset(
        "--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16",
        "--swiglu", "--seq-length", "4096"),
    "hybrid-8x512x2048": hybrid_preset(
        "--hybrid-layer-pattern", "M-M*M-M*", "--hidden-size", "512",
        "--num-attention-heads", "8", "--seq-length", "2048"),
    "hybrid-16x1024x4096": hybrid_preset(
        "--hybrid-layer-pattern", HYBRID_PATTERN_16, "--hidden-size", "1024",
        "--num-attention-heads", "16", "--seq-length", "4096"),
    "hybrid-24x2048x4096": hybrid_preset(
        "--hybrid-layer-pattern", "M-M-M*-M-M-M*-M-M-M-M*-M", "--hidden-size", "2048",
        "--num-attention-heads", "16", "--seq-length", "4096"),
    # MoE: 16 experts, top-2, drop-and-pad (MOE).
    "gpt-moe-small": gpt_preset(
        "--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16",
        "--num-query-groups", "8", "--swiglu", "--seq-length", "4096", *MOE),
    "hybrid-moe-small": hybrid_preset(
        "--hybrid-layer-pattern", HYBRID_MOE_PATTERN_16, "--hidden-size", "1024",
        "--num-attention-heads", "16", "--num-query-groups", "8", "--seq-length", "4096", *MOE),
    # Qwen3-30B-A3B's layer shapes, 4 layers: 32 heads of 128 over 4 query groups,
    # qk-layernorm, 128 experts top-8 of width 768 (TE attention and TE's grouped GEMM, which
    # the preset needs installed), drop-and-pad as every MoE preset (--moe-modes changes it).
    "qwen3-30b-a3b-layers": gpt_preset(
        "--num-layers", "4", "--hidden-size", "2048", "--num-attention-heads", "32",
        "--num-query-groups", "4", "--kv-channels", "128", "--qk-layernorm", "--swiglu",
        "--seq-length", "4096", "--rotary-base", "1000000", "--num-experts", "128",
        "--moe-router-topk", "8", "--moe-ffn-hidden-size", "768",
        "--moe-token-dispatcher-type", "alltoall", "--moe-expert-capacity-factor", "1.25",
        "--moe-pad-expert-input-to-capacity", "--moe-aux-loss-coeff", "1e-3",
        "--moe-grouped-gemm", "--attention-backend", "auto"),
    # Qwen3-MoE-like and small: hidden 512, 64 experts top-8 of width 256 (TE-free).
    "qwen3-moe-small": gpt_preset(
        "--num-layers", "8", "--hidden-size", "512", "--num-attention-heads", "8",
        "--num-query-groups", "4", "--qk-layernorm", "--swiglu", "--seq-length", "4096",
        "--num-experts", "64", "--moe-router-topk", "8", "--moe-ffn-hidden-size", "256",
        "--moe-token-dispatcher-type", "alltoall", "--moe-expert-capacity-factor", "1.25",
        "--moe-pad-expert-input-to-capacity", "--moe-aux-loss-coeff", "1e-3"),
    # Moonlight-16B-A3B's ratios at hidden 1024, 8 layers (docs/mla.md): MLA with kv_lora_rank
    # = hidden / 4, no query compression, head dims 128 / 64 / 128, latent norms, RoPE base
    # 50000 without yarn scaling; 64 experts, top-6, sigmoid router, expert width 0.6875 x
    # hidden, two shared experts; every layer MoE, drop-and-pad. MLA runs on TE attention
    # (auto: TE, which the preset needs installed); the experts follow --moe-experts like every
    # MoE preset's.
    "moonlight-small": gpt_preset(
        "--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "8",
        "--seq-length", "4096", "--swiglu", "--untie-embeddings-and-output-weights",
        "--multi-latent-attention", "--kv-lora-rank", "256", "--qk-head-dim", "128",
        "--qk-pos-emb-head-dim", "64", "--v-head-dim", "128", "--qk-layernorm",
        "--rotary-base", "50000",
        "--num-experts", "64", "--moe-router-topk", "6", "--moe-ffn-hidden-size", "704",
        "--moe-shared-expert-intermediate-size", "1408", "--moe-router-score-function",
        "sigmoid", "--moe-router-enable-expert-bias", "--moe-router-topk-scaling-factor",
        "2.446", "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff",
        "1e-3", "--moe-token-dispatcher-type", "alltoall", "--moe-expert-capacity-factor",
        "1.25", "--moe-pad-expert-input-to-capacity", "--attention-backend", "auto"),
    # Qwen3-8B's layer shapes, 4 layers: hidden 4096, 32 heads of 128 over 8 query groups,
    # qk-layernorm, SwiGLU FFN 12288, RoPE base 1e6, untied embeddings, sequence 8192.
    "qwen3-8b-layers": gpt_preset(
        "--num-layers", "4", "--hidden-size", "4096", "--num-attention-heads", "32",
        "--num-query-groups", "8", "--kv-channels", "128", "--qk-layernorm", "--swiglu",
        "--ffn-hidden-size", "12288", "--seq-length", "8192", "--rotary-base", "1000000",
        "--untie-embeddings-and-output-weights"),
    # Nemotron-H-8B's layer shapes, 7 layers of its pattern's opening (3 Mamba, 1 attention,
    # 3 MLP): hidden 4096; Mamba 128 heads of 64, 8 groups, state 128 (input projection
    # 18560 wide); 32 heads of 128 over 8 query groups; squared-ReLU FFN 21504; sequence 8192.
    "nemotron-h-8b-layers": hybrid_preset(
        "--hybrid-layer-pattern", NEMOTRON_H_PATTERN_7, "--hidden-size", "4096",
        "--mamba-num-heads", "128", "--mamba-head-dim", "64", "--mamba-num-groups", "8",
        "--mamba-state-dim", "128", "--num-attention-heads", "32", "--num-query-groups", "8",
        "--kv-channels", "128", "--squared-relu", "--ffn-hidden-size", "21504",
        "--seq-length", "8192", "--untie-embeddings-and-output-weights"),
}
PRESET_GROUPS = {
    "sweep": ["gpt-8x512x2048", "gpt-16x1024x4096", "gpt-24x2048x4096",
              "hybrid-8x512x2048", "hybrid-16x1024x4096", "hybrid-24x2048x4096"],
    # TE-free MoE presets: 16 experts, top-2.
    "moe": ["gpt-moe-small", "hybrid-moe-small"],
    # Multi-latent attention presets (need Transformer Engine).
    "mla": ["moonlight-small"],
    # Qwen3-MoE shapes: 128 experts top-8 on TE (needs Transformer Engine), 64 top-8 TE-free.
    "qwen3-moe": ["qwen3-30b-a3b-layers", "qwen3-moe-small"],
    # FP8 against BF16 (--precisions) at 8B layer shapes: dense, hybrid and MoE (need
    # Transformer Engine).
    "fp8": ["qwen3-8b-layers", "nemotron-h-8b-layers", "qwen3-30b-a3b-layers"],
    # --mode logprobs: forward-only throughput at the launch-bound and the GPU-bound end, and
    # a drop-and-pad MoE hybrid.
    "logprobs": ["gpt-8x512x2048", "gpt-16x1024x4096", "hybrid-8x512x2048",
                 "hybrid-16x1024x4096", "hybrid-moe-small"],
}

# Variants are extra flags on top of a preset.
VARIANTS = {
    "eager": [],
    "layer-graphs": ["--cuda-graph-impl", "local", "--cuda-graph-max-packed-seqs", "32",
                     "--cuda-graph-warmup-steps", "2"],
    # Transformer Engine's make_graphed_callables (needs TE; PP = 1).
    "te-layer-graphs": ["--cuda-graph-impl", "transformer_engine",
                        "--cuda-graph-max-packed-seqs", "32", "--cuda-graph-warmup-steps", "2"],
    "chunk-graphs": ["--cuda-graph-impl", "local", "--cuda-graph-granularity", "chunk",
                     "--cuda-graph-max-packed-seqs", "32", "--cuda-graph-warmup-steps", "2"],
    # layer-graphs plus the graph health check at every iteration: the step-time difference
    # to layer-graphs is one check's cost (at --cuda-graph-check-interval N, spread over N).
    "layer-graphs-health-check": ["--cuda-graph-impl", "local",
                                  "--cuda-graph-max-packed-seqs", "32",
                                  "--cuda-graph-warmup-steps", "2",
                                  "--cuda-graph-check-interval", "1"],
    # Each iteration whose micro-batches all fit is one graph; the others run layer graphs
    # (dense presets only, PP = 1). DDP's NaN check syncs, so it is off here (and only here;
    # Megatron-LM refuses full_iteration graphs with it on).
    "full-iteration": ["--cuda-graph-impl", "full_iteration", "--cuda-graph-max-packed-seqs",
                       "32", "--cuda-graph-warmup-steps", "2",
                       "--no-check-for-nan-in-loss-and-grad"],
    # A large top capacity (few fallbacks) without paying for it on ordinary micro-batches.
    "layer-graphs-ladder": ["--cuda-graph-impl", "local", "--cuda-graph-max-packed-seqs", "1024",
                            "--cuda-graph-capacity-ladder", "16", "64", "256",
                            "--cuda-graph-warmup-steps", "2"],
}

# No evaluation (mock data has a validation split of its own, which Megatron-LM would
# evaluate at the end), the data read in the loop as the old fork did (Megatron-LM's default
# is two loader workers), and FORK_NUMERICS. The data: `data_flags`.
COMMON = ["--sft", "--bf16", "--lr", "1e-4", "--micro-batch-size", "1",
          "--vocab-size", "32000", "--seed", "1234", "--eval-iters", "0", "--num-workers", "0",
          *FORK_NUMERICS]

# Metrics-file keys of MoE runs: the dropped-slot fraction per log interval (metrics.RuntimeLog,
# with a capacity factor) and the micro-batches rerun eager and dropless after an
# expert-capacity overflow (the graph runtime's eager count for reason
# moe_rerun.RERUN_REASON; written only where reruns are on).
DROPPED_KEY = "moe_dropped_token_fraction"
RERUN_KEY = "eager moe_overflow_rerun"

# How MoE presets route (--moe-modes): flags put in place of the preset's capacity flags
# (None: keep them). The first is the default and leaves the variant label alone.
CAPACITY_FLAGS = ("--moe-expert-capacity-factor", "--moe-pad-expert-input-to-capacity")
MOE_MODES = {
    "drop-and-pad": None,
    "dropless": [],  # megatron-core's dropless alltoall: eager (or partial graphs) only
    "dropless-graphs": ["--moe-dropless-graphs"],
    "rerun": None,  # drop-and-pad + --moe-capacity-overflow rerun: graph variants only
}
DEFAULT_MOE_MODE = "drop-and-pad"
MOE_ROUTERS = {"balanced": [], "skewed": ["--moe-router-skew", "0.5"]}

BF16_EXPERTS_PRECISION = "fp8-tensorwise-bf16-experts"
# Precisions (--precisions): Megatron-LM's FP8 flags for the linear layers' GEMMs (Transformer
# Engine's; attention and Mamba's scan stay BF16). The first is the default and leaves the row
# label alone when it is the only one.
PRECISIONS = {
    "bf16": [],
    "fp8-tensorwise": ["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise"],
    "fp8-blockwise": ["--fp8-format", "e4m3", "--fp8-recipe", "blockwise"],
    "fp8-delayed": ["--fp8-format", "e4m3", "--fp8-recipe", "delayed"],
    # Tensorwise with the routed experts kept in BF16 (Megatron-LM's per-module precision file;
    # MoE presets only: a dense model has no experts to keep).
    BF16_EXPERTS_PRECISION: ["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise",
                             "--te-precision-config-file", os.path.join(
                                 REPO, "examples", "fp8", "moe_experts_bf16.yaml")],
}
DEFAULT_PRECISION = "bf16"
TE_ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused")  # auto: TE where importable


def num_experts(preset: str) -> int | None:
    """--num-experts of a preset; None for a dense one."""
    flags = PRESETS[preset][1]
    return int(flags[flags.index("--num-experts") + 1]) if "--num-experts" in flags else None


def is_moe(preset: str) -> bool:
    return preset in PRESETS and num_experts(preset) is not None


def needs_transformer_engine(preset: str, variant: str, experts: str = "sequential",
                             precision: str = DEFAULT_PRECISION) -> bool:
    """Whether a run needs Transformer Engine: multi-latent attention (an MLA preset), grouped
    GEMM experts (asked for, or the preset's own), TE's graphs, or FP8 (TE's GEMMs).
    ``--attention-backend auto`` would run the others TE-free."""
    flags = PRESETS[preset][1]
    return ("--multi-latent-attention" in flags or "--moe-grouped-gemm" in flags
            or experts == "grouped-gemm" or variant == "te-layer-graphs"
            or precision != DEFAULT_PRECISION)


def transformer_engine_importable() -> bool:
    """Whether the runs (this interpreter, ``sys.executable``) can import Transformer Engine."""
    return importlib.util.find_spec("transformer_engine") is not None


def row_label(preset: str, args, cp_set: str = "", experts: str = "sequential", *,
              router: str = "balanced", precision: str = DEFAULT_PRECISION) -> str:
    """A row's preset column: the preset, then what this run changes about it; last the
    precision, on every row once --precisions holds more than the default."""
    label = preset
    if is_moe(preset):
        label += "" if experts == "sequential" else f" {experts}"
        label += "" if router == "balanced" else f" {router}"
        ep = args.expert_model_parallel_size
        label += f" ep{ep}" if ep > 1 else ""
    label = f"{label} cp{cp_set}" if cp_set else label
    return f"{label} {precision}" if labels_precision(args) else label


def labels_precision(args) -> bool:
    """Whether row labels name their precision: --precisions is more than the default."""
    return getattr(args, "precisions", [DEFAULT_PRECISION]) != [DEFAULT_PRECISION]


def variant_label(variant: str, mode: str = DEFAULT_MOE_MODE) -> str:
    """A row's variant column: the variant, and an MoE mode other than the default."""
    return variant if mode == DEFAULT_MOE_MODE else f"{variant} {mode}"


def moe_mode_applies(variant: str, mode: str) -> bool:
    """Whether training takes ``mode`` under ``variant``: megatron-core's dropless dispatch
    reads token counts on the host (no whole-layer graphs), and reruns redo what graphs
    dropped (no eager runs)."""
    graphed = bool(variant_flags(variant))
    return not ((mode == "dropless" and graphed) or (mode == "rerun" and not graphed))


def variant_applies(preset: str, variant: str) -> bool:
    """Whether training takes ``variant`` for ``preset``: full-iteration graphs hold no MoE
    layer (host state per micro-batch)."""
    return not (variant == "full-iteration" and is_moe(preset))


def precision_applies(preset: str, mode: str, precision: str) -> bool:
    """Whether ``precision`` is a row of ``preset`` with MoE ``mode``: dropless graphs' grouped
    experts run in BF16 only (drop-and-pad and megatron-core's dropless take FP8), and BF16
    experts need experts."""
    if precision == BF16_EXPERTS_PRECISION and not is_moe(preset):
        return False
    return not (mode == "dropless-graphs" and precision != DEFAULT_PRECISION)


def precision_flags(flags: list, precision: str) -> list:
    """What a run at ``precision`` (a PRECISIONS key) adds to ``flags`` (its preset's, common
    and variant flags): the FP8 flags, and ``--attention-backend auto`` where ``flags`` name
    a non-TE backend or none (FP8 runs on TE's layers; auto is TE where importable, and the
    row needs TE installed: `needs_transformer_engine`)."""
    added = list(PRECISIONS[precision])
    if added and flag_value(flags, "--attention-backend") not in TE_ATTENTION_BACKENDS:
        added += ["--attention-backend", "auto"]
    return added


def moe_mode_flags(model_flags: list, mode: str, capacity_factor=None) -> list:
    """``model_flags`` (an MoE preset's) routed by ``mode`` (`MOE_MODES`): the capacity flags
    replaced or kept, ``capacity_factor`` in place of the preset's factor where kept."""
    replacement = MOE_MODES[mode]
    flags = list(model_flags)
    if replacement is not None:
        for flag in CAPACITY_FLAGS:
            while flag in flags:
                at = flags.index(flag)
                takes_value = flag == CAPACITY_FLAGS[0]
                del flags[at:at + 1 + takes_value]
        return flags + replacement
    if capacity_factor is not None:
        flags[flags.index(CAPACITY_FLAGS[0]) + 1] = f"{capacity_factor:g}"
    return flags + (["--moe-capacity-overflow", "rerun"] if mode == "rerun" else [])


def variant_flags(variant: str) -> list:
    """Flags of a variant name: a VARIANTS key, or 'layer-graphs-c<N>' for capacity N."""
    if variant.startswith("layer-graphs-c"):
        capacity = variant.removeprefix("layer-graphs-c")
        flags = list(VARIANTS["layer-graphs"])
        flags[flags.index("--cuda-graph-max-packed-seqs") + 1] = capacity
        return flags
    return VARIANTS[variant]


def dynamic_cp_flags(cp_set: str, tokens_per_rank: int) -> list:
    """Training flags of a dynamic CP set ``"1,2"``: the sizes and the matching seq length."""
    sizes = [int(c) for c in cp_set.split(",")]
    return ["--dynamic-cp-sizes", *map(str, sizes), "--seq-length", str(tokens_per_rank * sizes[-1])]


class RunFailed(RuntimeError):
    """One configuration failed: ``summary`` is one line for the table, ``log`` its tail."""

    def __init__(self, summary: str, log: str = ""):
        super().__init__(summary)
        self.summary, self.log = summary, log


def launch_command(preset: str, variant: str, args, metrics: str, cp_set: str = "",
                   experts: str = "sequential", *, mode: str = DEFAULT_MOE_MODE,
                   router: str = "balanced", precision: str = DEFAULT_PRECISION) -> list:
    """The torchrun command of one configuration. ``--standalone``: torchrun's rendezvous
    store binds a free port itself (``localhost:0``) and the ranks reuse that store, so no
    port is chosen before it is bound (benchmarks side by side cannot race for one).
    ``experts`` (a MOE_EXPERTS key), ``mode`` (a MOE_MODES key), ``router`` (a MOE_ROUTERS
    key) and --expert-model-parallel-size reach MoE presets only; ``precision`` (a PRECISIONS
    key) every preset (`precision_flags`), before --extra-args."""
    script, model_flags = PRESETS[preset]
    dynamic_cp = dynamic_cp_flags(cp_set, args.tokens_per_rank) if cp_set else []
    moe = []
    if is_moe(preset):
        model_flags = moe_mode_flags(model_flags, mode,
                                     getattr(args, "moe_capacity_factor", None))
        moe = [*MOE_EXPERTS[experts], *MOE_ROUTERS[router], "--expert-model-parallel-size",
               str(args.expert_model_parallel_size)]
    profile = (["--profile", "--profile-step-start", str(args.steps - 1),
                "--profile-step-end", str(args.steps + 1)] if args.profile else [])
    if args.keep_traces:
        profile += ["--profile-trace-dir", trace_dir(args.keep_traces, preset, variant, args,
                                                     cp_set, experts, mode=mode, router=router,
                                                     precision=precision)]
    base = [*model_flags, *COMMON, *variant_flags(variant)]
    # Megatron-LM's memory report at the last step (--steps is a multiple of --log-interval).
    flags = [*base, *precision_flags(base, precision), *moe, *profile,
             "--train-iters", str(args.steps), "--global-batch-size", str(args.global_batch_size),
             *data_flags(args),
             "--pipeline-model-parallel-size", str(args.pipeline_model_parallel_size),
             "--log-interval", str(args.log_interval), "--log-memory-interval", str(args.steps),
             "--metrics-file", metrics, *shlex.split(args.extra_args), *dynamic_cp]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
            "--nproc-per-node", str(args.nproc), os.path.join(REPO, script), *flags,
            *position_limit(flags)]


def data_flags(args) -> list:
    """Mock data of --doc-length-median, or the user's --data-path in its place."""
    data_path = getattr(args, "data_path", None)
    if data_path:
        return ["--data-path", *data_path]
    return ["--mock-data", "--mock-doc-length-median", str(args.doc_length_median)]


def position_limit(flags: list) -> list:
    """``--max-position-embeddings`` for a --seq-length raised past the preset's limit (a
    dynamic CP set, --extra-args): Megatron-LM refuses a sequence longer than the limit; the
    old fork's limit was the sequence length. Empty when the flags' limit holds."""
    seq_length = flag_value(flags, "--seq-length")
    limit = flag_value(flags, "--max-position-embeddings")
    if seq_length is None or (limit is not None and int(limit) >= int(seq_length)):
        return []
    return ["--max-position-embeddings", seq_length]


def logprobs_command(preset: str, variant: str, args, row_file: str,
                     experts: str = "sequential", **moe) -> list:
    """The torchrun command of one --mode logprobs configuration: tools/logprobs_benchmark.py
    with the training flags `launch_command` gives the same configuration (``moe``: its MoE
    mode, router and precision keywords), less the metrics file; ``--steps`` calls of
    ``--global-batch-size`` / ``--nproc`` micro-batches each."""
    train = launch_command(preset, variant, args, row_file, "", experts, **moe)
    at = next(i for i, word in enumerate(train) if word.endswith(PRESETS[preset][0]))
    flags = train[at + 1:]
    at_metrics = flags.index("--metrics-file")
    del flags[at_metrics:at_metrics + 2]
    model = "hybrid" if PRESETS[preset][0] == "pretrain_mamba.py" else "gpt"
    return [*train[:at], os.path.join(REPO, "tools", "logprobs_benchmark.py"), "--model", model,
            "--calls", str(args.steps), "--warmup", str(args.warmup),
            "--micro-batches", str(args.global_batch_size // args.nproc), "--json", row_file,
            *(["--profile"] if args.profile else []), "--", *flags]


def logprobs_row(preset: str, variant: str, args, row_file: str, log: str = "",
                 experts: str = "sequential") -> dict:
    """The table row of a --mode logprobs run from the row its worker wrote; RunFailed when
    the file is missing or incomplete."""
    try:
        with open(row_file) as f:
            measured = json.load(f)
        row = {"preset": row_label(preset, args, "", experts), "variant": variant,
               "step_ms": measured["call_ms"], "step_iqr_ms": measured["call_iqr_ms"],
               "tokens_per_sec": measured["tokens_per_sec"],
               "peak_mem_gib": measured["peak_mem_gib"],
               "fallback_rate": measured["fallback_rate"], "capture_s": measured["capture_s"],
               "graph_mem_mib": measured["graph_mem_mib"],
               "gpu_busy_ms": measured.get("gpu_busy_ms"),
               "host_top": measured.get("host_top", []),
               "stats": measured.get("stats", {})}
    except FileNotFoundError:
        raise RunFailed(f"no row file {row_file}", log) from None
    except (json.JSONDecodeError, KeyError) as error:
        raise RunFailed(f"row file {row_file} is incomplete ({type(error).__name__}: {error})",
                        log) from None
    if is_moe(preset):
        row |= {"moe": True, "dropped_token_fraction": None, "rerun_rate": None}
    return row


def trace_dir(root: str, preset: str, variant: str, args, cp_set: str = "",
              experts: str = "sequential", *, mode: str = DEFAULT_MOE_MODE,
              router: str = "balanced", precision: str = DEFAULT_PRECISION) -> str:
    """Where --keep-traces keeps one configuration's traces: ``root/<row label>/<variant>``,
    the label's spaces as ``_`` (an MoE mode other than the default follows the variant)."""
    label = row_label(preset, args, cp_set, experts, router=router, precision=precision)
    return os.path.join(root, label.replace(" ", "_"),
                        variant_label(variant, mode).replace(" ", "_"))


def check_keep_traces(parser, args) -> None:
    """--keep-traces needs --profile, a training run, and a directory free of earlier traces."""
    root = args.keep_traces
    if root is None:
        return
    if args.from_metrics:
        parser.error(f"--keep-traces is wrong: {root}. --from-metrics trains nothing, so no "
                     f"trace is recorded; drop one of them.")
    if not args.profile:
        parser.error(f"--keep-traces is wrong: {root}. Traces are recorded in the profiled "
                     f"iterations only; add --profile.")
    if os.path.exists(root) and not (os.path.isdir(root) and not os.listdir(root)):
        parser.error(f"--keep-traces is wrong: {root} exists and is not an empty directory. "
                     f"Name a new or empty one, so that no earlier run's traces mix in.")


def failure_summary(output: str, returncode: int) -> str:
    """One line for the table: the last error-looking line of a failed run's output."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "Error" in ln or "error:" in ln or " is wrong: " in ln]
    last = (errors or lines or [""])[-1]
    text = f"exit {returncode}: {last}" if last else f"exit {returncode}"
    return text.replace("|", "/")[:200]


def run_one(preset: str, variant: str, args, cp_set: str = "",
            experts: str = "sequential", *, mode: str = DEFAULT_MOE_MODE,
            router: str = "balanced", precision: str = DEFAULT_PRECISION) -> dict:
    """Train one configuration; return its summary row (raises RunFailed on failure)."""
    if (needs_transformer_engine(preset, variant, experts, precision)
            and not transformer_engine_importable()):
        raise RunFailed("needs Transformer Engine, which is not importable here: install it "
                        "(pip install .[te]) or leave this row out")
    if getattr(args, "mode", "train") == "logprobs":
        with tempfile.TemporaryDirectory() as tmp:
            row_file = os.path.join(tmp, "row.json")
            cmd = logprobs_command(preset, variant, args, row_file, experts, mode=mode,
                                   router=router, precision=precision)
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
            output = proc.stdout + proc.stderr
            if proc.returncode != 0:
                raise RunFailed(failure_summary(output, proc.returncode), output[-4000:])
            row = logprobs_row(preset, variant, args, row_file, output[-4000:], experts)
            return row | {"preset": row_label(preset, args, "", experts, router=router,
                                              precision=precision),
                          "variant": variant_label(variant, mode), "precision": precision}
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "metrics.jsonl")
        cmd = launch_command(preset, variant, args, metrics, cp_set, experts, mode=mode,
                             router=router, precision=precision)
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        output = proc.stdout + proc.stderr
        if proc.returncode != 0:
            raise RunFailed(failure_summary(output, proc.returncode), output[-4000:])
        records = read_metrics(metrics, output[-4000:])
    return summarise(preset, variant, args, records, cp_set, output[-4000:], experts,
                     memory=memory_reports(output), mode=mode, router=router,
                     precision=precision)


# Megatron-LM's memory report (report_memory: at the first log points and every
# --log-memory-interval iterations, on each data-parallel rank 0), in MB of 2**20 bytes.
MEMORY_REPORT = re.compile(
    r"\(after (\d+) iterations\) memory \(MB\) \| allocated: ([\d.]+) \| max allocated: "
    r"([\d.]+) \| reserved: ([\d.]+) \| max reserved: ([\d.]+)")
MEMORY_KEYS = ("mem_allocated_bytes", "mem_max_allocated_bytes", "mem_reserved_bytes",
               "mem_max_reserved_bytes")


def memory_reports(log: str) -> list:
    """Megatron-LM's memory reports in a run's output, in order: ``{"iteration": N,
    "mem_allocated_bytes", "mem_max_allocated_bytes", "mem_reserved_bytes",
    "mem_max_reserved_bytes"}`` (the old metrics file's names) per report line."""
    reports = []
    for match in MEMORY_REPORT.finditer(log):
        values = [round(float(mb) * 2**20) for mb in match.groups()[1:]]
        reports.append({"iteration": int(match.group(1)), **dict(zip(MEMORY_KEYS, values))})
    return reports


def read_metrics(path: str, log: str = "") -> list:
    """The records of a metrics file; RunFailed when it is missing or not complete JSON."""
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        raise RunFailed(f"no metrics file {path}", log) from None
    except OSError as error:
        raise RunFailed(f"metrics file {path} cannot be read ({error.strerror})", log) from None
    except json.JSONDecodeError as error:
        raise RunFailed(f"metrics file {path} is truncated or not JSON lines ({error.msg})",
                        log) from None


def summarise(preset: str, variant: str, args, records: list, cp_set: str = "",
              log: str = "", experts: str = "sequential", memory: list = (), *,
              mode: str = DEFAULT_MOE_MODE, router: str = "balanced",
              precision: str = DEFAULT_PRECISION) -> dict:
    """The summary row of one configuration's metrics records; RunFailed when they lack what
    the row needs (e.g. no record past --warmup). ``memory``: the run's `memory_reports`;
    ``peak_mem_gib`` is the largest max-allocated of them (or of the records, an older metrics
    file's ``mem_max_allocated_bytes``), None with neither. An MoE row (an MoE preset, or
    records with MoE keys) has ``moe`` True, ``dropped_token_fraction`` and ``rerun_rate``
    (None where the run did not write the key). ``mode``, ``router`` and ``precision`` label
    the row (`variant_label`, `row_label`); ``precision`` is the row's too (the vs-bf16
    column's key)."""
    try:
        row = _summarise(preset, variant, args, records, cp_set, experts, memory)
    except (KeyError, IndexError, ValueError, ZeroDivisionError) as error:
        raise RunFailed(f"metrics incomplete ({type(error).__name__}: {error})", log) from None
    return row | {"preset": row_label(preset, args, cp_set, experts, router=router,
                                      precision=precision),
                  "variant": variant_label(variant, mode), "precision": precision}


def _summarise(preset: str, variant: str, args, records: list, cp_set: str,
               experts: str, memory: list) -> dict:
    train = [r for r in records if r.get("split", "train") == "train"]
    # One record per log interval (the mean of its iterations); --warmup is a multiple of it.
    timed = [r for r in train if r["iteration"] > args.warmup and "gpu busy (ms)" not in r]
    busy = [r["gpu busy (ms)"] for r in train if "gpu busy (ms)" in r]
    times = [r["iteration_time_ms"] for r in timed]
    quartiles = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    micro_batches = args.global_batch_size // (args.nproc // args.pipeline_model_parallel_size)
    capture = next((r for r in records if "graph capture (s)" in r), {})
    # full-iteration: the iteration graph's capture, on top of any layer graphs' for misses.
    whole = next((r for r in records if "iteration graph capture (s)" in r), {})
    peaks = [r["mem_max_allocated_bytes"] for r in [*records, *memory]
             if "mem_max_allocated_bytes" in r]
    row = {
        "preset": row_label(preset, args, cp_set, experts),
        "variant": variant,
        "step_ms": statistics.median(times),
        "step_iqr_ms": quartiles[2] - quartiles[0],
        "tokens_per_sec": statistics.median(r["tokens_per_sec"] for r in timed),
        "peak_mem_gib": max(peaks) / 2**30 if peaks else None,
        "first_step_ms": records[0]["iteration_time_ms"],
        "final_loss": records[-1]["lm_loss"],
        "fallback_rate": (sum(r.get("graph fallbacks", 0) for r in timed)
                          / (len(timed) * args.log_interval * micro_batches)),
        "capture_s": capture.get("graph capture (s)", 0.0)
                     + whole.get("iteration graph capture (s)", 0.0),
        # One value, or one per graph bank under dynamic CP (summed).
        "graph_mem_mib": sum(v for k, v in capture.items() if k.startswith("graph memory"))
                         + whole.get("iteration graph memory (MiB)", 0.0),
        "gpu_busy_ms": statistics.median(busy) if busy else None,
    }
    if is_moe(preset) or any(DROPPED_KEY in r or RERUN_KEY in r for r in timed):
        row |= moe_summary(timed, args.log_interval * micro_batches)
    return row


def moe_summary(timed: list, micro_batches_per_record: int) -> dict:
    """MoE columns of the timed records: the mean dropped-slot fraction, and the micro-batches
    rerun per micro-batch (``micro_batches_per_record``: log interval x micro-batches per step)."""
    dropped = [r[DROPPED_KEY] for r in timed if DROPPED_KEY in r]
    reruns = any(RERUN_KEY in r for r in timed)
    return {"moe": True,
            "dropped_token_fraction": statistics.fmean(dropped) if dropped else None,
            "rerun_rate": (sum(r.get(RERUN_KEY, 0) for r in timed)
                           / (len(timed) * micro_batches_per_record)) if reruns else None}


def format_table(rows: list) -> str:
    """Markdown table; speedup is against the eager row of the same preset (an MoE preset's
    ``eager dropless`` row where the table has one: dropless training without graphs).

    step IQR is the interquartile range of the timed steps: how much a step varies (the
    document count per micro-batch changes every step), to read differences against.

    A table with an MoE row adds *dropped tokens* (mean dropped-slot fraction over the timed
    steps) and *rerun rate* (micro-batches rerun per micro-batch); "-" where a row has none.
    *peak mem* is "-" for a row without a memory report (--from-metrics).

    A table with an FP8 row adds *vs bf16*: tokens/s against the bf16 row of the same preset
    and variant ("-" without one); *speedup* stays against eager at the row's own precision.
    """
    eager = {}
    for baseline in ("eager", variant_label("eager", "dropless")):  # the latter wins
        eager |= {r["preset"]: r["tokens_per_sec"] for r in rows
                  if r["variant"] == baseline and not r.get("error")}
    columns = ["preset", "variant", "step (ms)", "step IQR (ms)", "tokens/s", "speedup",
               "peak mem (GiB)", "fallback rate", "capture (s)", "graph mem (MiB)",
               "GPU busy (ms)", "step / busy"]
    fp8 = has_fp8_rows(rows)
    if fp8:
        columns.insert(columns.index("speedup") + 1, "vs bf16")
    moe = any(r.get("moe") for r in rows)
    if moe:
        columns += ["dropped tokens", "rerun rate"]
    lines = ["| " + " | ".join(columns) + " |",
             "| --- | --- |" + " ---: |" * (len(columns) - 2)]
    for r in rows:
        if r.get("error"):
            lines.append(f"| {r['preset']} | {r['variant']} | failed: {r['error']} |"
                         + " - |" * (len(columns) - 3))
            continue
        base = eager.get(r["preset"])
        cells = [r["preset"], r["variant"], f"{r['step_ms']:.1f}", f"{r['step_iqr_ms']:.1f}",
                 f"{r['tokens_per_sec']:,.0f}",
                 f"{r['tokens_per_sec'] / base:.2f}x" if base else "-"]
        if fp8:
            cells.append(vs_bf16(r, rows))
        cells += [_number(r.get("peak_mem_gib"), ".2f"), f"{r['fallback_rate']:.1%}",
                  f"{r['capture_s']:.2f}", f"{r['graph_mem_mib']:.0f}"]
        busy = r.get("gpu_busy_ms")
        cells += [f"{busy:.1f}", f"{r['step_ms'] / busy:.2f}"] if busy else ["-", "-"]
        if moe:
            cells += [_percent(r.get("dropped_token_fraction"), ".2%"),
                      _percent(r.get("rerun_rate"), ".1%")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def has_fp8_rows(rows: list) -> bool:
    """Whether a row ran at a precision other than the default (bf16)."""
    return any(r.get("precision", DEFAULT_PRECISION) != DEFAULT_PRECISION for r in rows)


def configuration_label(row: dict) -> str:
    """``row``'s preset column without its precision: what it ran, at any precision."""
    return row["preset"].removesuffix(" " + row["precision"])


def bf16_label(row: dict) -> str:
    """The preset column of the bf16 row that ran what ``row`` ran (its precision swapped)."""
    return f"{configuration_label(row)} {DEFAULT_PRECISION}"


def vs_bf16(row: dict, rows: list) -> str:
    """``row``'s tokens/s over those of the bf16 row of the same preset label and variant in
    ``rows`` ("1.25x"); "-" without such a row (or one that failed) or a precision."""
    if "precision" not in row:
        return "-"
    base = next((r["tokens_per_sec"] for r in rows
                 if r.get("precision") == DEFAULT_PRECISION and not r.get("error")
                 and r["variant"] == row["variant"] and r["preset"] == bf16_label(row)), None)
    return f"{row['tokens_per_sec'] / base:.2f}x" if base else "-"


def format_fastest_per_precision(rows: list) -> str:
    """Below a table with FP8 rows: per preset label, the fastest variant of each precision
    and its tokens/s against the fastest bf16 variant (graphs at their best on each side,
    whichever variant that is); "" without FP8 rows."""
    if not has_fp8_rows(rows):
        return ""
    best = {}  # preset label without precision -> precision -> fastest row
    for r in rows:
        if r.get("error") or "precision" not in r:
            continue
        config = configuration_label(r)
        fastest = best.setdefault(config, {}).get(r["precision"])
        if fastest is None or r["tokens_per_sec"] > fastest["tokens_per_sec"]:
            best[config][r["precision"]] = r
    lines = ["\nFastest variant of each precision (tokens/s; against the fastest bf16 "
             "variant):\n"]
    for config, by_precision in best.items():
        bf16 = by_precision.get(DEFAULT_PRECISION)
        shown = []
        for precision in PRECISIONS:
            r = by_precision.get(precision)
            if r is None:
                continue
            ratio = (f" ({r['tokens_per_sec'] / bf16['tokens_per_sec']:.2f}x)"
                     if bf16 and r is not bf16 else "")
            shown.append(f"{precision} {r['variant']} {r['tokens_per_sec']:,.0f}{ratio}")
        lines.append(f"- {config}: " + "; ".join(shown))
    return "\n".join(lines)


def format_host_profiles(rows: list) -> str:
    """--mode logprobs --profile: each row's top host functions of one call (cProfile, by own
    time), below the table; "" when no row has them."""
    blocks = []
    for r in rows:
        if r.get("host_top"):
            blocks.append(f"\nHost time of one call, {r['preset']} / {r['variant']} (cProfile, "
                          f"top functions by own time):\n\n```\n  own ms    cum ms   calls  "
                          f"function\n" + "\n".join(r["host_top"]) + "\n```")
    return "\n".join(blocks)


def _percent(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


_number = _percent  # "-" for a value the run did not report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--mode", choices=("train", "logprobs"), default="train",
                        help="train: training iterations (pretrain_*.py); logprobs: forward-only "
                             "log-prob calls of the library API (tools/logprobs_benchmark.py)")
    parser.add_argument("--presets", nargs="+", default=["hybrid-small", "gpt-small"],
                        help=f"names from {sorted(PRESETS)} or groups {sorted(PRESET_GROUPS)}; "
                             f"with --from-metrics, the first names the rows")
    parser.add_argument("--variants", nargs="+", default=["eager"], choices=sorted(VARIANTS),
                        help="flag sets on top of each preset; speedups are against eager")
    parser.add_argument("--capacities", nargs="*", type=int, default=[],
                        help="add a layer-graphs variant per capacity (capacity sweep)")
    parser.add_argument("--profile", action="store_true",
                        help="report GPU-busy time and step/busy from the last two iterations "
                             "(log-prob calls)")
    parser.add_argument("--keep-traces", default=None, metavar="DIR",
                        help="with --profile: keep the profiled iterations' Chrome traces (host "
                             "activity included) in DIR/<preset>/<variant>/, for "
                             "tools/kernel_time_diff.py and tools/step_gaps.py")
    parser.add_argument("--steps", type=int, default=30, help="training iterations per run")
    parser.add_argument("--warmup", type=int, default=5, help="leading steps left out")
    parser.add_argument("--log-interval", type=int, default=1,
                        help="training's --log-interval: step times are means over it; with 1 "
                             "every step waits for the GPU when it is logged")
    parser.add_argument("--global-batch-size", type=int, default=4,
                        help="training's --global-batch-size")
    parser.add_argument("--doc-length-median", type=int, default=512,
                        help="median synthetic document length in tokens (--mock-doc-length-median)")
    parser.add_argument("--data-path", nargs="+", default=None, metavar="PATH",
                        help="train on this data (Megatron-LM's --data-path: a JSONL file, an "
                             "indexed prefix or a blend) instead of mock data")
    parser.add_argument("--nproc", type=int, default=1, help="GPUs (torchrun processes) per run")
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                        help="pipeline stages (divides --nproc); metrics come from the last stage")
    parser.add_argument("--expert-model-parallel-size", type=int, default=1,
                        help="MoE presets only: ranks that split each layer's experts (divides "
                             "the data-parallel ranks, --nproc / pipeline stages, and the "
                             "preset's experts)")
    parser.add_argument("--moe-experts", nargs="+", default=["sequential"],
                        choices=sorted(MOE_EXPERTS),
                        help="MoE presets only: run each once per expert implementation; "
                             "grouped-gemm = --attention-backend auto --moe-grouped-gemm (needs "
                             "Transformer Engine)")
    parser.add_argument("--moe-modes", nargs="+", default=[DEFAULT_MOE_MODE],
                        choices=list(MOE_MODES),
                        help="MoE presets only: run each once per routing mode (drop-and-pad, "
                             "megatron-core's dropless, --moe-dropless-graphs, drop-and-pad "
                             "with reruns); combinations training refuses are left out")
    parser.add_argument("--moe-capacity-factor", type=float, default=None,
                        help="MoE presets only: the drop-and-pad and rerun modes' capacity "
                             "factor (default: the preset's, 1.25)")
    parser.add_argument("--moe-routers", nargs="+", default=["balanced"],
                        choices=list(MOE_ROUTERS),
                        help="MoE presets only: balanced (randomly initialised) routers, and/or "
                             "skewed ones (--moe-router-skew 0.5: about half the routed slots "
                             "to an eighth of the experts)")
    parser.add_argument("--precisions", nargs="+", default=[DEFAULT_PRECISION],
                        metavar="PRECISION",
                        help=f"run everything once per precision, from {list(PRECISIONS)}: "
                             "fp8-<recipe> adds --fp8-format e4m3 --fp8-recipe <recipe> (the "
                             "linear layers' GEMMs in FP8 on Transformer Engine, which the row "
                             "needs installed) and --attention-backend auto where the preset "
                             "names no TE attention backend; more than bf16 labels every row "
                             "with its precision and adds the column vs bf16 (tokens/s against "
                             "the bf16 row of the same preset and variant). A preset whose "
                             "positions per rank or Mamba input projection break FP8's "
                             "alignment is refused before any run; MoE dropless-graphs rows "
                             "(BF16 experts) stay bf16")
    parser.add_argument("--extra-args", default="",
                        help="more training flags for every run (Megatron-LM's command line), "
                             "one string: --extra-args=\"--no-check-for-nan-in-loss-and-grad\"")
    parser.add_argument("--dynamic-cp-sets", nargs="+", default=[], metavar="SIZES",
                        help="run everything once per set of dynamic CP sizes, e.g. 1 2 1,2")
    parser.add_argument("--tokens-per-rank", type=int, default=2048,
                        help="positions per rank with --dynamic-cp-sets")
    parser.add_argument("--json", default=None, help="also write the rows to this file, "
                        "rewritten as each run finishes")
    parser.add_argument("--from-metrics", nargs="+", default=[], metavar="VARIANT=FILE",
                        help="train nothing: tabulate these metrics files of finished runs, one "
                             "row each (--warmup, --log-interval, --nproc and "
                             "--global-batch-size describe those runs)")
    args = parser.parse_args(argv)
    check_keep_traces(parser, args)
    check_logprobs_mode(parser, args)
    check_precisions(parser, args)
    if args.from_metrics:
        return tabulate_metrics_files(parser, args)
    presets = [p for name in args.presets for p in PRESET_GROUPS.get(name, [name])]
    unknown = [p for p in presets if p not in PRESETS]
    if unknown:
        parser.error(f"--presets is wrong: {unknown}. Choose from {sorted(PRESETS)} "
                     f"or {sorted(PRESET_GROUPS)}.")
    if args.steps <= args.warmup:
        parser.error(f"--steps is wrong: {args.steps}. It must exceed --warmup ({args.warmup}).")
    if args.log_interval < 1 or args.warmup % args.log_interval or args.steps % args.log_interval:
        parser.error(f"--log-interval is wrong: {args.log_interval}. It must divide --warmup "
                     f"({args.warmup}) and --steps ({args.steps}).")
    if (args.profile and args.mode == "train"
            and args.steps < args.warmup + 2 * args.log_interval):
        # The profiled iterations' GPU-busy time goes into the last interval's record, which
        # the step-time median leaves out: it needs one more interval past --warmup.
        parser.error(f"--steps is wrong: {args.steps}. With --profile the last log interval "
                     f"is profiled and not timed, so --steps must be at least --warmup + 2 x "
                     f"--log-interval ({args.warmup + 2 * args.log_interval}).")
    if args.nproc % args.pipeline_model_parallel_size:
        parser.error(f"--pipeline-model-parallel-size is wrong: {args.pipeline_model_parallel_size}. "
                     f"It must divide --nproc ({args.nproc}).")
    check_moe_options(parser, args, presets)
    variants = args.variants + [f"layer-graphs-c{c}" for c in args.capacities]
    runs = [(preset, variant, cp_set, experts, mode, router, precision) for preset in presets
            for experts in (args.moe_experts if is_moe(preset) else ["sequential"])
            for router in (args.moe_routers if is_moe(preset) else ["balanced"])
            for cp_set in args.dynamic_cp_sets or [""]
            for precision in args.precisions
            for mode in (args.moe_modes if is_moe(preset) else [DEFAULT_MOE_MODE])
            for variant in variants
            if moe_mode_applies(variant, mode) and variant_applies(preset, variant)
            and precision_applies(preset, mode, precision)]
    check_fp8_shapes(parser, args, runs)
    problem = cuda_problem(args.nproc)
    if problem:  # before any torchrun: one line, not a log tail per row
        print(f"tools/benchmark.py: {problem}", file=sys.stderr)
        return 1
    rows, stopped = [], False
    # A time limit (timeout, Slurm) sends SIGTERM: print the rows measured so far.
    previous = signal.signal(signal.SIGTERM, _raise_time_limit)
    try:
        for preset, variant, cp_set, experts, mode, router, precision in runs:
            rows.append(run_row(preset, variant, args, cp_set, experts, mode=mode,
                                router=router, precision=precision))
            write_json(rows, args.json)
    except TimeLimit:
        stopped = True
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(run_header(sys.argv[1:] if argv is None else argv))
    if args.mode == "logprobs":
        print(f"Forward-only log-prob calls (the library API): a step is one call over "
              f"{args.global_batch_size // args.nproc} micro-batches per rank; graph memory "
              f"and capture are the forward-only graphs'.\n")
    code = report(rows, args)
    if stopped:
        print(f"benchmark: stopped by SIGTERM after {len(rows)} of {len(runs)} runs; the "
              f"table holds those", file=sys.stderr)
        return 124  # what timeout(1) returns
    return code


def cuda_problem(nproc: int) -> str | None:
    """Why no run can start on this machine (no CUDA device visible, or fewer than ``nproc``),
    or None. torch only counts the devices here; the runs make the CUDA contexts."""
    import torch

    if not torch.cuda.is_available():
        return ("needs a CUDA GPU (torch.cuda.is_available() is False): run it on a GPU "
                "machine; --from-metrics tabulates finished runs' metrics files without one")
    visible = torch.cuda.device_count()
    if visible < nproc:
        return (f"--nproc {nproc} needs {nproc} CUDA GPUs and {visible} are visible: lower "
                f"--nproc or make more GPUs visible (CUDA_VISIBLE_DEVICES)")
    return None


class TimeLimit(Exception):
    """SIGTERM arrived while runs were left."""


def _raise_time_limit(signum, frame):
    # subprocess.run kills the run in flight when this propagates through it.
    raise TimeLimit()


def run_header(argv: list, tool: str = "tools/benchmark.py") -> str:
    """Where, when and how the table below was measured: the GPUs the runs saw, the date, the
    installed torch / megatron-core / TE / mamba-ssm, and the command (``python tool argv``)."""
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    command = shlex.join(["python", tool, *argv])
    software = ", ".join(f"{name} {version}" for name, version in installed_versions())
    return f"Machine: {machine_description()}. Date: {date}.\nSoftware: {software}.\nCommand: {command}\n"


def machine_description() -> str:
    """The GPUs visible to the runs (CUDA_VISIBLE_DEVICES), by name, from nvidia-smi: this
    process makes no CUDA context, which would take GPU memory from the runs."""
    if shutil.which("nvidia-smi") is None:
        return "no NVIDIA GPU (nvidia-smi not found)"
    query = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        query += ["-i", visible]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError) as err:
        return f"unknown ({err})"
    names = collections.Counter(line.strip() for line in out.splitlines() if line.strip())
    return ", ".join(f"{count} x {name}" for name, count in names.items()) or "no GPU listed"


def installed_versions() -> list:
    """(name, version) of the packages that set a benchmark's speed, those installed
    (distribution names are matched with ``-`` and ``_`` alike)."""
    versions = []
    for name, dist in (("torch", "torch"), ("megatron-core", "megatron-core"),
                       ("Transformer Engine", "transformer-engine"), ("mamba-ssm", "mamba-ssm")):
        try:
            versions.append((name, importlib.metadata.version(dist)))
        except importlib.metadata.PackageNotFoundError:
            pass
    return versions


def check_moe_options(parser, args, presets: list) -> None:
    """--expert-model-parallel-size and --moe-experts against the presets and --nproc."""
    moe = [p for p in presets if is_moe(p)]
    ep = args.expert_model_parallel_size
    data_parallel = args.nproc // args.pipeline_model_parallel_size
    if ep < 1 or data_parallel % ep:
        parser.error(f"--expert-model-parallel-size is wrong: {ep}. It must divide the "
                     f"data-parallel ranks, --nproc / --pipeline-model-parallel-size "
                     f"({args.nproc} / {args.pipeline_model_parallel_size} = {data_parallel}); "
                     f"raise --nproc or lower it.")
    for preset in moe:
        if num_experts(preset) % ep:
            parser.error(f"--expert-model-parallel-size is wrong: {ep}. It must divide "
                         f"{preset}'s {num_experts(preset)} experts.")
    given = [flag for flag, changed in (
        ("--expert-model-parallel-size", ep != 1),
        ("--moe-experts", args.moe_experts != ["sequential"]),
        ("--moe-modes", getattr(args, "moe_modes", [DEFAULT_MOE_MODE]) != [DEFAULT_MOE_MODE]),
        ("--moe-capacity-factor", getattr(args, "moe_capacity_factor", None) is not None),
        ("--moe-routers", getattr(args, "moe_routers", ["balanced"]) != ["balanced"]))
        if changed]
    if given and not moe:
        parser.error(f"{given[0]} is wrong: no MoE preset in {presets}. Add one "
                     f"({', '.join(p for p in PRESETS if is_moe(p))} or group moe) or drop it.")


def check_precisions(parser, args) -> None:
    """--precisions: PRECISIONS keys; more than the default only for runs this tool trains
    (--from-metrics reads runs whose precision it does not know)."""
    unknown = [p for p in args.precisions if p not in PRECISIONS]
    if unknown:
        parser.error(f"--precisions is wrong: {unknown[0]}. Choose from "
                     f"{', '.join(PRECISIONS)}.")
    if args.from_metrics and labels_precision(args):
        parser.error(f"--precisions is wrong with --from-metrics: {' '.join(args.precisions)}. "
                     f"It tabulates finished runs as they are; drop it.")


def check_fp8_shapes(parser, args, runs: list) -> None:
    """Refuse, before any run, an FP8 row whose shapes break FP8's alignment: what training's
    parse-time rules (megatron/packed_training/fp8_flags.py) would refuse after start-up."""
    seen = set()
    for preset, variant, cp_set, experts, mode, router, precision in runs:
        if precision == DEFAULT_PRECISION or (preset, cp_set, precision) in seen:
            continue
        seen.add((preset, cp_set, precision))
        cmd = launch_command(preset, variant, args, "metrics.jsonl", cp_set, experts, mode=mode,
                             router=router, precision=precision)
        problem = fp8_shape_problem(cmd, cp_set)
        if problem:
            parser.error(f"--precisions is wrong: {precision} for preset {preset}. {problem}")


def fp8_shape_problem(cmd: list, cp_set: str = "") -> str | None:
    """What fp8_flags.check_fp8 refuses in launch command ``cmd`` (positions per rank a
    multiple of 16, 128 blockwise; the hybrid's Mamba input projection a multiple of 16; TE's
    layers and attention; the layers that put values into padding rows), or None. The flags
    go through the training parser unvalidated (Megatron-LM's defaults where the line has
    none). Under a dynamic CP set every rank holds --seq-length / its largest size. Asks
    nothing of a GPU (its compute capability is the run's to check) and makes no CUDA
    context."""
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    from megatron.packed_training.arguments import build_parser
    from megatron.packed_training.extra_args import module_names
    from megatron.packed_training.fp8_flags import check_fp8

    script = next(i for i, word in enumerate(cmd) if word.endswith(".py"))
    shape, _ = build_parser().parse_known_args([str(word) for word in cmd[script + 1:]])
    shape.packed_graph_impl = shape.cuda_graph_impl
    shape.packed_cuda_graph_modules = module_names(shape)
    shape.packed_notes = []
    if cp_set:
        shape.context_parallel_size = max(int(c) for c in cp_set.split(","))
    model = "hybrid" if cmd[script].endswith("pretrain_mamba.py") else "gpt"
    te_attention = shape.attention_backend.name in TE_ATTENTION_BACKENDS
    try:
        check_fp8(shape, model, te_attention=te_attention, capability=None)
    except ValueError as refused:
        return str(refused)
    return None


def check_logprobs_mode(parser, args) -> None:
    """--mode logprobs runs the library API: PP and CP 1, nothing tabulated from metrics files,
    no kept traces; its micro-batches are --global-batch-size / --nproc per call."""
    if args.mode != "logprobs":
        return
    refused = [(args.from_metrics, "--from-metrics", "it tabulates training runs"),
               (args.keep_traces, "--keep-traces", "it keeps traces of training iterations"),
               (args.dynamic_cp_sets, "--dynamic-cp-sets", "the library API runs CP size 1"),
               (args.pipeline_model_parallel_size != 1, "--pipeline-model-parallel-size",
                "the library API runs one pipeline stage")]
    for given, flag, why in refused:
        if given:
            parser.error(f"{flag} is wrong with --mode logprobs: {why}. Drop it.")
    if args.global_batch_size % args.nproc:
        parser.error(f"--global-batch-size is wrong: {args.global_batch_size}. With --mode "
                     f"logprobs it is the micro-batches of a call over all {args.nproc} "
                     f"ranks: give a multiple of --nproc.")


def run_row(preset: str, variant: str, args, cp_set: str, experts: str, *,
            mode: str = DEFAULT_MOE_MODE, router: str = "balanced",
            precision: str = DEFAULT_PRECISION) -> dict:
    """Train one configuration; its summary row, or its error row (log tail to stderr)."""
    label = row_label(preset, args, cp_set, experts, router=router, precision=precision)
    shown = variant_label(variant, mode)
    try:
        row = run_one(preset, variant, args, cp_set, experts, mode=mode, router=router,
                      precision=precision)
        print(f"done: {label}/{shown} {row['step_ms']:.1f} ms/step", flush=True)
        return row
    except RunFailed as failed:
        print(f"failed: {label}/{shown}: {failed.summary}\n{failed.log}", file=sys.stderr,
              flush=True)
        row = {"preset": label, "variant": shown, "precision": precision,
               "error": failed.summary}
        return (row | {"moe": True}) if is_moe(preset) else row


def tabulate_metrics_files(parser, args) -> int:
    """--from-metrics: one row per VARIANT=FILE, from the files alone."""
    if args.log_interval < 1 or args.warmup % args.log_interval:
        parser.error(f"--log-interval is wrong: {args.log_interval}. It must divide --warmup "
                     f"({args.warmup}).")
    rows = []
    for spec in args.from_metrics:
        variant, sep, path = spec.partition("=")
        if not sep or not variant or not path:
            parser.error(f"--from-metrics is wrong: {spec}. Give VARIANT=FILE, e.g. "
                         f"eager=runs/eager.jsonl.")
        try:
            rows.append(summarise(args.presets[0], variant, args, read_metrics(path)))
        except RunFailed as failed:
            row = {"preset": row_label(args.presets[0], args), "variant": variant,
                   "error": failed.summary}
            rows.append((row | {"moe": True}) if is_moe(args.presets[0]) else row)
    return report(rows, args)


def write_json(rows: list, path) -> None:
    """The rows so far to ``path`` (--json; nothing when None), replacing what it held."""
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=2)


def report(rows: list, args) -> int:
    """Print the table (and write --json); 1 when a row failed."""
    print(format_table(rows))
    fastest = format_fastest_per_precision(rows)
    if fastest:
        print(fastest)
    host = format_host_profiles(rows)
    if host:
        print(host)
    write_json(rows, args.json)
    failed = [f"{r['preset']}/{r['variant']}" for r in rows if r.get("error")]
    if failed:
        print(f"benchmark: {len(failed)} of {len(rows)} runs failed: {', '.join(failed)}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
