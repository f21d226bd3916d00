"""te_patches: the import-time transform of TE 2.11's THD context-parallel backward (CPU).

The transform is checked against the real TE 2.11 file, read from the published
``transformer_engine==2.11.0`` wheel (downloaded once per test session, 0.7 MB).
"""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "te_patches"))
import thd_context_parallel as tcp  # noqa: E402

TE_FILE = "transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py"


@pytest.fixture(scope="session")
def te_source(tmp_path_factory):
    where = tmp_path_factory.mktemp("te_wheel")
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(where),
                    "transformer_engine==2.11.0"], check=True, timeout=300)
    wheel = next(where.glob("transformer_engine-2.11.0-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        return zf.read(TE_FILE).decode("utf-8")


def test_transform_changes_exactly_the_three_zero_fills_of_the_real_file(te_source):
    patched = tcp.transform(te_source)
    before, after = te_source.splitlines(), patched.splitlines()
    assert len(before) == len(after)
    changed = [(a.strip(), b.strip()) for a, b in zip(before, after) if a != b]
    assert changed == [
        ("dq[cu_seqlens_q_padded[-1] :].fill_(0)", f"{tcp.HELPER}(dq, cu_seqlens_q_padded[-1])"),
        ("dk[cu_seqlens_kv_padded[-1] :].fill_(0)", f"{tcp.HELPER}(dk, cu_seqlens_kv_padded[-1])"),
        ("dv[cu_seqlens_kv_padded[-1] :].fill_(0)", f"{tcp.HELPER}(dv, cu_seqlens_kv_padded[-1])"),
    ]
    compile(patched, TE_FILE, "exec")  # still valid Python


def test_transform_refuses_a_file_it_does_not_recognise(te_source):
    one_missing = te_source.replace("dk[cu_seqlens_kv_padded[-1] :].fill_(0)", "pass", 1)
    for text in (one_missing, "", tcp.transform(te_source)):
        with pytest.raises(tcp.PatchRefused, match="did not find exactly the THD zero-fills"):
            tcp.transform(text)


def test_unknown_te_version_is_refused_loudly():
    tcp.check_te_version("2.11.0")
    with pytest.raises(tcp.PatchRefused, match="Transformer Engine 2.12.0 is not a version"):
        tcp.check_te_version("2.12.0")


@pytest.mark.parametrize("start", [0, 3, 7, 8])
def test_zero_rows_from_equals_the_slice_fill(start):
    grad = torch.randn(8, 2, 3)
    expected = grad.clone()
    expected[start:].fill_(0)
    tcp.zero_rows_from(grad, torch.tensor(start, dtype=torch.int32))
    assert torch.equal(grad, expected)


def _fake_te(root: Path, version: str) -> None:
    """A TE-shaped package with the three statements and a dist-info of ``version``."""
    module = root / TE_FILE
    module.parent.mkdir(parents=True)
    for package in module.relative_to(root).parents:
        if str(package) != ".":
            (root / package / "__init__.py").touch()
    module.write_text(
        "def backward_tail(dq, dk, dv, cu_seqlens_q_padded, cu_seqlens_kv_padded):\n"
        "    if True:\n"
        "        dq[cu_seqlens_q_padded[-1] :].fill_(0)\n"
        "        dk[cu_seqlens_kv_padded[-1] :].fill_(0)\n"
        "        dv[cu_seqlens_kv_padded[-1] :].fill_(0)\n")
    info = root / f"transformer_engine-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: transformer_engine\nVersion: {version}\n")


@pytest.mark.parametrize("version", ["2.11.0", "2.12.0"])
def test_finder_loads_the_module_through_the_transform(tmp_path, version):
    _fake_te(tmp_path, version)
    script = (
        "import sys, torch\n"
        f"sys.path.insert(0, {str(tmp_path)!r})\n"
        "import thd_context_parallel as tcp\n"
        "tcp.install()\n"
        "try:\n"
        "    import transformer_engine.pytorch.attention.dot_product_attention.context_parallel as cp\n"
        "except tcp.PatchRefused as err:\n"
        "    print('refused:', err); raise SystemExit(0)\n"
        "g = [torch.ones(4, 2) for _ in range(3)]\n"
        "cp.backward_tail(*g, torch.tensor([0, 2]), torch.tensor([0, 3]))\n"
        "print('rows', [int(x.sum()) for x in g], tcp.HELPER in cp.__dict__)\n")
    env = {**os.environ, "PYTHONPATH": str(REPO / "te_patches"), "PYTHONDONTWRITEBYTECODE": "1"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    if version == "2.11.0":
        assert "rows [4, 6, 6] True" in out.stdout  # rows 2.. of dq and 3.. of dk, dv zeroed
    else:
        assert "refused: te_patches: Transformer Engine 2.12.0" in out.stdout


def test_pythonpath_activates_the_patch_through_sitecustomize():
    env = {**os.environ, "PYTHONPATH": str(REPO / "te_patches")}
    out = subprocess.run(
        [sys.executable, "-c", "import sys; print([type(f).__name__ for f in sys.meta_path][0])"],
        env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ContextParallelPatchFinder", out.stderr
