"""GPU tests: run on the GPU machine (see docs/testing.md). Skipped without CUDA."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if "tests/gpu" not in str(item.fspath):
            continue
        if gpus == 0:
            item.add_marker(pytest.mark.skip(reason="needs CUDA: run tests/gpu on the GPU machine"))
            continue
        need = item.get_closest_marker("gpus")
        if need and gpus < need.args[0]:
            item.add_marker(pytest.mark.skip(
                reason=f"needs {need.args[0]} GPUs, {gpus} visible (use the x{need.args[0]} machine)"))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpus(n): test needs at least n GPUs")


@pytest.fixture(scope="session")
def dist():
    """One-GPU NCCL world with megatron-core's parallel state and a graph-safe RNG tracker."""
    import os

    from megatron.core import parallel_state, tensor_parallel

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.cuda.set_device(0)
    torch.distributed.init_process_group("nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(1234, use_cudagraphable_rng=True)
    yield
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
