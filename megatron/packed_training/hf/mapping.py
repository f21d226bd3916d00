"""Mapping tables (Hugging Face names <-> Megatron names) and the checkpoint layout they make.

A family (families/*.py) describes its model declaratively:

* `Rule`: one Megatron tensor, the Hugging Face tensors it is made of and the named
  `Transform` between them (transforms.py). Names are relative to their scope: the model
  (``embedding.word_embeddings.weight``), a layer (``self_attention.linear_qkv.weight``,
  Hugging Face ``model.layers.{layer}.self_attn.q_proj.weight``) or a routed expert of a
  layer (``mlp.experts.experts.linear_fc1.weight``, ``...experts.{expert}.gate_proj...``).
* `LayerKind`: the rules of one kind of layer, and the linear modules whose
  ``_extra_state`` entry megatron-core's checkpoint holds (empty for bf16 / fp32 training,
  but a loader asks for every one). Norms get one too (`norm_module`), as Transformer
  Engine's norms and the TE-free spec's (packed_model/providers.TELayoutNorm) save it; not
  Mamba's gated norm inside the mixer, mamba-ssm's module on every backend.
* `ModelMapping`: the model's rules, one `LayerKind` per layer, the number of routed experts
  and whether the checkpoint stacks layers; `Converted`: a family's reading of a config, its
  mapping and launch flags.

`checkpoint_layout` expands a mapping into what megatron-core's ``sharded_state_dict`` holds
at TP = PP = EP = 1 (the keys a torch_dist checkpoint stores): a GPT block whose layers are
all alike stores each name once with the layer as its first axis
(``decoder.layers.mlp.linear_fc1.weight`` ``[L, ...]``) and routed experts as the next axis;
a block with unlike layers (--moe-layer-freq as a list, every hybrid stack) stores one key per
layer (``decoder.layers.3.mlp.linear_fc1.weight``) with experts as the first axis. Full,
unsharded tensors under these keys load at any TP / PP / EP through dist_checkpointing,
which reads each rank's part.

The export direction, one function per step for both exporters (`convert.export_hf` reading a
torch_dist checkpoint, `rl.export.export_weights` gathering a policy's live parameters):
`export_layout` (the layout as the source stores it), `export_groups` (pieces in export order,
by layer) and `hf_tensors` (each piece's whole Megatron tensor -> its Hugging Face tensors).
"""

import dataclasses
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

import torch
from torch import Tensor

from megatron.packed_training.hf.config import ConversionError
from megatron.packed_training.hf.transforms import IDENTITY, Dims, Transform

MODEL, LAYER, EXPERT = "model", "layer", "expert"
LAYER_PREFIX = "decoder.layers."


@dataclass(frozen=True)
class Rule:
    """One Megatron tensor (``megatron``, relative to ``scope``) made of the Hugging Face
    tensors ``hf`` (``{layer}`` / ``{expert}`` filled in per layer / expert) by
    ``transform``."""

    megatron: str
    hf: tuple[str, ...]
    transform: Transform = IDENTITY
    scope: str = LAYER

    def __post_init__(self):
        if len(self.hf) != self.transform.arity:
            raise ValueError(f"rule {self.megatron}: {self.transform.name} takes "
                             f"{self.transform.arity} tensors, the rule names {len(self.hf)}")

    def hf_names(self, layer: int | None = None, expert: int | None = None) -> tuple[str, ...]:
        return tuple(name.format(layer=layer, expert=expert) for name in self.hf)


def model_rule(megatron: str, *hf: str, transform: Transform = IDENTITY) -> Rule:
    return Rule(megatron, hf, transform, MODEL)


def layer_rule(megatron: str, *hf: str, transform: Transform = IDENTITY) -> Rule:
    return Rule(megatron, hf, transform, LAYER)


def expert_rule(megatron: str, *hf: str, transform: Transform = IDENTITY) -> Rule:
    return Rule(megatron, hf, transform, EXPERT)


