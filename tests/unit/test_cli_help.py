"""The training scripts' --help shows every flag's default."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_training_help_shows_defaults():
    proc = subprocess.run([sys.executable, "pretrain_gpt.py", "--help"], capture_output=True,
                          text=True, cwd=REPO)
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())  # argparse wraps lines
    assert ("--cuda-graph-warmup-steps CUDA_GRAPH_WARMUP_STEPS Eager steps before capture. "
            "(default: 3)") in text
    assert "--lr LR Peak learning rate. (default:" in text
