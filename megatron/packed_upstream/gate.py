"""The version gate and the patch registry of every change the fork makes to upstream.

Every module of this package was checked line by line against megatron-core
`PATCHED_VERSION` (and its ``megatron.training``). A patch changes upstream behaviour
process-wide; it runs through `install`, which refuses another megatron-core version and
applies each patch once per process, however often it is asked (installing twice = once).
tests/unit/test_core_patches.py holds a sentinel per entry that fails when upstream changes
the code it relies on.
"""

import functools
from typing import Callable, Optional

import megatron.core

PATCHED_VERSION = "0.19.2"

# Every patch installed in this process: name -> "applied" or "not needed: <why>".
applied_patches: dict = {}


def require_patched_version() -> None:
    """Raise unless the installed megatron-core is the one every entry here was checked on.

    megatron-core appends the git hash of a repository its files sit in (``0.19.2+abc1234``,
    e.g. a venv inside a clone); that local label is the same release.
    """
    installed = megatron.core.__version__
    if installed.split("+")[0] != PATCHED_VERSION:
        raise RuntimeError(
            f"megatron.packed_upstream targets megatron-core {PATCHED_VERSION}, "
            f"found {installed}. Install megatron-core=={PATCHED_VERSION} "
            "(pyproject.toml pins it), or re-check each patch against the new version.")


def install(patch: Callable[[], Optional[str]]) -> str:
    """Apply ``patch`` (a function of no arguments that rebinds upstream names) once per
    process, after the version check. Returns what it reported: "applied" (it returned None)
    or its own "not needed: <why>"; a second call returns the first call's answer."""
    name = patch.__name__
    if name not in applied_patches:
        require_patched_version()
        applied_patches[name] = patch() or "applied"
    return applied_patches[name]


def patch(body: Callable[[], Optional[str]]) -> Callable[[], str]:
    """Declare ``body`` a patch: calling the decorated function installs it through
    `install` (version-checked, once per process). ``.body`` is the undecorated function."""

    @functools.wraps(body)
    def install_once() -> str:
        return install(body)

    install_once.body = body
    return install_once
