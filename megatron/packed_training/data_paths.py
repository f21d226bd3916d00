"""The data-path check the scripts run before importing anything heavy (arguments.py), and
Megatron-LM's blend lists (``[W1] P1 [W2] P2 ...``) that the data flags take."""

import math
import os
from dataclasses import dataclass

# The data flags and their argparse destinations: each takes a blend of sources.
DATA_PATHS = (("--data-path", "data_path"), ("--train-data-path", "train_data_path"),
              ("--valid-data-path", "valid_data_path"), ("--test-data-path", "test_data_path"))


@dataclass(frozen=True)
class Blend:
    """Sources of one blend and their weights (None: by size); ``flag`` names it in errors."""

    paths: tuple[str, ...]
    weights: tuple[float, ...] | None
    flag: str

    def __str__(self) -> str:
        if self.weights is None:
            return " ".join(self.paths)
        return " ".join(f"{w:g} {p}" for w, p in zip(self.weights, self.paths))


def _weight(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def parse_blend(values, flag: str) -> Blend:
    """``["0.3", "A", "0.7", "B"]`` or ``["A", "B"]`` (or one string) as a `Blend`; ValueError
    naming ``flag`` when weights and paths do not alternate, or a weight is negative, not
    finite, or all are 0."""
    values = [values] if isinstance(values, str) else values
    values = [str(v).strip() for v in values if str(v).strip()]
    if not values:
        raise ValueError(f"{flag} is wrong: no path given. Give PATH, or W1 PATH1 W2 PATH2 ...")
    weights = [_weight(v) for v in values[::2]]
    if all(w is None for w in weights):
        return Blend(tuple(values), None, flag)
    if len(values) % 2 or None in weights or any(_weight(v) is not None for v in values[1::2]):
        raise ValueError(
            f"{flag} is wrong: {' '.join(values)!r} mixes weights and paths. Give paths alone "
            f"(P1 P2 ...) or a weight before every path (W1 P1 W2 P2 ...).")
    if any(w < 0 or not math.isfinite(w) for w in weights) or sum(weights) <= 0:
        raise ValueError(f"{flag} is wrong: weights {' '.join(values[::2])} must be finite, "
                         f">= 0 and not all 0. Give each source's share, e.g. 0.3 A 0.7 B.")
    return Blend(tuple(values[1::2]), tuple(weights), flag)


def is_indexed_prefix(path: str) -> bool:
    """Whether ``path`` names an indexed dataset (either half exists) rather than a file."""
    return os.path.exists(path + ".idx") or os.path.exists(path + ".bin")


def check_data_path(path: str, flag: str = "--data-path") -> None:
    """ValueError naming ``flag`` and ``path`` unless ``path`` is a file, a folder, or an
    indexed-dataset prefix whose index header is sound (`indexed.check_indexed_prefix`)."""
    for suffix in (".bin", ".idx"):
        if path.endswith(suffix) and os.path.exists(path[:-4] + (".idx" if suffix == ".bin"
                                                                 else ".bin")):
            raise ValueError(f"{flag} is wrong: {path!r} is one file of an indexed dataset. Give "
                             f"its prefix, {path[:-4]!r}, as Megatron-LM does.")
    if os.path.isfile(path) or os.path.isdir(path):
        return
    if is_indexed_prefix(path):
        from megatron.packed_training.datasets.indexed import check_indexed_prefix

        check_indexed_prefix(path, flag)
        return
    raise ValueError(
        f"{flag} is wrong: {path!r} does not exist. Pass a .jsonl file, a folder of .jsonl "
        f"files, or a Megatron-LM indexed-dataset prefix (PREFIX for PREFIX.bin + PREFIX.idx).")
