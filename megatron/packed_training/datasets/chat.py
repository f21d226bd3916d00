"""Chat conversations as SFT documents: only assistant tokens are prediction targets.

One JSON object per line (the NeMo-RL / TRL ``messages`` format)::

    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."},
                  {"role": "assistant", "content": "..."}]}

Each conversation is rendered with the tokenizer's chat template (or the built-in ChatML
template when it has none) and becomes one `Document`: ``input_ids`` of the rendered text and
``loss_mask`` 1 on the assistant turns' tokens (their text and the template's end-of-turn
marks), 0 on system / user / tool turns and on every turn header. Extra message keys
(``tool_calls``, ``name``, ...) and a top-level ``tools`` list reach the template unchanged.

Where the assistant turns are:

- a template with ``{% generation %}`` blocks marks them itself (transformers'
  ``return_assistant_tokens_mask``);
- otherwise by prefix renders: assistant turn ``i`` starts where its content starts in the
  render of ``messages[:i]`` plus that turn, and ends where the render of ``messages[:i + 1]``
  stops agreeing with the whole conversation. The whole conversation is tokenized once; a
  token counts as assistant when its last character lies in an assistant span.

A file is chat data when its first record has ``messages``; every record must then be a
conversation. Conversations without an assistant turn teach nothing and are skipped (counted
in `ChatStats`). Every error names ``path:line`` and the fix; a ShareGPT-style record
(``conversations`` of ``from`` / ``value`` turns) is refused with the rewrite into
``messages`` (`jsonl.other_chat_format`).
"""

import json
import os
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from megatron.packed_training.datasets.jsonl import other_chat_format, read_jsonl_documents
from megatron.packed_training.datasets.packing import Document

CHAT = "chat"
TOKENIZED = "tokenized"
LOSS_ROLE = "assistant"
STANDARD_ROLES = ("system", "user", "assistant", "tool", "developer")
# Other formats' names for the standard roles (ShareGPT: human / gpt): a conversation written
# with them would have no assistant turn, and be skipped as one with nothing to train on.
ROLE_ALIASES = {"human": "user", "gpt": "assistant", "bot": "assistant"}
_MARKER = "MegatronChatTurnMarker"


@dataclass
class ChatStats:
    """Counters filled while reading conversations.

    Attributes:
        conversations: conversations read (skipped ones included).
        skipped: conversations without an assistant turn (nothing to train on).
        tokens: tokens of the documents produced.
        assistant_tokens: of those, tokens with loss mask 1.
    """

    conversations: int = 0
    skipped: int = 0
    tokens: int = 0
    assistant_tokens: int = 0


def _first_record(path: str) -> tuple[int, object] | None:
    """(line number, parsed JSON or None if malformed) of the first non-blank line."""
    with open(path, encoding="utf-8") as stream:
        for line_number, line in enumerate(stream, start=1):
            if line.strip():
                try:
                    return line_number, json.loads(line)
                except json.JSONDecodeError:
                    return line_number, None
    return None


