"""The run's data sources, opened and packed by split: what feeds training, validation and test.

A source is one path of a blend (`blend.py`):

- a Megatron-LM indexed dataset prefix (``PREFIX.bin`` + ``PREFIX.idx``; `indexed.py`): each
  of its documents is one sample, every token a target;
- a ``.jsonl`` file, or a folder of them: pre-tokenized or chat JSONL, tokenized once into the
  memory-mapped token cache (`token_cache.py`), which keeps each document's loss mask.

Each source's documents are packed into a `RowPlan` (`row_plan.py`, ``--packing-algorithm``);
rows are built from the mapped files when read. `pack_data` is what the data check (rank 0,
before any GPU work) and training both call, so the check's numbers are the run's.
"""

import json
import os
import re
from argparse import Namespace
from dataclasses import dataclass, field

from megatron.packed_training.data_paths import Blend, check_data_path, is_indexed_prefix
from megatron.packed_training.datasets.blend import SPLITS, blends_from_args
from megatron.packed_training.datasets.dynamic_cp import pack_rows_for_dynamic_cp
from megatron.packed_training.datasets.indexed import IndexedSource
from megatron.packed_training.datasets.packing import (
    Document,
    PackingStats,
    check_truncated_fraction,
    resolve_long_document_policy,
)
from megatron.packed_training.datasets.row_plan import (
    DEFAULT_PACKING_ALGORITHM,
    DEFAULT_PACKING_MAX_DOCUMENTS,
    DEFAULT_PACKING_WINDOW,
    PlannedRows,
    plan_rows,
)
from megatron.packed_training.datasets.token_cache import (
    CacheInfo,
    open_cached_source,
    tokenizer_fingerprint,
)


def is_first_rank(environ=None) -> bool:
    """Whether this process is the first rank (``RANK`` unset, empty or ``"0"``): it checks
    the data and builds token caches; the others wait for them."""
    rank = (os.environ if environ is None else environ).get("RANK")
    return rank in (None, "", "0")


def split_shares(split: str) -> tuple[float, float, float]:
    """Megatron's ``--split`` ("969,30,1", "98/2", "100") as train, valid and test fractions
    summing to 1 (missing shares are 0); ValueError says what is wrong."""
    try:
        shares = [float(value) for value in re.split(r"[,/]", split.replace(" ", ""))]
    except ValueError:
        raise ValueError("Give up to three non-negative numbers separated by ',' or '/', "
                         "e.g. 98,2,0") from None
    if len(shares) > 3 or min(shares) < 0 or sum(shares) <= 0:
        raise ValueError("Give up to three non-negative numbers (train, valid, test) with a "
                         "positive sum, e.g. 98,2,0")
    total = sum(shares)
    return tuple(share / total for share in shares + [0.0] * (3 - len(shares)))


def split_boundaries(shares: tuple, count: int) -> list[int]:
    """Where each split of ``count`` documents ends, in source order: the cumulative shares
    rounded, the last at ``count``."""
    ends, total = [], 0.0
    for share in shares:
        total += share
        ends.append(round(total * count))
    ends[-1] = count
    return ends


def _shares(args: Namespace) -> tuple[float, float, float]:
    split = getattr(args, "split", None)
    return (1.0, 0.0, 0.0) if split is None else split_shares(split)


def has_split_data(args: Namespace, split: str) -> bool:
    """Whether the run has rows for ``split`` ("valid" or "test"): a per-split path, or a
    ``--split`` share of ``--data-path`` (a bad flag counts: the data check reports it)."""
    try:
        if getattr(args, "mock_data", False):
            return split == "valid"
        blend, per_split = blends_from_args(args)
        return split in per_split or (blend is not None and _shares(args)[SPLITS.index(split)] > 0)
    except (ValueError, OSError):
        return True


def has_validation_data(args: Namespace) -> bool:
    """Whether the run has validation rows: --mock-data, a validation path or a --split with a
    validation share."""
    return has_split_data(args, "valid")


@dataclass
class SplitRows:
    """The packed rows of one split.

    Attributes:
        parts: one ``(name, rows)`` per source of the split's blend; ``rows`` a `PlannedRows`.
        blend_weights: the blend's weights (None: one source, or weighted by rows).
        stats: packing statistics of all its sources together.
        name: how the data check names the split's data.
    """

    parts: list = field(default_factory=list)
    blend_weights: list | None = None
    stats: PackingStats = field(default_factory=PackingStats)
    name: str = ""

    @property
    def rows(self):
        """The rows of a one-source split."""
        return self.parts[0][1]


