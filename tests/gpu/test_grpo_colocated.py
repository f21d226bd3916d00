"""examples/rl/grpo_colocated.py on one GPU, from a tiny converted Qwen3 (tied embeddings):

* every iteration prints every phase's line (refit, generate, score, log-probs, train), the
  refit fills every tensor of the Hugging Face model, and the generator's log-probs of its
  samples equal the policy's on the same tokens within bf16 noise (weights of standard
  deviation 0.2: a wrong or missing refit differs by ~2 nats a token, bf16 by ~0.02);
* with ``--offload`` (torch_memory_saver's preload library in LD_PRELOAD) the same, plus the
  offload and onload lines; skipped where torch_memory_saver is not installed.
"""

import math
import os
import re
import subprocess
import sys

import pytest

from tests.gpu.launch import REPO, assert_succeeded, free_port

SCRIPT = os.path.join(REPO, "examples", "rl", "grpo_colocated.py")
ITERATIONS = 3
PHASES = ("refit", "generate", "score", "reference log-probs", "policy log-probs", "train")
MISMATCH = re.compile(r"\|policy - generator\| mean ([0-9.]+), max ([0-9.]+)")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from megatron.packed_training.hf import import_hf
    from tests.unit.hf_tiny import tiny_qwen3

    root = tmp_path_factory.mktemp("qwen3")
    import_hf(tiny_qwen3(root / "hf", initializer_range=0.2), root / "converted")
    return str(root / "converted")


def preload_library():
    """torch_memory_saver's preload library, or None where the package is not installed."""
    try:
        from torch_memory_saver.utils import get_binary_path_from_package
    except ImportError:
        return None
    return str(get_binary_path_from_package("torch_memory_saver_hook_mode_preload"))


def run_example(converted, tmp_path, *extra, env=None):
    # A plain `python` process is a world of one on MASTER_PORT (default 29500): a port of
    # its own, so that runs side by side (pytest-xdist) do not collide.
    env = dict(os.environ if env is None else env, MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()))
    proc = subprocess.run(
        [sys.executable, SCRIPT, converted, "--iterations", str(ITERATIONS), "--prompts", "4",
         "--group-size", "4", "--prompt-length", "16", "--max-new-tokens", "48",
         "--seq-length", "256", "--lr", "1e-3", *extra],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900,
        env=env)
    with open(str(tmp_path / "grpo_colocated.log"), "w") as f:
        f.write(proc.stdout)
    assert_succeeded("examples/rl/grpo_colocated.py", proc.returncode, proc.stdout)
    lines = [line.split() for line in proc.stdout.splitlines() if re.match(r"\d+  ", line)]
    print("\n".join(line for line in proc.stdout.splitlines() if re.match(r"(\d+|iter)  ", line)))
    return proc.stdout, lines


def check_iterations(output: str, lines: list, phases) -> None:
    for it in range(ITERATIONS):
        seen = [" ".join(words[1:words.index(next(w for w in words[1:]
                                                  if re.fullmatch(r"[0-9.]+", w)))])
                for words in lines if words[0] == str(it)]
        assert seen == list(phases), (it, seen)
    refits = re.findall(r"refit .* (\d+) tensors", output)
    assert len(set(refits)) == 1 and int(refits[0]) > 0, refits
    mismatches = [(float(mean), float(most)) for mean, most in MISMATCH.findall(output)]
    assert len(mismatches) == ITERATIONS
    assert all(mean < 0.2 for mean, _ in mismatches), mismatches
    losses = [float(x) for x in re.findall(r"loss (-?[0-9.e+-]+),", output)]
    assert len(losses) == ITERATIONS and all(math.isfinite(x) for x in losses)


def test_the_colocated_loop_refits_generates_and_trains(converted, tmp_path):
    output, lines = run_example(converted, tmp_path)
    check_iterations(output, lines, PHASES)


def test_the_colocated_loop_with_offload(converted, tmp_path):
    library = preload_library()
    if library is None:
        pytest.skip("torch_memory_saver is not installed (pip install torch_memory_saver): "
                    "--offload needs its preload library")
    env = dict(os.environ, LD_PRELOAD=library)
    output, lines = run_example(converted, tmp_path, "--offload", env=env)
    check_iterations(output, lines, ("refit", "offload", "generate", "score", "onload",
                                     *PHASES[3:]))
