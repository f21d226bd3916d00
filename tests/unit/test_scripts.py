"""The entry points say clearly when there is no GPU, and reject bad flags like argparse."""

import os
import subprocess
import sys

import pytest
import torch

from megatron.packed_training.extra_args import is_importable

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# A Megatron-LM launch line (Megatron-LM wants --max-position-embeddings and
# --micro-batch-size; --eval-iters 0: no evaluation of the mock validation split).
VALID = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "128", "--max-position-embeddings", "128", "--micro-batch-size", "1",
         "--train-iters", "1", "--lr", "1e-4", "--mock-data", "--eval-iters", "0"]


def _run(*cmd):
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)


HYBRID = ["--hybrid-layer-pattern", "M*", "--mamba-head-dim", "16", "--mamba-num-groups", "2"]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_training_without_cuda_exits_1_and_says_why():
    """The real entry point, as a process (its exit status)."""
    proc = _run(sys.executable, "pretrain_gpt.py", *VALID)
    assert proc.returncode == 1
    assert "no CUDA device is visible" in proc.stderr


def _main(script, argv):
    """``script``'s main(argv) in this process (Megatron-LM's imports paid once per session);
    returns its exit status."""
    import importlib

    with pytest.raises(SystemExit) as done:
        importlib.import_module(script[:-3]).main(argv)
    return done.value.code


def _without_mock_data(argv):
    return [token for token in argv if token != "--mock-data"]


def _write_bad_jsonl(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"input_ids": [1, 2, 3]}\n{"input_ids": [1, 2\n')
    return str(path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_hybrid_training_without_cuda_says_so_before_the_mamba_kernels(capsys):
    # The hybrid model's layers come from the pattern (Megatron-LM derives --num-layers).
    # Without a GPU that is the message, whether or not mamba-ssm / causal-conv1d are there.
    assert _main("pretrain_mamba.py", VALID[2:] + HYBRID) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if "pretrain_mamba.py" in line]
    assert len(err) == 1 and err[0].startswith("pretrain_mamba.py: no CUDA device is visible")


def test_hybrid_data_error_comes_before_the_gpu_and_the_kernels(tmp_path, capsys):
    bad = _write_bad_jsonl(tmp_path)
    assert _main("pretrain_mamba.py", _without_mock_data(VALID[2:]) + HYBRID
                 + ["--data-path", bad]) == 1
    out, err = capsys.readouterr()
    err = [line for line in err.splitlines() if "pretrain_mamba.py" in line]
    assert err == [f"pretrain_mamba.py: error: {bad}:2:20: JSON is wrong: Expecting ',' "
                   f"delimiter. The line ends before the JSON object does: write each object "
                   f"whole, on one line (JSONL, not pretty-printed JSON)."]
    assert "arguments" not in out


@pytest.mark.skipif(is_importable("mamba_ssm") and is_importable("causal_conv1d"),
                    reason="checks a machine without the Mamba kernels")
def test_hybrid_training_with_a_gpu_but_without_its_kernels_names_the_install(capsys,
                                                                              monkeypatch):
    from megatron.packed_training import initialize

    monkeypatch.setattr(initialize, "require_cuda", lambda script: None)  # as on a GPU machine
    assert _main("pretrain_mamba.py", VALID[2:] + HYBRID) == 1
    out, err = capsys.readouterr()
    err = [line for line in err.splitlines() if "pretrain_mamba.py" in line]
    assert len(err) == 1 and err[0].startswith("pretrain_mamba.py: error: ")
    assert "is not importable, and the Mamba" in err[0]
    assert 'pip install --no-build-isolation -e ".[mamba]"' in err[0]
    assert "arguments" not in out  # Megatron-LM's argument dump only once every check passed


@pytest.mark.slow
def test_bad_data_file_is_reported_before_megatrons_argument_dump(tmp_path):
    """The real script: the data error is the first (and only) thing it prints."""
    bad = _write_bad_jsonl(tmp_path)
    proc = _run(sys.executable, "pretrain_gpt.py", "--sft", "--data-path", bad,
                *_without_mock_data(VALID))
    assert proc.returncode == 1
    assert proc.stdout == ""  # no argument dump, no data summary
    assert proc.stderr.startswith(f"pretrain_gpt.py: error: {bad}:2:20: JSON is wrong: ")


def test_bad_flag_is_a_usage_error(capsys):
    assert _main("pretrain_gpt.py", VALID + ["--cuda-graph-impl", "local"]) == 2
    assert ("pretrain_gpt.py: error: --cuda-graph-max-packed-seqs is wrong: 0"
            in capsys.readouterr().err)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_example_launcher_refuses_without_gpu():
    script = os.path.join("examples", "local", "train_hybrid_synthetic.sh")
    assert _run("bash", "-n", script).returncode == 0
    proc = _run("bash", script)
    assert proc.returncode == 1 and "no CUDA GPU is visible" in proc.stderr


def _ci_test_block():
    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read()
    start, end = text.index("<!-- ci:test -->"), text.index("<!-- /ci:test -->")
    return [line for line in text[start:end].splitlines()[1:] if not line.startswith("```")]


def test_readme_ci_command_pins_torch_and_installs_the_test_extra():
    lines = [line for line in _ci_test_block() if line.strip()]
    assert lines == [
        'pip install torch==2.11.0 && pip install -e ".[test]" && python -m pytest -q --all tests']


def test_ci_run_is_valid_bash_and_uses_python_312():
    script = os.path.join(".ci", "run")
    assert os.access(os.path.join(REPO, script), os.X_OK)
    assert _run("bash", "-n", script).returncode == 0
    with open(os.path.join(REPO, script)) as f:
        text = f.read()
    assert "python3.12" in text and ".pyenv/versions/3.12" in text


def test_ci_run_without_python_312_says_so(tmp_path):
    if any(os.path.exists(os.path.join(d, "python3.12")) for d in ("/usr/bin", "/bin")):
        pytest.skip("this machine has a system python3.12")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = subprocess.run(["bash", os.path.join(".ci", "run")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "no working Python 3.12 found" in proc.stderr