@dataclass
class OpenedSources:
    """Sources opened once per path (a path in two splits is read once)."""

    args: Namespace
    build: bool
    print_fn: object = None
    opened: dict = field(default_factory=dict)
    caches: list = field(default_factory=list)

    def open(self, path: str, flag: str):
        if path not in self.opened:
            self.opened[path] = open_source(path, self.args, flag, self.build, self.print_fn)
            if self.opened[path][1] is not None:
                self.caches.append(self.opened[path][1])
        return self.opened[path]


def open_source(path: str, args: Namespace, flag: str, build: bool,
                print_fn=None) -> tuple[object, CacheInfo | None]:
    """``(document source, CacheInfo or None)`` of one blend path: a JSONL file or folder
    (through the token cache; ``build``: this rank builds it) or an indexed prefix. ValueError
    naming ``flag`` and the fix for a path that is none of them."""
    from megatron.packed_training.tokenizer import tokenizer_from_args

    if args.vocab_size is None:  # Megatron-LM's own tokenizers learn it later, at start-up
        raise ValueError(
            f"{flag} is wrong: {path} holds token ids, and the vocabulary size is not known yet "
            f"for --tokenizer-type {getattr(args, 'tokenizer_type', None)}. Add --vocab-size "
            f"(the tokenizer's vocabulary size) so the ids can be checked.")
    if os.path.isfile(path) or os.path.isdir(path):
        source, cache = open_cached_source(
            path, vocab_size=args.vocab_size, load_tokenizer=lambda: tokenizer_from_args(args),
            tokenizer_key=tokenizer_fingerprint(getattr(args, "tokenizer_type", None),
                                                getattr(args, "tokenizer_model", None)),
            cache_root=getattr(args, "data_cache_path", None), build=build, flag=flag,
            print_fn=print_fn)
        if not args.sft:  # pretraining on packed documents: every real token is a target
            source.loss_masks = None
        return source, cache
    if is_indexed_prefix(path):
        check_cache_tokenizer(path, args, flag)
        source = IndexedSource(path, flag)
        if build:  # the first rank checks every token once, in the data check
            source.check_token_ids(args.vocab_size, flag)
        return source, None
    check_data_path(path, flag)  # raises: neither a file, a folder nor a prefix
    raise AssertionError(path)


def check_cache_tokenizer(prefix: str, args: Namespace, flag: str) -> None:
    """A token cache's ``tokens`` prefix given as indexed data: refused when the cache was built
    with another tokenizer or vocabulary than this run's (its ids would mean other tokens)."""
    meta = os.path.join(os.path.dirname(os.path.abspath(prefix)), "meta.json")
    if os.path.basename(prefix) != "tokens" or not os.path.isfile(meta):
        return
    with open(meta) as stream:
        built = json.load(stream)
    wanted = tokenizer_fingerprint(getattr(args, "tokenizer_type", None),
                                   getattr(args, "tokenizer_model", None))
    if built.get("tokenizer") != wanted or built.get("vocab_size") != args.vocab_size:
        raise ValueError(
            f"{flag} is wrong: {prefix} is a token cache built with tokenizer "
            f"{built.get('tokenizer')} (vocabulary {built.get('vocab_size')}), and this run uses "
            f"{wanted} (vocabulary {args.vocab_size}). Pass the JSONL source itself as the data "
            f"path (its cache is rebuilt for this tokenizer), or train with the tokenizer the "
            f"cache was built with.")


def segment_multiple(args: Namespace) -> int:
    """Context parallelism splits every document into 2 * cp equal chunks: pad to that."""
    cp = getattr(args, "context_parallel_size", 1)
    return 2 * cp if cp > 1 else 1


def long_document_policy(args: Namespace) -> str:
    """--long-document-policy (--reject-long-documents is its older spelling of reject)."""
    return resolve_long_document_policy(getattr(args, "long_document_policy", None),
                                        getattr(args, "reject_long_documents", False))


def pack_source(source, args: Namespace, stats: PackingStats, documents=None, stream: int = 0):
    """The rows of ``source``'s ``documents`` (default all), packed as the run asks: planned
    rows read on demand, or (dynamic CP) rows of every CP size, packed in memory."""
    policy = long_document_policy(args)
    if getattr(args, "dynamic_cp_sizes", None):
        indices = range(len(source.lengths)) if documents is None else documents
        read = (Document(*source.read(d, 0, int(source.lengths[d])), source.origin(d))
                for d in indices)
        return pack_rows_for_dynamic_cp(read, args.dynamic_cp_sizes,
                                        args.dynamic_cp_tokens_per_rank,
                                        long_document_policy=policy, stats=stats)
    return PlannedRows(source, plan_rows(
        source, args.seq_length, long_document_policy=policy, stats=stats,
        segment_multiple=segment_multiple(args),
        algorithm=getattr(args, "packing_algorithm", None) or DEFAULT_PACKING_ALGORITHM,
        window=getattr(args, "packing_window", None) or DEFAULT_PACKING_WINDOW,
        seed=args.seed + stream, documents=documents,
        max_documents=getattr(args, "packing_max_documents", DEFAULT_PACKING_MAX_DOCUMENTS)
        or None))


