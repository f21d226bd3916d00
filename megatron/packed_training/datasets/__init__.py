"""Packed-sequence data pipeline: documents -> packed rows -> micro-batch dicts.

Reading order: `packing` (the row layout and the micro-batch contract), `jsonl` (pre-tokenized
input), `mock` (synthetic rows), `packed_row_dataset` and `sampler` (what a rank reads at which
step), `builder` (everything wired from the CLI arguments).
"""

from megatron.packed_training.datasets.builder import build_data_iterator, build_datasets, describe_packing
from megatron.packed_training.datasets.jsonl import read_jsonl_documents
from megatron.packed_training.datasets.mock import MockPackedDataset
from megatron.packed_training.datasets.packed_row_dataset import PackedRowDataset
from megatron.packed_training.datasets.packing import (
    PAD_TOKEN_ID,
    Document,
    PackedRow,
    PackingStats,
    collate_packed_rows,
)
from megatron.packed_training.datasets.row_plan import pack_documents
from megatron.packed_training.datasets.sampler import MicroBatchSampler

__all__ = [
    "PAD_TOKEN_ID",
    "Document",
    "MicroBatchSampler",
    "MockPackedDataset",
    "PackedRow",
    "PackedRowDataset",
    "PackingStats",
    "build_data_iterator",
    "build_datasets",
    "collate_packed_rows",
    "describe_packing",
    "pack_documents",
    "read_jsonl_documents",
]
