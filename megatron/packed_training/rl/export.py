"""Weights for an inference engine: the policy's live weights under Hugging Face names and in
the Hugging Face layout of its family, one whole tensor at a time, for the refit of a rollout
engine that loads Hugging Face checkpoints (vLLM, SGLang; docs/rl.md, "Weights for an
inference engine").

    for name, tensor in export_weights(policy.model, "qwen3-converted"):  # a config.json folder
        ...                                      # hand (name, tensor) to the engine

The names and layouts are the offline converter's (`tools/convert_hf.py export`): the same
family tables (hf/families/*.py: `mapping.Rule`s and their hf/transforms.py transforms) and the
same function per tensor, `mapping.hf_tensors`, run in the export direction. Only the source
differs: `convert.export_hf` reads each Megatron tensor from a torch_dist checkpoint, this
module puts it together from the live parameters of every rank.

Where each rank's tensors belong comes from megatron-core itself: the model's sharded state
dict (what a checkpoint save writes) gives every local tensor its checkpoint key (the names the
family tables use) and its offset in the global tensor, which carries the tensor-parallel
partition dimension (``partition_dim``, swapped halves of a SwiGLU fc1 and Mamba's in_proj
sections included), the routed expert's global index (expert-parallel rank x local experts)
and the layer's global number (the pipeline stage's layer offset). One piece at a time (one
layer's or one expert's tensor):

1. on the pipeline stage (and expert-parallel rank) that holds the piece, one all-gather over
   the tensor-parallel group (routed experts: the expert tensor-parallel group) joins its
   parts; a piece every rank holds whole (norms, TP = 1) is used where it lies;
2. a routed expert is broadcast over the expert-parallel group from the rank that holds it;
3. under pipeline parallelism the piece is broadcast over the pipeline group from its stage.

So every rank yields every pair, in the same order; a single process is the case where every
group has one rank and no collective runs. Each rank of a model replica takes part in the
collectives of every piece: all ranks iterate the export to its end, together.
"""

import dataclasses
import itertools
import math
import os
from dataclasses import dataclass
from typing import Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from megatron.core.utils import unwrap_model

from megatron.packed_training.hf.config import ConversionError, HFConfig
from megatron.packed_training.hf.convert import CONTENT_METADATA, FLAGS_FILE
from megatron.packed_training.hf.families import describe, supported_model_types
from megatron.packed_training.hf.mapping import (
    EXPERT,
    Converted,
    ModelMapping,
    Piece,
    TensorEntry,
    export_groups,
    export_layout,
    hf_tensors,
    with_dims,
)

HFSource = Union[str, os.PathLike, HFConfig, Mapping, Converted, ModelMapping]
Pair = Tuple[str, Tensor]
EMBEDDING = "embedding.word_embeddings.weight"
HOLDER = "the policy's model"
FIX = ("give the config.json of the model the policy was built from (PolicyConfig.hf_config, "
       "or export_weights' second argument)")


# -- the family ---------------------------------------------------------------------------------

def hf_mapping(source: HFSource) -> ModelMapping:
    """The family's mapping table of ``source``: a folder holding the model's config.json (the
    converter's import output or the Hugging Face folder), an `HFConfig`, a config.json
    mapping, a family's `Converted` or its `ModelMapping`. Raises `ConversionError` (a
    ValueError) for a family the converter does not know, naming the model_type and the
    families it maps."""
    if isinstance(source, ModelMapping):
        return source
    if isinstance(source, Converted):
        return source.mapping
    if isinstance(source, (str, os.PathLike)):
        source = HFConfig.from_folder(source)
    elif isinstance(source, Mapping):
        source = HFConfig(dict(source))
    if not isinstance(source, HFConfig):
        raise ValueError(f"the Hugging Face config is wrong: a {type(source).__name__}. Give a "
                         f"folder holding config.json, its contents as a dict, an HFConfig, or "
                         f"a family's Converted / ModelMapping (megatron.packed_training.hf).")
    return describe(source).mapping


