"""Sync-free THD context parallelism for Transformer Engine, applied at import time.

TE's P2P context-parallel attention backward (``AttnFuncWithCPAndKVP2P.backward``, THD
format, FlashAttention backend) zeroes the gradient rows past the last padded sequence with
``dq[cu_seqlens_q_padded[-1] :].fill_(0)`` (and ``dk``, ``dv``). Slicing by a 0-d CUDA tensor
reads it on the host: a GPU->CPU sync inside the backward, which breaks CUDA graph capture
and stalls the host in eager steps.

This module rewrites exactly those three statements, in TE's own installed source as it is
imported, into calls of `zero_rows_from` (the same result, computed with a device-side
mask). It copies no TE code: it reads the installed file, replaces three statements it
recognises inside that backward, and compiles the result under the original file name.

Each TE release it knows has a decision in `SUPPORTED_TE_VERSIONS`: apply the transform, or
leave TE alone and say once why it is not needed. Any other TE version, or a file of a known
version where the statements are not where they should be, is refused loudly
(`PatchRefused`); nothing is changed then.

Activated by ``export PYTHONPATH=<repo>/te_patches:$PYTHONPATH`` (see sitecustomize.py).
"""

import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import re
import sys
from typing import NamedTuple

TARGET = "transformer_engine.pytorch.attention.dot_product_attention.context_parallel"
HELPER = "_te_patch_zero_rows_from"


class Decision(NamedTuple):
    """What te_patches does on one TE release: ``action`` "apply" or "not needed", and why."""

    action: str
    reason: str


APPLY, NOT_NEEDED = "apply", "not needed"

# TE release -> decision, each read off that release's context_parallel.py.
SUPPORTED_TE_VERSIONS = {
    "2.11.0": Decision(
        APPLY, "AttnFuncWithCPAndKVP2P.backward zero-fills dq, dk, dv by slicing at "
        "cu_seqlens_*_padded[-1] (a host sync) on every THD flash-attn backward"),
    "2.20.2": Decision(
        APPLY, "AttnFuncWithCPAndKVP2P.backward masks on the device while TE's capture flag "
        "is set (make_graphed_callables, megatron-core's graph capture), but its eager branch "
        "still zero-fills by slicing at cu_seqlens_*_padded[-1] (a host sync); the eager "
        "branch is transformed, the capture branch is TE's own"),
}

# `    dq[cu_seqlens_q_padded[-1] :].fill_(0)` (black's slice spacing), for dq, dk and dv.
_ZERO_FILL = re.compile(
    r"^(?P<indent>[ \t]*)(?P<grad>d[qkv])\[(?P<cu>cu_seqlens_(?:q|kv)_padded)\[-1\] ?:\]"
    r"\.fill_\(0\)[ \t]*$", re.MULTILINE)
_EXPECTED = {"dq": "cu_seqlens_q_padded", "dk": "cu_seqlens_kv_padded", "dv": "cu_seqlens_kv_padded"}
# From `class AttnFuncWithCPAndKVP2P` through its own `def backward` (no top-level line in
# between) to the next top-level line.
_P2P_BACKWARD = re.compile(
    r"^class AttnFuncWithCPAndKVP2P\b[^\n]*\n(?:(?!^\S).)*?^    def backward\(.*?(?=^\S)",
    re.MULTILINE | re.DOTALL)
_RELEASE = re.compile(r"(\d+\.\d+\.\d+)(\+[0-9A-Za-z.]+)?")
_TO_DO = ("Remove <repo>/te_patches from PYTHONPATH (TE then runs unpatched), or install a "
          "supported TE, e.g. pip install 'transformer_engine[pytorch]=={newest}'.")


class PatchRefused(RuntimeError):
    """te_patches does not know the installed TE, or does not find what it replaces there;
    nothing was changed.

    Not an ImportError on purpose: TE's own ``transformer_engine/__init__.py`` imports its
    ``pytorch`` package under ``except ImportError: pass``, and megatron-core takes an
    ImportError for "TE not installed", so an ImportError would turn the refusal into a
    silently missing TE.
    """


def zero_rows_from(tensor, start) -> None:
    """``tensor[start:] = 0`` along dim 0, ``start`` a 0-d device tensor. No host sync."""
    import torch

    rows = torch.arange(tensor.shape[0], device=tensor.device)
    mask = (rows >= start).view(-1, *([1] * (tensor.dim() - 1)))
    tensor.masked_fill_(mask, 0)


