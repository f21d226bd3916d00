"""tools/data_benchmark.py runs end to end on a tiny corpus and prints its table (the numbers
themselves are the benchmark's business: docs/benchmarks.md)."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_the_data_benchmark_prints_its_table(tmp_path):
    run = subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", "data_benchmark.py"), "--documents", "300",
         "--seq-length", "512", "--micro-batches", "20", "--out", str(tmp_path / "corpus"),
         "--balance", "2x8", "--ranks", "2",
         "--measure", "build", "warm", "read", "packing", "balance"],
        capture_output=True, text=True, timeout=600, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    for row in ("| Cache build: first `check_data`", "| Peak RSS (`ru_maxrss`)",
                "| Padding, `--packing-algorithm best-fit-decreasing`",
                "| Start-up balance line", "| Warm start, 2 ranks started at once"):
        assert row in run.stdout, run.stdout