@dataclass(frozen=True)
class LayerKind:
    """A kind of layer: its rules and its linear modules' ``_extra_state`` entries (per
    layer; ``expert_extra_states`` once per routed expert)."""

    name: str
    rules: tuple[Rule, ...]
    extra_states: tuple[str, ...] = ()
    expert_extra_states: tuple[str, ...] = ()

    @property
    def has_experts(self) -> bool:
        return bool(self.expert_extra_states) or any(rule.scope == EXPERT for rule in self.rules)

    def __add__(self, other: "LayerKind") -> "LayerKind":
        """Two halves of one layer (attention + MLP) as one kind."""
        return LayerKind(f"{self.name}+{other.name}", self.rules + other.rules,
                         self.extra_states + other.extra_states,
                         self.expert_extra_states + other.expert_extra_states)


@dataclass
class ModelMapping:
    """A whole model. ``stacked``: a GPT block of alike layers (see module doc)."""

    dims: Dims
    model_rules: tuple[Rule, ...]
    layers: Sequence[LayerKind]
    num_experts: int = 0
    stacked: bool = False
    model_extra_states: tuple[str, ...] = ()
    ignored: dict = field(default_factory=dict)
    """Hugging Face tensors deliberately left out: a regular expression (``re.search``) of
    their names -> why (printed by the converter)."""

    def __post_init__(self):
        if self.stacked and len({kind for kind in self.layers}) > 1:
            raise ValueError("a stacked checkpoint needs every layer of one kind")


@dataclass
class Converted:
    """What a family makes of a Hugging Face config (families/*.py ``describe``).

    ``script``: the entry script that builds the model (``pretrain_gpt.py`` or
    ``pretrain_mamba.py``); ``flags``: its model flags, in order (True: a bare flag); the
    converter adds the vocabulary and tokenizer flags. ``mapping``: the tensor mapping."""

    family: str
    script: str
    flags: dict
    mapping: ModelMapping
    notes: list = field(default_factory=list)


@dataclass(frozen=True)
class Piece:
    """One Megatron tensor of one layer (and expert): the Hugging Face tensors it is made of,
    and where it sits in its checkpoint key (``index``: its position on the stacked axes)."""

    rule: Rule
    hf: tuple[str, ...]
    layer: int | None
    index: tuple[int, ...]


@dataclass
class TensorEntry:
    """A checkpoint key: its global shape (stacked axes first), dtype, and pieces."""

    key: str
    stacked_axes: tuple[int, ...]
    shape: tuple[int, ...] = ()
    dtype: torch.dtype | None = None
    pieces: list = field(default_factory=list)

    @property
    def global_shape(self) -> tuple[int, ...]:
        return self.stacked_axes + self.shape


@dataclass(frozen=True)
class ObjectEntry:
    """An ``_extra_state`` entry: megatron-core's ShardedObject ``key`` at ``offset`` of
    ``global_shape``; ``layer`` as for a piece."""

    key: str
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    layer: int | None


def _placement(mapping: ModelMapping, scope: str, name: str, layer: int | None,
               expert: int | None) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    """(checkpoint key, stacked axes, index on them) of a scope-relative name."""
    if scope == MODEL:
        return name, (), ()
    num_layers, experts = len(mapping.layers), mapping.num_experts
    if mapping.stacked:
        key = LAYER_PREFIX + name
        if scope == LAYER:
            return key, (num_layers,), (layer,)
        return key, (num_layers, experts), (layer, expert)
    key = f"{LAYER_PREFIX}{layer}.{name}"
    if scope == LAYER:
        return key, (), ()
    return key, (experts,), (expert,)


def _instances(mapping: ModelMapping):
    """(scope, layer, expert, kind) for the model, every layer and every routed expert of a
    layer that has experts, in checkpoint order."""
    yield MODEL, None, None, None
    for layer, kind in enumerate(mapping.layers):
        yield LAYER, layer, None, kind
        if kind.has_experts:
            for expert in range(mapping.num_experts):
                yield EXPERT, layer, expert, kind


MAMBA_GATED_NORM = "mixer.norm"  # mamba-ssm's RMSNormGated: no ``_extra_state``


