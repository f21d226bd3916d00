"""A Hugging Face ``config.json`` as the converters read it.

The same field has had several names: transformers 5.x writes ``rope_parameters``,
``num_local_experts`` and ``layers_block_type`` where checkpoints on the hub carry
``rope_theta`` + ``rope_scaling``, ``num_experts`` and ``hybrid_override_pattern``. `HFConfig`
reads either spelling, so a family's code asks for a value once.

Every refusal is a `ConversionError` naming the field, its value and what to do.
"""

import json
import os
from typing import Any


class ConversionError(ValueError):
    """A checkpoint or config the converter cannot turn into the fork's model (or back)."""


def refuse(field: str, value, why: str) -> None:
    """Raise the one error shape the converters use for a field the fork cannot build."""
    raise ConversionError(f"config.json field {field} is {value!r}: {why}.")


class HFConfig:
    """A ``config.json`` mapping with alias-aware reads (see module doc)."""

    def __init__(self, raw: dict, path: str = "config.json"):
        self.raw = dict(raw)
        self.path = path

    @classmethod
    def from_folder(cls, folder: str | os.PathLike) -> "HFConfig":
        path = os.path.join(os.fspath(folder), "config.json")
        if not os.path.isdir(folder):
            raise ConversionError(f"{folder} does not exist: the converter reads a local "
                                  "folder, never the hub (download the model first, e.g. "
                                  "`hf download ORG/MODEL --local-dir MODEL`)")
        if not os.path.isfile(path):
            raise ConversionError(f"{folder} has no config.json: pass a Hugging Face model "
                                  "folder (config.json, *.safetensors, tokenizer files)")
        with open(path) as f:
            return cls(json.load(f), path)

    @property
    def model_type(self) -> str:
        return self.raw.get("model_type", "")

    def get(self, *names: str, default: Any = None) -> Any:
        """The value of the first of ``names`` present (and not None), else ``default``."""
        for name in names:
            if self.raw.get(name) is not None:
                return self.raw[name]
        return default

    def require(self, *names: str) -> Any:
        value = self.get(*names)
        if value is None:
            raise ConversionError(f"{self.path} has no {' or '.join(names)}; it is needed to "
                                  f"build the {self.model_type} model")
        return value

    def rope_theta(self, default: float = 10000.0) -> float:
        """RoPE base: ``rope_theta`` (hub) or ``rope_parameters.rope_theta`` (transformers 5)."""
        params = self.raw.get("rope_parameters") or {}
        return float(self.get("rope_theta", default=params.get("rope_theta", default)))

    def rope_scaling(self) -> dict | None:
        """The RoPE scaling parameters with their type under ``rope_type`` (the hub's
        ``rope_scaling``, whose older files say ``type``, or transformers 5's
        ``rope_parameters``); None for plain RoPE."""
        scaling = self.raw.get("rope_scaling") or self.raw.get("rope_parameters") or {}
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind in (None, "default"):
            return None
        return {**scaling, "rope_type": kind}

    def tied_embeddings(self, default: bool = True) -> bool:
        """transformers ties the input and output embeddings unless the config says not."""
        return bool(self.raw.get("tie_word_embeddings", default))
