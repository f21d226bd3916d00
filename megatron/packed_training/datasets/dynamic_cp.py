"""Dynamic-CP data: packed micro-batches that each carry a CP size, and each rank's turns.

A micro-batch of CP size ``c`` is one `PackedRow` of ``c * N`` positions (``N`` = tokens per
rank), packed by `megatron.packed_model.dynamic_cp.pack_for_dynamic_cp` with every document
padded to a multiple of ``2 * c``. An iteration takes ``--global-batch-size`` of them; every
rank reads the same ones, places them on the data x context parallel ranks with
`schedule_cp_rounds`, and runs only its own turns (`DynamicCPBatches`).
"""

from collections import Counter
from dataclasses import replace
from typing import Iterable, List, Sequence

import torch

from megatron.packed_model.dynamic_cp import pack_for_dynamic_cp, schedule_cp_rounds, turns_of_rank
from megatron.packed_training.datasets.packing import (
    Document,
    PackedRow,
    PackingStats,
    admit_document,
    collate_packed_rows,
    resolve_long_document_policy,
)
from megatron.packed_training.datasets.row_plan import pack_documents


def pack_rows_for_dynamic_cp(documents: Iterable[Document], cp_sizes: Sequence[int],
                             tokens_per_rank: int, *, long_document_policy: str | None = None,
                             reject_long_documents: bool = False,
                             stats: PackingStats | None = None) -> List[PackedRow]:
    """Pack documents, in order, into dynamic-CP rows (`PackedRow.cp_size` set).

    Documents with fewer than 2 tokens are skipped; one longer than the largest size holds
    (``max(cp_sizes) * tokens_per_rank`` positions) follows ``long_document_policy``
    (`admit_lengths`: split into pieces of that size by default, or truncated to it, or a
    ValueError under ``reject``). Host only.
    """
    policy = resolve_long_document_policy(long_document_policy, reject_long_documents)
    stats = stats if stats is not None else PackingStats()
    longest = max(cp_sizes) * tokens_per_rank
    kept = []
    for document in documents:
        kept += admit_document(
            document, longest, policy=policy, stats=stats,
            too_long=lambda n, origin=document.origin: (
                f"document length is wrong: {origin} has {n - 1} training positions, more "
                f"than the largest CP size holds ({max(cp_sizes)} x {tokens_per_rank} = "
                f"{longest}). Use --long-document-policy split (pieces of {longest}) or "
                f"truncate, or add a larger --dynamic-cp-sizes entry."))
    plan = pack_for_dynamic_cp([len(d.input_ids) - 1 for d in kept], cp_sizes, tokens_per_rank)
    rows = []
    for micro_batch in plan:
        size = micro_batch.cp_size
        # The plan fitted these documents into one row of this size: the packer agrees.
        (row,) = pack_documents([kept[i] for i in micro_batch.documents], size * tokens_per_rank,
                                segment_multiple=2 * size, stats=stats)
        rows.append(replace(row, cp_size=size))
    return rows


class DynamicCPBatches:
    """This rank's micro-batches, one training iteration per ``next()``.

    Iteration ``k`` reads samples ``[consumed + k * gbs, consumed + (k + 1) * gbs)`` of
    ``dataset`` (`PackedRow` s with their ``cp_size``), places them with
    `schedule_cp_rounds` over ``num_ranks`` data x context parallel ranks and returns the
    collated micro-batches of ``rank``'s turns, in round order, each with its ``cp_turn``
    (and, for the log, the iteration's size mix, round count and positions).
    ``global_batch_size >= num_ranks`` gives every rank at least one turn. ``cycle``
    (validation) restarts at sample 0 instead of stopping.
    """

    def __init__(self, dataset, consumed_samples: int, global_batch_size: int, rank: int,
                 num_ranks: int, cycle: bool = False):
        if global_batch_size < num_ranks or len(dataset) < global_batch_size:
            raise ValueError(
                f"global batch size is wrong: {global_batch_size} micro-batches for "
                f"{num_ranks} ranks and {len(dataset)} samples. Under dynamic CP it must be "
                f"at least the data-parallel size and at most the dataset.")
        self.dataset, self.consumed = dataset, consumed_samples
        self.global_batch_size, self.rank, self.num_ranks = global_batch_size, rank, num_ranks
        self.cycle = cycle

    def __iter__(self):
        return self

    def __next__(self) -> List[dict]:
        if self.consumed + self.global_batch_size > len(self.dataset):
            if not self.cycle:
                raise StopIteration
            self.consumed = 0
        rows = [self.dataset[i] for i in range(self.consumed, self.consumed + self.global_batch_size)]
        self.consumed += self.global_batch_size
        sizes = [row.cp_size for row in rows]
        rounds = schedule_cp_rounds(sizes, self.num_ranks)
        mix = " ".join(f"{size}x{count}" for size, count in sorted(Counter(sizes).items()))
        batches = []
        for turn in turns_of_rank(rounds, self.rank):
            batch = collate_packed_rows([rows[turn.micro_batch]])
            if torch.cuda.is_available():  # pinned: the forward step's copies are asynchronous
                batch = {k: v.pin_memory() if torch.is_tensor(v) else v for k, v in batch.items()}
            batches.append(batch | {"cp_turn": turn, "cp_mix": mix, "cp_rounds": len(rounds),
                                    "iteration_positions": sum(len(r.tokens) for r in rows)})
        return batches
