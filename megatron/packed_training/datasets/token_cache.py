"""JSONL and chat JSONL tokenized once into a memory-mapped cache: Megatron-LM's indexed format.

One streaming pass over a source (a ``.jsonl`` file, or a folder of them) reads each line with
the training reader (pre-tokenized ids, or a chat conversation rendered with the tokenizer's
template), checks it (errors name ``file:line`` and the fix), and appends it through
megatron-core's ``IndexedDatasetBuilder`` to

    <cache root>/packed_token_cache/<source name>-<hash of its path>/
        tokens.bin, tokens.idx        the token ids (uint16 below 65500 ids, else int32)
        loss_mask.bin, loss_mask.idx  one 0/1 byte per token
        lines.npy, files.npy          each document's line and file, for errors
        meta.json                     what it was built from, and its counts

Training then reads only the pages it packs, so a rank's memory does not grow with the data.
The first rank builds it (in the data check, before any GPU work) into a temporary folder
renamed when complete; the other ranks wait for it. A cache is reused only when
`fingerprint` matches (the files' sizes and modification times, the tokenizer's files, the
vocabulary size); otherwise it is rebuilt, and the log says why.
"""

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from megatron.packed_training.datasets.indexed import IndexedSource

CACHE_FORMAT = 1
CACHE_FOLDER = "packed_token_cache"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def source_files(path: str, flag: str = "--data-path") -> list[str]:
    """The JSONL files of a source: ``path`` itself, or the ``*.jsonl`` files of a folder,
    sorted by name. ValueError when a folder holds none."""
    if not os.path.isdir(path):
        return [path]
    files = sorted(os.path.join(path, name) for name in os.listdir(path)
                   if name.endswith(".jsonl") and os.path.isfile(os.path.join(path, name)))
    if not files:
        raise ValueError(f"{flag} is wrong: the folder {path!r} holds no .jsonl file. Point it at "
                         f"a folder of JSONL files, a .jsonl file or an indexed-dataset prefix.")
    return files


def first_jsonl(path: str) -> str | None:
    """The file that stands for source ``path``'s format: itself, or a folder's first
    ``.jsonl`` file; None for an indexed prefix or an empty folder."""
    if not (os.path.isfile(path) or os.path.isdir(path)):
        return None
    try:
        return source_files(path)[0]
    except ValueError:  # a folder without .jsonl files: the data check names it
        return None


def tokenizer_fingerprint(tokenizer_type: str | None, tokenizer_model: str | None) -> dict | None:
    """What of the tokenizer a cache depends on: its type and a hash of its files; None without
    a tokenizer model (pre-tokenized data depends on the vocabulary size alone)."""
    if tokenizer_model is None:
        return None
    model = os.path.abspath(tokenizer_model)
    digest = hashlib.sha256()
    names = [model] if os.path.isfile(model) else [
        os.path.join(model, name) for name in TOKENIZER_FILES]
    for name in names:
        if os.path.isfile(name):
            with open(name, "rb") as stream:
                digest.update(os.path.basename(name).encode() + b"\0" + stream.read())
    return {"type": tokenizer_type, "model": model, "sha256": digest.hexdigest()}


def fingerprint(files: list[str], vocab_size: int, tokenizer: dict | None) -> dict:
    """What a cache was built from; equal fingerprints mean equal contents."""
    stats = [os.stat(f) for f in files]
    return {"format": CACHE_FORMAT, "vocab_size": int(vocab_size), "tokenizer": tokenizer,
            "files": [[os.path.abspath(f), s.st_size, s.st_mtime_ns] for f, s in zip(files, stats)]}


def cache_folder(path: str, cache_root: str | None) -> str:
    """Where the cache of source ``path`` lives: under ``cache_root`` (``--data-cache-path``),
    else under ``cache/`` beside the source, as Megatron-LM keeps its dataset indices."""
    path = os.path.abspath(path)
    root = cache_root or os.path.join(os.path.dirname(path.rstrip("/")), "cache")
    name = os.path.basename(path.rstrip("/"))
    return os.path.join(root, CACHE_FOLDER,
                        f"{name}-{hashlib.sha256(path.encode()).hexdigest()[:12]}")


@dataclass
class CacheInfo:
    """What one source's cache holds and how it came to be.

    Attributes:
        folder: the cache folder.
        documents: documents in it (conversations without an assistant turn are not).
        tokens: tokens in it.
        skipped_no_target: chat conversations skipped for having no assistant turn.
        built: ``"built"``, ``"rebuilt (<why>)"`` or ``"reused"``.
        seconds: build time (0 when reused).
    """

    folder: str
    documents: int
    tokens: int
    skipped_no_target: int
    built: str
    seconds: float = 0.0

    def describe(self) -> str:
        rate = f", {self.documents / self.seconds:.0f} documents/s" if self.seconds else ""
        return (f"token cache {self.built}: {self.folder} ({self.documents} documents, "
                f"{self.tokens} tokens{rate})")


def _stale_reason(old: dict | None, new: dict) -> str | None:
    if old is None:
        return None
    for key, why in (("format", "another cache format"), ("files", "the data files changed"),
                     ("tokenizer", "another tokenizer"), ("vocab_size", "another vocabulary size")):
        if old.get(key) != new.get(key):
            return why
    return None