def policy_family(hf_config, args, model: str) -> Optional[Converted]:
    """The Hugging Face family of a policy (`PolicyConfig`): the config.json in ``hf_config``
    (a folder) or, unset, in the converted checkpoint the training config starts from
    (``pretrained_checkpoint`` or ``load``, where `tools/convert_hf.py import` wrote it beside
    megatron_flags.txt); None where there is neither (the policy exports nothing). Raises
    ValueError, before anything is built, for a family the converter does not map or one that
    another model than ``model`` ("gpt" / "hybrid") builds."""
    where = "PolicyConfig.hf_config"
    folder = os.fspath(hf_config) if hf_config is not None else None
    if folder is None:
        for name in ("pretrained_checkpoint", "load"):
            value = getattr(args, name, None)
            if value and all(os.path.isfile(os.path.join(value, f))
                             for f in ("config.json", FLAGS_FILE)):
                folder, where = os.fspath(value), f"the training config's {name}"
                break
        else:
            return None
    try:
        converted = describe(HFConfig.from_folder(folder))
    except ConversionError as err:
        raise ValueError(
            f"{where} is wrong: {folder}: {str(err).rstrip('.')}. export_weights maps the "
            f"converter's families ({', '.join(supported_model_types())}): give hf_config the "
            f"config.json folder of such a model (tools/convert_hf.py import writes one); "
            f"without one (and without a converted checkpoint to start from) the policy "
            f"trains without export_weights.") from None
    wanted = "hybrid" if converted.script == "pretrain_mamba.py" else "gpt"
    if wanted != model:
        raise ValueError(f"PolicyConfig.model is wrong: {model!r}. {where} ({folder}) is a "
                         f"{converted.family} model, which {converted.script} builds: use "
                         f"model={wanted!r}.")
    return converted


# -- the export ---------------------------------------------------------------------------------

def export_weights(model_chunks: Sequence[torch.nn.Module], hf_config: HFSource, *,
                   bucket_bytes: Optional[int] = None
                   ) -> Union[Iterator[Pair], Iterator[List[Pair]]]:
    """The model's live weights as the Hugging Face tensors of its family: an iterator of
    ``(hf_name, tensor)`` or, with ``bucket_bytes``, of lists of such pairs of about that many
    bytes each (a list closes before the tensor that would take it past ``bucket_bytes``; a
    larger tensor is a list of its own).

    ``model_chunks``: the policy's chunks (DDP / Float16Module wrapped or not); ``hf_config``:
    where its family comes from (`hf_mapping`). Every Hugging Face tensor of the model comes
    exactly once (a tied model's lm_head is its embedding: not repeated, as its checkpoint
    files hold it once), whole (tensor, expert and pipeline parallel parts gathered: module
    doc), in the parameters' dtype, on their device, its vocabulary rows cut to config.json's
    ``vocab_size``. No host round trip and no copy of the model: one tensor (or one bucket)
    is put together as it is asked for; beyond the bucket, the peak is about twice the
    largest tensor (a gather buffer and the tensor put together from it). A tensor whose
    layout is the parameter's (the whole parameter on this rank) is the live parameter
    itself, detached: use it before the next `train_step` or `load_weights` changes it, or
    clone it. Host syncs: the layout exchange in this call (the chunks' sharded state dicts,
    an object all-gather over the model- and expert-parallel groups); none per tensor (device
    collectives on the current stream).

    Every rank returns the same pairs, in the same order, and every rank of the model's
    parallel groups must iterate to the end, together (each tensor's gather is a collective);
    a rank that needs nothing (no engine beside it) iterates and drops them. The layout
    exchange runs in this call, so a model that does not fit ``hf_config`` raises
    `ConversionError` here, on every rank.
    """
    if bucket_bytes is not None and (isinstance(bucket_bytes, bool)
                                     or not isinstance(bucket_bytes, int) or bucket_bytes <= 0):
        raise ValueError(f"bucket_bytes is wrong: {bucket_bytes!r}. Give a positive number of "
                         f"bytes (e.g. 1 << 30), or None for one tensor at a time.")
    export = LiveExport(list(model_chunks), hf_mapping(hf_config))
    pairs = export.pairs()
    return pairs if bucket_bytes is None else buckets(pairs, bucket_bytes)


def buckets(pairs: Iterable[Pair], bucket_bytes: int) -> Iterator[List[Pair]]:
    """``pairs`` in lists of at most ``bucket_bytes`` bytes (a larger tensor alone)."""
    bucket, size = [], 0
    for name, tensor in pairs:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


