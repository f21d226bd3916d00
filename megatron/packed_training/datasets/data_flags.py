"""The fork's data flags (docs/data-format.md) and their rules; Megatron-LM's own data flags
(``--data-path`` and its siblings, ``--split``, ``--data-cache-path``) act as in Megatron-LM."""

import argparse

from megatron.packed_model.refusals import refuse
from megatron.packed_training.data_paths import DATA_PATHS
from megatron.packed_training.datasets.balance import DP_SCHEDULERS
from megatron.packed_training.datasets.packing import LONG_DOCUMENT_POLICIES
from megatron.packed_training.datasets.row_plan import (
    DEFAULT_PACKING_ALGORITHM,
    DEFAULT_PACKING_MAX_DOCUMENTS,
    DEFAULT_PACKING_WINDOW,
    PACKING_ALGORITHMS,
)
from megatron.packed_training.datasets.sources import split_shares


def add_data_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("packed data", "docs/data-format.md")
    g.add_argument("--long-document-policy", choices=LONG_DOCUMENT_POLICIES, default="split",
                   help="A document longer than a row: split into row-sized pieces, truncate "
                   "to --seq-length + 1 tokens, or reject it.")
    g.add_argument("--max-truncated-token-fraction", type=float,
                   help="With truncate: the largest share of a file's tokens it may drop.")
    g.add_argument("--packing-algorithm", choices=PACKING_ALGORITHMS,
                   default=DEFAULT_PACKING_ALGORITHM, help="Fill rows tightly, longest first "
                   "within each shuffled window, or keep documents in source order.")
    g.add_argument("--packing-window", type=int, default=DEFAULT_PACKING_WINDOW, metavar="N",
                   help="best-fit-decreasing: documents (pieces) packed together.")
    g.add_argument("--packing-max-documents", type=int, default=DEFAULT_PACKING_MAX_DOCUMENTS,
                   metavar="N", help="best-fit-decreasing: at most N documents per row (0: no "
                   "limit); a graph capacity holds N + 1 segments per row.")
    g.add_argument("--sequence-packing-scheduler", choices=DP_SCHEDULERS, default="default",
                   help="dp_balanced: deal each global batch's rows so data-parallel ranks "
                   "get near-equal real tokens.")
    g.add_argument("--mock-doc-length-median", type=float, default=512,
                   help="--mock-data: median document length in tokens.")
    g.add_argument("--mock-doc-length-sigma", type=float, default=1.0,
                   help="--mock-data: log-normal sigma of document lengths.")


def check_data_args(args) -> None:
    """The data flags' rules, after Megatron-LM's ``validate_args``; a start-up note
    (``args.packed_notes``) when packed micro-batches can outgrow the graph capacity."""
    fraction, balanced = args.max_truncated_token_fraction, args.sequence_packing_scheduler
    balanced = balanced == "dp_balanced"
    per_split = [flag for flag, dest in DATA_PATHS[1:] if getattr(args, dest, None)] or [""]
    refuse((fraction is not None and not 0.0 <= fraction <= 1.0, "--max-truncated-token-"
            "fraction", fraction, "Use a fraction in [0, 1], e.g. 0.05"),
           (fraction is not None and args.long_document_policy != "truncate",
            "--max-truncated-token-fraction", fraction, "It limits what truncation drops and "
            f"--long-document-policy {args.long_document_policy} drops nothing; add "
            "--long-document-policy truncate"),
           (args.packing_window < 1, "--packing-window", args.packing_window,
            "Give the number of documents packed together, e.g. 20000"),
           (args.packing_max_documents < 0, "--packing-max-documents",
            args.packing_max_documents, "Give the documents a row may hold, or 0 for no limit"),
           (balanced and bool(args.rampup_batch_size or args.step_batch_size_schedule),
            "--sequence-packing-scheduler", "dp_balanced", "It deals whole global batches, "
            "which --rampup-batch-size (a step batch-size schedule) resizes; drop one of them"),
           (balanced and bool(args.dynamic_cp_sizes), "--sequence-packing-scheduler",
            "dp_balanced", "Dynamic CP deals its own turns per rank; drop one of the two"),
           (bool(args.per_split_data_args_path and per_split[0]), "--per-split-data-args-path",
            args.per_split_data_args_path, f"It lists every split's data, and {per_split[0]} "
            "gives one again; keep one of the two"),
           (bool(args.data_path and args.valid_data_path and args.split
                 and split_shares(args.split)[1] > 0), "--valid-data-path",
            " ".join(args.valid_data_path or []), f"--split {args.split} already holds "
            "validation documents of --data-path; make its validation share 0 (e.g. 100,0,0) "
            "or drop --valid-data-path"))
    capacity, most = args.cuda_graph_max_packed_seqs or 0, args.packing_max_documents
    if capacity and not args.mock_data and args.packing_algorithm == "best-fit-decreasing" and (
            not most or (most + 1) * args.micro_batch_size > capacity):  # mock rows: not packed
        args.packed_notes.append(
            f"rows may hold {most or 'any number of'} documents, so a micro-batch of "
            f"{args.micro_batch_size} row(s) can outgrow --cuda-graph-max-packed-seqs "
            f"{capacity} and run eager; --packing-max-documents "
            f"{max(capacity // args.micro_batch_size - 1, 1)} keeps every micro-batch within "
            "it (give the same value to an eager run you compare with)")