def _check_rows(split: SplitRows, args: Namespace) -> None:
    check_truncated_fraction(split.stats, getattr(args, "max_truncated_token_fraction", None),
                             split.name)
    if sum(len(rows) for _, rows in split.parts) == 0:
        raise ValueError(
            f"data is wrong: {split.name} holds no document with at least 2 tokens "
            f"({split.stats.skipped_empty} shorter, {split.stats.skipped_no_target} "
            "conversations without an assistant turn). Point the data path at real data; a "
            'conversation trains on the turns whose role is "assistant".')


class PackedData(dict):
    """``{split: SplitRows}``, and ``caches``: the `CacheInfo` of every token cache opened."""

    def __init__(self, splits: dict, caches: list):
        super().__init__(splits)
        self.caches = caches


def pack_data(args: Namespace, with_valid: bool = True, with_test: bool = False,
              print_fn=None) -> PackedData:
    """`PackedData`, ``{split: SplitRows}`` of the run's data: splits "train", "valid" and
    "test" where the run has them (``with_valid`` / ``with_test`` False: that split is not read). The first rank
    (`is_first_rank`) builds missing token caches; others wait for them.

    ``--data-path``'s blend is divided by ``--split`` (per source, in document order); the
    per-split paths give each split its own blend."""
    blend, per_split = blends_from_args(args)
    wanted = {"train": True, "valid": with_valid, "test": with_test}
    sources = OpenedSources(args, is_first_rank(), print_fn)
    packed: dict[str, SplitRows] = {}

    def add(split: str, blend_: Blend, name: str, path: str, weight, rows) -> None:
        rows_of_split = packed.setdefault(split, SplitRows(name=name))
        rows_of_split.parts.append((path, rows))
        if blend_.weights is not None:
            rows_of_split.blend_weights = (rows_of_split.blend_weights or []) + [weight]

    if blend is not None:
        shares = _shares(args)
        for split, share in zip(SPLITS, shares):  # an empty share is an error, not a skip
            if share > 0 and wanted[split] and split not in per_split:
                packed[split] = SplitRows(name=split_name(args, blend, split))
        for k, path in enumerate(blend.paths):
            source, cache = sources.open(path, blend.flag)
            if cache is not None and "train" in packed:  # skipped conversations: training's
                packed["train"].stats.skipped_no_target += cache.skipped_no_target
            weight = None if blend.weights is None else blend.weights[k]
            bounds = split_boundaries(shares, len(source.lengths))
            if shares[1] > 0 and bounds[1] == bounds[0]:
                raise ValueError(
                    f"--split is wrong: {args.split} gives validation none of the "
                    f"{len(source.lengths)} documents of {path}. Raise the validation share, "
                    f"or make it 0 to train without validation")
            begin = 0
            for split, end in zip(SPLITS, bounds):
                if end > begin and wanted[split] and split not in per_split:
                    name = split_name(args, blend, split)
                    stats = packed.setdefault(split, SplitRows(name=name)).stats
                    add(split, blend, name, path, weight,
                        pack_source(source, args, stats, range(begin, end), stream=k))
                begin = end
    for split, split_blend in per_split.items():
        if not wanted[split]:
            continue
        for k, path in enumerate(split_blend.paths):
            source, cache = sources.open(path, split_blend.flag)
            name = f"{split_blend.flag} {split_blend}"
            stats = packed.setdefault(split, SplitRows(name=name)).stats
            if cache is not None:
                stats.skipped_no_target += cache.skipped_no_target
            weight = None if split_blend.weights is None else split_blend.weights[k]
            add(split, split_blend, name, path, weight, pack_source(source, args, stats, stream=k))
    for split in packed.values():
        _check_rows(split, args)
    return PackedData(packed, caches=sources.caches)


def split_name(args: Namespace, blend: Blend, split: str) -> str:
    """How errors and the data check name one split's share of ``--data-path``."""
    if getattr(args, "split", None) is None:
        return f"{blend.flag} {blend}"
    return f"{blend.flag} {blend} (--split {args.split}, {split})"