@dataclass(frozen=True)
class Part:
    """A rank's part of a piece: its offset in the piece's tensor and its shape."""

    offset: Tuple[int, ...]
    shape: Tuple[int, ...]


@dataclass(frozen=True)
class Holder:
    """A rank holding parts of a piece: where (``owner``: its pipeline stage, and for routed
    experts its expert-parallel rank), its rank in the gather group (tensor parallel, or expert
    tensor parallel) and its parts, in the order it sends them."""

    owner: Tuple[int, ...]
    rank: int
    parts: Tuple[Part, ...]


@dataclass(frozen=True)
class Groups:
    """This rank's process groups and its rank in each (None and 0 in a single process)."""

    tp: object = None
    pp: object = None
    ep: object = None
    etp: object = None
    model: object = None   # tensor x pipeline parallel: every dense piece
    experts: object = None  # expert tensor x expert x pipeline parallel: every routed expert

    @classmethod
    def current(cls) -> "Groups":
        from megatron.core import parallel_state as ps

        if not (torch.distributed.is_initialized() and ps.model_parallel_is_initialized()):
            return cls()
        return cls(tp=ps.get_tensor_model_parallel_group(),
                   pp=ps.get_pipeline_model_parallel_group(),
                   ep=ps.get_expert_model_parallel_group(),
                   etp=ps.get_expert_tensor_parallel_group(),
                   model=ps.get_model_parallel_group(),
                   experts=ps.get_expert_tensor_model_pipeline_parallel_group())

    def rank(self, name: str) -> int:
        group = getattr(self, name)
        return 0 if group is None else torch.distributed.get_rank(group)

    def size(self, name: str) -> int:
        group = getattr(self, name)
        return 1 if group is None else torch.distributed.get_world_size(group)


@dataclass(frozen=True)
class Local:
    """One tensor of this rank's sharded state dict: its key, global shape and offset, its local
    shape with megatron-core's prepended axes (size 1), dtype; ``data`` stays on this rank."""

    key: str
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    shape: Tuple[int, ...]
    dtype: torch.dtype
    data: Optional[Tensor] = None

    def described(self) -> "Local":
        return dataclasses.replace(self, data=None)


