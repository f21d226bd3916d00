"""Hugging Face safetensors checkpoints, read tensor by tensor and written shard by shard.

`HFReader` opens a model folder (``model.safetensors``, or the shards a
``model.safetensors.index.json`` names) and reads single tensors; at most ``open_files``
shards are open (memory-mapped) at a time, so reading a model in shard order keeps about one
shard resident. Shapes and dtypes come from the shard headers without reading data.

`HFWriter` writes ``model-0000K-of-0000N.safetensors`` shards of at most ``max_shard_bytes``
and their index, holding one shard's tensors at a time.
"""

import json
import os
from collections import OrderedDict
from contextlib import ExitStack

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from megatron.packed_training.hf.config import ConversionError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"  # a Megatron-LM checkpoint's


def _open(path: str):
    """``safe_open(path)``; a missing, truncated or damaged file is a `ConversionError` that
    names it (safetensors checks the header and the data's length when it opens a file)."""
    try:
        return safe_open(path, framework="pt")
    except FileNotFoundError:
        raise ConversionError(f"{path} does not exist: the checkpoint is incomplete; download "
                              "the model folder again") from None
    except (SafetensorError, OSError) as error:
        reason = " ".join(str(error).split())
        raise ConversionError(f"{path} is truncated or not a safetensors file ({reason}): "
                              "download it again") from None


class HFReader:
    """Tensors of a Hugging Face model folder by name (see module doc)."""

    def __init__(self, folder: str | os.PathLike, open_files: int = 2):
        self.folder = os.fspath(folder)
        index = os.path.join(self.folder, INDEX)
        if os.path.isfile(index):
            self.shard_of = _weight_map(index)
        elif os.path.isfile(os.path.join(self.folder, SINGLE)):
            with _open(os.path.join(self.folder, SINGLE)) as f:
                self.shard_of = {name: SINGLE for name in f.keys()}
        elif os.path.isfile(os.path.join(self.folder, MEGATRON_TRACKER)):
            raise ConversionError(f"{self.folder} is a Megatron-LM checkpoint, not a Hugging "
                                  "Face folder: convert it with `export`")
        else:
            raise ConversionError(f"{self.folder} has no {SINGLE} or {INDEX}: the converter "
                                  "reads safetensors checkpoints only (save the model with "
                                  "save_pretrained(..., safe_serialization=True))")
        self.shards = sorted(set(self.shard_of.values()))
        missing = [shard for shard in self.shards
                   if not os.path.isfile(os.path.join(self.folder, shard))]
        if missing:
            raise ConversionError(f"{index} names {len(missing)} shard file(s) that "
                                  f"{self.folder} lacks, e.g. {missing[0]}: download every "
                                  "file the index names")
        self._shard_numbers = {shard: number for number, shard in enumerate(self.shards)}
        self._open: OrderedDict = OrderedDict()
        self._open_files = open_files
        self._meta: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}

    def names(self) -> list[str]:
        return list(self.shard_of)

    def shard_number(self, name: str) -> int:
        """The position of ``name``'s shard among the checkpoint's shards (file order)."""
        return self._shard_numbers[self._lookup(name)]

    def _handle(self, shard: str):
        if shard in self._open:
            self._open.move_to_end(shard)
            return self._open[shard][1]
        while len(self._open) >= self._open_files:
            self._open.popitem(last=False)[1][0].close()
        files = ExitStack()
        handle = files.enter_context(_open(os.path.join(self.folder, shard)))
        self._open[shard] = (files, handle)
        return handle

    def _lookup(self, name: str) -> str:
        if name not in self.shard_of:
            raise ConversionError(f"{self.folder} has no tensor {name}; the checkpoint does "
                                  "not match its config.json")
        return self.shard_of[name]

    def meta(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        """(shape, dtype) from the shard header; no data read."""
        if name not in self._meta:
            shard = self._lookup(name)
            with _open(os.path.join(self.folder, shard)) as f:
                for key in f.keys():
                    if self.shard_of.get(key) == shard:
                        view = f.get_slice(key)
                        self._meta[key] = (tuple(view.get_shape()),
                                           _DTYPES[view.get_dtype()])
        return self._meta[name]

    def get(self, name: str) -> Tensor:
        return self._handle(self._lookup(name)).get_tensor(name)

    def close(self) -> None:
        while self._open:
            self._open.popitem()[1][0].close()


def _weight_map(index: str) -> dict[str, str]:
    """{tensor name: shard file} of a ``model.safetensors.index.json``."""
    try:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
        raise ConversionError(f"{index} is not a safetensors index (JSON with a weight_map "
                              "object): download it again") from None
    return dict(weight_map)


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
           "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class HFWriter:
    """Writes tensors into size-limited safetensors shards plus their index (module doc).
    `add` in any order; `close` names the shards and writes the index."""

    def __init__(self, folder: str | os.PathLike, max_shard_bytes: int = 5 * 10 ** 9):
        self.folder = os.fspath(folder)
        os.makedirs(self.folder, exist_ok=True)
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, Tensor] = {}
        self._pending_bytes = 0
        self._written: list[tuple[str, list[str]]] = []  # (temporary file, names)
        self.total_bytes = 0

    def add(self, name: str, tensor: Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.contiguous()
        self._pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        path = os.path.join(self.folder, f".shard-{len(self._written):05d}.tmp")
        save_file(self._pending, path, metadata={"format": "pt"})
        self._written.append((path, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[str]:
        """Write the last shard and the index; returns the shard file names."""
        if self._pending or not self._written:
            self._flush()
        count = len(self._written)
        if count == 1:
            os.replace(self._written[0][0], os.path.join(self.folder, SINGLE))
            return [SINGLE]
        weight_map, files = {}, []
        for number, (path, names) in enumerate(self._written, start=1):
            name = f"model-{number:05d}-of-{count:05d}.safetensors"
            os.replace(path, os.path.join(self.folder, name))
            weight_map.update({tensor: name for tensor in names})
            files.append(name)
        with open(os.path.join(self.folder, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": self.total_bytes},
                       "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
        return files
