"""Scripts of examples/ and tools/ loaded as modules, for the tests that check their parts
(examples/ is no package, and a tool's functions are tested without running its main)."""

import importlib.util
import os
from types import ModuleType

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_script(*path: str) -> ModuleType:
    """The script at ``REPO/<path...>``, executed as a new module named after its file."""
    location = os.path.join(REPO, *path)
    spec = importlib.util.spec_from_file_location(
        os.path.splitext(os.path.basename(location))[0], location)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
