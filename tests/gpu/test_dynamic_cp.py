"""Dynamic context parallelism on 2 GPUs (issue 7): a micro-batch's own CP group.

Skipped without Transformer Engine (docs/te-on-device.md) or with fewer than 2 GPUs.
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformer_engine.pytorch",
                    reason="needs Transformer Engine (docs/te-on-device.md)")

from tests.gpu.launch import REPO, _free_port  # noqa: E402


@pytest.mark.gpus(2)
def test_micro_batch_cp_group_matches_the_whole_micro_batch(tmp_path):
    """Two ranks splitting one micro-batch over a CP group given per micro-batch (TE CP
    attention + fused RoPE with that group) give the loss and gradients of one rank running
    it whole; afterwards a micro-batch without a group runs like the reference again."""
    out = tmp_path / "dynamic_cp.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(_free_port()),
           os.path.join(REPO, "tests", "gpu", "dynamic_cp_worker.py"), str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    result = json.loads(out.read_text())
    print(json.dumps(result))
    ref, cp2, cp1 = result["reference"], result["dynamic CP 2"], result["dynamic CP 1"]
    assert result["documents"] > 1
    assert cp2["tokens"] == ref["tokens"]
    # bf16 with another reduction order (ring attention, split RoPE): a few 1e-3 relative.
    assert cp2["loss"] == pytest.approx(ref["loss"], rel=1e-2)
    assert cp2["grad_rel_diff"] < 3e-2
    # Back to no CP: the same kernels as the reference.
    assert cp1["loss"] == pytest.approx(ref["loss"], rel=1e-6)
    assert cp1["grad_rel_diff"] < 1e-6
