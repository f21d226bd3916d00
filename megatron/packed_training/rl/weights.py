"""In-place weight updates of a graphed policy: reference-model swaps and refits.

Every CUDA graph of the policy (training layer graphs, forward-only graphs) reads the model's
weights at the addresses they had at capture. So other weights enter the model only by
copying into the live tensors, never by replacing them: then every graph computes with the
new values on its next replay, exactly as an eager call would.

* `policy_weights(model_chunks)`: the live floating-point tensors by name (parameters and
  persistent buffers, e.g. an MoE router's expert bias; tied tensors once).
* `WeightStore`: a copy of them (a reference policy, another policy's weights), taken from
  the model (`WeightStore.snapshot`) or read from a Megatron-LM checkpoint
  (`WeightStore.from_checkpoint`: the model weights only, in this rank's shards).
* `load_weights(model_chunks, source)`: copy a store or a ``{name: tensor}`` mapping in
  (a refit from another copy); `swapped_weights(model_chunks, store)`: exchange the live
  weights with a store for the scope (the reference model's log-probs on the policy's
  graphs), and back.

Names are the unwrapped chunk's ``state_dict`` names (``decoder.layers.0.mlp.linear_fc1.
weight``), prefixed ``chunk<i>.`` when there are several chunks. All copies run on the
current stream, device to device where both sides are on the device; nothing syncs.
"""

import os
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Dict, Iterator, Mapping, Optional, Sequence, Union

import torch
from torch import Tensor

from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.utils import unwrap_model

from megatron.packed_training.hf.config import ConversionError
from megatron.packed_training.hf.torch_dist import checkpoint_folder as torch_dist_folder


def policy_weights(model_chunks: Sequence[torch.nn.Module]) -> Dict[str, Tensor]:
    """The model's live floating-point weights by name (module doc); a tensor reachable under
    two names (tied embeddings) is listed once, under its first."""
    chunks = list(model_chunks)
    named, seen = {}, set()
    for index, chunk in enumerate(chunks):
        prefix = f"chunk{index}." if len(chunks) > 1 else ""
        for name, value in unwrap_model(chunk).state_dict(keep_vars=True).items():
            if not torch.is_tensor(value) or not value.is_floating_point():
                continue  # e.g. TE's _extra_state
            if id(value) in seen:
                continue
            seen.add(id(value))
            named[prefix + name] = value
    return named


@dataclass
class WeightStore:
    """A copy of a policy's weights: ``tensors`` by name, shapes and dtypes of the live ones."""

    tensors: Dict[str, Tensor]

    @classmethod
    def snapshot(cls, model_chunks: Sequence[torch.nn.Module],
                 device: Optional[torch.device] = None) -> "WeightStore":
        """The model's current weights, copied (to ``device``; default: where they are).
        A store on the host costs no GPU memory; swapping with it copies over PCIe."""
        with torch.no_grad():
            return cls({name: value.detach().to(device or value.device, copy=True)
                        for name, value in policy_weights(model_chunks).items()})

    @classmethod
    def from_checkpoint(cls, path: Union[str, os.PathLike],
                        model_chunks: Sequence[torch.nn.Module],
                        device: Optional[torch.device] = None) -> "WeightStore":
        """The model weights of the Megatron-LM checkpoint at ``path`` (torch_dist format: a
        ``--save`` folder, as ``load`` takes it, or one of its ``iter_*`` / ``release``
        folders), as this rank's shards of ``model_chunks``: the names, shapes and dtypes of
        `policy_weights`, on ``device`` (default: where each live weight is).

        megatron-core's ``dist_checkpointing.load`` reads the model's sharded state dict into
        new tensors, so a checkpoint saved at any tensor, pipeline or expert parallel layout
        loads; the optimizer state is not read, the live weights are untouched and no second
        model is built. Collective: every rank of the model calls it (the load checks the
        shards over all ranks). Raises ValueError, on every rank before the load, where
        ``path`` is no torch_dist checkpoint or holds another model (`checkpoint_folder`,
        `check_checkpoint_model`)."""
        folder = checkpoint_folder(path)
        requests = checkpoint_requests(model_chunks, folder, device)
        check_checkpoint_model(path, folder, requests)
        loaded = dist_checkpointing.load(requests, folder)
        return cls({name: loaded[key][local]
                    for name, (_, key, local) in _chunk_names(model_chunks).items()})

    def __len__(self) -> int:
        return len(self.tensors)


