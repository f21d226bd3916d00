"""Every reach into upstream internals lives in megatron/packed_upstream/.

The rest of the fork extends megatron-core through specs, subclasses and its public calls.
This test reads the fork's source and fails on a new reach anywhere else: a private
keyword argument (TE's ``_order``), ``setattr``/``delattr`` on an upstream object, a write
to a field or method of an upstream object (an optimizer, a graph runner or manager, a
dispatcher, a layer or model that is not ``self``, also one held by ``self``), a write to an
upstream module or class, a private name imported from upstream, or any private attribute
of an object other than ``self`` (``getattr`` with a private name too), a read or write of
upstream's graph internals (a manager's runners, a layer's graphs or graph manager, also on
``self``), an MRO bypass (``super(Class, self)``, ``UpstreamClass.method(self, ...)``), a
``__class__`` swap, and a per-call swap of a field upstream builds once (``self.cp``,
``self.pg_collection``). Move such code into the module of megatron/packed_upstream/ for the
upstream part it touches, as a named function (its docstring says why;
tests/unit/test_core_patches.py pins the upstream code it relies on), and call that.
"""

import ast
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
SOURCES = sorted([*(REPO / "megatron").rglob("*.py"), REPO / "pretrain_gpt.py",
                  REPO / "pretrain_mamba.py"])
SHIM = REPO / "megatron" / "packed_upstream"
REACHES_LIVE_IN = sorted(SHIM.glob("*.py"))

# Names under which the fork's code holds upstream objects whose state it must not write.
UPSTREAM_HOLDERS = {"optimizer", "part", "runner", "manager", "dispatcher", "layer", "block",
                    "chunk", "model", "module", "mlp", "attention", "transformer_layer"}
# Receivers of setattr that are the fork's own objects: the parsed arguments, the
# full-iteration graph's twin of a micro-batch's params (a dataclass copy it builds), and the
# transformer config the fork builds from the arguments before any module reads it.
OWN_SETATTR_RECEIVERS = {"args", "twin", "config"}
# Private names that are a protocol, not internals: argparse keeps a parser's actions in
# ``_actions`` (no public accessor); Megatron-LM's own parse_args sets
# ``_is_global_batch_size_explicitly_specified`` for its validate_args, as the fork's parse does.
PROTOCOL_PRIVATE = {"_actions", "_is_global_batch_size_explicitly_specified"}
# Public names under which megatron-core 0.19.2 keeps its graph state: read or written only in
# the shim (a wheel upgrade re-examines them there).
GRAPH_INTERNALS = {"cudagraph_runners", "reuse_cudagraphs", "cuda_graphs", "cudagraph_manager",
                   "cuda_graph_manual_hooks", "cudagraph_created"}
# Fields upstream builds once at init and reads in forward: swapping them per call is a reach.
FIELDS_BUILT_ONCE = {"cp", "pg_collection"}


def _root(node):
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node


