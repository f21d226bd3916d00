"""Hugging Face folder <-> Megatron-LM torch_dist checkpoint (see package doc).

`import_hf` reads the Hugging Face shards tensor by tensor and writes the Megatron checkpoint
as a ``release`` (`torch_dist.write_checkpoint`); `export_hf` reads the Megatron checkpoint
one layer at a time and writes Hugging Face shards. Neither holds the model in memory.
"""

import argparse
import math
import os
import re
import shutil
from dataclasses import dataclass, field
from typing import Sequence

from megatron.packed_training.hf import torch_dist
from megatron.packed_training.hf.config import ConversionError, HFConfig
from megatron.packed_training.hf.families import describe
from megatron.packed_training.hf.mapping import (
    TensorEntry,
    checkpoint_layout,
    export_groups,
    export_layout,
    hf_tensors,
    megatron_shape,
    with_dims,
)
from megatron.packed_training.hf.safetensors_io import HFReader, HFWriter

# What Megatron-LM's checkpoint loader reads besides the model (training/checkpointing.py):
# the version (below 3.0 it reorders QKV rows of old checkpoints) and the iteration
# (release checkpoints load as iteration 0 and never bring optimizer or RNG state).
CHECKPOINT_VERSION = 3.0
# Megatron-LM's content metadata (checkpointing._build_sharded_state_dict_metadata) as a
# model-only save writes it: loaders build their sharded state dicts from it.
CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")
WEIGHT_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
FLAGS_FILE = "megatron_flags.txt"
CONFIG_FILES = ("config.json", "generation_config.json")


