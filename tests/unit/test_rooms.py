"""The rooms rule on the real tree (tools/rooms.py): imports run one way, from scripts through
packed_training, packed_graphs, packed_model and packed_upstream down to the megatron-core
wheel; no import cycle between modules; every import finds its module; docs/architecture.md
shows the current picture."""

import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
import rooms  # noqa: E402

ARCHITECTURE = REPO / "docs" / "architecture.md"


@pytest.fixture(scope="module")
def tree():
    return rooms.read_tree(REPO)


def test_no_arrow_goes_up(tree):
    up = rooms.upward_imports(tree)
    assert not up, "imports against the rooms' one-way rule (docs/architecture.md):\n" + "\n".join(
        f"{rooms.room_of(i.source).name} -> {rooms.room_of(i.target).name}: {i.source} imports "
        f"{i.target} ({tree.where(i)})" for i in up)


def test_no_import_cycle(tree):
    assert rooms.import_cycles(tree) == [], "\n".join(rooms.problems(tree))


def test_every_import_of_the_fork_finds_its_module(tree):
    assert tree.missing == [], "\n".join(rooms.problems(tree))


def test_architecture_doc_shows_the_current_picture(tree):
    documented = rooms.documented_picture(ARCHITECTURE)
    assert documented == rooms.picture(tree), (
        f"docs/architecture.md's rooms picture is out of date; run {rooms.REGENERATE}")


def test_every_room_is_read_and_the_shim_imports_only_the_wheel(tree):
    arrows = rooms.room_arrows(tree)
    assert arrows[rooms.UPSTREAM] == ["megatron.core", "megatron.training"]
    for room in rooms.ROOMS[:-1]:
        assert any(rooms.room_of(module) is room for module in tree.paths), room.name
    assert "megatron.packed_upstream.training_loop" in tree.paths
    assert "tools.rooms" in tree.paths and "pretrain_gpt" in tree.paths


def _write(root, files):
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_scan_sees_lazy_relative_and_bare_imports_and_each_kind_of_problem(tmp_path):
    _write(tmp_path, {
        "megatron/packed_model/low.py": (
            "import torch\n"
            "def late():\n"
            "    from megatron.packed_graphs.high import thing\n"  # lazy, and up
            "    return thing\n"),
        "megatron/packed_graphs/high.py": "from . import ring\nfrom megatron.core import x\n",
        "megatron/packed_graphs/ring.py": (
            "def f():\n    import megatron.packed_graphs.high.thing as t\n"),
        "megatron/packed_upstream/gate.py": "PATCHED_VERSION = '9.9'\nimport megatron.training\n",
        "tools/one.py": "import two\n",
        "tools/two.py": "from megatron.packed_model import low\n",
        "tools/three.py": ("import megatron.packed_graphs\n"
                           "from megatron.packed_graphs.gone import x\n"),
        "pretrain_x.py": "from megatron.packed_upstream.gate import PATCHED_VERSION\n",
    })
    tree = rooms.read_tree(tmp_path)
    up = rooms.upward_imports(tree)
    assert [(i.source, i.target, i.line) for i in up] == [
        ("megatron.packed_model.low", "megatron.packed_graphs.high", 3)]
    cycles = rooms.import_cycles(tree)
    assert [[(i.source, i.target) for i in cycle] for cycle in cycles] == [[
        ("megatron.packed_graphs.high", "megatron.packed_graphs.ring"),
        ("megatron.packed_graphs.ring", "megatron.packed_graphs.high")]]
    assert rooms.room_arrows(tree)[rooms.SCRIPTS] == ["packed_model", "packed_upstream"]
    assert [(i.source, i.target, i.line) for i in tree.missing] == [
        ("tools.three", "megatron.packed_graphs.gone", 2)]  # the namespace package is fine
    problems = rooms.problems(tree)
    assert problems.pop(0) == ("missing: tools.three imports megatron.packed_graphs.gone, "
                               "which is no module of the fork (tools/three.py:2)")
    assert problems[0] == ("up-arrow: packed_model -> packed_graphs: megatron.packed_model.low "
                           "imports megatron.packed_graphs.high "
                           "(megatron/packed_model/low.py:3)")
    assert problems[1].startswith("cycle: megatron.packed_graphs.high -> "
                                  "megatron.packed_graphs.ring -> megatron.packed_graphs.high")
    picture = rooms.picture(tree)
    assert picture.startswith("```text\n") and picture.endswith("```\n")
    assert "the megatron-core wheel 9.9" in picture and "    tools/ one  three  two" in picture


def test_the_picture_goes_between_the_markers(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text(f"# Doc\n{rooms.BEGIN}\nold\n{rooms.END}\nafter\n")
    assert rooms.write_picture(doc, "```text\nnew\n```\n")
    assert doc.read_text() == f"# Doc\n{rooms.BEGIN}\n```text\nnew\n```\n{rooms.END}\nafter\n"
    assert rooms.documented_picture(doc) == "```text\nnew\n```\n"
    assert not rooms.write_picture(doc, "```text\nnew\n```\n")  # already current
    doc.write_text("# no markers\n")
    with pytest.raises(ValueError, match="no picture markers"):
        rooms.documented_picture(doc)


def test_the_command_checks_the_doc_and_exits_zero_on_the_real_tree():
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "rooms.py"), "--check",
                           str(ARCHITECTURE)], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=""))
    assert proc.returncode == 0, proc.stderr
