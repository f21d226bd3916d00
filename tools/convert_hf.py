"""Hugging Face checkpoints in and out of the fork (docs/hf-checkpoints.md).

    # HF folder -> Megatron-LM torch_dist release checkpoint + tokenizer + launch flags
    python tools/convert_hf.py import Qwen3-0.6B qwen3-converted
    # any Megatron-LM checkpoint of that model (a --save folder) -> HF folder
    python tools/convert_hf.py export runs/sft qwen3-sft-hf --hf-config qwen3-converted
    # the launch flags only
    python tools/convert_hf.py flags Qwen3-0.6B

``--measure`` prints wall time and peak host memory. A model the fork cannot build, a
truncated or missing shard, a folder that is not what the command reads, or a missing
dependency (the ``hf`` extra: ``pip install -e ".[hf]"``) is refused in one line,
``convert_hf.py: error: ...`` (exit status 2).
"""

import argparse
import logging
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _size(text: str) -> int:
    units = {"KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "KIB": 2 ** 10, "MIB": 2 ** 20,
             "GIB": 2 ** 30}
    upper = text.strip().upper()
    for unit, factor in units.items():
        if upper.endswith(unit):
            return int(float(upper[:-len(unit)]) * factor)
    return int(upper)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    to_megatron = commands.add_parser("import", help="Hugging Face folder -> Megatron-LM "
                                                     "torch_dist release checkpoint")
    to_megatron.add_argument("hf_folder")
    to_megatron.add_argument("output")
    to_megatron.add_argument("--tensor-parallel-size", type=int, default=1,
                             help="Pad the vocabulary for this TP (Megatron-LM pads to "
                                  "--make-vocab-size-divisible-by x TP); any TP loads it.")
    to_megatron.add_argument("--make-vocab-size-divisible-by", type=int, default=None,
                             help="Megatron-LM's padding multiple (default: the largest "
                                  "power of two up to 128 that pads the tokenizer's vocabulary "
                                  "with trained rows only)")
    to_megatron.add_argument("--no-tokenizer", action="store_true",
                             help="Do not copy the tokenizer (pre-tokenized data: the flags "
                                  "give --vocab-size instead).")
    to_hf = commands.add_parser("export", help="Megatron-LM torch_dist checkpoint -> "
                                               "Hugging Face folder")
    to_hf.add_argument("checkpoint", help="A --save folder (its tracker picks the "
                                          "iteration) or one iteration's folder")
    to_hf.add_argument("output")
    to_hf.add_argument("--hf-config", default=None,
                       help="Folder with the model's config.json (and tokenizer); default: "
                            "the checkpoint folder (where `import` puts them)")
    to_hf.add_argument("--max-shard-size", type=_size, default=5 * 10 ** 9,
                       help="Largest safetensors shard, e.g. 5GB (default)")
    flags = commands.add_parser("flags", help="Print the launch flags of a Hugging Face model")
    flags.add_argument("hf_folder")
    for sub in (to_megatron, to_hf):
        sub.add_argument("--measure", action="store_true",
                         help="Print wall time and peak host memory")
    return parser


def _quiet_imports() -> None:
    """Hold back what megatron-core, torch and PyTorch Distributed Checkpoint print on a
    machine without a GPU, Apex or Transformer Engine (a conversion needs none of them)."""
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module=r"megatron\.core\..*")
    warnings.filterwarnings("ignore", module=r"torch\.distributed\.checkpoint\..*")


REQUIRED = ("safetensors",)
"""Packages every command needs (the ``hf`` extra of pyproject.toml; transformers, also in it,
is needed only to read a tokenizer)."""


def missing_dependency() -> str | None:
    """The one-line error when a package of `REQUIRED` is not importable, else None."""
    for package in REQUIRED:
        try:
            __import__(package)
        except ImportError:
            return (f"the {package} package is not importable, and the converter reads and "
                    f"writes safetensors files: install the converter's dependencies, "
                    f"pip install -e \".[hf]\"")
    return None


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    missing = missing_dependency()
    if missing:
        print(f"convert_hf.py: error: {missing}", file=sys.stderr)
        return 2
    _quiet_imports()
    from megatron.packed_training.hf import ConversionError, export_hf, import_hf
    from megatron.packed_training.hf.measure import measured

    try:
        if args.command == "flags":
            from megatron.packed_training.hf.config import HFConfig
            from megatron.packed_training.hf.convert import flag_tokens
            from megatron.packed_training.hf.families import describe

            converted = describe(HFConfig.from_folder(args.hf_folder))
            print(" \\\n".join([converted.script] + [
                f"    {token}" for token in flag_tokens(converted.flags)]))
            return 0
        with measured() as measurement:
            if args.command == "import":
                result = import_hf(args.hf_folder, args.output,
                                   tensor_parallel_size=args.tensor_parallel_size,
                                   make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                                   tokenizer=not args.no_tokenizer)
            else:
                result = export_hf(args.checkpoint, args.output, hf_config=args.hf_config,
                                   max_shard_bytes=args.max_shard_size)
    except ConversionError as error:
        print(f"convert_hf.py: error: {error}", file=sys.stderr)
        return 2
    print(f"{result.family}: {result.source} -> {result.destination} "
          f"({result.parameters / 1e6:.1f}M parameters)")
    for note in result.notes:
        print(f"note: {note}")
    if args.command == "import":
        print("Train from it with these flags (also in "
              f"{os.path.join(result.destination, 'megatron_flags.txt')}):")
        print(result.launch_text())
    if args.measure:
        print(f"measured: {measurement.describe(result.bytes)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
