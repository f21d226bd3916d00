"""Megatron-LM's FP8 flags on packed rows: what is refused at parse time and why (docs/flags.md,
"FP8").

Only the linear layers' GEMMs run in FP8 (Transformer Engine's); core attention on packed THD
stays BF16 on Hopper (cuDNN's FP8 attention takes no THD layout), and Mamba's SSD and conv
kernels stay BF16. A packed row has a fixed number of positions, so TE's alignment rules for
FP8 GEMM inputs are checked once here, not per batch.
"""

import math
import os

from megatron.packed_graphs.fp8_state import check_fp8_graphs
from megatron.packed_model.mamba_shapes import mamba_in_proj_width
from megatron.packed_model.refusals import refuse

# Recipes whose scales need Blackwell's (sm100) block-scaled GEMMs.
SM100_RECIPES = ("mxfp8",)
# FP8 GEMM input rows: TE asks for a multiple of 16 (its generic FP8 GEMM check), blockwise
# scaling for whole 128-row blocks of every quantized tensor.
ROWS_MULTIPLE = {"blockwise": 128}
DEFAULT_ROWS_MULTIPLE = 16
BLOCKWISE_MIN_CUDA = (12, 9)  # cuBLAS's block-scaled FP8 GEMM


def ranks_sharing_a_row(args) -> int:
    """Ranks a micro-batch's positions are split over before an FP8 GEMM: CP, times TP with
    sequence parallelism (TE quantizes the local share before the all-gather)."""
    tp = args.tensor_model_parallel_size if args.sequence_parallel else 1
    return args.context_parallel_size * tp


def check_fp8(args, model: str, *, te_attention: bool, cuda_version="torch's",
              capability="the visible GPU's") -> None:
    """Refuse FP8 settings that cannot run on packed rows, each naming the flag and a valid
    value; add the start-up note on what stays BF16 (``args.packed_notes``). ``cuda_version``
    and ``capability`` (the GPU's), ``(major, minor)``: torch's and the visible GPU's by
    default; None where unknown (a CPU-only build, no GPU at parse time), and those checks
    are left to the run."""
    if not (args.fp8 or getattr(args, "fp4", None)):
        return
    if isinstance(cuda_version, str):
        cuda_version = torch_cuda_version()
    if isinstance(capability, str):  # asked only where a recipe depends on it (a CUDA context)
        sm100_only = args.fp8_recipe in SM100_RECIPES or getattr(args, "fp4", None)
        capability = gpu_capability() if sm100_only else None
    refuse((bool(getattr(args, "fp4", None)) and capability is not None
            and capability < (10, 0), "--fp4-format", getattr(args, "fp4", None),
            f"NVFP4 needs a Blackwell GPU (sm100) and this one is {_sm(capability)}; use "
            "--fp8-format e4m3 --fp8-recipe tensorwise"))
    check_router_padding(args)
    if not args.fp8:
        return
    recipe = args.fp8_recipe
    multiple = ROWS_MULTIPLE.get(recipe, DEFAULT_ROWS_MULTIPLE)
    positions, sharing = args.micro_batch_size * args.seq_length, ranks_sharing_a_row(args)
    split = "context parallel" + (" x tensor parallel (sequence parallelism)"
                                  if args.sequence_parallel else "")
    refuse((args.transformer_impl != "transformer_engine" or not te_attention, "--fp8-format",
            args.fp8, "FP8 GEMMs are Transformer Engine's, and this run takes the TE-free path; "
            "install Transformer Engine and use --transformer-impl transformer_engine with "
            "--attention-backend auto, or drop --fp8-format"),
           # Padding rows must reach every FP8 GEMM as zeros (packed_model/padding_rows.py).
           (args.normalization == "LayerNorm", "--normalization", "LayerNorm", "Under FP8 "
            "padding rows are held at zero so that no scale sees them, and LayerNorm maps a "
            "zero row to its bias; use --normalization RMSNorm"),
           (args.add_bias_linear, "--disable-bias-linear", "not given", "Under FP8 padding "
            "rows are held at zero so that no scale sees them, and a linear bias (fc1's, through "
            "the activation) reaches them; pass --disable-bias-linear (--add-qkv-bias is fine)"),
           (recipe in SM100_RECIPES and capability is not None and capability < (10, 0),
            "--fp8-recipe", recipe, f"It needs a Blackwell GPU (sm100) and this one is "
            f"{_sm(capability)}; use --fp8-recipe tensorwise, blockwise or "
            "delayed"),
           (recipe == "blockwise" and cuda_version is not None
            and cuda_version < BLOCKWISE_MIN_CUDA, "--fp8-recipe", recipe,
            f"It needs CUDA {BLOCKWISE_MIN_CUDA[0]}.{BLOCKWISE_MIN_CUDA[1]} or newer and "
            f"torch runs CUDA {cuda_version[0]}.{cuda_version[1]}; use --fp8-recipe "
            "tensorwise"),
           (positions % (sharing * multiple) != 0, "--seq-length", args.seq_length,
            f"FP8 ({recipe}) GEMMs take a multiple of {multiple} rows per rank and a "
            f"micro-batch's {positions} positions split over {sharing} rank(s) ({split}) do "
            f"not give one; use --seq-length {fitting_length(args, sharing * multiple)}"))
    check_delayed_scaling_under_graphs(args)
    if model == "hybrid":
        width = mamba_in_proj_width(args)
        refuse((width % DEFAULT_ROWS_MULTIPLE != 0, "--mamba-num-heads",
                args.mamba_num_heads or "its default", f"Mamba's FP8 input projection is "
                f"{width} wide, not a multiple of {DEFAULT_ROWS_MULTIPLE}; choose heads, head "
                "dim, groups and state size that make 2 x heads x head dim + 2 x groups x "
                "state + heads a multiple of 16"))
    args.packed_notes.append(f"FP8 ({args.fp8}, {recipe} scaling): the linear layers' GEMMs; "
                             "core attention on packed THD stays BF16 (cuDNN's FP8 attention "
                             "takes no THD layout)"
                             + (", Mamba's SSD and conv kernels BF16" if model == "hybrid"
                                else ""))


