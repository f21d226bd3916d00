"""Fixtures for every test folder (unit, gpu, functional), and the test lanes."""

import pytest

_SLOW_LEFT_OUT = pytest.StashKey[int]()


def pytest_addoption(parser):
    parser.addoption("--all", action="store_true", dest="run_all_lanes",
                     help="run the tests marked slow too (the full lane; what CI runs)")


@pytest.hookimpl(trylast=True)  # after -k and the folders' own hooks
def pytest_collection_modifyitems(config, items):
    """The default lane leaves out the tests marked ``slow``. ``--all`` keeps them, and so does
    any ``-m`` expression (``-m slow`` runs only them; ``-m gpus`` and ``-m "not gpus"``
    select as written)."""
    if config.getoption("run_all_lanes") or config.option.markexpr:
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]
    config.stash[_SLOW_LEFT_OUT] = len(slow)


def pytest_terminal_summary(terminalreporter, config):
    left_out = config.stash.get(_SLOW_LEFT_OUT, 0)
    if left_out:
        tests = "test" if left_out == 1 else "tests"
        terminalreporter.write_line(
            f"{left_out} {tests} marked slow left out (the default lane); "
            "--all runs them too (docs/testing.md)")


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
