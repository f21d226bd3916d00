"""megatron.core comes from the pinned wheel; megatron.training / packed_graphs from this repo."""

import importlib
import importlib.metadata
import os
import sys
import tomllib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PINNED_CORE = "0.19.2"
MIN_PYTHON = (3, 12)


def _project():
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


def test_core_is_the_pinned_wheel():
    core = importlib.import_module("megatron.core")
    # megatron-core appends "+<git hash>" when its files sit inside a git work tree
    # (a virtual environment inside a clone); the release is what is pinned.
    assert core.__version__.split("+")[0] == PINNED_CORE
    assert importlib.metadata.version("megatron-core") == PINNED_CORE
    assert not os.path.abspath(core.__file__).startswith(REPO + os.sep)


def test_pyproject_pins_core_and_python():
    project = _project()
    assert f"megatron-core=={PINNED_CORE}" in project["dependencies"]
    assert project["requires-python"] == ">=%d.%d" % MIN_PYTHON


def test_running_python_meets_the_requirement():
    assert sys.version_info[:2] >= MIN_PYTHON


def test_training_and_graph_packages_are_ours():
    for name in ("megatron.training.arguments", "megatron.packed_graphs.packed_seq"):
        module = importlib.import_module(name)
        assert os.path.abspath(module.__file__).startswith(os.path.join(REPO, "megatron")), name


def test_repo_does_not_shadow_the_wheel():
    assert not os.path.exists(os.path.join(REPO, "megatron", "__init__.py"))
    assert not os.path.exists(os.path.join(REPO, "megatron", "core"))