def _upstream_imports(tree) -> set:
    """Names this file binds to megatron.core / transformer_engine modules and classes."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                ("megatron.core", "transformer_engine")):
            names.update(alias.asname or alias.name for alias in node.names)
    return names


def reaches(path: pathlib.Path) -> list:
    """``(line, what)`` for every reach into upstream internals in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    upstream = _upstream_imports(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            for keyword in node.keywords:
                if keyword.arg and keyword.arg.startswith("_"):
                    found.append((node.lineno, f"private keyword {keyword.arg}="))
            if (isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr")
                    and not (isinstance(node.args[0], ast.Name)
                             and node.args[0].id in OWN_SETATTR_RECEIVERS)):
                found.append((node.lineno, ast.unparse(node)))
        targets = []
        if isinstance(node, ast.Assign):
            targets = [t for target in node.targets
                       for t in (target.elts if isinstance(target, ast.Tuple) else [target])]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            if not isinstance(target, ast.Attribute):
                continue
            holder = target.value  # `optimizer.step = ...`, also `self.optimizer.step = ...`
            name = (holder.id if isinstance(holder, ast.Name)
                    else holder.attr if isinstance(holder, ast.Attribute) else None)
            if name in UPSTREAM_HOLDERS or (isinstance(holder, ast.Name) and name in upstream):
                found.append((node.lineno, f"write {ast.unparse(target)}"))
        for target in targets:
            if isinstance(target, ast.Attribute) and target.attr == "__class__":
                found.append((node.lineno, f"class swap {ast.unparse(target)}"))
            elif (isinstance(target, ast.Attribute) and target.attr in FIELDS_BUILT_ONCE
                  and isinstance(target.value, ast.Name) and target.value.id == "self"):
                found.append((node.lineno, f"field swap {ast.unparse(target)}"))
        if isinstance(node, ast.Attribute) and node.attr in GRAPH_INTERNALS:
            found.append((node.lineno, f"graph internals {ast.unparse(node)}"))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) > 1
                and isinstance(node.args[1], ast.Constant)
                and node.args[1].value in GRAPH_INTERNALS):
            found.append((node.lineno, f"graph internals {ast.unparse(node)}"))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id == "super" and node.args:
            found.append((node.lineno, f"MRO bypass {ast.unparse(node)}"))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(_root(node.func.value), ast.Name)
                and _root(node.func.value).id in upstream and node.args and isinstance(node.args[0], ast.Name)
                and node.args[0].id == "self"):
            found.append((node.lineno, f"MRO bypass {ast.unparse(node.func)}(self, ...)"))
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                ("megatron.core", "megatron.training", "transformer_engine")):
            found.extend((node.lineno, f"private import {alias.name}") for alias in node.names
                         if alias.name.startswith("_"))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr") and len(node.args) > 1
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
                and node.args[1].value.startswith("_") and not node.args[1].value.startswith("__")
                and node.args[1].value not in PROTOCOL_PRIVATE):
            found.append((node.lineno, ast.unparse(node)))
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__") and node.attr not in PROTOCOL_PRIVATE):
            root = _root(node.value)
            is_super = (isinstance(root, ast.Name) and root.id == "super")
            if not is_super and not (isinstance(node.value, ast.Name)
                                     and node.value.id in ("self", "cls")):
                found.append((node.lineno, f"private {ast.unparse(node)}"))
    return found


def test_the_scan_sees_each_kind_of_reach(tmp_path):
    source = tmp_path / "reaching.py"
    source.write_text(
        "from megatron.core.transformer import cuda_graphs\n"
        "def f(optimizer, runner, make, args, x):\n"
        "    optimizer.step = None\n"
        "    runner.mempool = 1\n"
        "    cuda_graphs.flag = True\n"
        "    setattr(x, 'y', 1)\n"
        "    make(_order=[1])\n"
        "    return x._private, super()._method, args, setattr(args, 'a', 1)\n"
        "from megatron.core.models import _helper, public\n"
        "def g(self, x):\n"
        "    self.optimizer.step = None\n"
        "    self.count = getattr(x, '_private', 0) + getattr(x, 'public', 0)\n"
        "    y = self.cuda_graphs[0], x.cudagraph_runners, getattr(x, 'cudagraph_manager', None)\n"
        "    super(cuda_graphs.CudaGraphManager, self).forward()\n"
        "    x.__class__ = int\n"
        "    self.cp = x\n"
        "    return cuda_graphs.CudaGraphManager.forward(self, x)\n")
    assert sorted(line for line, _ in reaches(source)) == [
        3, 4, 5, 6, 7, 8, 9, 11, 12, 13, 13, 13, 14, 15, 16, 17]


@pytest.mark.parametrize("path", [p for p in SOURCES if p not in REACHES_LIVE_IN],
                         ids=lambda p: str(p.relative_to(REPO)))
def test_no_reach_outside_the_shim(path):
    found = reaches(path)
    assert not found, (f"{path.relative_to(REPO)} reaches into upstream internals; move it "
                       "into megatron/packed_upstream/: "
                       + "; ".join(f"line {line}: {what}" for line, what in found))


# The shim's own helpers, called only by its patches: not reaches of their own.
SHIM_HELPERS = {"require_patched_version", "forward_inputs_reused_as_grad_buffers",
                "foreach_l2_norm", "foreach_scale", "grad_norm_on_device",
                "clip_by_device_norm", "moe_metric_names", "any_rank_requested",
                "signals_received_on_host", "install", "patch", "reserved_without_cache",
                "process_stream"}


def test_docs_list_every_patch():
    """docs/architecture.md names each public function of megatron/packed_upstream/."""
    patches = {node.name for path in REACHES_LIVE_IN
               for node in ast.parse(path.read_text()).body
               if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")}
    patches -= SHIM_HELPERS
    docs = (REPO / "docs" / "architecture.md").read_text()
    assert sorted(name for name in patches if f"`{name}`" not in docs) == []
