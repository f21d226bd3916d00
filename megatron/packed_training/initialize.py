"""Process start-up: the CUDA and Mamba-kernel checks, torch.distributed, megatron-core parallel
state, seeds."""

import datetime
import importlib.util
import os
import random
import sys

import numpy as np
import torch

from megatron.core import parallel_state, tensor_parallel
from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator


def require_cuda(script: str) -> None:
    """Exit with a clear message (status 1) when no CUDA device is visible."""
    if not torch.cuda.is_available():
        print(
            f"{script}: no CUDA device is visible. Training needs NVIDIA GPUs "
            "(megatron-core's DDP, pipeline schedules and the Mamba kernels are CUDA-only). "
            "Run on a GPU machine; the CPU-only unit tests are `python -m pytest tests/unit`.",
            file=sys.stderr,
        )
        sys.exit(1)


def require_mamba_kernels() -> None:
    """pretrain_mamba.py: mamba-ssm and causal-conv1d importable (checked before any GPU work,
    not at parse time, so hybrid launch lines parse anywhere)."""
    from megatron.packed_training.extra_args import is_importable

    for package in ("mamba_ssm", "causal_conv1d"):
        if not is_importable(package):
            raise ValueError(f"{package} is not importable, and the Mamba layers need "
                             "mamba-ssm and causal-conv1d. Install them: pip install "
                             "--no-build-isolation -e \".[mamba]\" (docs/quickstart.md).")


def initialize_distributed(args) -> None:
    """Init torch.distributed from the torchrun environment and megatron-core's groups.

    Works for a plain ``python script.py`` too (a world of one).
    """
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    torch.cuda.set_device(local_rank)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(
            backend=args.distributed_backend,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(minutes=args.distributed_timeout_minutes),
            device_id=torch.device("cuda", local_rank),
        )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=getattr(args, "expert_model_parallel_size", 1),
        expert_tensor_parallel_size=getattr(args, "expert_tensor_parallel_size", None),
        # Dynamic CP: megatron-core's aligned DP x CP groups of every power-of-two size.
        hybrid_context_parallel=args.dynamic_cp_groups,
    )
    init_num_microbatches_calculator(
        rank, None, args.global_batch_size, args.micro_batch_size,
        parallel_state.get_data_parallel_world_size(),
        step_batch_size_schedule=args.step_batch_size_schedule,
        seq_length=args.seq_length,  # the schedule's thresholds are tokens, as Megatron-LM's
    )


def initialize_single_gpu(seed: int = 1234, port: int = 29533) -> None:
    """A one-GPU NCCL world with megatron-core's groups and a graph-safe RNG tracker.

    For tools and tests that build a model in one process without torchrun; undo with
    `destroy`.
    """
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    torch.cuda.set_device(0)
    torch.distributed.init_process_group("nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    # TE attention asserts TE's tracker while a graph is captured, as training forces it.
    te_rng_tracker = importlib.util.find_spec("transformer_engine") is not None
    tensor_parallel.model_parallel_cuda_manual_seed(seed, te_rng_tracker=te_rng_tracker,
                                                    use_cudagraphable_rng=True)


def set_seeds(seed: int, deterministic: bool = False, te_rng_tracker: bool = False) -> None:
    """Seed Python, NumPy and torch; per-PP-stage offset like Megatron, TP-aware CUDA RNG.

    ``te_rng_tracker``: Transformer Engine's tracker (graph-safe; TE's graphs require it)."""
    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    # A graph-safe RNG tracker, so dropout and init work inside CUDA graph capture too.
    tensor_parallel.model_parallel_cuda_manual_seed(seed, te_rng_tracker=te_rng_tracker,
                                                    use_cudagraphable_rng=True)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False


def destroy() -> None:
    parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
