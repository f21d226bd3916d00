"""Megatron-LM's data blends: which sources feed each split, with which weights, and the
blended order of their samples.

Megatron-LM's flags, Megatron-LM's semantics:

- ``--data-path [W1] P1 [W2] P2 ...`` (or the same list in ``--data-args-path FILE``): one
  blend; ``--split`` divides each source's documents into train / valid / test, in order.
- ``--train-data-path`` / ``--valid-data-path`` / ``--test-data-path`` (or
  ``--per-split-data-args-path FILE.json``, ``{"train": [...], "valid": [...], "test": [...]}``):
  one blend per split, each source's documents all in that split.
- Weights are normalised; without weights the sources weigh their sizes (rows). A split of
  ``N`` samples draws sample ``i`` from the source whose share of the first ``i`` samples lags
  its weight the most (megatron-core's ``build_blending_indices``), and each source serves its
  own rows epoch after epoch (`PackedRowDataset`).
"""

import json
import math

import numpy as np
import torch

from megatron.packed_training.data_paths import Blend, parse_blend

SPLITS = ("train", "valid", "test")


def blends_from_args(args) -> tuple[Blend | None, dict]:
    """``(blend of --data-path, {split: Blend})`` from Megatron-LM's data flags: the first is
    divided by ``--split``; the second holds the per-split blends (``--train-data-path`` and
    its siblings, or ``--per-split-data-args-path``). The fork also takes
    ``--valid-data-path`` beside ``--data-path``."""
    data = getattr(args, "data_path", None)
    if getattr(args, "data_args_path", None):
        with open(args.data_args_path) as stream:
            data = stream.read().split()
    if isinstance(data, str):
        data = [data]
    per_split = {}
    if getattr(args, "per_split_data_args_path", None):
        path = args.per_split_data_args_path
        try:
            with open(path) as stream:
                listed = json.load(stream)
            listed = {split: (v.split() if isinstance(v, str) else list(v))
                      for split, v in listed.items() if split in SPLITS and v}
        except (OSError, ValueError, AttributeError, TypeError) as err:
            raise ValueError(f"--per-split-data-args-path is wrong: {path}: {err}. Give a JSON "
                             'object {"train": [...], "valid": [...], "test": [...]}.') from None
        per_split = {split: parse_blend(v, f"--per-split-data-args-path {split}")
                     for split, v in listed.items()}
    for split in SPLITS:
        values = getattr(args, f"{split}_data_path", None)
        if values:
            values = [values] if isinstance(values, str) else values
            per_split[split] = parse_blend(values, f"--{split}-data-path")
    return (parse_blend(data, "--data-path") if data else None), per_split


class BlendedRows(torch.utils.data.Dataset):
    """``num_samples`` samples drawn from ``datasets`` by ``weights`` (normalised), in
    megatron-core's blended order: the same on every rank. Each dataset must hold at least
    the samples its weight asks (`samples_per_source`)."""

    def __init__(self, datasets: list, weights: list[float], num_samples: int):
        from megatron.core.datasets import helpers_cpp

        weights = np.asarray(weights, dtype=np.float64) / float(np.sum(weights))
        self.datasets, self.num_samples = datasets, num_samples
        self.dataset_index = np.zeros(num_samples, dtype=np.int16)
        self.sample_index = np.zeros(num_samples, dtype=np.int64)
        helpers_cpp.build_blending_indices(self.dataset_index, self.sample_index, weights,
                                           len(datasets), num_samples, False)

    def __len__(self) -> int:
        return self.num_samples

    def source_of(self, index: int) -> tuple[object, int]:
        return self.datasets[int(self.dataset_index[index])], int(self.sample_index[index])

    def __getitem__(self, index: int):
        dataset, sample = self.source_of(index)
        return dataset[sample]

    def real_positions(self, index: int) -> int:
        dataset, sample = self.source_of(index)
        return dataset.real_positions(sample)


def samples_per_source(weights: list[float], num_samples: int) -> list[int]:
    """Samples each source serves in a blend of ``num_samples`` (the blended order never asks
    a source for more than ``ceil(weight * num_samples) + 1``)."""
    total = float(sum(weights))
    return [math.ceil(w / total * num_samples) + 1 for w in weights]