def detect_format(path: str | os.PathLike) -> str | None:
    """`CHAT` when the file's first record has ``messages``, `TOKENIZED` otherwise; None when
    the path is not a readable file (the reader reports that)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        return None
    try:
        first = _first_record(path)
    except (OSError, UnicodeDecodeError):
        return None
    if first is not None and isinstance(first[1], dict) and "messages" in first[1]:
        return CHAT
    return TOKENIZED


def chat_line(path: str | os.PathLike) -> int | None:
    """Line number of the first record when the file is chat data, else None."""
    if detect_format(path) != CHAT:
        return None
    return _first_record(os.fspath(path))[0]


def _check_messages(record, where: str) -> tuple[list[dict], list | None]:
    if not isinstance(record, dict):
        raise ValueError(
            f"{where}: record is wrong: a JSON {type(record).__name__}, not an object. Write one "
            f'conversation per line, e.g. {{"messages": [{{"role": "user", "content": "Hi"}}, '
            f'{{"role": "assistant", "content": "Hello"}}]}}.')
    if "messages" not in record:
        other = other_chat_format(record, where)
        if other is not None:
            raise other
        found = "input_ids, a pre-tokenized record" if "input_ids" in record else \
            f"keys {sorted(record)}"
        raise ValueError(
            f"{where}: record is wrong: no messages ({found}). The file's first record is a "
            f"conversation, so every record must be one: keep one format per file.")
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        shown = "an empty list" if messages == [] else f"a JSON {type(messages).__name__}"
        raise ValueError(
            f"{where}: messages is wrong: {shown}. Write a non-empty list of "
            f'{{"role": ..., "content": ...}} objects.')
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(
                f"{where}: messages[{index}] is wrong: a JSON {type(message).__name__}. Write "
                f'an object such as {{"role": "user", "content": "..."}}.')
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(
                f"{where}: messages[{index}].role is wrong: {json.dumps(role)}. Write the "
                f'speaker as a string: "system", "user", "assistant", "tool", ...')
        lower = role.strip().lower()
        meant = ROLE_ALIASES.get(lower, lower)
        if role != meant and meant in STANDARD_ROLES:
            # "Assistant" would render as another speaker, and its turn would carry no loss.
            raise ValueError(
                f"{where}: messages[{index}].role is wrong: {json.dumps(role)}. Roles are "
                f"lower case, as in OpenAI's chat format: write {json.dumps(meant)}.")
        if not isinstance(message.get("content"), str):
            raise ValueError(
                f"{where}: messages[{index}].content is wrong: "
                f"{json.dumps(message.get('content'))}. Write the message text as a string "
                f'("" when empty).')
    tools = record.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise ValueError(
            f"{where}: tools is wrong: a JSON {type(tools).__name__}. Write a list of tool "
            f"schemas or leave it out.")
    return messages, tools


def _common_prefix(a: str, b: str) -> int:
    return len(os.path.commonprefix([a, b]))


def assistant_spans(tokenizer, messages: list[dict], tools: list | None = None
                    ) -> tuple[str, list[tuple[int, int]]]:
    """(rendered conversation, character spans of its assistant turns) by prefix renders.

    Turn ``i`` starts where its content starts: ``messages[:i]`` plus the turn with a marker
    for content is rendered, and the text before the marker must begin the whole conversation.
    It ends where the render of ``messages[:i + 1]`` stops agreeing with the whole conversation
    (its end-of-turn marks included). Raises ValueError (without a location) when the template
    renders earlier turns differently once later turns follow.
    """
    text = tokenizer.render(messages, tools=tools)
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != LOSS_ROLE:
            continue
        marked = tokenizer.render(messages[:index] + [{**message, "content": _MARKER}],
                                  tools=tools)
        start = marked.find(_MARKER)
        if start < 0 or not text.startswith(marked[:start]):
            raise ValueError(
                f"chat template is wrong for this conversation: the text before "
                f"messages[{index}] (an assistant turn) renders differently inside the whole "
                f"conversation, so the turn cannot be placed. Use a template that renders each "
                f"turn the same whatever follows, or one that marks assistant text with "
                f"{{% generation %}} blocks")
        end = _common_prefix(tokenizer.render(messages[:index + 1], tools=tools), text)
        if end > start:
            spans.append((start, end))
    return text, spans


def encode_conversation(tokenizer, messages: list[dict], tools: list | None = None
                        ) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids int64, loss_mask float32) of one conversation: 1 on assistant tokens."""
    if tokenizer.marks_assistant_tokens:
        ids, mask = tokenizer.render_with_assistant_mask(messages, tools=tools)
        return np.array(ids, dtype=np.int64), np.array(mask, dtype=np.float32)
    text, spans = assistant_spans(tokenizer, messages, tools)
    ids, offsets = tokenizer.tokenize_with_offsets(text)
    mask = np.zeros(len(ids), dtype=np.float32)
    if spans and ids:
        # A token belongs to the turn holding its last character.
        last = np.array([max(end - 1, start) for start, end in offsets], dtype=np.int64)
        for start, end in spans:
            mask[(last >= start) & (last < end)] = 1.0
    return np.array(ids, dtype=np.int64), mask


def read_chat_documents(path: str | os.PathLike, tokenizer,
                        stats: ChatStats | None = None) -> Iterator[Document]:
    """Yield one `Document` per conversation of a chat JSONL file (see the module doc).

    ``Document.origin`` is ``"<path>:<line>"``. A missing path raises at call time; malformed
    records raise ValueError naming ``path:line`` while iterating.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(
            f"chat data path is wrong: {path!r} is not a file. Pass one .jsonl file of "
            f"conversations.")
    return _iter_chat(path, tokenizer, stats if stats is not None else ChatStats())


def encode_line(line: str, where: str, tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids, loss_mask) of one non-blank line of a chat file; ValueError naming ``where``
    (``path:line``) when the record or its rendering is wrong."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{where}: JSON is wrong: {error.msg} at column {error.colno}. Write one "
            f"JSON object per line.") from None
    messages, tools = _check_messages(record, where)
    try:
        return encode_conversation(tokenizer, messages, tools)
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None
    except Exception as error:  # jinja2 errors, raise_exception() in templates
        raise ValueError(
            f"{where}: chat template is wrong for this conversation: "
            f"{type(error).__name__}: {error}. Fix the conversation (roles, order) or "
            f"the template of --tokenizer-model.") from None


def count(stats: ChatStats, loss_mask: np.ndarray) -> bool:
    """Count one encoded conversation in ``stats``; False when it is skipped (no target)."""
    stats.conversations += 1
    if not loss_mask.any():
        stats.skipped += 1
        return False
    stats.tokens += len(loss_mask)
    stats.assistant_tokens += int(loss_mask.sum())
    return True


def _iter_chat(path: str, tokenizer, stats: ChatStats) -> Iterator[Document]:
    with open(path, encoding="utf-8") as stream:
        for line_number, line in enumerate(stream, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_number}"
            input_ids, loss_mask = encode_line(line, where, tokenizer)
            if count(stats, loss_mask):
                yield Document(input_ids=input_ids, loss_mask=loss_mask, origin=where)


def read_documents(path: str | os.PathLike, vocab_size: int, tokenizer=None,
                   stats: ChatStats | None = None) -> Iterator[Document]:
    """Documents of one JSONL file, chat or pre-tokenized (decided by its first record).

    Chat data needs ``tokenizer`` (raises ValueError naming the file and the flags otherwise);
    pre-tokenized data is read by `read_jsonl_documents` with ``vocab_size``.
    """
    if detect_format(path) != CHAT:
        return read_jsonl_documents(path, vocab_size)
    if tokenizer is None:
        raise ValueError(
            f"{os.fspath(path)}:{chat_line(path)}: data is wrong: a chat conversation "
            f"(\"messages\"), and no tokenizer is given. Add --tokenizer-type "
            f"HuggingFaceTokenizer --tokenizer-model <tokenizer folder>, or pre-tokenize the "
            f"file with tools/preprocess_sft.py.")
    return read_chat_documents(path, tokenizer, stats)
