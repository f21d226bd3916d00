"""Tokenizers for text data: ``--tokenizer-type HuggingFaceTokenizer --tokenizer-model PATH``.

``PATH`` is local, never a hub name: a tokenizer folder (``tokenizer.json`` plus
``tokenizer_config.json``, the chat template in ``tokenizer_config.json`` or
``chat_template.jinja``) or a bare ``tokenizer.json`` file. Loading goes through
``transformers.AutoTokenizer.from_pretrained(..., local_files_only=True)`` (a file through
``PreTrainedTokenizerFast(tokenizer_file=...)``), so special tokens and chat templates behave
as in transformers. ``transformers`` is imported on first load only: pre-tokenized and mock
runs do not need it (``pip install .[chat]``).

As in Megatron-LM, the vocabulary size is the tokenizer's length (added tokens included);
``args.padded_vocab_size`` rounds it up as usual.
"""

import functools
import os
import re
import warnings

TOKENIZER_TYPES = ("HuggingFaceTokenizer",)
"""Values of --tokenizer-type this fork builds."""

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML, used when the tokenizer has no chat template of its own."""

_GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")


def _fail(what: str, value, todo: str):
    raise ValueError(f"{what} is wrong: {value}. {todo}.")


class HuggingFaceTokenizer:
    """A local Hugging Face tokenizer and the chat template it renders conversations with.

    Attributes:
        tokenizer_type: "HuggingFaceTokenizer".
        path: the --tokenizer-model it was loaded from.
        vocab_size: ``len(tokenizer)``: every id it can produce is below it.
        chat_template: the tokenizer's own template, else `DEFAULT_CHAT_TEMPLATE`.
        uses_default_template: True when the tokenizer had none.
        marks_assistant_tokens: the template wraps assistant text in ``{% generation %}``
            blocks, so transformers' ``return_assistant_tokens_mask`` can mark it.
    """

    tokenizer_type = "HuggingFaceTokenizer"

    def __init__(self, path: str):
        self.path = path
        try:
            import transformers
        except ImportError:
            _fail("--tokenizer-model", path,
                  "Reading it needs the transformers package, which is not importable: "
                  "install the chat extra (`pip install .[chat]`)")
        try:
            if os.path.isdir(path):
                tokenizer = transformers.AutoTokenizer.from_pretrained(
                    path, local_files_only=True, trust_remote_code=False)
            else:
                tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=path)
        except Exception as error:  # transformers raises OSError, ValueError, KeyError, ...
            reason = " ".join(str(error).split())[:300]
            _fail("--tokenizer-model", path,
                  f"transformers could not load a tokenizer from it ({type(error).__name__}: "
                  f"{reason}); pass a folder with tokenizer.json and tokenizer_config.json, or "
                  f"a tokenizer.json file")
        if not getattr(tokenizer, "is_fast", False):
            _fail("--tokenizer-model", path,
                  "It loads as a slow (Python) tokenizer, which cannot map tokens back to "
                  "characters; give the folder a tokenizer.json")
        self._tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        template = tokenizer.chat_template
        if isinstance(template, dict):  # named templates: transformers picks "default"
            template = template.get("default")
        self.uses_default_template = not template
        self.chat_template = template or DEFAULT_CHAT_TEMPLATE
        self.marks_assistant_tokens = bool(_GENERATION_BLOCK.search(self.chat_template))
        if self.uses_default_template:
            where = "a tokenizer.json file carries none; pass its folder to use the folder's" \
                if not os.path.isdir(path) else "its folder has none"
            warnings.warn(f"tokenizer {path}: no chat template ({where}); conversations are "
                          f"rendered with the built-in ChatML template.", stacklevel=2)

    @property
    def eod(self) -> int | None:
        """End-of-document id (the tokenizer's eos token), or None."""
        return self._tokenizer.eos_token_id

    def tokenize(self, text: str) -> list[int]:
        """Ids of ``text`` as written: special tokens spelled in it are recognised, none added."""
        return list(self._tokenizer(text, add_special_tokens=False)["input_ids"])

    def tokenize_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """`tokenize` plus each token's ``(start, end)`` character span in ``text``."""
        encoded = self._tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(encoded["input_ids"]), [tuple(span) for span in encoded["offset_mapping"]]

    def detokenize(self, ids) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False,
                                      clean_up_tokenization_spaces=False)

    def render(self, messages: list[dict], *, add_generation_prompt: bool = False,
               tools: list | None = None) -> str:
        """The conversation as text, through the chat template."""
        return self._tokenizer.apply_chat_template(
            messages, chat_template=self.chat_template, tools=tools, tokenize=False,
            add_generation_prompt=add_generation_prompt)

    def render_with_assistant_mask(self, messages: list[dict], *,
                                   tools: list | None = None) -> tuple[list[int], list[int]]:
        """(ids, mask) from transformers' ``return_assistant_tokens_mask``: 1 on the tokens the
        template's ``{% generation %}`` blocks wrap. Only when `marks_assistant_tokens`."""
        encoded = self._tokenizer.apply_chat_template(
            messages, chat_template=self.chat_template, tools=tools, tokenize=True,
            return_dict=True, return_assistant_tokens_mask=True, add_generation_prompt=False)
        return list(encoded["input_ids"]), list(encoded["assistant_masks"])


def load_tokenizer(tokenizer_type: str, path) -> HuggingFaceTokenizer:
    """The tokenizer of --tokenizer-type / --tokenizer-model, loaded once per process.

    Raises ``ValueError("<what> is wrong: <value>. <what to do>.")`` for an unknown type, a
    path that does not exist, or a tokenizer transformers cannot load. Never downloads.
    """
    if tokenizer_type not in TOKENIZER_TYPES:
        _fail("--tokenizer-type", tokenizer_type,
              f"This fork builds {', '.join(TOKENIZER_TYPES)} only (a local tokenizer folder "
              f"or tokenizer.json); for another tokenizer pre-tokenize the data and pass "
              f"--vocab-size")
    if path is None or not str(path).strip():
        _fail("--tokenizer-model", repr(path),
              "Pass a local tokenizer folder or tokenizer.json file")
    return _load(tokenizer_type, os.path.abspath(os.fspath(path)))


@functools.lru_cache(maxsize=8)
def _load(tokenizer_type: str, path: str) -> HuggingFaceTokenizer:
    if not os.path.exists(path):
        _fail("--tokenizer-model", path,
              "No such file or folder (it is read locally, never downloaded); pass a local "
              "tokenizer folder (tokenizer.json, tokenizer_config.json) or a tokenizer.json file")
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "tokenizer.json")):
        _fail("--tokenizer-model", path,
              "The folder has no tokenizer.json; save the tokenizer with "
              "`tokenizer.save_pretrained(folder)` from transformers, or pass a tokenizer.json file")
    return HuggingFaceTokenizer(path)


def tokenizer_from_args(args) -> HuggingFaceTokenizer | None:
    """The run's tokenizer, or None for pre-tokenized data (no --tokenizer-type, or Megatron-LM's
    NullTokenizer)."""
    tokenizer_type = getattr(args, "tokenizer_type", None)
    if tokenizer_type in (None, "NullTokenizer"):  # pre-tokenized data: ids below --vocab-size
        return None
    return load_tokenizer(tokenizer_type, getattr(args, "tokenizer_model", None))