def local_tensors(model_chunks: Sequence[torch.nn.Module]) -> List[Local]:
    """Every tensor of the chunks' sharded state dicts (megatron-core's, as a checkpoint save
    builds them: factories applied; ``_extra_state`` objects left out), data detached."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    found = []
    for chunk in model_chunks:
        sharded = unwrap_model(chunk).sharded_state_dict(metadata=dict(CONTENT_METADATA))
        apply_factories(sharded)
        for value in nested_values(sharded):
            if not isinstance(value, ShardedTensor):
                continue
            if value.flattened_range is not None or value.data is None:
                raise ConversionError(f"{value.key}: a flattened or empty shard in the model's "
                                      f"sharded state dict; export_weights reads whole local "
                                      f"tensors")
            shape = (1,) * value.prepend_axis_num + tuple(value.data.shape)
            found.append(Local(value.key, tuple(value.global_shape), tuple(value.global_offset),
                               shape, value.data.dtype, value.data.detach()))
    return found


def _parts(local: Local, entry: TensorEntry):
    """(piece index, `Part`, the part's data or None) for each layer / expert of the piece
    tensors ``local`` covers (its offset on the stacked axes, then within the piece)."""
    stacked = len(entry.stacked_axes)
    start, count = local.global_offset[:stacked], local.shape[:stacked]
    part = Part(local.global_offset[stacked:], local.shape[stacked:])
    data = None if local.data is None else local.data.reshape(local.shape)
    for step in itertools.product(*(range(n) for n in count)):
        index = tuple(s + i for s, i in zip(start, step))
        yield index, part, (None if data is None else data[step])


class LiveExport:
    """One export of a model's live weights (`export_weights`): the layout exchange at
    construction, then `pairs` gathers and converts one piece at a time."""

    def __init__(self, model_chunks: Sequence[torch.nn.Module], mapping: ModelMapping):
        self.groups = groups = Groups.current()
        mine = local_tensors(model_chunks)
        self.device = mine[0].data.device if mine else torch.device(
            "cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        coords = {"dense": ((groups.rank("pp"),), groups.rank("tp")),
                  "expert": ((groups.rank("pp"), groups.rank("ep")), groups.rank("etp"))}
        payload = (coords, [local.described() for local in mine])
        dense = self._exchange(payload, groups.model)
        experts = self._exchange(payload, groups.experts)
        metadata = {local.key: (local.global_shape, local.dtype)
                    for _, described in dense + experts for local in described}
        rows = metadata.get(EMBEDDING, ((0,), None))[0][0]
        self.mapping, self.entries = export_layout(with_dims(mapping, padded_vocab_size=rows),
                                                   metadata, holder=HOLDER, fix=FIX)
        self.pieces = {(entry.key, piece.index): piece for entry in self.entries.values()
                       for piece in entry.pieces}
        unmapped = sorted(set(metadata) - set(self.entries))
        if unmapped:
            raise ConversionError(
                f"{HOLDER} has {len(unmapped)} tensors the family's mapping does not export, "
                f"e.g. {', '.join(unmapped[:3])}: an engine refit would keep stale values; "
                f"{FIX}")
        self.coords = coords
        self.holders = {False: self._holders(dense, expert=False),
                        True: self._holders(experts, expert=True)}
        self.mine: dict = {}
        for local in mine:
            for index, part, data in _parts(local, self.entries[local.key]):
                self.mine.setdefault((local.key, index), []).append((part, data))
        for entry in self.entries.values():
            for piece in entry.pieces:
                self._check(entry, piece)

    @staticmethod
    def _exchange(payload, group) -> list:
        """Every rank's payload in ``group`` (a single process: this rank's)."""
        if group is None or torch.distributed.get_world_size(group) == 1:
            return [payload]
        gathered = [None] * torch.distributed.get_world_size(group)
        torch.distributed.all_gather_object(gathered, payload, group=group)
        return gathered

    def _holders(self, payloads: list, expert: bool) -> dict:
        """{(key, piece index): [`Holder`]} of the pieces of one kind (routed experts or not)."""
        holders: dict = {}
        kind = "expert" if expert else "dense"
        for coords, described in payloads:
            owner, rank = coords[kind]
            parts: dict = {}
            for local in described:
                entry = self.entries[local.key]
                for index, part, _ in _parts(local, entry):
                    if (self._piece(local.key, index).rule.scope == EXPERT) == expert:
                        parts.setdefault((local.key, index), []).append(part)
            for piece_id, found in parts.items():
                holders.setdefault(piece_id, []).append(Holder(owner, rank, tuple(found)))
        return holders

    def _piece(self, key: str, index) -> Piece:
        piece = self.pieces.get((key, index))
        if piece is None:
            raise ConversionError(f"{HOLDER} has {key} at {index}, which the family's layout "
                                  f"has not; {FIX}")
        return piece

    def _owners(self, entry: TensorEntry, piece: Piece) -> Tuple[tuple, list]:
        """The holding rank's place (lowest pipeline stage, then expert rank) and the parts
        each rank of its gather group holds there."""
        expert = piece.rule.scope == EXPERT
        holders = self.holders[expert].get((entry.key, piece.index))
        if not holders:
            raise ConversionError(f"{HOLDER} has no {entry.key} {piece.index} on any rank; "
                                  f"{FIX}")
        owner = min(holder.owner for holder in holders)
        return owner, sorted({h.rank: h for h in holders if h.owner == owner}.values(),
                             key=lambda holder: holder.rank)

    def _check(self, entry: TensorEntry, piece: Piece) -> None:
        """The parts at the owner tile the piece, and each rank holds it whole or the group's
        ranks hold equal shares (one all-gather)."""
        _, holders = self._owners(entry, piece)
        if all(_whole(holder.parts, entry.shape) for holder in holders):
            return
        name = "etp" if piece.rule.scope == EXPERT else "tp"
        size = math.prod(entry.shape)
        unique = {(part.offset, part.shape) for holder in holders for part in holder.parts}
        shares = {sum(math.prod(part.shape) for part in holder.parts) for holder in holders}
        if ([holder.rank for holder in holders] != list(range(self.groups.size(name)))
                or len(shares) != 1 or sum(math.prod(shape) for _, shape in unique) != size):
            raise ConversionError(f"{entry.key} {piece.index}: its parts on the ranks do not "
                                  f"tile the {entry.shape} tensor in equal tensor-parallel "
                                  f"shares; export_weights cannot gather it")

    # -- per piece ----------------------------------------------------------------------------

    def pairs(self) -> Iterator[Pair]:
        for group in export_groups(self.entries.values()):
            whole = ((entry, piece, self._whole(entry, piece)) for entry, piece in group)
            yield from hf_tensors(whole, self.mapping.dims)

    def _whole(self, entry: TensorEntry, piece: Piece) -> Tensor:
        """The piece's whole Megatron tensor on this rank (module doc: gather, broadcasts)."""
        expert = piece.rule.scope == EXPERT
        owner, holders = self._owners(entry, piece)
        here = self.coords["expert" if expert else "dense"][0]
        tensor = None
        if here == owner:
            tensor = self._join(entry, piece, holders, "etp" if expert else "tp")
        if expert and here[0] == owner[0]:  # the stage's expert-parallel ranks
            tensor = self._broadcast(tensor, entry, "ep", owner[1])
        return self._broadcast(tensor, entry, "pp", owner[0])

    def _join(self, entry: TensorEntry, piece: Piece, holders: list, name: str) -> Tensor:
        """The piece from the parts of the gather group's ranks (this rank among them)."""
        parts = self.mine[(entry.key, piece.index)]
        for part, data in parts:
            if _whole((part,), entry.shape):  # where it lies: norms, TP = 1
                return data
        size = self.groups.size(name)
        if size == 1:  # all parts here: an fc1's halves, Mamba's sections
            joined = _adjacent(parts, entry.shape)
            return joined if joined is not None else _assemble(entry, parts)
        flat = torch.cat([data.reshape(-1) for _, data in parts]) if len(parts) > 1 \
            else parts[0][1].reshape(-1)
        gathered = torch.empty(size * flat.numel(), dtype=flat.dtype, device=flat.device)
        torch.distributed.all_gather_into_tensor(gathered, flat.contiguous(),
                                                 group=getattr(self.groups, name))
        received, position = [], 0
        for holder in holders:
            for part in holder.parts:
                count = math.prod(part.shape)
                received.append((part, gathered[position:position + count].view(part.shape)))
                position += count
        if _in_order(received, entry.shape):  # rank-major along dim 0: the buffer is it
            return gathered.view(entry.shape)
        return _assemble(entry, received)

    def _broadcast(self, tensor: Optional[Tensor], entry: TensorEntry, name: str,
                   source: int) -> Tensor:
        group = getattr(self.groups, name)
        if group is None or self.groups.size(name) == 1:
            return tensor
        if tensor is None:
            tensor = torch.empty(entry.shape, dtype=entry.dtype, device=self.device)
        tensor = tensor.contiguous()
        torch.distributed.broadcast(tensor, group=group, group_src=source)
        return tensor


