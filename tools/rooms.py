"""The rooms of the fork and the imports between them, read from the code.

The fork's code lives in rooms, and imports run one way, from the top down:

    scripts (pretrain_*.py, tools/*.py)
      -> megatron/packed_training -> megatron/packed_graphs -> megatron/packed_model
      -> megatron/packed_upstream -> the megatron-core wheel (megatron.core, megatron.training)

A room may import any room below it, not only the next one. This tool reads every import
statement (``ast``: imports inside functions count too) of megatron/packed_*/**/*.py,
pretrain_*.py and tools/*.py, and prints

* the picture: each room, its modules, and the rooms it imports (a fenced block for
  markdown, or a mermaid chart with ``--format mermaid``);
* every arrow that goes up (a room importing a room above it), every import cycle between
  modules, and every import of a fork module that does not exist (moved or removed), with
  file and line.

    python tools/rooms.py                                  # picture + problems
    python tools/rooms.py --write docs/architecture.md     # put the picture into the doc
    python tools/rooms.py --check docs/architecture.md     # is the doc's picture current?

The picture goes between the lines ``<!-- rooms:begin -->`` and ``<!-- rooms:end -->`` of the
document given to ``--write`` / ``--check``. Exit status: 0 when no arrow goes up, no cycle
exists and every import finds its module (and, with ``--check``, the document holds the
current picture); 1 otherwise;
2 for a usage error (a document without the markers included). Needs only the standard
library: nothing of the fork is imported.
"""

import argparse
import ast
import dataclasses
import pathlib
import sys
import textwrap
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

REPO = pathlib.Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- rooms:begin -->", "<!-- rooms:end -->"
WIDTH = 96  # of a picture line


@dataclasses.dataclass(frozen=True)
class Room:
    name: str   # how arrows name it
    title: str  # its heading in the picture
    what: str   # one line: what it holds
    rank: int   # higher rooms import lower ones, never the other way


SCRIPTS = Room("scripts", "scripts", "pretrain_*.py, tools/*.py: entry points and tools", 5)
TRAINING = Room("packed_training", "megatron/packed_training",
                "the training side: flags, data, models, forward step, library API", 4)
GRAPHS = Room("packed_graphs", "megatron/packed_graphs",
              "CUDA graphs: plan, dispatch, runtime, capture and replay", 3)
MODEL = Room("packed_model", "megatron/packed_model",
             "packed (THD) modules that need no graphs", 2)
UPSTREAM = Room("packed_upstream", "megatron/packed_upstream",
                "the upstream shim: every patch of and reach into the wheel", 1)
WHEEL = Room("wheel", "the megatron-core wheel", "megatron.core, megatron.training", 0)
ROOMS = (SCRIPTS, TRAINING, GRAPHS, MODEL, UPSTREAM, WHEEL)
FORK_PACKAGES = {"megatron." + room.name: room for room in (TRAINING, GRAPHS, MODEL, UPSTREAM)}
WHEEL_PARTS = ("megatron.core", "megatron.training")


@dataclasses.dataclass(frozen=True)
class Import:
    """One import of one module: ``source`` imports ``target`` at ``line``."""

    source: str  # the importing module ("megatron.packed_graphs.runtime", "tools.soak")
    target: str  # a module of the fork or a script, or a part of the wheel ("megatron.core")
    line: int


@dataclasses.dataclass
class Tree:
    """The modules read, by dotted name, and every import among them and into the wheel."""

    paths: Dict[str, pathlib.Path]  # module -> file
    imports: List[Import]
    root: pathlib.Path = REPO
    # Imports of a name under a fork package that is no module of it (moved or removed):
    # ``target`` is the name as written.
    missing: List[Import] = dataclasses.field(default_factory=list)

    def where(self, found: Import) -> str:
        """``path:line`` of an import."""
        return f"{self.paths[found.source].relative_to(self.root)}:{found.line}"


