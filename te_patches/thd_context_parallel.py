"""Sync-free THD context parallelism for Transformer Engine 2.11, applied at import time.

TE 2.11's P2P context-parallel attention backward (``AttnFuncWithCPAndKVP2P.backward``, THD
format, FlashAttention backend) zeroes the gradient rows past the last padded sequence with
``dq[cu_seqlens_q_padded[-1] :].fill_(0)`` (and ``dk``, ``dv``). Slicing by a 0-d CUDA tensor
reads it on the host: a GPU->CPU sync inside the backward, which breaks CUDA graph capture.

This module rewrites exactly those three statements, in TE's own installed source as it is
imported, into calls of `zero_rows_from` (the same result, computed with a device-side
mask). It copies no TE code: it reads the installed file, replaces three statements it
recognises, and compiles the result under the original file name. It refuses, loudly, a TE
version it was not written for, or a file where it does not find exactly those statements.

Activated by ``export PYTHONPATH=<repo>/te_patches:$PYTHONPATH`` (see sitecustomize.py).
"""

import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import re
import sys

TARGET = "transformer_engine.pytorch.attention.dot_product_attention.context_parallel"
SUPPORTED_TE_VERSIONS = ("2.11.0",)

# `    dq[cu_seqlens_q_padded[-1] :].fill_(0)` (black's slice spacing), for dq, dk and dv.
_ZERO_FILL = re.compile(
    r"^(?P<indent>[ \t]*)(?P<grad>d[qkv])\[(?P<cu>cu_seqlens_(?:q|kv)_padded)\[-1\] ?:\]"
    r"\.fill_\(0\)[ \t]*$", re.MULTILINE)
_EXPECTED = {"dq": "cu_seqlens_q_padded", "dk": "cu_seqlens_kv_padded", "dv": "cu_seqlens_kv_padded"}
HELPER = "_te_patch_zero_rows_from"


class PatchRefused(ImportError):
    """The installed TE is not the one this patch was written for; nothing was changed."""


def zero_rows_from(tensor, start) -> None:
    """``tensor[start:] = 0`` along dim 0, ``start`` a 0-d device tensor; no host sync."""
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


def check_te_version(version: str) -> None:
    if version not in SUPPORTED_TE_VERSIONS:
        raise PatchRefused(
            f"te_patches: Transformer Engine {version} is not a version this patch knows "
            f"({', '.join(SUPPORTED_TE_VERSIONS)}). Remove <repo>/te_patches from PYTHONPATH, or "
            "check whether that TE still syncs in the THD P2P backward and extend the patch.")


def transform(source: str) -> str:
    """TE 2.11 context_parallel.py text -> the same text with the three zero-fills sync-free."""
    found = list(_ZERO_FILL.finditer(source))
    grads = sorted(m["grad"] for m in found)
    if grads != ["dk", "dq", "dv"] or any(_EXPECTED[m["grad"]] != m["cu"] for m in found):
        raise PatchRefused(
            "te_patches: did not find exactly the THD zero-fills of dq, dk and dv in TE's "
            f"context_parallel.py (found {[m.group(0).strip() for m in found]}); the installed "
            "file is not the one this patch was written for. Nothing was changed.")
    return _ZERO_FILL.sub(lambda m: f"{m['indent']}{HELPER}({m['grad']}, {m['cu']}[-1])", source)


class _TransformingLoader(importlib.machinery.SourceFileLoader):
    def get_data(self, path):
        data = super().get_data(path)
        if path == self.path:  # the module source, not its bytecode cache
            data = transform(data.decode("utf-8")).encode("utf-8")
        return data

    def path_stats(self, path):
        raise OSError("never use TE's bytecode cache for the transformed module")

    def exec_module(self, module):
        module.__dict__[HELPER] = zero_rows_from
        super().exec_module(module)


class ContextParallelPatchFinder(importlib.abc.MetaPathFinder):
    """Finds TE's context_parallel module as usual and loads it through the transform."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or not spec.origin:
            return None
        check_te_version(installed_te_version())
        return importlib.util.spec_from_file_location(
            fullname, spec.origin, loader=_TransformingLoader(fullname, spec.origin))


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (idempotent)."""
    if not any(isinstance(f, ContextParallelPatchFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, ContextParallelPatchFinder())
