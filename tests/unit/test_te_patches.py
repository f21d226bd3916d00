"""te_patches: the import-time transform of TE's THD context-parallel backward (CPU, offline).

The transform is checked against the context_parallel.py of every TE release te_patches
supports, through shipped excerpts of that file (tests/unit/fixtures/te_<version>_
context_parallel_excerpt.txt): the published release's lines around
``AttnFuncWithCPAndKVP2P.backward``'s zero-fills, verbatim, with every other stretch replaced
by an ``# [excerpt] lines A-B elided`` comment. Where that TE release is installed, a test
checks the excerpt against the installed file.
"""

import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "te_patches"))
import thd_context_parallel as tcp  # noqa: E402

TE_FILE = "transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py"
ZERO_FILLS = [
    ("dq[cu_seqlens_q_padded[-1] :].fill_(0)", f"{tcp.HELPER}(dq, cu_seqlens_q_padded[-1])"),
    ("dk[cu_seqlens_kv_padded[-1] :].fill_(0)", f"{tcp.HELPER}(dk, cu_seqlens_kv_padded[-1])"),
    ("dv[cu_seqlens_kv_padded[-1] :].fill_(0)", f"{tcp.HELPER}(dv, cu_seqlens_kv_padded[-1])"),
]


FIXTURES = Path(__file__).resolve().parent / "fixtures"
ELIDED = re.compile(r"^\s*# \[excerpt\] lines \d+-\d+\b.* elided$")


def excerpt_path(version: str) -> Path:
    return FIXTURES / f"te_{version}_context_parallel_excerpt.txt"


@pytest.fixture(scope="session", params=sorted(tcp.SUPPORTED_TE_VERSIONS))
def te(request):
    """(version, the excerpt of that TE release's context_parallel.py)."""
    version = request.param
    return version, excerpt_path(version).read_text(encoding="utf-8")


@pytest.mark.parametrize("version", sorted(tcp.SUPPORTED_TE_VERSIONS))
def test_every_supported_release_has_an_excerpt_that_names_it(version):
    text = excerpt_path(version).read_text(encoding="utf-8")
    head = text.splitlines()[:4]
    assert head[0].startswith("# EXCERPT, not a whole file")
    assert f"Transformer Engine {version}, the PyPI wheel transformer_engine-{version}-" in head[1]
    assert TE_FILE in head[2]


