"""Pre-tokenized JSONL documents.

One JSON object per line::

    {"input_ids": [1, 5023, 318, 2], "loss_mask": [0, 0, 1, 1]}

``input_ids`` is required: JSON integers in ``[0, vocab_size)`` (``true``/``false`` and floats
such as ``3.0`` are rejected: they mean the tokenizer output was mangled). ``loss_mask`` is
optional, one 0/1 per token, where 1 marks the token as a prediction target. Blank lines are
skipped. Every error names ``path:line`` (``path:line:col`` for text that is not JSON or not
UTF-8, with an excerpt of the line and a caret under the fault) and what to do.
"""

import json
import os
from typing import Iterator

import numpy as np

from megatron.packed_training.data_paths import check_data_path
from megatron.packed_training.datasets.packing import Document


EXCERPT_WIDTH = 30
"""Characters shown on each side of the fault in a JSON error's excerpt."""

SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}
"""ShareGPT's ``from`` values and the ``role`` each is written as in ``messages``."""


def other_chat_format(record, where: str) -> ValueError | None:
    """The error for a record that is a conversation in another layout than ``messages``
    (ShareGPT's ``{"conversations": [{"from": "human", "value": ...}]}``, or ``messages``
    under the key ``conversations``), naming ``where`` and how to rewrite it; else None.
    Every reader of JSONL data (training, tools/preprocess_sft.py, tools/capacity_advisor.py)
    refuses these records with this one message."""
    if not isinstance(record, dict) or "messages" in record:
        return None
    turns = record.get("conversations")
    if not isinstance(turns, list) or not turns or not isinstance(turns[0], dict):
        return None
    if "from" in turns[0] or "value" in turns[0]:
        mapping = ", ".join(f"{old} -> {new}" for old, new in SHAREGPT_ROLES.items())
        return ValueError(
            f'{where}: data is wrong: a ShareGPT-style conversation ("conversations" of '
            f'"from" / "value" turns). Rewrite each line as {{"messages": [{{"role": ..., '
            f'"content": ...}}]}}: "conversations" -> "messages", "from" -> "role" ({mapping}), '
            f'"value" -> "content" (a converter: docs/data-format.md, "ShareGPT data").')
    if "role" in turns[0]:
        return ValueError(
            f'{where}: data is wrong: the conversation is under "conversations". Rename the key '
            f'to "messages" (docs/data-format.md).')
    return None


def excerpt_with_caret(text: str, column: int) -> str:
    """Two indented lines: ``text`` around 1-based ``column`` (cut to `EXCERPT_WIDTH` characters
    each side, ``...`` where cut) and a caret under that column."""
    index = column - 1
    start, end = max(0, index - EXCERPT_WIDTH), min(len(text), index + EXCERPT_WIDTH)
    head, tail = ("..." if start > 0 else ""), ("..." if end < len(text) else "")
    shown = head + text[start:end].replace("\t", " ") + tail
    return f"    {shown}\n    {' ' * (len(head) + index - start)}^"


def _trailing_comma(error: json.JSONDecodeError, text: str) -> int | None:
    """Index of the comma when the parser stopped at a ``]`` / ``}`` right after one (it
    reports the bracket; the comma is the fault), else None."""
    if error.pos < len(text) and text[error.pos] in "]}" and error.msg in (
            "Expecting value", "Expecting property name enclosed in double quotes"):
        before = text[:error.pos].rstrip()
        if before.endswith(","):
            return len(before) - 1
    return None


def _json_fix(error: json.JSONDecodeError, text: str) -> str:
    """What to do about one JSON syntax error in the line ``text``."""
    if error.msg.startswith("Unexpected UTF-8 BOM"):
        return "Save the file as UTF-8 without a byte-order mark"
    if error.pos >= len(text.rstrip()):
        return ("The line ends before the JSON object does: write each object whole, on one "
                "line (JSONL, not pretty-printed JSON)")
    if error.msg == "Extra data":
        return "Put one JSON object per line"
    if error.msg.startswith("Expecting property name"):
        return "Write keys in double quotes (JSON, not Python)"
    if error.msg == "Expecting value":
        return "Write a JSON value here: a number, a list, a string in double quotes"
    if error.msg == "Expecting ',' delimiter":
        return "Separate list items and key-value pairs with commas"
    if error.msg == "Expecting ':' delimiter":
        return "Write each key as \"key\": value"
    return "Write one valid JSON object per line"


def json_error(path: str, line_number: int, text: str, error: json.JSONDecodeError) -> ValueError:
    """The error for a line that is not JSON: ``path:line:col`` (col: 1-based, within the
    line), the parser's reason, the fix, then the line's excerpt with a caret under the
    fault. ``text`` is the one line given to ``json.loads``, without its line break, so the
    column of a line that ends too early is just past its last character. A comma before a
    closing bracket is reported at the comma, not at the bracket where the parser stopped."""
    comma = _trailing_comma(error, text)
    if comma is not None:
        column, reason = comma + 1, f"a comma before '{text[error.pos]}'"
        fix = "Remove the trailing comma"
    else:
        column, reason, fix = error.pos + 1, error.msg, _json_fix(error, text)
    return ValueError(f"{path}:{line_number}:{column}: JSON is wrong: {reason}. {fix}.\n"
                      f"{excerpt_with_caret(text, column)}")


