"""Imports written inside functions (to keep start-up light, or to break a cycle) run only when
their function does, so a moved or renamed name breaks them silently until that path runs,
often only on a GPU. Each such import of the fork's own modules must name what the module
defines."""

import ast
import importlib
import importlib.util
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OWN = ("megatron.packed_training", "megatron.packed_graphs")
SOURCES = ("megatron/packed_training", "megatron/packed_graphs", "tools", "examples")


def _function_imports():
    """(file:line, module, name) of every `from <own module> import name` inside a function."""
    for folder in SOURCES:
        for root, _, files in os.walk(os.path.join(REPO, folder)):
            for file in sorted(f for f in files if f.endswith(".py")):
                path = os.path.join(root, file)
                tree = ast.parse(open(path).read(), path)
                for function in ast.walk(tree):
                    if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        continue
                    for node in ast.walk(function):
                        if isinstance(node, ast.ImportFrom) and node.module and \
                                node.module.startswith(OWN):
                            where = f"{os.path.relpath(path, REPO)}:{node.lineno}"
                            for alias in node.names:
                                yield where, node.module, alias.name


IMPORTS = sorted(set(_function_imports()))


def test_there_are_function_level_imports_to_check():
    assert len(IMPORTS) > 50


@pytest.mark.parametrize("where, module, name", IMPORTS,
                         ids=[f"{w}:{n}" for w, _, n in IMPORTS])
def test_a_function_level_import_names_what_its_module_defines(where, module, name):
    try:
        imported = importlib.import_module(module)
    except ImportError as err:  # a module that needs a GPU-only package (TE, mamba-ssm)
        if not str(err.name or "").startswith(OWN):
            pytest.skip(f"{module} needs {err.name}")
        raise
    assert hasattr(imported, name) or importlib.util.find_spec(f"{module}.{name}"), \
        f"{where}: {module} has no {name}"