def _read_meta(folder: str) -> dict | None:
    try:
        with open(os.path.join(folder, "meta.json")) as stream:
            return json.load(stream)
    except (OSError, ValueError):
        return None


def _build(files: list[str], folder: str, vocab_size: int, load_tokenizer, print_fn,
           flag: str) -> tuple[dict, str]:
    """Stream ``files`` into a new cache beside ``folder``; returns its counts and the folder
    it was built in (renamed by the caller). Nothing is left if a line is bad (the ValueError
    names it)."""
    import torch
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    from megatron.packed_training.datasets.chat import ChatStats, read_documents

    parent = os.path.dirname(folder)
    try:
        os.makedirs(parent, exist_ok=True)
        building = f"{folder}.building-{os.getpid()}"
        shutil.rmtree(building, ignore_errors=True)
        os.makedirs(building)
    except OSError as err:
        raise ValueError(f"{flag} is wrong: the token cache cannot be written at {parent} "
                         f"({err.strerror}). Pass --data-cache-path with a writable folder "
                         f"that every rank can read.") from None
    try:
        tokens = IndexedDatasetBuilder(os.path.join(building, "tokens.bin"),
                                       dtype=DType.optimal_dtype(vocab_size))
        masks = IndexedDatasetBuilder(os.path.join(building, "loss_mask.bin"), dtype=np.uint8)
        lines, file_of, chat, total, started = [], [], ChatStats(), 0, time.time()
        tokenizer = load_tokenizer()
        for index, path in enumerate(files):
            for document in read_documents(path, vocab_size, tokenizer, chat):
                ids = document.input_ids
                mask = (np.ones(len(ids), np.uint8) if document.loss_mask is None
                        else document.loss_mask.astype(np.uint8))
                tokens.add_document(torch.from_numpy(ids), [len(ids)])
                masks.add_document(torch.from_numpy(mask), [len(ids)])
                lines.append(int(document.origin.rsplit(":", 1)[1]))
                file_of.append(index)
                total += len(ids)
                if print_fn and len(lines) % 1_000_000 == 0:
                    print_fn(f" > token cache: {len(lines)} documents from {path} ...")
        tokens.finalize(os.path.join(building, "tokens.idx"))
        masks.finalize(os.path.join(building, "loss_mask.idx"))
        np.save(os.path.join(building, "lines.npy"), np.asarray(lines, dtype=np.int64))
        np.save(os.path.join(building, "files.npy"), np.asarray(file_of, dtype=np.int32))
        counts = {"documents": len(lines), "tokens": total, "skipped_no_target": chat.skipped,
                  "seconds": time.time() - started}
        return counts, building
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise


def open_cached_source(path: str, *, vocab_size: int, load_tokenizer: Callable[[], object],
                       tokenizer_key: dict | None,
                       cache_root: str | None, build: bool, flag: str = "--data-path",
                       print_fn=None, wait_seconds: float = 3600.0) -> tuple[IndexedSource, CacheInfo]:
    """The cached documents of JSONL source ``path`` (`IndexedSource` with loss masks and
    ``file:line`` origins) and the `CacheInfo`.

    ``build``: this rank builds or rebuilds a missing or stale cache (the first rank); the
    others wait up to ``wait_seconds`` for one whose fingerprint matches, then fail naming it.
    ``load_tokenizer``: called only to build (a reused cache needs no tokenizer)."""
    files = source_files(path, flag)
    wanted = fingerprint(files, vocab_size, tokenizer_key)
    folder = cache_folder(path, cache_root)
    meta, state, seconds = _read_meta(folder), "reused", 0.0
    if meta is None or _stale_reason(meta, wanted):
        if build:
            why = _stale_reason(meta, wanted)
            counts, building = _build(files, folder, vocab_size, load_tokenizer, print_fn, flag)
            meta = wanted | counts
            with open(os.path.join(building, "meta.json"), "w") as stream:
                json.dump(meta, stream, indent=1)
            shutil.rmtree(folder, ignore_errors=True)  # stale: never reused
            os.replace(building, folder)
            state, seconds = ("rebuilt (" + why + ")") if why else "built", counts["seconds"]
        else:
            deadline = time.time() + wait_seconds
            while meta is None or _stale_reason(meta, wanted):
                if time.time() > deadline:
                    raise ValueError(
                        f"{flag} is wrong: no token cache of {path} appeared at {folder} within "
                        f"{wait_seconds:.0f} s; rank 0 builds it. Give every rank the same "
                        f"--data-cache-path on a shared file system.")
                time.sleep(1.0)
                meta = _read_meta(folder)
    source = IndexedSource(os.path.join(folder, "tokens"), flag,
                           loss_mask_prefix=os.path.join(folder, "loss_mask"),
                           origins=(files, np.load(os.path.join(folder, "files.npy")),
                                    np.load(os.path.join(folder, "lines.npy"))))
    info = CacheInfo(folder, meta["documents"], meta["tokens"], meta["skipped_no_target"],
                     state, seconds)
    return source, info