def _matched(live: Dict[str, Tensor], source: Mapping[str, Tensor]) -> None:
    """Raise unless ``source`` holds exactly the live names, each of the live shape."""
    missing = sorted(set(live) - set(source))
    extra = sorted(set(source) - set(live))
    if missing or extra:
        raise ValueError(f"weights are wrong: missing {_first(missing)}, unexpected "
                         f"{_first(extra)}. Give every weight of policy_weights(model), by its "
                         f"name (WeightStore.snapshot of a model built from the same config).")
    for name, value in live.items():
        given = source[name]
        if not torch.is_tensor(given) or tuple(given.shape) != tuple(value.shape):
            shown = tuple(given.shape) if torch.is_tensor(given) else type(given).__name__
            raise ValueError(f"weight {name} is wrong: shape {shown}, the model's is "
                             f"{tuple(value.shape)}. Give weights of the same model config and "
                             f"parallel layout (this rank's shard).")


def _first(names: list, shown: int = 4) -> str:
    return str(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def load_weights(model_chunks: Sequence[torch.nn.Module],
                 source: "WeightStore | Mapping[str, Tensor]") -> None:
    """Copy ``source`` into the model's live weights, in place (dtype converted as
    ``copy_`` does). Graph addresses stay valid. The optimizer's own copies (fp32 main
    parameters) are the caller's: `PackedPolicy.load_weights` reloads them."""
    live = policy_weights(model_chunks)
    tensors = source.tensors if isinstance(source, WeightStore) else source
    _matched(live, tensors)
    with torch.no_grad():
        for name, value in live.items():
            _copy(value, tensors[name])


@contextmanager
def swapped_weights(model_chunks: Sequence[torch.nn.Module],
                    store: WeightStore) -> Iterator[None]:
    """Within the scope the model holds ``store``'s weights and ``store`` the model's; both
    are exchanged back on exit (also on an error). In place: graphs replay with the swapped
    weights. One temporary per tensor, freed as it goes."""
    live = policy_weights(model_chunks)
    _matched(live, store.tensors)
    _exchange(live, store.tensors)
    try:
        yield
    finally:
        _exchange(live, store.tensors)


def _exchange(live: Dict[str, Tensor], stored: Dict[str, Tensor]) -> None:
    with torch.no_grad():
        for name, value in live.items():
            other = stored[name]
            held = value.detach().clone()
            _copy(value, other)
            _copy(other, held)


def _copy(destination: Tensor, source: Tensor) -> None:
    # Asynchronous only device to device: a copy to pageable host memory must finish before
    # its source (a temporary) is freed.
    destination.copy_(source, non_blocking=destination.device == source.device)


# -- checkpoints ---------------------------------------------------------------------------------

def checkpoint_folder(path: Union[str, os.PathLike]) -> str:
    """The torch_dist folder of the Megatron-LM checkpoint at ``path`` (`hf.torch_dist.
    checkpoint_folder`: ``path`` itself, or the folder its tracker names). Raises ValueError
    naming ``path``, what it holds instead and the fix."""
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"checkpoint path is wrong: {path!r}. Give the folder of a Megatron-LM "
                         f"checkpoint (str or os.PathLike).")
    try:
        return torch_dist_folder(path, fix="give the folder PackedPolicy.save or a training "
                                           "run's --save wrote (or one of its iter_* folders)")
    except ConversionError as error:
        raise ValueError(f"checkpoint path is wrong: {error}.") from None