def _decode_line(raw: bytes, path: str, line_number: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        good = raw[:error.start].decode("utf-8")
        column = len(good) + 1
        text = (good + raw[error.start:].decode("utf-8", errors="replace")).rstrip("\r\n")
        raise ValueError(
            f"{path}:{line_number}:{column}: text is wrong: byte 0x{raw[error.start]:02x} is not "
            f"UTF-8. Save the file as UTF-8.\n{excerpt_with_caret(text, column)}") from None


def _parse_input_ids(value, where: str, vocab_size: int) -> np.ndarray:
    # The common case at C speed (a list of JSON integers in range); anything else takes the
    # element-wise checks below, which name the first bad element.
    if isinstance(value, list) and value and set(map(type, value)) == {int}:
        try:
            ids = np.array(value, dtype=np.int64)
        except OverflowError:
            ids = None
        if ids is not None and ids.min() >= 0 and ids.max() < vocab_size:
            return ids
    if not isinstance(value, list):
        raise ValueError(
            f"{where}: input_ids is wrong: a JSON {type(value).__name__}. Write a list of token ids."
        )
    for index, token in enumerate(value):
        # bool is a subclass of int; `type(...) is int` rejects true/false as well as 3.0.
        if type(token) is not int:
            raise ValueError(
                f"{where}: input_ids is wrong: element {index} is {json.dumps(token)}. "
                f"Write token ids as JSON integers."
            )
    if any(token < 0 for token in value):
        index = next(i for i, token in enumerate(value) if token < 0)
        raise ValueError(
            f"{where}: input_ids is wrong: element {index} is {value[index]}, negative. "
            f"Token ids must be >= 0."
        )
    if any(token >= vocab_size for token in value):
        index = next(i for i, token in enumerate(value) if token >= vocab_size)
        raise ValueError(
            f"{where}: input_ids is wrong: element {index} is {value[index]}, not below the "
            f"vocab size {vocab_size}. Set --vocab-size to the tokenizer's vocabulary size."
        )
    return np.array(value, dtype=np.int64)


def _parse_loss_mask(value, where: str, num_tokens: int) -> np.ndarray | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise ValueError(
            f"{where}: loss_mask is wrong: a JSON {type(value).__name__}. Write a list of 0/1."
        )
    if len(value) != num_tokens:
        raise ValueError(
            f"{where}: loss_mask is wrong: {len(value)} values for {num_tokens} input_ids. "
            f"Give one 0/1 per token."
        )
    if set(map(type, value)) <= {int, bool}:  # the common case, checked at C speed
        mask = np.array(value, dtype=np.int64)
        if ((mask == 0) | (mask == 1)).all():
            return mask.astype(np.float32)
    for index, flag in enumerate(value):
        if type(flag) not in (int, bool) or flag not in (0, 1):
            raise ValueError(
                f"{where}: loss_mask is wrong: element {index} is {json.dumps(flag)}. "
                f"Write 0 (not a target) or 1 (target)."
            )
    return np.array(value, dtype=np.float32)


def read_jsonl_documents(path: str | os.PathLike, vocab_size: int) -> Iterator[Document]:
    """Yield one `Document` per non-blank line of a pre-tokenized JSONL file.

    ``Document.origin`` is ``"<path>:<line>"`` (1-based line). Raises ValueError, naming
    ``path:line``, on the first malformed line (see the module doc for the format). A bad
    ``vocab_size``, a missing path or a directory raise at call time, not on first ``next``.
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size is wrong: {vocab_size!r}. Set --vocab-size to a positive integer.")
    path = os.fspath(path)
    check_data_path(path)
    if not os.path.isfile(path):
        raise ValueError(f"--data-path is wrong: {path!r} is not a file. Pass a .jsonl file here "
                         f"(training also reads folders of them and indexed datasets).")
    return _iter_documents(path, vocab_size)


def _iter_documents(path: str, vocab_size: int) -> Iterator[Document]:
    with open(path, "rb") as stream:
        for line_number, raw in enumerate(stream, start=1):
            line = _decode_line(raw, path, line_number)
            if not line.strip():
                continue
            where = f"{path}:{line_number}"
            text = line.rstrip("\r\n")  # a fault at the line's end is at its last column + 1
            try:
                record = json.loads(text)
            except json.JSONDecodeError as error:
                raise json_error(path, line_number, text, error) from None
            if not isinstance(record, dict):
                raise ValueError(
                    f"{where}: record is wrong: a JSON {type(record).__name__}, not an object. "
                    f'Write one object per line, e.g. {{"input_ids": [1, 2, 3]}}.'
                )
            if "input_ids" not in record:
                other = other_chat_format(record, where)
                if other is not None:
                    raise other
                raise ValueError(
                    f"{where}: record is wrong: no input_ids (keys: {sorted(record)}). "
                    f"Add an \"input_ids\" list of token ids."
                )
            input_ids = _parse_input_ids(record["input_ids"], where, vocab_size)
            loss_mask = _parse_loss_mask(record.get("loss_mask"), where, len(input_ids))
            yield Document(input_ids=input_ids, loss_mask=loss_mask, origin=where)
