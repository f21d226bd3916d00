"""Tokenize chat conversations once, into the pre-tokenized JSONL that training reads.

Reads a JSONL of conversations (``{"messages": [{"role": ..., "content": ...}, ...]}``, see
docs/data-format.md), renders each with the tokenizer's chat template (the built-in ChatML
template when it has none) and writes one ``{"input_ids": [...], "loss_mask": [...]}`` line per
conversation, loss mask 1 on assistant tokens only: the same documents, in the same order, as
``--data-path chat.jsonl --tokenizer-type HuggingFaceTokenizer --tokenizer-model PATH``.

    python tools/preprocess_sft.py --input chat.jsonl --output train.jsonl \\
        --tokenizer-model /path/to/tokenizer

Then train with ``--data-path train.jsonl --sft`` and ``--vocab-size`` (the size it prints) or
the same tokenizer flags. The output is written to a temporary file and renamed at the end, so
a failed run leaves no partial file. Conversations without an assistant turn are skipped; a
file where no conversation has one is refused (exit status 2, no output). ShareGPT-style
records (``conversations`` of ``from`` / ``value`` turns) are refused naming the rewrite into
``messages`` (docs/data-format.md).
"""

import argparse
import json
import logging
import multiprocessing
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# torch's note about a CUDA_HOME without a CUDA runtime, on machines without a GPU
logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
with warnings.catch_warnings():  # megatron-core's notes about optional packages it lacks
    warnings.simplefilter("ignore")
    from megatron.packed_training.datasets.chat import (  # noqa: E402
        ChatStats,
        count,
        detect_format,
        encode_line,
    )
    from megatron.packed_training.datasets.jsonl import other_chat_format  # noqa: E402
    from megatron.packed_training.tokenizer import TOKENIZER_TYPES, load_tokenizer  # noqa: E402


class _SimpleBar:
    """A progress line on stderr for when tqdm is not installed."""

    def __init__(self, total: int, desc: str, disable: bool = False):
        self.total, self.desc, self.disable = total, desc, disable
        self.n, self._shown = 0, 0.0

    def update(self, count: int):
        self.n += count
        now = time.monotonic()
        if not self.disable and (now - self._shown >= 0.5 or self.n >= self.total):
            self._shown = now
            percent = 100.0 * self.n / self.total if self.total else 100.0
            sys.stderr.write(f"\r{self.desc}: {percent:3.0f}% {self.n}/{self.total} conversations")
            sys.stderr.flush()

    def close(self):
        if not self.disable:
            sys.stderr.write("\n")
            sys.stderr.flush()


