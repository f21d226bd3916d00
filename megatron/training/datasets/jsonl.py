"""Pre-tokenized JSONL documents.

One JSON object per line::

    {"input_ids": [1, 5023, 318, 2], "loss_mask": [0, 0, 1, 1]}

``input_ids`` is required: JSON integers in ``[0, vocab_size)`` (``true``/``false`` and floats
such as ``3.0`` are rejected: they mean the tokenizer output was mangled). ``loss_mask`` is
optional, one 0/1 per token, where 1 marks the token as a prediction target. Blank lines are
skipped. Every error names ``path:line``.
"""

import json
import os
from typing import Iterator

import numpy as np

from megatron.training.datasets.packing import Document


def _check_path(path: str) -> None:
    if not os.path.exists(path):
        raise ValueError(
            f"JSONL data path is wrong: {path!r} does not exist. "
            f"Pass an existing pre-tokenized .jsonl file (--data-path / --valid-data-path)."
        )
    if not os.path.isfile(path):
        raise ValueError(
            f"JSONL data path is wrong: {path!r} is not a file. "
            f"Pass a single pre-tokenized .jsonl file, not a directory."
        )


def _parse_input_ids(value, where: str, vocab_size: int) -> np.ndarray:
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
    _check_path(path)
    return _iter_documents(path, vocab_size)


def _iter_documents(path: str, vocab_size: int) -> Iterator[Document]:
    with open(path, encoding="utf-8") as stream:
        for line_number, line in enumerate(stream, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(
                    f"{where}: JSON is wrong: {error.msg} at column {error.colno}. "
                    f"Write one JSON object per line."
                ) from None
            if not isinstance(record, dict):
                raise ValueError(
                    f"{where}: record is wrong: a JSON {type(record).__name__}, not an object. "
                    f'Write one object per line, e.g. {{"input_ids": [1, 2, 3]}}.'
                )
            if "input_ids" not in record:
                raise ValueError(
                    f"{where}: record is wrong: no input_ids (keys: {sorted(record)}). "
                    f"Add an \"input_ids\" list of token ids."
                )
            input_ids = _parse_input_ids(record["input_ids"], where, vocab_size)
            loss_mask = _parse_loss_mask(record.get("loss_mask"), where, len(input_ids))
            yield Document(input_ids=input_ids, loss_mask=loss_mask, origin=where)