def _kept_lines(text: str):
    """The excerpt's verbatim lines: from TE's copyright line on, less the elision comments."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("# Copyright"))
    return [ln for ln in lines[start:] if not ELIDED.match(ln)]


def test_excerpt_matches_the_installed_release():
    """Where a supported TE is installed, its excerpt's kept lines are that file's, in order."""
    try:
        version = importlib.metadata.version("transformer_engine").split("+")[0]
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("Transformer Engine is not installed")
    if version not in tcp.SUPPORTED_TE_VERSIONS:
        pytest.skip(f"installed TE {version} has no excerpt")
    spec = importlib.util.find_spec("transformer_engine")
    installed = Path(spec.submodule_search_locations[0]).parent / TE_FILE
    real = iter(installed.read_text(encoding="utf-8").splitlines())
    for line in _kept_lines(excerpt_path(version).read_text(encoding="utf-8")):
        assert any(line == candidate for candidate in real), f"not in TE {version}: {line!r}"


def _functions_calling(code, name, path=()):
    """Qualified names of the functions inside ``code`` that call global ``name``."""
    found = []
    for const in code.co_consts:
        if hasattr(const, "co_code"):
            found += _functions_calling(const, name, path + (const.co_name,))
    if name in code.co_names and path:
        found.append(".".join(path))
    return found


def test_supported_versions_are_exactly_the_checked_releases():
    decisions = {v: d.action for v, d in tcp.SUPPORTED_TE_VERSIONS.items()}
    assert decisions == {"2.11.0": tcp.APPLY, "2.20.2": tcp.APPLY}


def test_transform_changes_exactly_the_three_zero_fills_of_the_release_file(te):
    version, source = te
    assert tcp.decision_for(version).action == tcp.APPLY
    patched = tcp.transform(source, version)
    before, after = source.splitlines(), patched.splitlines()
    assert len(before) == len(after)
    changed = [(a.strip(), b.strip()) for a, b in zip(before, after) if a != b]
    assert changed == ZERO_FILLS
    code = compile(patched, TE_FILE, "exec")  # still valid Python
    assert _functions_calling(code, tcp.HELPER) == ["AttnFuncWithCPAndKVP2P.backward"]


def test_the_zero_fills_still_sync_where_the_decision_says_apply(te):
    """The facts behind each release's decision, read off the release's file; fails when a
    release in the table turns out to differ (then its decision needs a new look)."""
    version, source = te
    dq_line = source.index(ZERO_FILLS[0][0])
    backward = source[source.index("class AttnFuncWithCPAndKVP2P"):dq_line]
    guard = backward[backward.rindex('ctx.qkv_format == "thd"'):]
    assert "not ctx.use_fused_attention" in guard  # the flash-attn backend only
    if version == "2.11.0":
        assert "is_graph_capturing()" not in guard  # one branch: every backward syncs
    elif version == "2.20.2":
        # 2.20.2: a device mask under TE's capture flag, the slicing zero-fills under `else:`.
        capture = guard[guard.index("if is_graph_capturing():"):]
        assert ">= cu_seqlens_q_padded[-1]" in capture
        code = [ln.strip() for ln in capture.splitlines() if not ln.strip().startswith("#")]
        assert [ln for ln in code if ln][-1] == "else:"
    else:
        pytest.fail(f"no facts recorded for TE {version}: read its file, then add them here")


def test_transform_refuses_a_file_it_does_not_recognise(te):
    version, source = te
    one_missing = source.replace(ZERO_FILLS[1][0], "pass", 1)
    extra_outside_the_backward = source + f"\n\ndef elsewhere(dq, cu_seqlens_q_padded):\n" \
                                          f"    {ZERO_FILLS[0][0]}\n"
    moved_out = one_missing + f"\n\ndef elsewhere(dk, cu_seqlens_kv_padded):\n" \
                              f"    {ZERO_FILLS[1][0]}\n"
    no_p2p_class = source.replace("class AttnFuncWithCPAndKVP2P", "class Renamed", 1)
    p2p = source.index("class AttnFuncWithCPAndKVP2P")
    backward = source.index("    def backward(", p2p)
    no_p2p_backward = source[:backward] + "    def renamed(" + source[backward + 17:]
    for text in (one_missing, extra_outside_the_backward, moved_out, no_p2p_class,
                 no_p2p_backward, "",
                 tcp.transform(source, version)):
        with pytest.raises(tcp.PatchRefused, match=f"did not find exactly the THD zero-fills"
                                                   f".* of TE {version}'s .*Nothing was changed"):
            tcp.transform(text, version)


@pytest.mark.parametrize("version", ["2.12.0", "2.20.1", "2.21.0", "3.0.0", "2.11",
                                     "2.11.0.dev0+abc123", "2.20.2rc1", "unknown"])
def test_unknown_te_version_is_refused_loudly(version):
    with pytest.raises(tcp.PatchRefused) as refused:
        tcp.check_te_version(version)
    message = str(refused.value)
    named = ("has no version metadata" if version == "unknown"
             else f"Transformer Engine is {version};")
    assert named in message
    assert "supports TE 2.11.0, 2.20.2 only" in message
    assert "Remove <repo>/te_patches from PYTHONPATH" in message
    assert "transformer_engine[pytorch]==2.20.2" in message


@pytest.mark.parametrize("version", ["2.11.0", "2.20.2", "2.20.2+c0ffee1"])
def test_known_te_version_has_a_decision(version):
    assert tcp.decision_for(version) == tcp.SUPPORTED_TE_VERSIONS[version.split("+")[0]]


def test_a_refusal_is_not_an_import_error():
    """TE imports its pytorch package under `except ImportError: pass` and megatron-core takes
    an ImportError for "no TE": an ImportError would make the refusal silent."""
    assert not issubclass(tcp.PatchRefused, ImportError)


@pytest.mark.parametrize("start", [0, 3, 7, 8])
def test_zero_rows_from_equals_the_slice_fill(start):
    grad = torch.randn(8, 2, 3)
    expected = grad.clone()
    expected[start:].fill_(0)
    tcp.zero_rows_from(grad, torch.tensor(start, dtype=torch.int32))
    assert torch.equal(grad, expected)


_FAKE_MODULE = (
    "class AttnFuncWithCPAndKVP2P:\n"
    "    @staticmethod\n"
    "    def backward(dq, dk, dv, cu_seqlens_q_padded, cu_seqlens_kv_padded):\n"
    "        if True:\n"
    "{body}"
    "\n\ndef after():\n"
    "    pass\n")


def _fake_te(root: Path, version: str, zero_fills: bool = True) -> None:
    """A TE-shaped package with ``version`` in its dist-info: its ``__init__`` imports the
    ``pytorch`` package under ``except ImportError: pass`` and that package imports
    context_parallel, as TE's do; the P2P backward holds the three zero-fills (or not)."""
    module = root / TE_FILE
    module.parent.mkdir(parents=True)
    for package in module.relative_to(root).parents:
        if str(package) != ".":
            (root / package / "__init__.py").touch()
    (root / "transformer_engine" / "__init__.py").write_text(
        "try:\n    from . import pytorch\nexcept ImportError:\n    pass\n")
    (root / "transformer_engine" / "pytorch" / "__init__.py").write_text(
        f"import {tcp.TARGET}\n")
    body = "".join(f"            {line}\n" for line, _ in ZERO_FILLS) if zero_fills else \
        "            pass\n"
    module.write_text(_FAKE_MODULE.format(body=body))
    info = root / f"transformer_engine-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: transformer_engine\nVersion: {version}\n")