def norm_module(rule: Rule) -> str | None:
    """The norm module whose ``weight`` ``rule`` makes (``input_layernorm``,
    ``decoder.final_layernorm``, ``self_attention.q_layernorm``), else None. Norm weights
    fused into a TE linear (``linear_qkv.layer_norm_weight``) belong to the linear."""
    module, _, leaf = rule.megatron.rpartition(".")
    if module == MAMBA_GATED_NORM:
        return None
    return module if leaf == "weight" and "norm" in module.rpartition(".")[2] else None


def checkpoint_layout(mapping: ModelMapping) -> tuple[dict[str, TensorEntry], list[ObjectEntry]]:
    """Every checkpoint key of ``mapping`` with its pieces (shapes and dtypes not yet known:
    see `fill_shapes`) and every ``_extra_state`` object, in checkpoint order."""
    tensors: dict[str, TensorEntry] = {}
    objects: list[ObjectEntry] = []

    def add_object(scope, module, layer, expert):
        key, axes, index = _placement(mapping, scope, f"{module}._extra_state", layer, expert)
        objects.append(ObjectEntry(key, axes or (1,), index or (0,), layer))

    model_first = [rule for rule in mapping.model_rules if not rule.megatron.startswith(
        ("decoder.", "output_layer."))]
    model_last = [rule for rule in mapping.model_rules if rule not in model_first]
    for scope, layer, expert, kind in _instances(mapping):
        if scope == MODEL:
            rules = model_first
        else:
            rules = [rule for rule in kind.rules if rule.scope == scope]
        for rule in rules:
            key, axes, index = _placement(mapping, scope, rule.megatron, layer, expert)
            entry = tensors.setdefault(key, TensorEntry(key, axes))
            entry.pieces.append(Piece(rule, rule.hf_names(layer, expert), layer, index))
        if scope == LAYER:
            norms = [norm_module(rule) for rule in rules]
            for module in (*kind.extra_states, *filter(None, norms)):
                add_object(LAYER, module, layer, None)
        elif scope == EXPERT:
            for module in kind.expert_extra_states:
                add_object(EXPERT, module, layer, expert)
    for rule in model_last:
        tensors[rule.megatron] = TensorEntry(rule.megatron, (), pieces=[
            Piece(rule, rule.hf_names(), None, ())])
    norms = [norm_module(rule) for rule in mapping.model_rules]
    for module in (*mapping.model_extra_states, *filter(None, norms)):
        add_object(MODEL, module, None, None)
    return tensors, objects


def megatron_shape(piece: Piece, hf_shapes: Sequence[tuple], dtype: torch.dtype,
                   dims: Dims) -> tuple[int, ...]:
    """The Megatron shape of ``piece`` from its Hugging Face shapes (the transform on meta
    tensors: no data read)."""
    meta = [torch.empty(shape, dtype=dtype, device="meta") for shape in hf_shapes]
    return tuple(piece.rule.transform.to_megatron(meta, dims).shape)


def hf_shapes(piece: Piece, shape: tuple, dtype: torch.dtype, dims: Dims) -> list[tuple]:
    """The Hugging Face shapes of ``piece`` from its Megatron shape (meta tensors)."""
    meta = torch.empty(shape, dtype=dtype, device="meta")
    return [tuple(t.shape) for t in piece.rule.transform.to_hf(meta, dims)]


def with_dims(mapping: ModelMapping, **changes) -> ModelMapping:
    return dataclasses.replace(mapping, dims=dataclasses.replace(mapping.dims, **changes))


# -- the export direction: shared by `convert.export_hf` (a torch_dist checkpoint on disk) and
# -- `rl.export.export_weights` (a policy's live parameters)

CHECKPOINT_FIX = "pass the --hf-config of the model the checkpoint was trained from"