def _chunk_names(model_chunks: Sequence[torch.nn.Module]) -> Dict[str, tuple]:
    """{`policy_weights` name: (chunk index, the chunk's key in Megatron-LM's checkpoint state
    dict: ``model``, or ``model<i>`` with several chunks, the name in the chunk)}."""
    chunks = list(model_chunks)
    if len(chunks) == 1:
        return {name: (0, "model", name) for name in policy_weights(chunks)}
    names = {}
    for name in policy_weights(chunks):
        prefix, local = name.split(".", 1)  # chunk<i>.
        index = int(prefix[len("chunk"):])
        names[name] = (index, f"model{index}", local)
    return names


def checkpoint_requests(model_chunks: Sequence[torch.nn.Module], folder: str,
                        device: Optional[torch.device] = None) -> dict:
    """The model's sharded state dict as Megatron-LM's load builds it for ``folder`` (the
    checkpoint's content metadata, this rank's data-parallel group), keyed as its checkpoints
    are (``model`` / ``model<i>``), cut to the `policy_weights` tensors, each request's data
    a new empty tensor on ``device`` (default: the live one's): dist_checkpointing loads into
    a request's data in place, and must not write the live weights."""
    metadata = dict(dist_checkpointing.load_content_metadata(folder) or {})
    metadata["dp_cp_group"] = parallel_state.get_data_parallel_group(with_context_parallel=True)
    chunks = list(model_chunks)
    sharded = {}  # by chunk index, built once
    requests: Dict[str, dict] = {}
    for index, key, local in _chunk_names(chunks).values():
        if index not in sharded:
            sharded[index] = unwrap_model(chunks[index]).sharded_state_dict(metadata=metadata)
        item = sharded[index].get(local)
        if not isinstance(item, (ShardedTensor, ShardedTensorFactory)):
            raise RuntimeError(f"the model's sharded_state_dict has no tensor {local} (a weight "
                               f"of policy_weights): megatron-core cannot read it from a "
                               f"checkpoint; its module's sharded_state_dict must list it.")
        fresh = torch.empty_like(item.data, device=device or item.data.device)
        requests.setdefault(key, {})[local] = replace(item, data=fresh)
    return requests


def check_checkpoint_model(path, folder: str, requests: dict) -> None:
    """Raise ValueError unless the checkpoint in ``folder`` holds every tensor ``requests``
    reads, each at the global shape the model's sharded state dict gives it (the whole
    tensor, layers stacked on a leading axis): else it holds another model. Reads the
    checkpoint's metadata only. Every rank raises where any does (each checks only its own
    shards, and a rank that went on would wait in the load's collectives): one
    ``all_gather_object`` where a process group is up, a host sync."""
    stored = dist_checkpointing.load_tensors_metadata(folder)
    problems: Dict[str, str] = {}  # by checkpoint key: layers share one
    for item in nested_values(requests):
        # A factory (fused SwiGLU fc1, Mamba's in_proj) stores the parts its build makes.
        parts = nested_values([item.build()]) if isinstance(item, ShardedTensorFactory) else [item]
        for tensor in parts:
            if not isinstance(tensor, ShardedTensor) or tensor.key in problems:
                continue
            found = stored.get(tensor.key)
            if found is None:
                problems[tensor.key] = f"{tensor.key} is not in it"
            elif tuple(found.global_shape) != tuple(tensor.global_shape):
                problems[tensor.key] = (f"{tensor.key} is {tuple(found.global_shape)} there, "
                                        f"{tuple(tensor.global_shape)} in this model")
    if torch.distributed.is_initialized():
        everyone = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(everyone, problems)
        problems = {key: why for each in everyone for key, why in each.items()}
    if problems:
        shown = "; ".join(list(problems.values())[:3])
        more = f" and {len(problems) - 3} more" if len(problems) > 3 else ""
        raise ValueError(f"checkpoint path is wrong: {os.fspath(path)} holds another model: "
                         f"{shown}{more}. Give a checkpoint of this model's config (the "
                         f"policy's training config: layers, sizes, vocabulary); any tensor, "
                         f"pipeline or expert parallel layout loads.")