def progress_bar(total: int, desc: str, disable: bool = False):
    """tqdm when importable, else `_SimpleBar`."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _SimpleBar(total, desc, disable)
    return tqdm(total=total, desc=desc, unit=" conv", disable=disable, file=sys.stderr)


def count_records(path: str) -> int:
    with open(path, encoding="utf-8") as stream:
        return sum(1 for line in stream if line.strip())


def _lines(path: str):
    """(``path:line``, text) of every non-blank line."""
    with open(path, encoding="utf-8") as stream:
        for line_number, line in enumerate(stream, start=1):
            if line.strip():
                yield f"{path}:{line_number}", line


_worker_tokenizer = None


def _start_worker(tokenizer_type: str, tokenizer_model: str):
    global _worker_tokenizer
    warnings.simplefilter("ignore")  # the parent already warned about the template
    _worker_tokenizer = load_tokenizer(tokenizer_type, tokenizer_model)


def _encode(item):
    where, line = item
    return encode_line(line, where, _worker_tokenizer)


def _other_format(path: str) -> ValueError | None:
    """The error for a first record in another chat layout (ShareGPT), naming ``path:line``."""
    for where, line in _lines(path):
        try:
            return other_chat_format(json.loads(line), where)
        except json.JSONDecodeError:
            return None
    return None


def summary(stats: ChatStats, output: str, vocab_size: int, default_template: bool) -> str:
    share = 100.0 * stats.assistant_tokens / stats.tokens if stats.tokens else 0.0
    template = "built-in ChatML template" if default_template else "the tokenizer's chat template"
    return (f"preprocess_sft: {stats.conversations} conversations, {stats.tokens} tokens, "
            f"{stats.assistant_tokens} assistant tokens ({share:.1f}%), skipped {stats.skipped} "
            f"(no assistant turn) -> {output} ({template}; train with --sft --vocab-size "
            f"{vocab_size} or the same tokenizer flags)")


def preprocess(input_path: str, output_path: str, tokenizer, progress: bool = True,
               workers: int = 1) -> ChatStats:
    """Write ``output_path`` from the conversations of ``input_path``; returns the counts.
    ``workers > 1`` encodes in that many processes (same output, same order). Raises
    ValueError (naming ``input:line``) on a bad record, leaving no output file."""
    if detect_format(input_path) is None:
        raise ValueError(f"--input is wrong: {input_path!r} is not a file. Pass a .jsonl file "
                         f"of conversations.")
    if detect_format(input_path) != "chat":
        other = _other_format(input_path)
        if other is not None:
            raise other
        raise ValueError(f"--input is wrong: {input_path} is not chat data (its first record "
                         f"has no \"messages\"). Pass a JSONL of conversations; pre-tokenized "
                         f"files are read by training as they are.")
    stats = ChatStats()
    temporary = f"{output_path}.tmp{os.getpid()}"
    bar = progress_bar(count_records(input_path), "preprocess_sft", disable=not progress)
    pool = None
    try:
        if workers > 1:
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one thread per worker
            pool = multiprocessing.get_context().Pool(
                workers, initializer=_start_worker,
                initargs=(tokenizer.tokenizer_type, tokenizer.path))
            encoded = pool.imap(_encode, _lines(input_path), chunksize=64)
        else:
            encoded = (encode_line(line, where, tokenizer) for where, line in _lines(input_path))
        with open(temporary, "w", encoding="utf-8") as out:
            for input_ids, loss_mask in encoded:
                if count(stats, loss_mask):
                    record = {"input_ids": input_ids.tolist(),
                              "loss_mask": loss_mask.astype(int).tolist()}
                    out.write(json.dumps(record, separators=(",", ":")) + "\n")
                bar.update(1)
        if stats.conversations and not stats.tokens:
            raise ValueError(
                f"--input is wrong: none of the {stats.conversations} conversations of "
                f"{input_path} has an assistant turn, so there is nothing to train on (a "
                f'conversation trains on the turns whose role is "assistant"). Check the '
                f"roles; no output was written.")
        os.replace(temporary, output_path)
    finally:
        if pool is not None:
            pool.terminate()
        bar.close()
        if os.path.exists(temporary):
            os.remove(temporary)
    return stats


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--input", required=True, help="JSONL of conversations ('messages')")
    parser.add_argument("--output", required=True, help="pre-tokenized JSONL to write")
    parser.add_argument("--tokenizer-type", default=TOKENIZER_TYPES[0],
                        help=f"default {TOKENIZER_TYPES[0]} (the only type)")
    parser.add_argument("--tokenizer-model", required=True,
                        help="local tokenizer folder or tokenizer.json file (never downloaded)")
    parser.add_argument("--workers", type=int, default=1,
                        help="processes encoding conversations (default 1)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if os.path.abspath(args.input) == os.path.abspath(args.output):
            raise ValueError(f"--output is wrong: {args.output} is the input file. Write to "
                             f"another path.")
        if args.workers < 1:
            raise ValueError(f"--workers is wrong: {args.workers}. Use 1 or more.")
        with warnings.catch_warnings():  # a missing chat template is in the summary line
            warnings.simplefilter("ignore")
            tokenizer = load_tokenizer(args.tokenizer_type, args.tokenizer_model)
        stats = preprocess(args.input, args.output, tokenizer, progress=not args.no_progress,
                           workers=args.workers)
    except ValueError as error:
        print(f"preprocess_sft: error: {error}", file=sys.stderr)
        return 2
    print(summary(stats, args.output, tokenizer.vocab_size, tokenizer.uses_default_template))
    return 0


if __name__ == "__main__":
    sys.exit(main())
