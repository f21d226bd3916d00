"""The data-file check the scripts run before importing anything heavy (arguments.py) and
again where the files are read (datasets/preflight.py, datasets/jsonl.py)."""

import os

# The data flags and their argparse destinations: one JSONL file each.
DATA_PATHS = (("--data-path", "data_path"), ("--valid-data-path", "valid_data_path"))


def check_data_path(path: str, flag: str = "--data-path / --valid-data-path") -> None:
    """ValueError naming ``flag`` and ``path`` unless ``path`` is an existing file."""
    if not os.path.exists(path):
        raise ValueError(
            f"{flag} is wrong: {path!r} does not exist. "
            f"Pass an existing pre-tokenized .jsonl file."
        )
    if not os.path.isfile(path):
        raise ValueError(
            f"{flag} is wrong: {path!r} is not a file. "
            f"Pass a single pre-tokenized .jsonl file, not a directory."
        )
