"""An FP8 policy's graphs never serve weights quantized before a change (docs/fp8.md,
"Quantized weights"): after a refit (`load_weights`), inside and after a reference swap
(`swapped_weights`) and after training steps, the log-probs replayed on forward-only graphs
equal eager ones (which re-quantize at every call), and both moved off the log-probs before
the change by far more than that difference (fp8_refit_worker.py).

Run: ``python -m pytest -q -s tests/gpu/test_fp8_refit.py`` (one GPU, TE).
"""

import json
import os

import pytest

from megatron.packed_training.extra_args import is_importable
from tests.gpu.launch import assert_succeeded, torchrun

WORKER = os.path.join("tests", "gpu", "fp8_refit_worker.py")
# Graphed against eager: the same kernels on the same quantized weights, up to the order of
# TE's reductions; a stale weight moves log-probs by the perturbation's effect (~1e-1).
SAME = 2e-3

pytestmark = pytest.mark.skipif(not is_importable("transformer_engine"),
                                reason="FP8 needs Transformer Engine (pip install -e .[te])")


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_graphs_follow_refits_swaps_and_steps(tmp_path, recipe):
    out = tmp_path / "result.json"
    proc = torchrun(WORKER, ["--recipe", recipe, "--out", str(out)], nproc=1,
                    log=str(tmp_path / "worker.log"))
    assert_succeeded("the worker", proc.returncode, proc.stdout)
    result = json.loads(out.read_text())
    print(f"{recipe}: {json.dumps(result)}")
    for name in ("start", "after_refit", "inside_swap", "after_swap", "after_steps"):
        row = result[name]
        assert row["finite"] and row["forward_graphs"] >= 1, (name, row)  # some replayed
        assert row["max_graphed_vs_eager"] <= SAME, (name, row)
    # Each change is visible (a stale graph would not follow it); out of the swap, the
    # refit's weights are back.
    assert result["after_refit"]["moved_eager"] > 50 * SAME
    assert result["inside_swap"]["moved_eager"] > 50 * SAME
    assert result["after_swap"]["moved_eager"] <= SAME
    assert result["after_steps"]["moved_eager"] > 5 * SAME
    assert result["inside_swap_vs_start"] <= SAME  # the original weights, re-quantized