def installed_te_version() -> str:
    """Version of the installed Transformer Engine (the meta package, else its core wheel)."""
    for dist in ("transformer_engine", "transformer_engine_cu13", "transformer_engine_cu12"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def _supported() -> str:
    return ", ".join(SUPPORTED_TE_VERSIONS)


def _to_do() -> str:
    newest = max(SUPPORTED_TE_VERSIONS, key=lambda v: tuple(map(int, v.split("."))))
    return _TO_DO.format(newest=newest)


def decision_for(version: str) -> Decision:
    """The decision for TE ``version``. A local build label (``2.20.2+abc123``) counts as its
    release; its file is still checked by `transform`. Raises PatchRefused for any other
    version."""
    match = _RELEASE.fullmatch(version)
    decision = SUPPORTED_TE_VERSIONS.get(match.group(1)) if match else None
    if decision is None:
        installed = ("has no version metadata" if version == "unknown" else f"is {version}")
        raise PatchRefused(
            f"te_patches: the installed Transformer Engine {installed}; te_patches supports "
            f"TE {_supported()} only and does not guess what another version's "
            "context-parallel backward does. " + _to_do())
    if decision.action not in (APPLY, NOT_NEEDED):
        raise ValueError(f"te_patches: decision for TE {version} is wrong: {decision.action!r}")
    return decision


def check_te_version(version: str) -> None:
    """Raises PatchRefused unless te_patches has a decision for TE ``version``."""
    decision_for(version)


def transform(source: str, version: str = "") -> str:
    """TE's context_parallel.py text (of TE ``version``, for the message) -> the same text
    with the three zero-fills of the THD P2P backward sync-free. Raises PatchRefused unless
    it finds exactly those three statements, all inside ``AttnFuncWithCPAndKVP2P.backward``."""
    found = list(_ZERO_FILL.finditer(source))
    backward = _P2P_BACKWARD.search(source)
    grads = sorted(m["grad"] for m in found)
    if (grads != ["dk", "dq", "dv"] or any(_EXPECTED[m["grad"]] != m["cu"] for m in found)
            or backward is None
            or not all(backward.start() <= m.start() < backward.end() for m in found)):
        raise PatchRefused(
            f"te_patches: did not find exactly the THD zero-fills of dq, dk and dv in "
            f"AttnFuncWithCPAndKVP2P.backward of TE {version or '?'}'s context_parallel.py (found "
            f"{[m.group(0).strip() for m in found]}"
            f"{'' if backward else ', and no AttnFuncWithCPAndKVP2P.backward'}); this build "
            f"of TE is not the release te_patches was checked against. Nothing was changed. "
            + _to_do())
    return _ZERO_FILL.sub(lambda m: f"{m['indent']}{HELPER}({m['grad']}, {m['cu']}[-1])", source)


_reported = set()


def report_not_needed(version: str, decision: Decision) -> None:
    """Say once per process that this TE needs no patch, and why (not an error)."""
    if version not in _reported:
        _reported.add(version)
        print(f"te_patches: not needed on TE {version}: {decision.reason}; TE's "
              "context_parallel is loaded unchanged.", file=sys.stderr)


class _TransformingLoader(importlib.machinery.SourceFileLoader):
    def __init__(self, fullname, path, version):
        super().__init__(fullname, path)
        self.te_version = version

    def get_data(self, path):
        data = super().get_data(path)
        if path == self.path:  # the module source, not its bytecode cache
            data = transform(data.decode("utf-8"), self.te_version).encode("utf-8")
        return data

    def path_stats(self, path):
        raise OSError("never use TE's bytecode cache for the transformed module")

    def exec_module(self, module):
        module.__dict__[HELPER] = zero_rows_from
        super().exec_module(module)


class ContextParallelPatchFinder(importlib.abc.MetaPathFinder):
    """Finds TE's context_parallel module as usual and, where the installed TE's decision is
    "apply", loads it through the transform."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or not spec.origin:
            return None
        version = installed_te_version()
        decision = decision_for(version)
        if decision.action == NOT_NEEDED:
            report_not_needed(version, decision)
            return None  # the next finder loads TE's module as it is
        return importlib.util.spec_from_file_location(
            fullname, spec.origin, loader=_TransformingLoader(fullname, spec.origin, version))


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (idempotent)."""
    if not any(isinstance(f, ContextParallelPatchFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, ContextParallelPatchFinder())