def check_delayed_scaling_under_graphs(args) -> None:
    """Refuse what delayed scaling's state (amax histories and scales, updated as each FP8
    region ends) would make differ from eager, at parse time: the graph kinds that would
    capture the update (`fp8_state.check_fp8_graphs`, which graph setup calls again for library
    users); the health check's two passes, which would each update it; megatron-core's layer
    graphs update after every layer's backward replay, rolling every history once per layer
    (cuda_graphs.py, the backward replay node), so a max over more than one entry covers fewer
    micro-batches than eager's (the most recent amax is the same)."""
    if args.fp8_recipe != "delayed":
        return
    check_fp8_graphs(args.packed_graph_impl, args.cuda_graph_granularity, args.fp8_recipe)
    layer_graphs = args.packed_graph_impl == "local" and args.cuda_graph_granularity == "layer"
    refuse((args.cuda_graph_check_interval > 0, "--cuda-graph-check-interval",
            args.cuda_graph_check_interval, "The health check's replayed and eager passes would "
            "each update delayed scaling's amax history and scales: a trace in training; drop "
            "it, or use --fp8-recipe tensorwise or blockwise"),
           (layer_graphs and args.fp8_amax_history_len > 1 and args.fp8_amax_compute_algo
            == "max", "--fp8-amax-compute-algo", "max", f"Under --cuda-graph-impl local layer "
            f"graphs megatron-core rolls the gradients' amax history (--fp8-amax-history-len "
            f"{args.fp8_amax_history_len}) once per layer instead of once per micro-batch; use "
            f"--fp8-amax-compute-algo most_recent or --fp8-amax-history-len 1"))


def check_router_padding(args) -> None:
    """Refuse megatron-core's router padding (--moe-router-padding-for-quantization, alias -fp8)
    where it breaks (docs/moe.md, "FP8"); without it the experts pad their own FP8 rows."""
    flag = next((f"--moe-router-padding-for-{kind}" for kind in ("quantization", "fp8")
                 if getattr(args, f"moe_router_padding_for_{kind}", False)), None)
    modules, local = args.packed_cuda_graph_modules, args.packed_graph_impl == "local"
    refuse((flag and args.moe_pad_expert_input_to_capacity, flag, True, "Under drop-and-pad "
            "each expert takes its capacity in rows, which megatron-core's experts pad for FP8 "
            "themselves; padding the routing map too adds slots past a capacity that is not a "
            "multiple of 16, and they push routed tokens out: drop it"),
           (flag and ("moe_preprocess" in modules or local and "moe_router" in modules), flag,
            True, "It makes the dispatcher's preprocess read the token count on the host, in the "
            "moe_preprocess graph (moe_router under --cuda-graph-impl local): drop it (megatron-"
            "core's experts pad for FP8 themselves)"))


def fitting_length(args, divisor: int) -> int:
    """The least sequence length from ``--seq-length`` up whose micro-batch positions are a
    multiple of ``divisor``."""
    step = divisor // math.gcd(args.micro_batch_size, divisor)
    return -(-args.seq_length // step) * step


def torch_cuda_version():
    """torch's CUDA version as ``(major, minor)``, or None for a CPU-only build."""
    import torch

    return (tuple(int(part) for part in torch.version.cuda.split(".")[:2])
            if torch.version.cuda else None)


def gpu_capability():
    """This rank's GPU's compute capability ``(major, minor)`` (torchrun's ``LOCAL_RANK``), or
    None without one. Creates the CUDA context on that GPU, as the run will."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(int(os.environ.get("LOCAL_RANK", 0)))


def _sm(capability) -> str:
    return f"sm{capability[0]}{capability[1]}" if capability else "unknown"
