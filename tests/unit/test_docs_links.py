"""Cross-references of the user docs: the paths they name exist, the user guide indexes every
doc, and docs/architecture.md names every module of the fork's packages."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", *DOCS]
# Named on purpose although absent: the wheel's package, and the file the namespace must not have.
ABSENT_ON_PURPOSE = {"megatron/core", "megatron/__init__.py"}
_PATH = re.compile(r"(?<![\w/.])((?:docs|tests|tools|megatron|examples|te_patches)/[\w./-]*\w)")
_TEST_NODE = re.compile(r"(tests/[\w/]+\.py)::(\w+)")
ROOMS = ("packed_training", "packed_graphs", "packed_model", "packed_upstream")


def named_paths(text: str) -> set:
    return {match.rstrip(".") for match in _PATH.findall(text)}


def test_named_paths_exist():
    missing = [f"{page.name}: {path}" for page in PAGES for path in named_paths(page.read_text())
               if path not in ABSENT_ON_PURPOSE and not (ROOT / path).exists()]
    assert missing == []


def test_named_test_functions_exist():
    missing = [f"{page.name}: {path}::{name}" for page in PAGES
               for path, name in _TEST_NODE.findall(page.read_text())
               if not re.search(rf"^\s*def {name}\(", (ROOT / path).read_text(), re.M)]
    assert missing == []


def test_user_guide_indexes_every_doc():
    guide = (ROOT / "docs" / "user-guide.md").read_text()
    assert [doc.name for doc in DOCS
            if doc.name != "user-guide.md" and f"`{doc.name}`" not in guide] == []


def test_architecture_names_every_module():
    """Each module of the four package rooms has its line in docs/architecture.md (the Hugging
    Face families are named by family)."""
    architecture = (ROOT / "docs" / "architecture.md").read_text()
    modules = [module for room in ROOMS for module in (ROOT / "megatron" / room).rglob("*.py")
               if module.name != "__init__.py" and "families" not in module.parts]
    assert len(modules) > 50
    assert [str(m.relative_to(ROOT)) for m in sorted(modules)
            if not re.search(rf"\b{re.escape(m.name)}\b", architecture)] == []


def test_path_pattern_finds_paths_and_skips_urls():
    assert named_paths("see docs/moe.md, and `tests/unit/x.py`.") == {"docs/moe.md",
                                                                      "tests/unit/x.py"}
    assert named_paths("https://example.org/docs/x.md") == set()
