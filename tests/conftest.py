"""Fixtures for every test folder (unit, gpu, functional)."""

import pytest


@pytest.fixture(autouse=True)
def attention_backend_environment():
    """megatron-core's language models write NVTE_{FLASH,FUSED,UNFUSED}_ATTN into the process
    environment for their --attention-backend, and refuse another backend's values later, in
    this process and in every training process it starts (they inherit the environment): put
    them back after every test, as each training process starts clean."""
    import os

    names = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")
    saved = {name: os.environ.get(name) for name in names}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(autouse=True)
def megatron_moe_process_state():
    """megatron-core keeps MoE state per process: the aux-loss backward scale (whose shape is
    fixed by its first writer: a bare MoE backward writes a 0-d tensor, the schedule later
    copies a size-1 one into it and fails) and the metrics tracker (sized by the first model's
    layers). Forget both after every test, as each training process starts clean."""
    import sys

    yield
    moe_utils = sys.modules.get("megatron.core.transformer.moe.moe_utils")
    if moe_utils is not None:
        moe_utils.MoEAuxLossAutoScaler.main_loss_backward_scale = None
    moe_logging = sys.modules.get("megatron.core.transformer.moe.moe_logging")
    if moe_logging is not None and hasattr(moe_logging, "get_moe_metrics_tracker"):
        moe_logging.get_moe_metrics_tracker().metrics.clear()