def _in(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def room_of(module: str) -> Room:
    """The room of a dotted module name (a module read by `read_tree`, or a wheel part)."""
    if any(_in(module, part) for part in WHEEL_PARTS):
        return WHEEL
    for package, room in FORK_PACKAGES.items():
        if _in(module, package):
            return room
    return SCRIPTS


def module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    """``megatron/packed_graphs/runtime.py`` -> ``megatron.packed_graphs.runtime``; a package's
    ``__init__.py`` is the package; ``pretrain_gpt.py`` -> ``pretrain_gpt``."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_files(root: pathlib.Path = REPO) -> List[pathlib.Path]:
    """The files whose imports make the picture."""
    return sorted([*root.glob("megatron/packed_*/**/*.py"), *root.glob("pretrain_*.py"),
                   *root.glob("tools/*.py")])


def _resolve(name: str, known: Set[str]) -> Optional[str]:
    """The module of the fork (or the wheel part) an imported dotted name lands in; None for
    anything else (torch, the standard library). ``megatron.packed_graphs.plan.Reason`` ->
    ``megatron.packed_graphs.plan``: the longest known prefix."""
    for part in WHEEL_PARTS:
        if _in(name, part):
            return part
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in known:
            return ".".join(parts[:end])
    return None


def _imported_names(node: ast.AST, module: str, is_package: bool) -> Iterable[Tuple[str, str]]:
    """``(name, module)`` for each alias of an import statement: the dotted name it may bind
    (``from a.b import c``: ``a.b.c``, a submodule or an attribute) and the module it names
    for sure (``a.b``)."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name, alias.name
        return
    base = node.module or ""
    if node.level:  # relative: from the importing module's package
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[:len(package) - (node.level - 1)]
        base = ".".join(package + ([base] if base else []))
    for alias in node.names:
        yield (f"{base}.{alias.name}" if alias.name != "*" else base), base


def read_tree(root: pathlib.Path = REPO) -> Tree:
    """Every import (at any depth: a lazy import inside a function counts) of the files of
    `source_files`, resolved to the fork's modules and the wheel's two parts."""
    paths = {module_name(path, root): path for path in source_files(root)}
    known = set(paths)
    # tools/ put their own folder on sys.path and import each other by bare name too.
    bare_tools = {name.split(".", 1)[1]: name for name in known if name.startswith("tools.")}
    imports, missing = [], []
    for module, path in paths.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for name, named_module in _imported_names(node, module, is_package):
                target = _resolve(name, known)
                if target is None and module.startswith("tools.") and name in bare_tools:
                    target = bare_tools[name]
                if target is not None and target != module:
                    imports.append(Import(module, target, node.lineno))
                elif (target is None and any(_in(name, package) for package in FORK_PACKAGES)
                      and not (root / name.replace(".", "/")).is_dir()):  # a namespace package
                    missing.append(Import(module, named_module, node.lineno))
    order = lambda found: (found.source, found.line, found.target)  # noqa: E731
    return Tree(paths, sorted(set(imports), key=order), root, sorted(set(missing), key=order))


def room_arrows(tree: Tree) -> Dict[Room, List[str]]:
    """What each room imports from the others: room -> names of the rooms (and wheel parts)
    below or above it, top room first."""
    arrows: Dict[Room, Set[str]] = {room: set() for room in ROOMS}
    for found in tree.imports:
        source, target = room_of(found.source), room_of(found.target)
        if source is not target:
            arrows[source].add(found.target if target is WHEEL else target.name)
    order = [room.name for room in ROOMS[:-1]] + list(WHEEL_PARTS)
    return {room: sorted(names, key=order.index) for room, names in arrows.items()}


def upward_imports(tree: Tree) -> List[Import]:
    """Every import of a room above the importer's own (the one-way rule broken)."""
    return [found for found in tree.imports
            if room_of(found.target).rank > room_of(found.source).rank]


def import_cycles(tree: Tree) -> List[List[Import]]:
    """The import cycles between the fork's modules: for each group of modules that import
    each other round, one cycle through all of it, as its imports in order."""
    edges: Dict[str, Dict[str, Import]] = {}
    for found in tree.imports:
        if room_of(found.target) is not WHEEL:
            edges.setdefault(found.source, {}).setdefault(found.target, found)
    cycles = []
    for group in _strongly_connected(sorted(tree.paths), edges):
        if len(group) > 1:
            cycles.append(_cycle_through(sorted(group), edges))
    return cycles


def _strongly_connected(nodes: Sequence[str],
                        edges: Dict[str, Dict[str, Import]]) -> List[Set[str]]:
    """Tarjan's algorithm, iterative (deep import chains stay off Python's stack limit)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    groups = []
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, {}))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            advanced = False
            for target in targets:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(edges.get(target, {})))))
                    advanced = True
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.add(member)
                    if member == node:
                        break
                groups.append(group)
    return groups


def _cycle_through(group: List[str], edges: Dict[str, Dict[str, Import]]) -> List[Import]:
    """A shortest cycle from the group's first module back to it, within the group."""
    start = group[0]
    previous: Dict[str, Import] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target, found in sorted(edges.get(node, {}).items()):
                if target not in group or target in previous:
                    continue
                previous[target] = found
                if target == start:
                    path = [found]
                    while path[0].source != start:
                        path.insert(0, previous[path[0].source])
                    return path
                following.append(target)
        frontier = following
    raise AssertionError(f"no cycle through {start}")  # a strongly connected group has one


def _wheel_version(root: pathlib.Path) -> str:
    """`PATCHED_VERSION` of packed_upstream/gate.py, read without importing it."""
    gate = root / "megatron" / "packed_upstream" / "gate.py"
    if gate.exists():
        for node in ast.parse(gate.read_text()).body:
            if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                    and any(getattr(t, "id", None) == "PATCHED_VERSION" for t in node.targets)):
                return f" {node.value.value}"
    return ""


