"""Megatron-LM torch_dist checkpoints, written tensor by tensor and read layer by layer.

Writing (`write_checkpoint`) produces what megatron-core's ``dist_checkpointing.save`` writes
for a sharded state dict (PyTorch Distributed Checkpoint files, one entry per ShardedTensor
key and per ShardedObject, the common state as the ``common_state`` object, and
``metadata.json``), but through a `SavePlanner` whose data are produced on demand: each
chunk is made (read from the Hugging Face shards, transformed) only when the writer reaches
it, and dropped once written. Peak host memory is one chunk plus what the producer caches,
not the model. It needs no process group and no GPU (megatron-core's own save synchronises
the CUDA device).

Reading (`read_tensors`) goes through megatron-core's ``dist_checkpointing.load``, one
request per call (a layer's tensors), so any Megatron-LM torch_dist checkpoint reads at any
TP / PP / EP it was saved at.
"""

import contextlib
import io
import os
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.packed_training.hf.config import ConversionError

TRACKER = "latest_checkpointed_iteration.txt"
RELEASE = "release"
COMMON_STATE_KEY = "common_state"  # megatron-core's ShardedObject for the common state


@dataclass
class Chunk:
    """A part of a stored tensor: its ``offsets`` in the global tensor, its ``shape`` and
    ``produce()``, called once when the writer reaches it (a tensor of ``shape``). Chunks are
    written in ascending ``order`` (stable): the importer orders them by layer, so the
    Hugging Face shards are read in their own order whatever the checkpoint keys' order."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    produce: Callable[[], Tensor]
    order: tuple = ()


@dataclass
class StoredTensor:
    """A ShardedTensor key of the checkpoint: global shape, dtype, chunks tiling it."""

    key: str
    global_shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: list


@dataclass
class StoredObject:
    """A ShardedObject (``key`` at ``offset`` of ``global_shape``) holding ``data``."""

    key: str
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    data: Any = None

    @property
    def unique_key(self) -> str:
        return ShardedObject(self.key, None, self.global_shape, self.offset).unique_key


def check_tiling(tensor: StoredTensor) -> None:
    """The chunks are alike, aligned to their own shape, in bounds, distinct and cover the
    tensor: together exactly one copy of every element."""
    shapes = {chunk.shape for chunk in tensor.chunks}
    offsets = [chunk.offsets for chunk in tensor.chunks]
    problem = None
    if len(shapes) != 1:
        problem = f"chunks of different shapes {sorted(shapes)}"
    else:
        (shape,) = shapes
        if len(shape) != len(tensor.global_shape):
            problem = f"chunk shape {shape} has another rank"
        elif any(o % s or o + s > g for offset in offsets
                 for o, s, g in zip(offset, shape, tensor.global_shape)):
            problem = "a chunk is out of bounds or off its grid"
        elif len(set(offsets)) != len(offsets):
            problem = "two chunks at one offset"
        elif len(offsets) * _volume(shape) != _volume(tensor.global_shape):
            problem = (f"{len(offsets)} chunks of {shape} do not cover "
                       f"{tensor.global_shape}")
    if problem:
        raise ValueError(f"checkpoint tensor {tensor.key}: {problem}")


def _volume(shape) -> int:
    volume = 1
    for size in shape:
        volume *= size
    return volume


def _object_bytes(data) -> io.BytesIO:
    # megatron-core stores the ShardedObjects of one key on a rank as a list (strategies/
    # torch.py) and reads them back with torch.load(weights_only=True).
    buffer = io.BytesIO()
    torch.save([data], buffer)
    buffer.seek(0)
    return buffer


class _StreamingPlanner(SavePlanner):
    """A SavePlanner over `StoredTensor` / `StoredObject` lists: the plan from their
    metadata, the data from ``produce()`` on demand (see module doc)."""

    def __init__(self, tensors: Sequence[StoredTensor], objects: Sequence[StoredObject]):
        self.tensors = {tensor.key: tensor for tensor in tensors}
        self.chunks = {(tensor.key, chunk.offsets): chunk
                       for tensor in tensors for chunk in tensor.chunks}
        self.objects = {obj.unique_key: obj for obj in objects}
        self.plan = None

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
        pass  # everything comes from the constructor

    def create_local_plan(self) -> SavePlan:
        items = [WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO)
                 for key in self.objects]
        chunks = sorted(((tensor, chunk) for tensor in self.tensors.values()
                         for chunk in tensor.chunks), key=lambda pair: pair[1].order)
        for tensor, chunk in chunks:
            items.append(WriteItem(
                index=MetadataIndex(tensor.key, torch.Size(chunk.offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(chunk.offsets),
                                               sizes=torch.Size(chunk.shape)),
                    properties=TensorProperties(dtype=tensor.dtype),
                    size=torch.Size(tensor.global_shape))))
        self.plan = SavePlan(items)
        return self.plan

    def create_global_plan(self, all_plans: list[SavePlan]):
        entries = {key: BytesStorageMetadata() for key in self.objects}
        for tensor in self.tensors.values():
            entries[tensor.key] = TensorStorageMetadata(
                properties=TensorProperties(dtype=tensor.dtype),
                size=torch.Size(tensor.global_shape),
                chunks=[ChunkStorageMetadata(offsets=torch.Size(chunk.offsets),
                                             sizes=torch.Size(chunk.shape))
                        for chunk in tensor.chunks])
        return all_plans, Metadata(state_dict_metadata=entries)

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        self.plan = new_plan
        return new_plan

    def resolve_data(self, write_item: WriteItem):
        index = write_item.index
        if write_item.type == WriteItemType.BYTE_IO:
            return _object_bytes(self.objects[index.fqn].data)
        chunk = self.chunks[(index.fqn, tuple(index.offset))]
        tensor = self.tensors[index.fqn]
        data = chunk.produce()
        if tuple(data.shape) != chunk.shape or data.dtype != tensor.dtype:
            raise ValueError(f"checkpoint tensor {index.fqn} at {tuple(index.offset)}: "
                             f"produced {tuple(data.shape)} {data.dtype}, planned "
                             f"{chunk.shape} {tensor.dtype}")
        return data.contiguous()


def write_checkpoint(directory: str | os.PathLike, tensors: Sequence[StoredTensor],
                     objects: Sequence[StoredObject], common_state: dict) -> None:
    """Write a torch_dist checkpoint into the empty (or new) ``directory``.

    ``common_state``: the non-sharded entries megatron-core keeps in the ``common_state``
    object (Megatron-LM's ``args``, ``checkpoint_version``, ``iteration``, the content
    metadata); values must load under ``torch.load(weights_only=True)``.
    """
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    for tensor in tensors:
        check_tiling(tensor)
    objects = [*objects, StoredObject(COMMON_STATE_KEY, (1,), (0,), common_state)]
    # One writer thread and no copy-ahead: chunks are produced one at a time, in order.
    writer = dcp.FileSystemWriter(directory, single_file_per_rank=True, thread_count=1,
                                  per_thread_copy_ahead=0)
    dcp.save({}, storage_writer=writer, planner=_StreamingPlanner(tensors, objects),
             no_dist=True)
    save_config(CheckpointingConfig("torch_dist", 1), directory)


def write_release_tracker(root: str | os.PathLike) -> str:
    """``latest_checkpointed_iteration.txt`` saying ``release``; returns the release folder."""
    root = os.fspath(root)
    with open(os.path.join(root, TRACKER), "w") as f:
        f.write(RELEASE)
    return os.path.join(root, RELEASE)


def checkpoint_folder(root: str | os.PathLike,
                      fix: str = "pass a training run's --save folder or one of its iter_* "
                                 "folders") -> str:
    """The torch_dist folder of the Megatron-LM checkpoint at ``root``: ``root`` itself where
    it is one (it holds metadata.json), else the folder its tracker names (``iter_0001000`` or
    ``release``), as Megatron-LM's ``--load`` picks it. Raises `ConversionError` (a ValueError)
    saying what ``root`` holds instead, ending in ``fix`` where the fix is to name another
    folder."""
    root = os.fspath(root)
    if os.path.isfile(os.path.join(root, "metadata.json")):
        return root
    if not os.path.isdir(root):
        raise ConversionError(f"{root} is not a folder: {fix}")
    tracker = os.path.join(root, TRACKER)
    if not os.path.isfile(tracker):
        hint = ("it is a Hugging Face folder: convert it with `import`"
                if os.path.isfile(os.path.join(root, "config.json"))
                and any(name.endswith(".safetensors") for name in os.listdir(root)) else fix)
        raise ConversionError(f"{root} is not a Megatron-LM checkpoint (it has neither "
                              f"{TRACKER} nor metadata.json): {hint}")
    with open(tracker) as f:
        mark = f.read().strip()
    if mark != RELEASE and not mark.isdigit():
        raise ConversionError(f"{tracker} says {mark!r}, neither an iteration nor {RELEASE!r}: "
                              f"the checkpoint is damaged; {fix}")
    folder = os.path.join(root, RELEASE if mark == RELEASE else f"iter_{int(mark):07d}")
    if not os.path.isfile(os.path.join(folder, "metadata.json")):
        held = os.listdir(folder) if os.path.isdir(folder) else []
        what = ("holds a checkpoint of --ckpt-format torch (mp_rank_* folders)"
                if any(name.startswith("mp_rank_") for name in held) else
                "is not a torch_dist checkpoint folder (no metadata.json)")
        raise ConversionError(f"{folder} (named by {tracker}) {what}. Model weights are read "
                              f"from torch_dist checkpoints: save with --ckpt-format "
                              f"torch_dist, Megatron-LM's default")
    return folder


@contextlib.contextmanager
def single_process_group():
    """A one-process gloo world for megatron-core's dist_checkpointing calls, unless one is
    already initialised (then that one is used and left alone)."""
    if torch.distributed.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory() as tmp:
        torch.distributed.init_process_group("gloo", init_method=f"file://{tmp}/store",
                                             rank=0, world_size=1)
        try:
            yield
        finally:
            torch.distributed.destroy_process_group()


def tensor_metadata(folder: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{key: (global shape, dtype)} of every ShardedTensor in a torch_dist folder."""
    return {key: (tuple(tensor.global_shape), tensor.dtype)
            for key, tensor in dist_checkpointing.load_tensors_metadata(folder).items()}


