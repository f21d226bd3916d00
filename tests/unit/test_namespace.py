"""megatron.core comes from the pinned wheel; megatron.packed_training / packed_graphs from this repo."""

import importlib
import importlib.metadata
import os
import subprocess
import sys
import tomllib

import pytest

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
    for name in ("megatron.packed_training.arguments", "megatron.packed_graphs.packed_seq"):
        module = importlib.import_module(name)
        assert os.path.abspath(module.__file__).startswith(os.path.join(REPO, "megatron")), name


def test_repo_does_not_shadow_the_wheel():
    assert not os.path.exists(os.path.join(REPO, "megatron", "__init__.py"))
    assert not os.path.exists(os.path.join(REPO, "megatron", "core"))
    # The wheel owns megatron.training (Megatron-LM's training layer): no package here by
    # that name, or one of the two would hide the other depending on sys.path order.
    assert not os.path.exists(os.path.join(REPO, "megatron", "training"))


@pytest.mark.slow
def test_installed_packages_import_from_outside_the_repo(tmp_path):
    """What a framework's own process sees: run from another folder, with no PYTHONPATH,
    the fork's packages come from this repo and megatron.training from the wheel, and the
    documented entry point (docs/config-api.md) validates a run's settings."""
    probe = (
        "import json, megatron.packed_training.config as c, megatron.packed_graphs.runtime as r, "
        "megatron.training as t, megatron.core as core\n"
        "args = c.load_training_config(dict(num_layers=2, hidden_size=64, num_attention_heads=4, "
        "seq_length=128, max_position_embeddings=128, micro_batch_size=1, global_batch_size=2, "
        "train_iters=2, lr=1e-4, mock_data=True, sft=True, cuda_graph_impl='local', "
        "cuda_graph_max_packed_seqs=8), model='gpt')\n"
        "assert (args.packed_graph_impl, args.num_layers) == ('local', 2), args\n"
        "print(json.dumps([c.__file__, r.__file__, t.__file__, core.__file__]))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    ours_config, ours_runtime, training, core = __import__("json").loads(
        done.stdout.strip().splitlines()[-1])
    for path in (ours_config, ours_runtime):
        assert os.path.abspath(path).startswith(os.path.join(REPO, "megatron") + os.sep), path
    for path in (training, core):
        assert not os.path.abspath(path).startswith(REPO + os.sep), path
