"""The training scripts' --help: Megatron-LM's flags and the fork's, with the fork's help text."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_training_help_lists_megatron_lm_and_fork_flags():
    # pretrain_mamba.py builds the same parser (arguments.build_parser): one start-up is enough.
    proc = subprocess.run([sys.executable, "pretrain_gpt.py", "--help"], capture_output=True,
                          text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # megatron-core's and torch's import notices (no Apex, TE or CUDA toolkit here) are held
    # back: the help is all the script prints.
    assert proc.stderr == ""
    text = " ".join(proc.stdout.split())  # argparse wraps lines
    # Megatron-LM's own flags, with its help text.
    assert "--lr LR Initial learning rate." in text
    assert "--hybrid-layer-pattern" in text and "--attention-backend" in text
    # The fork's flags, in their own group.
    assert "packed cuda graphs:" in text
    assert ("--cuda-graph-max-packed-seqs [CUDA_GRAPH_MAX_PACKED_SEQS] Graph capacity: "
            "documents per micro-batch") in text
    assert "--long-document-policy {truncate,split,reject}" in text


def test_a_typo_is_the_one_line_the_script_prints():
    proc = subprocess.run([sys.executable, "pretrain_mamba.py", "--num-layerz", "2"],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 2
    assert proc.stdout == ""
    # Found before Megatron-LM's parser is imported: the flag alone, not the value after it.
    assert proc.stderr.splitlines() == ["pretrain_mamba.py: error: arguments are wrong: "
                                        "unrecognized arguments: --num-layerz."]