def _modules_by_folder(tree: Tree, room: Room) -> List[Tuple[str, List[str]]]:
    """A room's modules, grouped by folder: ``[("", [top-level names]), ("datasets/", ...)]``;
    a package is listed by its folder, its ``__init__`` not as a module of its own."""
    folders: Dict[str, List[str]] = {}
    for module, path in tree.paths.items():
        if room_of(module) is not room or path.name == "__init__.py":
            continue
        relative = path.relative_to(tree.root)
        if room is SCRIPTS:
            folder = "" if len(relative.parts) == 1 else "/".join(relative.parts[:-1]) + "/"
        else:
            folder = "/".join(relative.parts[2:-1]) + ("/" if len(relative.parts) > 3 else "")
        folders.setdefault(folder, []).append(path.stem)
    return [(folder, sorted(folders[folder])) for folder in sorted(folders)]


def picture(tree: Tree) -> str:
    """The rooms, their modules and their arrows as a fenced text block (markdown)."""
    arrows = room_arrows(tree)
    lines = ["```text"]
    for room in ROOMS:
        title = room.title + (_wheel_version(tree.root) if room is WHEEL else "")
        lines.append(f"{title}  ({room.what})")
        for folder, names in _modules_by_folder(tree, room):
            head = f"    {folder}" + (" " if folder else "")
            lines.extend(textwrap.wrap("  ".join(names), WIDTH, initial_indent=head,
                                       subsequent_indent=" " * len(head),
                                       break_on_hyphens=False))
        if arrows[room]:
            lines.extend(textwrap.wrap(", ".join(arrows[room]), WIDTH,
                                       initial_indent="  └─► imports ",
                                       subsequent_indent=" " * len("  └─► imports ")))
        if room is not WHEEL:
            lines.append("")
    lines.append("```")
    return "\n".join(lines) + "\n"


def mermaid(tree: Tree) -> str:
    """The rooms and their arrows as a mermaid flowchart (in a fenced block)."""
    node = {room: room.name.replace("packed_", "") for room in ROOMS}
    lines = ["```mermaid", "flowchart TD"]
    for room in ROOMS:
        label = room.title + (_wheel_version(tree.root) if room is WHEEL else "")
        lines.append(f'    {node[room]}["{label}"]')
    by_name = {room.name: room for room in ROOMS} | {part: WHEEL for part in WHEEL_PARTS}
    for room, targets in room_arrows(tree).items():
        for target in sorted({by_name[name] for name in targets}, key=lambda r: -r.rank):
            lines.append(f"    {node[room]} --> {node[target]}")
    lines.append("```")
    return "\n".join(lines) + "\n"


def problems(tree: Tree) -> List[str]:
    """One line per arrow that goes up, per import cycle and per import of a module the fork
    does not have; empty when the rule holds."""
    found = [f"missing: {gone.source} imports {gone.target}, which is no module of the fork "
             f"({tree.where(gone)})" for gone in tree.missing]
    for up in upward_imports(tree):
        found.append(f"up-arrow: {room_of(up.source).name} -> {room_of(up.target).name}: "
                     f"{up.source} imports {up.target} ({tree.where(up)})")
    for cycle in import_cycles(tree):
        chain = " -> ".join([cycle[0].source] + [step.target for step in cycle])
        found.append(f"cycle: {chain} ("
                     + ", ".join(tree.where(step) for step in cycle) + ")")
    return found


def documented_picture(document: pathlib.Path) -> str:
    """The text between the markers of ``document``, as `write_picture` writes it."""
    text = document.read_text()
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ValueError(f"{document} has no picture markers: add one line {BEGIN} and one "
                         f"line {END} below it where the picture goes")
    return text[text.index(BEGIN) + len(BEGIN):text.index(END)].strip("\n") + "\n"


def write_picture(document: pathlib.Path, block: str) -> bool:
    """Put ``block`` between the markers of ``document``; whether the text changed."""
    documented_picture(document)  # the markers are there
    text = document.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    new = text[:start] + "\n" + block + text[end:]
    if new != text:
        document.write_text(new)
    return new != text


REGENERATE = "python tools/rooms.py --write docs/architecture.md"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description="The fork's rooms and the imports between them; up-arrows and cycles.")
    parser.add_argument("--format", choices=("text", "mermaid"), default="text",
                        help="the picture as a text block (default) or a mermaid chart")
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", metavar="DOC", type=pathlib.Path,
                        help="put the text picture between the rooms markers of DOC")
    action.add_argument("--check", metavar="DOC", type=pathlib.Path,
                        help="exit 1 unless DOC holds the current text picture")
    opts = parser.parse_args(argv)
    tree = read_tree()
    block = picture(tree)
    status = 0
    try:
        if opts.write:
            changed = write_picture(opts.write, block)
            print(f"{opts.write}: picture {'written' if changed else 'already current'}")
        elif opts.check:
            if documented_picture(opts.check) != block:
                print(f"{opts.check}: the rooms picture is out of date; run {REGENERATE}",
                      file=sys.stderr)
                status = 1
        else:
            print(mermaid(tree) if opts.format == "mermaid" else block, end="")
    except (OSError, ValueError) as error:
        print(f"rooms.py: {error}", file=sys.stderr)
        return 2
    found = problems(tree)
    for line in found:
        print(line, file=sys.stderr)
    if not found and not opts.write and not opts.check:
        print("no up-arrows, no import cycles, no missing modules")
    return 1 if found else status


if __name__ == "__main__":
    sys.exit(main())