def common_state(folder: str) -> dict:
    return dist_checkpointing.load_common_state_dict(folder)


@dataclass(frozen=True)
class Request:
    """A tensor to read: ``key`` of ``global_shape``; ``index`` its position on the first
    ``len(index)`` (stacked) axes, each read one element wide."""

    key: str
    global_shape: tuple[int, ...]
    dtype: torch.dtype
    index: tuple[int, ...] = ()


def read_tensors(folder: str, requests: dict[str, Request]) -> dict[str, Tensor]:
    """{name: tensor} for ``requests`` ({name: Request}); each tensor without its stacked
    axes. Needs a process group (`single_process_group`)."""
    sharded = {}
    for name, request in requests.items():
        stacked = len(request.index)
        # The stacked axes are ordinary axes of size one here (not megatron-core's prepended
        # axes, whose legacy path expects a rank to hold every layer of the key).
        offsets = [(axis, position, request.global_shape[axis])
                   for axis, position in enumerate(request.index)]
        local = (1,) * stacked + tuple(request.global_shape[stacked:])
        sharded[name] = ShardedTensor.from_rank_offsets(
            request.key, torch.empty(local, dtype=request.dtype), *offsets, replica_id=0)
    loaded = dist_checkpointing.load(sharded, folder, validate_access_integrity=False)
    return {name: loaded[name].reshape(request.global_shape[len(request.index):])
            for name, request in requests.items()}
