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