def export_layout(mapping: ModelMapping, metadata: dict, *, holder: str = "the checkpoint",
                  fix: str = CHECKPOINT_FIX) -> tuple[ModelMapping, dict[str, TensorEntry]]:
    """The mapping's layout as ``holder`` stores it: stacked or one key per layer, whichever
    its keys are, every entry's shape and dtype from ``metadata`` ({key: (global shape,
    dtype)}); a `ConversionError` ending in ``fix`` where the two differ."""
    first = mapping.layers[0].rules[0].megatron if mapping.layers else None
    if first is not None:
        stacked = f"{LAYER_PREFIX}{first}" in metadata
        if stacked and len(set(mapping.layers)) > 1:
            raise ConversionError(f"{holder} stacks its layers, but the config.json describes "
                                  "layers of different kinds")
        mapping = dataclasses.replace(mapping, stacked=stacked)
    entries, _ = checkpoint_layout(mapping)
    for entry in entries.values():
        if entry.key not in metadata:
            raise ConversionError(f"{holder} has no {entry.key}, which the model of this "
                                  f"config.json has; {fix}")
        shape, dtype = metadata[entry.key]
        stacked = len(entry.stacked_axes)
        if tuple(shape[:stacked]) != entry.stacked_axes:
            raise ConversionError(f"{entry.key} stacks {tuple(shape[:stacked])} layers / experts "
                                  f"in {holder}, {entry.stacked_axes} in the config.json")
        entry.shape, entry.dtype = tuple(shape[stacked:]), dtype
    return mapping, entries


def export_groups(entries: Iterable[TensorEntry]) -> Iterator[list[tuple[TensorEntry, Piece]]]:
    """(entry, piece) pairs in export order, grouped: every model-wide tensor alone, then each
    layer's tensors (experts included) together. A group holds every row section of its
    Hugging Face tensors (`hf_tensors` joins them at its end)."""
    by_layer: dict = {}
    for entry in entries:
        for piece in entry.pieces:
            if piece.layer is None:
                yield [(entry, piece)]
            else:
                by_layer.setdefault(piece.layer, []).append((entry, piece))
    for layer in sorted(by_layer):
        yield by_layer[layer]


def hf_tensors(pieces: Iterable[tuple[TensorEntry, Piece, Tensor]],
               dims: Dims) -> Iterator[tuple[str, Tensor]]:
    """The Hugging Face tensors ``(name, tensor)`` of one `export_groups` group, from each
    piece's whole Megatron tensor (``entry.shape``, every layer / expert axis taken off): the
    piece's transform in the export direction, each result of the shape the mapping gives.

    Lazy, one piece at a time: ``pieces`` is read as the tensors are asked for, and only row
    sections of one Hugging Face tensor (Mamba's in_proj and conv1d) wait, to be joined after
    the group's last piece. A tensor the transform passes through unchanged is the given
    tensor itself (no copy)."""
    sections: dict[str, list] = {}
    for entry, piece, tensor in pieces:
        if tuple(tensor.shape) != entry.shape:
            raise ConversionError(f"{entry.key} of {', '.join(piece.hf)}: a "
                                  f"{tuple(tensor.shape)} tensor, the mapping's is {entry.shape}")
        transform = piece.rule.transform
        hf = transform.to_hf(tensor, dims)
        if transform.rows is not None:  # a section of one Hugging Face tensor
            sections.setdefault(piece.hf[0], []).append((transform.rows, hf[0]))
            continue
        expected = hf_shapes(piece, entry.shape, entry.dtype, dims)
        for name, value, shape in zip(piece.hf, hf, expected):
            assert tuple(value.shape) == shape, (name, value.shape, shape)
            yield name, value
    for name, parts in sections.items():
        yield name, join_sections(name, parts)


def join_sections(name: str, parts: list) -> Tensor:
    """The Hugging Face tensor ``name`` from its row sections [((start, stop), rows)]."""
    parts = sorted(parts, key=lambda part: part[0][0])
    position = 0
    for (start, stop), rows in parts:
        if start != position or rows.shape[0] != stop - start:
            raise ConversionError(f"{name}: its sections do not tile it (rows {start}:{stop} "
                                  f"after {position})")
        position = stop
    return torch.cat([rows for _, rows in parts])