def _import_fake_te(root: Path, prelude: str = "") -> subprocess.CompletedProcess:
    """Imports the fake TE under te_patches (through PYTHONPATH, as users do), twice, and runs
    the P2P backward on three gradients of 4 rows with boundaries 2 (q) and 3 (kv)."""
    script = (
        "import sys, torch\n"
        f"sys.path.insert(0, {str(root)!r})\n"
        "import thd_context_parallel as tcp\n"
        f"{prelude}"
        "import transformer_engine\n"
        f"del sys.modules[{tcp.TARGET!r}]\n"
        "import importlib; cp = importlib.import_module(tcp.TARGET)\n"
        "g = [torch.ones(4, 2) for _ in range(3)]\n"
        "cp.AttnFuncWithCPAndKVP2P.backward(*g, torch.tensor([0, 2]), torch.tensor([0, 3]))\n"
        "print('rows', [int(x.sum()) for x in g], 'patched' if tcp.HELPER in cp.__dict__ "
        "else 'unpatched')\n")
    env = {**os.environ, "PYTHONPATH": str(REPO / "te_patches"), "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("version", ["2.11.0", pytest.param("2.20.2", marks=pytest.mark.slow),
                                     pytest.param("2.20.2+c0ffee1", marks=pytest.mark.slow)])
def test_a_supported_te_is_loaded_through_the_transform(tmp_path, version):
    _fake_te(tmp_path, version)
    out = _import_fake_te(tmp_path)
    assert out.returncode == 0, out.stderr
    # rows 2.. of dq and 3.. of dk, dv zeroed, by the helper
    assert "rows [4, 6, 6] patched" in out.stdout
    assert "te_patches" not in out.stderr


@pytest.mark.slow
@pytest.mark.parametrize("version", ["2.12.0", "2.20.1"])
def test_an_unknown_te_stops_the_import_of_transformer_engine(tmp_path, version):
    _fake_te(tmp_path, version)
    out = _import_fake_te(tmp_path)
    assert out.returncode != 0
    assert f"PatchRefused: te_patches: the installed Transformer Engine is {version};" in out.stderr


@pytest.mark.slow
def test_a_supported_te_without_the_statements_stops_the_import(tmp_path):
    _fake_te(tmp_path, "2.20.2", zero_fills=False)
    out = _import_fake_te(tmp_path)
    assert out.returncode != 0
    assert ("PatchRefused: te_patches: did not find exactly the THD zero-fills of dq, dk and dv "
            "in AttnFuncWithCPAndKVP2P.backward of TE 2.20.2's") in out.stderr


@pytest.mark.slow
def test_not_needed_is_said_once_and_leaves_te_alone(tmp_path):
    """A release whose decision is "not needed" (none of the supported ones today) loads TE's
    module unchanged and says so once per process, on stderr, without failing."""
    _fake_te(tmp_path, "9.9.0")
    out = _import_fake_te(tmp_path, prelude=(
        "tcp.SUPPORTED_TE_VERSIONS['9.9.0'] = tcp.Decision(tcp.NOT_NEEDED, 'no host sync here')\n"))
    assert out.returncode == 0, out.stderr
    assert "rows [4, 6, 6] unpatched" in out.stdout  # TE's own statements ran
    assert out.stderr.count("te_patches: not needed on TE 9.9.0: no host sync here") == 1


def test_pythonpath_activates_the_patch_through_sitecustomize():
    env = {**os.environ, "PYTHONPATH": str(REPO / "te_patches")}
    out = subprocess.run(
        [sys.executable, "-c", "import sys; print([type(f).__name__ for f in sys.meta_path][0])"],
        env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ContextParallelPatchFinder", out.stderr
