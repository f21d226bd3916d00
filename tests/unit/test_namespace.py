"""megatron.core comes from the pinned wheel; megatron.training / packed_graphs from this repo."""

import importlib
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_core_is_the_pinned_wheel():
    core = importlib.import_module("megatron.core")
    assert core.__version__ == "0.16.1"
    assert not os.path.abspath(core.__file__).startswith(REPO + os.sep)


def test_training_and_graph_packages_are_ours():
    for name in ("megatron.training.arguments", "megatron.packed_graphs.packed_seq"):
        module = importlib.import_module(name)
        assert os.path.abspath(module.__file__).startswith(os.path.join(REPO, "megatron")), name


def test_repo_does_not_shadow_the_wheel():
    assert not os.path.exists(os.path.join(REPO, "megatron", "__init__.py"))
    assert not os.path.exists(os.path.join(REPO, "megatron", "core"))