def padded_vocab_size(vocab_size: int, divisible_by: int = 128, tensor_parallel: int = 1) -> int:
    """Megatron-LM's padding: the next multiple of ``divisible_by`` x TP."""
    multiple = divisible_by * tensor_parallel
    return -(-vocab_size // multiple) * multiple


def vocab_divisor(run_vocab: int, hf_vocab: int, tensor_parallel: int = 1) -> int:
    """--make-vocab-size-divisible-by for a run whose tokenizer has ``run_vocab`` ids on a
    checkpoint of ``hf_vocab`` rows: the largest power of two up to Megatron's 128 whose
    padding keeps every row of the run's embedding a trained row. Zero rows (Megatron's
    padding) give logits of 0, and each adds exp(0) to every softmax denominator: a
    pretrained model would start from another loss than its own. 128 when no divisor
    avoids them (then they are few against a trained vocabulary's logits)."""
    for divisor in (128, 64, 32, 16, 8, 4, 2, 1):
        if padded_vocab_size(run_vocab, divisor, tensor_parallel) <= hf_vocab:
            return divisor
    return 128


def tokenizer_size(folder: str) -> int | None:
    """``len(tokenizer)`` of the folder's Hugging Face tokenizer (the vocabulary Megatron-LM
    builds the run's model with), or None when it has none or it does not load. Reading it
    needs transformers (a `ConversionError` naming the extra when it is not importable)."""
    if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
        return None
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ConversionError(f"reading the tokenizer of {folder} needs the transformers "
                              "package, which is not importable: pip install -e \".[hf]\" "
                              "(or pass --no-tokenizer for pre-tokenized data)") from None
    try:
        from megatron.packed_training.tokenizer import load_tokenizer

        return load_tokenizer("HuggingFaceTokenizer", folder).vocab_size
    except ValueError:
        return None


@dataclass
class ConversionResult:
    """What a conversion did. ``flags``: the launch flags that build the model (tokens, one
    flag or ``--flag=value`` each); ``parameters``: Megatron parameters written or read."""

    family: str
    script: str
    source: str
    destination: str
    flags: list = field(default_factory=list)
    parameters: int = 0
    bytes: int = 0
    notes: list = field(default_factory=list)

    def launch_text(self) -> str:
        lines = [f"{self.script} \\"] + [f"    {token} \\" for token in self.flags]
        return "\n".join(lines)[:-2]


def flag_tokens(flags: dict) -> list[str]:
    """``{"--swiglu": True, "--num-layers": 2}`` -> ``["--swiglu", "--num-layers=2"]``."""
    return [flag if value is True else f"{flag}={value}" for flag, value in flags.items()
            if value is not False and value is not None]


def _checkpoint_args(tokens: list[str], model: str) -> argparse.Namespace:
    """The ``args`` Megatron-LM keeps in a checkpoint, for the model the flags build: the
    parser's values (no training flags) with the derived sizes a loader compares and a
    TP = PP = 1 save. Plain values only, so the common state loads with weights_only."""
    from megatron.packed_training.arguments import build_parser

    parsed = vars(build_parser().parse_args(tokens))
    plain = (bool, int, float, str, type(None))
    args = {name: value for name, value in parsed.items()
            if isinstance(value, plain) or (isinstance(value, list)
                                           and all(isinstance(v, plain) for v in value))}
    if model == "hybrid":
        pattern = args["hybrid_layer_pattern"]
        args["num_layers"] = len(pattern.split("/")[0].replace("|", ""))
    args.update(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                expert_model_parallel_size=1, context_parallel_size=1, world_size=1,
                data_parallel_size=1, ckpt_format="torch_dist", use_dist_ckpt=True,
                iteration=0, consumed_train_samples=0, consumed_valid_samples=0)
    return argparse.Namespace(**args)


def copy_side_files(source: str, destination: str, tokenizer: bool = True) -> list[str]:
    """Copy everything in ``source`` but the weights (config.json, generation config,
    tokenizer files, chat template, license) to ``destination``; without ``tokenizer`` only
    the model's configs."""
    copied = []
    for name in sorted(os.listdir(source)):
        path = os.path.join(source, name)
        if (not os.path.isfile(path) or name.endswith(WEIGHT_SUFFIXES) or name in WEIGHT_FILES
                or name in (FLAGS_FILE, torch_dist.TRACKER)
                or not (tokenizer or name in CONFIG_FILES)):
            continue
        shutil.copy2(path, os.path.join(destination, name))
        copied.append(name)
    return copied


def _entry_meta(entry: TensorEntry, reader: HFReader, mapping) -> None:
    """Fill ``entry``'s shape and dtype from the Hugging Face headers; every piece alike."""
    for piece in entry.pieces:
        metas = [reader.meta(name) for name in piece.hf]
        dtypes = {dtype for _, dtype in metas}
        if len(dtypes) != 1:
            raise ConversionError(f"{', '.join(piece.hf)} have different dtypes {dtypes}; "
                                  f"{entry.key} needs one")
        (dtype,) = dtypes
        shape = megatron_shape(piece, [shape for shape, _ in metas], dtype, mapping.dims)
        if entry.dtype is None:
            entry.shape, entry.dtype = shape, dtype
        elif (shape, dtype) != (entry.shape, entry.dtype):
            raise ConversionError(f"{', '.join(piece.hf)} make a {shape} {dtype} tensor, the "
                                  f"other layers' {entry.key} are {entry.shape} {entry.dtype}: "
                                  "the fork's model has one shape per name")


def _produce(reader: HFReader, piece, dims):
    def produce():
        return piece.rule.transform.to_megatron([reader.get(name) for name in piece.hf], dims)
    return produce


def _check_coverage(reader: HFReader, entries: Sequence[TensorEntry], ignored: dict) -> list:
    """Every Hugging Face tensor is mapped or deliberately ignored (else the model would
    silently lose weights); returns notes on the ignored ones."""
    used = {name for entry in entries for piece in entry.pieces for name in piece.hf}
    missing = sorted(used - set(reader.names()))
    if missing:
        raise ConversionError(f"the checkpoint lacks {len(missing)} tensors its config.json "
                              f"implies, e.g. {', '.join(missing[:3])}")
    notes = []
    left = sorted(set(reader.names()) - used)
    for pattern, why in ignored.items():
        dropped = [name for name in left if re.search(pattern, name)]
        if dropped:
            notes.append(f"left out {len(dropped)} tensors ({dropped[0]}, ...): {why}")
    unmapped = [name for name in left if not any(re.search(p, name) for p in ignored)]
    if unmapped:
        raise ConversionError(f"{len(unmapped)} checkpoint tensors have no place in the "
                              f"fork's model, e.g. {', '.join(unmapped[:3])}; the family's "
                              f"mapping does not cover this checkpoint")
    return notes


def import_hf(hf_folder: str | os.PathLike, output: str | os.PathLike, *,
              tensor_parallel_size: int = 1, make_vocab_size_divisible_by: int | None = None,
              tokenizer: bool = True) -> ConversionResult:
    """Convert the Hugging Face model in ``hf_folder`` (config.json, safetensors, tokenizer)
    into a Megatron-LM torch_dist ``release`` checkpoint in ``output``.

    ``output`` gets ``latest_checkpointed_iteration.txt`` (``release``), ``release/`` (the
    model as megatron-core saves it at TP = PP = 1, tensors in the Hugging Face dtype,
    vocabulary padded to a multiple of ``make_vocab_size_divisible_by`` x
    ``tensor_parallel_size``; by default the `vocab_divisor` that gives the run's model no
    zero rows), every non-weight file of ``hf_folder`` (tokenizer, chat template, config.json:
    ``--tokenizer-model <output>`` reads it, and `export_hf` finds the config there; without
    ``tokenizer`` only the configs, and the flags say ``--vocab-size``) and
    ``megatron_flags.txt``.
    Load it with ``--pretrained-checkpoint <output>`` (or ``--load <output> --finetune``)
    at any TP / PP / EP. Returns the `ConversionResult` with the launch flags.
    Raises `ConversionError` for a model the fork does not build, and for a folder whose
    weights files are missing, truncated or damaged (before anything is written).
    """
    hf_folder, output = os.fspath(hf_folder), os.path.abspath(os.fspath(output))
    config = HFConfig.from_folder(hf_folder)
    converted = describe(config)
    dims = converted.mapping.dims
    reader = HFReader(hf_folder)  # first: a missing or damaged weights file stops it here
    run_vocab = (tokenizer_size(hf_folder) if tokenizer else None) or dims.vocab_size
    divisor = make_vocab_size_divisible_by or vocab_divisor(run_vocab, dims.vocab_size,
                                                            tensor_parallel_size)
    padded = padded_vocab_size(dims.vocab_size, divisor, tensor_parallel_size)
    mapping = with_dims(converted.mapping, padded_vocab_size=padded)
    entries, objects = checkpoint_layout(mapping)
    notes = list(converted.notes) + _check_coverage(reader, entries.values(), mapping.ignored)
    if padded_vocab_size(run_vocab, divisor, tensor_parallel_size) > dims.vocab_size:
        notes.append(f"the run's vocabulary ({run_vocab} ids) pads to "
                     f"{padded_vocab_size(run_vocab, divisor, tensor_parallel_size)} rows at "
                     f"TP {tensor_parallel_size}, past the checkpoint's {dims.vocab_size}: the "
                     f"extra rows are zero (logit 0)")
    stored, layers = [], len(mapping.layers)
    for entry in entries.values():
        _entry_meta(entry, reader, mapping)
        stacked = len(entry.stacked_axes)
        # In the Hugging Face shards' order (then layer by layer, the embedding first, the
        # final norm and output layer last), so each shard is read in one pass.
        last = entry.key.startswith(("decoder.", "output_layer."))
        chunks = [torch_dist.Chunk(piece.index + (0,) * len(entry.shape),
                                   (1,) * stacked + entry.shape,
                                   _unsqueezed(_produce(reader, piece, mapping.dims), stacked),
                                   order=(reader.shard_number(piece.hf[0]),
                                          piece.layer if piece.layer is not None
                                          else (layers if last else -1)))
                  for piece in entry.pieces]
        stored.append(torch_dist.StoredTensor(entry.key, entry.global_shape, entry.dtype, chunks))
    os.makedirs(output, exist_ok=True)
    tokens = flag_tokens({**converted.flags, "--make-vocab-size-divisible-by": divisor})
    if tokenizer:
        tokens += ["--tokenizer-type=HuggingFaceTokenizer", f"--tokenizer-model={output}"]
    else:  # pre-tokenized data: ids below the model's vocabulary
        tokens += [f"--vocab-size={dims.vocab_size}"]
    model = "hybrid" if converted.script == "pretrain_mamba.py" else "gpt"
    args = _checkpoint_args(tokens, model)
    args.padded_vocab_size, args.vocab_size = padded, dims.vocab_size
    common = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": 0,
              "content_metadata": dict(CONTENT_METADATA)}
    try:
        torch_dist.write_checkpoint(
            os.path.join(output, torch_dist.RELEASE), stored,
            [torch_dist.StoredObject(o.key, o.global_shape, o.offset) for o in objects], common)
    finally:
        reader.close()
    torch_dist.write_release_tracker(output)  # last: a tracker names a complete checkpoint
    copy_side_files(hf_folder, output, tokenizer)
    with open(os.path.join(output, FLAGS_FILE), "w") as f:
        f.write("\n".join(tokens + [f"--pretrained-checkpoint={output}"]) + "\n")
    return ConversionResult(
        converted.family, converted.script, hf_folder, output,
        tokens + [f"--pretrained-checkpoint={output}"],
        parameters=sum(math.prod(t.global_shape) for t in stored),
        bytes=sum(math.prod(t.global_shape) * t.dtype.itemsize for t in stored), notes=notes)


