"""docs/flags.md against the fork's own flags (extra_args.add_packed_args; Megatron-LM's are
documented upstream): every one has one table row, in the section of its ``--help`` group,
with the parser's default in its default column; no table row names a flag the parser does
not have."""

import re
from pathlib import Path

import pytest

import argparse

from megatron.packed_training.arguments import build_parser
from megatron.packed_training.extra_args import add_packed_args

FLAGS_MD = Path(__file__).resolve().parents[2] / "docs" / "flags.md"
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def documented_rows() -> dict:
    """``{flag: [(section heading, default cell), ...]}`` from the flag tables of docs/flags.md
    (those headed ``| flag | default | meaning |``)."""
    rows, section, flag_table = {}, None, False
    for line in FLAGS_MD.read_text().splitlines():
        if line.startswith("## "):
            section, flag_table = line[3:].strip(), False
        elif line.startswith("| flag | default |"):
            flag_table = True
        elif flag_table and line.startswith("| `-"):
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            for flag in re.findall(r"`(--[a-z0-9_-]+)", cells[0]):
                rows.setdefault(flag, []).append((section, cells[1]))
    return rows


def parser_flags():
    """``(flag, group title, default)`` for every long option the fork adds."""
    parser = add_packed_args(argparse.ArgumentParser(add_help=False))
    for group in parser._action_groups:
        for action in group._group_actions:
            for flag in action.option_strings:
                if flag.startswith("--"):
                    yield flag, group.title, action.default


def default_documented(default, cell: str) -> bool:
    """Whether a default cell states ``default`` (None: derived, described in words)."""
    if default is None:
        return True
    if isinstance(default, bool):
        return bool(re.search(r"\bon\b" if default else r"^off\b", cell))
    if isinstance(default, (int, float)):
        number = _NUMBER.search(cell)
        return number is not None and float(number.group()) == float(default)
    return str(default) in cell


def test_every_fork_flag_has_one_row_in_its_section_with_its_default():
    rows = documented_rows()
    problems = []
    for flag, group, default in parser_flags():
        found = rows.get(flag, [])
        if len(found) != 1:
            problems.append(f"{flag}: {len(found)} table rows, want 1")
            continue
        section, cell = found[0]
        if not section.lower().startswith(group):
            problems.append(f"{flag}: under '## {section}', want the '{group}' section")
        if not default_documented(default, cell):
            problems.append(f"{flag}: default cell {cell!r} does not state {default!r}")
    assert problems == []


def test_no_row_documents_a_flag_the_parser_lacks():
    known = {flag for action in build_parser()._actions for flag in action.option_strings}
    assert sorted(set(documented_rows()) - known) == []


def test_default_check_tells_wrong_defaults_apart():
    assert default_documented(0.01, "0.01") and not default_documented(0.01, "0.1")
    assert default_documented(1e-5, "1e-5") and default_documented(0, "0 (bare flag: 50)")
    assert default_documented(False, "off (tied)") and not default_documented(False, "on")
    assert default_documented(True, "check on") and not default_documented(True, "off")
    assert default_documented("warn", "`warn`") and not default_documented("warn", "`disable`")
