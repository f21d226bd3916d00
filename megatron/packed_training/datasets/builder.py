"""Datasets and micro-batch iterators built from the training CLI arguments."""

import functools
import itertools
import signal
from argparse import Namespace
from typing import Iterator

import torch

from megatron.packed_training.data_paths import DATA_PATHS
from megatron.packed_training.datasets.balance import DataParallelBalanced, balance_report
from megatron.packed_training.datasets.blend import BlendedRows, samples_per_source
from megatron.packed_training.datasets.dynamic_cp import DynamicCPBatches
from megatron.packed_training.datasets.mock import MockPackedDataset, mock_documents
from megatron.packed_training.datasets.packed_row_dataset import PackedRowDataset
from megatron.packed_training.datasets.packing import (
    PackingStats,
    collate_packed_rows,
)
from megatron.packed_training.datasets.row_plan import DocumentList
from megatron.packed_training.datasets.sampler import MicroBatchSampler
from megatron.packed_training.datasets.sources import (
    SplitRows,
    has_split_data,
    long_document_policy,
    pack_data,
    pack_source,
    segment_multiple,
)


def _sample_counts(args: Namespace) -> tuple[int, int]:
    """(train samples, valid samples) the run will read; valid is 0 when evaluation is off.

    Megatron-LM's budgets: --train-iters x --global-batch-size, or --train-samples (then the
    iteration count is at most samples / the smallest global batch, a ramp-up's start)."""
    if args.global_batch_size < 1:
        raise ValueError(
            f"global_batch_size is wrong: {args.global_batch_size!r}. Set --global-batch-size >= 1."
        )
    if args.train_iters:
        if args.train_iters < 1:
            raise ValueError(f"train_iters is wrong: {args.train_iters!r}. "
                             "Set --train-iters >= 1.")
        iterations, train_samples = args.train_iters, args.train_iters * args.global_batch_size
    elif getattr(args, "train_samples", None):
        rampup = getattr(args, "rampup_batch_size", None)
        smallest_batch = int(rampup[0]) if rampup else args.global_batch_size
        train_samples = args.train_samples
        iterations = -(-train_samples // smallest_batch)
    else:
        raise ValueError("the training length is missing: set --train-iters or --train-samples.")
    if args.eval_interval and args.eval_interval > 0 and args.eval_iters > 0:
        # One evaluation every eval_interval steps plus the final one.
        evaluations = iterations // args.eval_interval + 1
        return train_samples, args.eval_iters * args.global_batch_size * evaluations
    return train_samples, 0


def build_datasets(args: Namespace, packed_rows: dict | None = None):
    """Build ``(train_dataset, valid_dataset or None, PackingStats or None)``.

    ``packed_rows``: `pack_data`'s result for this run, packed already (the data check's on
    rank 0), used instead of reading the data again.

    Reads ``args.``: seq_length, vocab_size, seed, data_path, valid_data_path, split, mock_data,
    mock_doc_length_median, mock_doc_length_sigma, long_document_policy (or the older
    reject_long_documents), max_truncated_token_fraction, sft, train_iters,
    global_batch_size, eval_iters, eval_interval.

    Train holds ``train_iters * global_batch_size`` samples; valid holds
    ``eval_iters * global_batch_size * (train_iters // eval_interval + 1)`` when
    ``eval_interval > 0`` and ``eval_iters > 0``, else there is no valid dataset. With
    ``--mock-data`` valid rows come from ``seed + 1`` and the stats are None (dynamic CP: the
    training document pool's); with JSONL the valid set exists only if ``valid_data_path`` or
    a ``split`` with a validation share is given, and the stats are the training data's.
    Datasets yield `PackedRow`; JSONL files are read and packed here, once.
    """
    given = [flag for flag, dest in DATA_PATHS + (("--data-args-path", "data_args_path"),
                                                   ("--per-split-data-args-path",
                                                    "per_split_data_args_path"))
             if getattr(args, dest, None)]
    if args.mock_data and given:
        raise ValueError(f"data source is wrong: both --mock-data and {given[0]} are set. "
                         f"Pass one of them.")
    if not args.mock_data and not given:
        raise ValueError("data source is wrong: none given. Pass --data-path (a .jsonl file, a "
                         "folder of them or an indexed-dataset prefix) or --mock-data.")
    train_samples, valid_samples = _sample_counts(args)

    if args.mock_data and getattr(args, "dynamic_cp_sizes", None):
        def mock(num_samples: int, seed: int, stats: PackingStats) -> PackedRowDataset:
            # A document pool of about one size-1 micro-batch per sample (capped), cycled.
            positions = min(num_samples, 4096) * args.dynamic_cp_tokens_per_rank
            documents = mock_documents(
                positions, args.seq_length, args.vocab_size, seed,
                args.mock_doc_length_median, args.mock_doc_length_sigma)
            return PackedRowDataset(pack_source(DocumentList(documents), args, stats),
                                    num_samples, seed)

        valid = mock(valid_samples, args.seed + 1, PackingStats()) if valid_samples > 0 else None
        stats = PackingStats()  # of the training pool
        return mock(train_samples, args.seed, stats), valid, stats

    if args.mock_data:
        def mock(num_samples: int, seed: int) -> MockPackedDataset:
            return MockPackedDataset(
                num_samples,
                args.seq_length,
                args.vocab_size,
                seed,
                doc_length_median=args.mock_doc_length_median,
                doc_length_sigma=args.mock_doc_length_sigma,
                segment_multiple=segment_multiple(args),
                long_document_policy=long_document_policy(args),
            )

        valid = mock(valid_samples, args.seed + 1) if valid_samples > 0 else None
        return mock(train_samples, args.seed), valid, None

    # The data check packed the data already on rank 0: its rows and stats, else pack now.
    packed = packed_rows or pack_data(args, with_valid=valid_samples > 0)
    train = split_dataset(packed["train"], train_samples, args.seed)
    valid = None
    if "valid" in packed and valid_samples > 0:
        valid = split_dataset(packed["valid"], valid_samples, args.seed + 1)
    return train, valid, packed["train"].stats


def build_test_dataset(args: Namespace, packed_rows: dict | None = None):
    """The test split's dataset (``--test-data-path``, or a test share of ``--split``), of
    ``--eval-iters x --global-batch-size`` samples, Megatron-LM's test evaluation after
    training; None without test data or evaluation."""
    if args.mock_data or not args.eval_iters or not has_split_data(args, "test"):
        return None
    packed = packed_rows if packed_rows and "test" in packed_rows else None
    packed = packed or pack_data(args, with_valid=False, with_test=True)
    return split_dataset(packed["test"], args.eval_iters * args.global_batch_size, args.seed + 2)


def split_dataset(split: SplitRows, num_samples: int, seed: int):
    """``num_samples`` samples of one split: its rows epoch after epoch (`PackedRowDataset`),
    or, for a blend of several sources, Megatron-LM's blended order over each source's own
    `PackedRowDataset` (weights: the blend's, else the sources' row counts)."""
    if len(split.parts) == 1:
        return PackedRowDataset(split.rows, num_samples, seed)
    weights = split.blend_weights or [len(rows) for _, rows in split.parts]
    counts = samples_per_source(weights, num_samples)
    return BlendedRows([PackedRowDataset(rows, count, seed, stream=k)
                        for k, ((_, rows), count) in enumerate(zip(split.parts, counts))],
                       weights, num_samples)


def build_data_iterator(
    dataset,
    consumed_samples: int,
    micro_batch_size: int,
    data_parallel_rank: int,
    data_parallel_size: int,
    cycle: bool = False,
    num_workers: int = 0,
    exit_signal: int | None = None,
) -> Iterator[dict]:
    """Iterator of this rank's micro-batch dicts (see `collate_packed_rows` for the keys).

    Starts at ``consumed_samples``. With ``cycle=True`` (validation) it restarts from sample 0
    whenever it runs out, and never ends. ``num_workers > 0`` reads and collates rows in
    worker processes, ahead of the training loop (same rows, same order); for in-memory rows
    the read is cheap and workers did not help (``--num-workers`` in docs/flags.md).
    ``exit_signal`` (``--exit-signal-handler``): workers ignore it, so the signal that asks
    training to save and stop (torchrun passes it to the whole process group) leaves them be.
    """

    def loader(consumed: int) -> torch.utils.data.DataLoader:
        sampler = MicroBatchSampler(
            len(dataset), consumed, micro_batch_size, data_parallel_rank, data_parallel_size
        )
        return torch.utils.data.DataLoader(
            dataset, batch_sampler=sampler, collate_fn=collate_packed_rows,
            num_workers=num_workers,
            worker_init_fn=functools.partial(_ignore_signal, exit_signal) if num_workers
            and exit_signal is not None else None,
            # Pinned rows make the forward step's non_blocking copies asynchronous.
            pin_memory=torch.cuda.is_available(),
        )

    first = loader(consumed_samples)
    if not cycle:
        return iter(first)
    if len(loader(0)) == 0:
        raise ValueError(
            f"dataset is wrong: {len(dataset)} samples, fewer than one micro-batch per rank "
            f"({micro_batch_size} x {data_parallel_size} ranks), so it cannot be cycled. "
            f"Raise --eval-iters or lower --micro-batch-size."
        )
    return itertools.chain(first, itertools.chain.from_iterable(loader(0) for _ in itertools.count()))


def build_rank_iterators(train, valid, args: Namespace, rank: int, size: int) -> tuple:
    """Megatron-LM's ``(train, valid)`` iterators of data-parallel rank ``rank`` of ``size``
    over the built datasets (``valid`` None: None): training from
    ``args.consumed_train_samples`` on (a loaded checkpoint's), validation cycling.

    Static layouts yield one micro-batch dict per ``next()`` (`build_data_iterator`). Dynamic
    CP yields one training iteration per ``next()``: the list of this rank's turns
    (`DynamicCPBatches`), whose length varies by rank and iteration; the graph runtime's seam
    runs that many micro-batches (packed_graphs/schedule.py)."""
    if getattr(args, "dynamic_cp_sizes", None):
        def iterations(dataset, consumed, cycle=False):
            return DynamicCPBatches(dataset, consumed, args.global_batch_size, rank, size,
                                    cycle=cycle)
        return (iterations(train, args.consumed_train_samples),
                None if valid is None else iterations(valid, 0, cycle=True))
    exit_signal = args.exit_signal if args.exit_signal_handler else None
    if getattr(args, "sequence_packing_scheduler", None) == "dp_balanced":
        train = DataParallelBalanced(train, args.global_batch_size, size, args.micro_batch_size)
    train_iterator = build_data_iterator(train, args.consumed_train_samples,
                                         args.micro_batch_size, rank, size,
                                         num_workers=args.num_workers, exit_signal=exit_signal)
    valid_iterator = None if valid is None else build_data_iterator(
        valid, 0, args.micro_batch_size, rank, size, cycle=True)
    return train_iterator, valid_iterator


def _ignore_signal(signum: int, _worker_id: int) -> None:
    signal.signal(signum, signal.SIG_IGN)


def describe_balance(train, args: Namespace, size: int) -> str:
    """One start-up line: how evenly the data-parallel ranks' real tokens fall per step, in
    the plain order and with ``--sequence-packing-scheduler dp_balanced``."""
    batch, mbs = args.global_batch_size, args.micro_batch_size
    plain = balance_report(train, batch, size, mbs)
    balanced = balance_report(DataParallelBalanced(train, batch, size, mbs), batch, size, mbs)
    chosen = args.sequence_packing_scheduler == "dp_balanced"
    return (f"data-parallel balance over {size} ranks, real tokens per step max/mean: "
            f"plain order mean {plain[0]:.3f} worst {plain[1]:.3f}; dp_balanced mean "
            f"{balanced[0]:.3f} worst {balanced[1]:.3f} (this run: "
            f"{'dp_balanced' if chosen else 'plain order'})")


def describe_packing(stats: PackingStats | None) -> str:
    """One line for the start-up log."""
    if stats is None:
        return "packing: synthetic rows (--mock-data), no packing statistics"
    slots = stats.tokens + stats.padding_tokens
    padding = 100.0 * stats.padding_tokens / slots if slots else 0.0
    split = f"split {stats.split}" + (f" into {stats.pieces} pieces" if stats.split else "")
    no_target = (f" and {stats.skipped_no_target} without an assistant turn"
                 if stats.skipped_no_target else "")
    return (
        f"packing: {stats.documents} documents into {stats.rows} rows "
        f"({stats.documents / max(stats.rows, 1):.1f} per row), skipped {stats.skipped_empty} empty"
        f"{no_target}, "
        f"{split}, truncated {stats.truncated} ({stats.truncated_tokens} tokens lost, "
        f"{100 * stats.truncated_fraction:.2f}%), padding {padding:.1f}% of {slots} positions"
    )