def _unsqueezed(produce, axes: int):
    """``produce()`` with ``axes`` leading axes of size one (a chunk of a stacked key)."""
    if not axes:
        return produce

    def stacked():
        tensor = produce()
        return tensor.reshape((1,) * axes + tuple(tensor.shape))
    return stacked


def export_hf(checkpoint: str | os.PathLike, output: str | os.PathLike, *,
              hf_config: str | os.PathLike | None = None,
              max_shard_bytes: int = 5 * 10 ** 9) -> ConversionResult:
    """Convert a Megatron-LM torch_dist checkpoint (``checkpoint``: a ``--save`` folder with
    its tracker, or one iteration's folder) into a Hugging Face folder ``output`` that
    ``transformers.AutoModelForCausalLM.from_pretrained`` loads.

    The model is the one ``hf_config`` (a folder with config.json, default: ``checkpoint``
    itself, where `import_hf` put one) describes; the checkpoint may be saved at any TP / PP /
    EP and with any vocabulary padding (rows past config.json's vocab_size are dropped; rows
    the checkpoint lacks are zero). Tensors keep the checkpoint's dtype. Non-weight files of
    the config folder (tokenizer, generation config) are copied along.
    """
    checkpoint, output = os.fspath(checkpoint), os.fspath(output)
    folder = torch_dist.checkpoint_folder(checkpoint)
    config_folder = os.fspath(hf_config) if hf_config is not None else checkpoint
    if hf_config is None and not os.path.isfile(os.path.join(checkpoint, "config.json")):
        raise ConversionError(f"{checkpoint} has no config.json: name the folder that holds "
                              "the model's config.json (the `import` output) with --hf-config")
    config = HFConfig.from_folder(config_folder)
    converted = describe(config)
    os.makedirs(output, exist_ok=True)
    writer = HFWriter(output, max_shard_bytes)
    notes = list(converted.notes)
    with torch_dist.single_process_group():
        metadata = torch_dist.tensor_metadata(folder)
        rows = metadata.get("embedding.word_embeddings.weight", ((0,), None))[0][0]
        mapping, entries = export_layout(
            with_dims(converted.mapping, padded_vocab_size=rows), metadata)
        if rows < mapping.dims.vocab_size:
            notes.append(f"the checkpoint has {rows} vocabulary rows, config.json "
                         f"{mapping.dims.vocab_size}: the missing rows are written as zeros")
        for group in export_groups(entries.values()):
            requests = {f"{entry.key}@{piece.index}": torch_dist.Request(
                entry.key, entry.global_shape, entry.dtype, piece.index)
                for entry, piece in group}
            loaded = torch_dist.read_tensors(folder, requests)  # one layer at a time
            read = ((entry, piece, loaded[f"{entry.key}@{piece.index}"]) for entry, piece in group)
            for name, value in hf_tensors(read, mapping.dims):
                writer.add(name, value)
            del loaded
    writer.close()
    copy_side_files(config_folder, output)
    parameters = sum(math.prod(entry.global_shape) for entry in entries.values())
    return ConversionResult(converted.family, converted.script, checkpoint, output,
                            parameters=parameters, bytes=writer.total_bytes, notes=notes)
