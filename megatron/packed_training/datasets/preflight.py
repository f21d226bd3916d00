"""The data check before training: run on rank 0 before distributed start-up or any GPU work.

`run_data_check` (called once, by ``run_pretraining``) opens every source of the run's data
(building the token cache of JSONL sources, checking indexed datasets) and packs it exactly as
training will (`sources.pack_data`: the same reader, blend, ``--split``, long-document policy
and packer), so a bad line or file, a too-long document under ``--long-document-policy reject`` or more truncation than
``--max-truncated-token-fraction`` allows stops the run with a ValueError naming the file (and
``file:line`` where there is one) and the fix, before any GPU is touched. A run that passes
prints one summary line, the packer's own statistics (`builder.describe_packing`).

``--mock-data`` has no file to check: the summary counts the synthetic rows (the first
`MOCK_ROWS_CHECKED` when there are more). Other ranks skip the check; they read the data
later anyway.
"""

from dataclasses import dataclass, field
from typing import Callable, Mapping

from megatron.packed_training.data_paths import check_data_path
from megatron.packed_training.datasets.blend import blends_from_args
from megatron.packed_training.datasets.builder import build_datasets, describe_packing
from megatron.packed_training.datasets.mock import MockPackedDataset
from megatron.packed_training.datasets.packing import PackingStats
from megatron.packed_training.datasets.sources import has_split_data, is_first_rank, pack_data

MOCK_ROWS_CHECKED = 10_000
"""Synthetic rows the summary counts at most (about 0.3 s for 4096-position rows)."""


@dataclass
class DataCheck:
    """What the check found.

    Attributes:
        train: packing statistics of the training data (``--data-path``, or the mock rows).
        valid: those of the validation data (``--valid-data-path`` or ``--split``); None
            without any.
        line: the one summary line printed.
        rows: `sources.pack_data`'s ``{"train" | "valid" | "test": SplitRows}``, for training
            to reuse (rank 0 then packs the data once).
        caches: one line per token cache: built, rebuilt (and why) or reused.
    """

    train: PackingStats
    valid: PackingStats | None
    line: str
    rows: dict = field(default_factory=dict)
    caches: list = field(default_factory=list)


def _describe(stats: PackingStats) -> str:
    return describe_packing(stats).removeprefix("packing: ")


def check_data(args, print_fn: Callable[[str], None] | None = None) -> DataCheck:
    """Check the run's data from its parsed arguments and return the statistics; raises
    ValueError (naming the flag or ``file:line`` and the fix) on the first problem."""
    if args.mock_data:
        return _check_mock(args)
    # Every path first: a typo fails before a long read.
    blend, per_split = blends_from_args(args)
    for each in ([blend] if blend else []) + list(per_split.values()):
        for path in each.paths:
            check_data_path(path, each.flag)
    # Every split the run can read, test included: errors name file:line.
    packed = pack_data(args, with_test=has_split_data(args, "test"), print_fn=print_fn)
    parts = [f"{split.name}: {_describe(split.stats)}" for split in packed.values()]
    return DataCheck(packed["train"].stats, packed["valid"].stats if "valid" in packed else None,
                     "data check: " + "; ".join(parts), packed,
                     [cache.describe() for cache in packed.caches])


def _check_mock(args) -> DataCheck:
    train, _, stats = build_datasets(args)  # lazy rows; dynamic CP packs its document pool
    if stats is not None:
        scope = "document pool"
    else:
        rows = len(train)
        if isinstance(train, MockPackedDataset):
            rows = min(rows, MOCK_ROWS_CHECKED)
            stats = train.packing_stats(rows)
        scope = f"first {rows} of {len(train)} rows" if rows < len(train) else f"{rows} rows"
    return DataCheck(stats, None, f"data check: --mock-data ({scope}): {_describe(stats)}")


def run_data_check(args, print_fn: Callable[[str], None] | None = None,
                   environ: Mapping[str, str] | None = None) -> DataCheck | None:
    """On the first rank (`is_first_rank`): `check_data` and print its summary line; returns
    the `DataCheck`. On other ranks: nothing, returns None."""
    if not is_first_rank(environ):
        return None
    print_fn = print_fn or (lambda line: print(line, flush=True))
    result = check_data(args, print_fn)
    for line in result.caches:
        print_fn(line)
    print_fn(result.line)
    return result