def _whole(parts, shape) -> bool:
    """``parts`` hold the whole tensor of ``shape`` as one part."""
    return any(part.shape == tuple(shape) and not any(part.offset) for part in parts)


def _in_order(received, shape) -> bool:
    """The parts are consecutive rows of the tensor, in order, each with its other axes whole."""
    row = 0
    for part, _ in received:
        if part.offset[0] != row or any(part.offset[1:]) or part.shape[1:] != tuple(shape[1:]):
            return False
        row += part.shape[0]
    return row == shape[0]


def _adjacent(parts, shape) -> Optional[Tensor]:
    """The tensor the parts are consecutive rows of, in one storage one after the other (the
    halves of an fc1, Mamba's in_proj sections: views of one parameter), as a view; else
    None."""
    parts = sorted(parts, key=lambda part: part[0].offset)
    if not _in_order(parts, shape) or not all(data.is_contiguous() for _, data in parts):
        return None
    first = parts[0][1]
    step = first.element_size()
    for (_, before), (_, after) in zip(parts, parts[1:]):
        if (after.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or after.data_ptr() != before.data_ptr() + before.numel() * step):
            return None
    return first.as_strided(shape, torch.empty(shape, device="meta").stride(),
                            first.storage_offset())


def _assemble(entry: TensorEntry, received) -> Tensor:
    """A new tensor of the piece with every part copied to its place."""
    _, first = received[0]
    tensor = torch.empty(entry.shape, dtype=first.dtype, device=first.device)
    for part, data in received:
        tensor[tuple(slice(o, o + n) for o, n in zip(part.offset, part.shape))].copy_(data)
    return tensor
