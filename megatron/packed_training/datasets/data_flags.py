"""The fork's data flags (docs/data-format.md) and their rules, beside Megatron-LM's own data
flags (``--data-path`` and its siblings, ``--split``, ``--data-cache-path``), which the data
pipeline reads as Megatron-LM does."""

import argparse

from megatron.packed_model.refusals import refuse
from megatron.packed_training.datasets.balance import DP_SCHEDULERS
from megatron.packed_training.datasets.packing import LONG_DOCUMENT_POLICIES
from megatron.packed_training.datasets.row_plan import (
    DEFAULT_PACKING_ALGORITHM,
    DEFAULT_PACKING_WINDOW,
    PACKING_ALGORITHMS,
)


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
                   help="best-fit-decreasing: documents packed together (seeded shuffle).")
    g.add_argument("--sequence-packing-scheduler", choices=DP_SCHEDULERS, default="default",
                   help="dp_balanced: deal each global batch's rows so data-parallel ranks "
                   "get near-equal real tokens.")
    g.add_argument("--mock-doc-length-median", type=float, default=512,
                   help="--mock-data: median document length in tokens.")
    g.add_argument("--mock-doc-length-sigma", type=float, default=1.0,
                   help="--mock-data: log-normal sigma of document lengths.")


def check_data_args(args) -> None:
    """The data flags' rules, after Megatron-LM's ``validate_args``."""
    fraction, flag = args.max_truncated_token_fraction, "--max-truncated-token-fraction"
    if fraction is not None:
        refuse((not 0.0 <= fraction <= 1.0, flag, fraction, "Use a fraction in [0, 1], e.g. 0.05"),
               (args.long_document_policy != "truncate", flag, fraction, "It limits what "
                f"truncation drops and --long-document-policy {args.long_document_policy} drops "
                "nothing; add --long-document-policy truncate"))
    balanced = args.sequence_packing_scheduler == "dp_balanced"
    refuse((args.packing_window < 1, "--packing-window", args.packing_window,
            "Give the number of documents packed together, e.g. 20000"),
           (balanced and bool(args.rampup_batch_size), "--sequence-packing-scheduler",
            "dp_balanced", "It deals whole global batches, which --rampup-batch-size resizes; "
            "drop one of the two"),
           (balanced and bool(args.dynamic_cp_sizes), "--sequence-packing-scheduler",
            "dp_balanced", "Dynamic CP deals its own turns per rank; drop one of the two"))
