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
    import socket

    from megatron.packed_training.initialize import destroy, initialize_single_gpu

    if "MASTER_PORT" not in os.environ:
        # A port of its own, so that several pytest processes (or xdist workers) share a GPU.
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(probe.getsockname()[1])
    initialize_single_gpu()
    yield
    destroy()
