"""Activates te_patches when this folder is first on PYTHONPATH.

    export PYTHONPATH=<repo>/te_patches:$PYTHONPATH

Python imports ``sitecustomize`` at start-up; this one installs the import-time transform of
thd_context_parallel.py, then runs the ``sitecustomize`` it shadows, if the environment has
one further down sys.path.
"""

import importlib.machinery
import importlib.util
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _here)
import thd_context_parallel  # noqa: E402

thd_context_parallel.install()
sys.path.remove(_here)

_others = [p for p in sys.path if os.path.abspath(p or ".") != _here]
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _others)
if _spec is not None and _spec.origin and os.path.dirname(_spec.origin) != _here:
    _shadowed = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_shadowed)
