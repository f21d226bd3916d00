"""The command line of pretrain_gpt.py / pretrain_mamba.py: Megatron-LM's parser and checks
(the wheel's ``megatron.training.arguments``) plus the fork's flags and rules (extra_args.py).

``parse_args(argv, model)``: the validated ``args``, or ``ValueError`` (docs/flags.md); the
scripts' ``parse_args_or_exit`` prints it as ``<script>: error: <message>`` and exits 2."""

import argparse
import contextlib
import functools
import io
import logging
import os
import pathlib
import sys
import traceback
import warnings

from megatron.packed_training.data_paths import DATA_PATHS, check_data_path, parse_blend

MODELS = ("gpt", "hybrid")

# validate_args fills these where still None: evaluation every 1000 iterations, as upstream.
UPSTREAM_DEFAULTS = {"eval_interval": 1000}
DEFAULT_VOCAB_SIZE = 32000  # pre-tokenized data without --vocab-size (NullTokenizer)
# Every long option of `build_parser`, and `--help`'s text for prog PROG at 100 columns
# (tests/unit/test_extra_args.py keeps both so): the scripts answer from them in 0.1 s.
MEGATRON_FLAGS = pathlib.Path(__file__).with_name("megatron_flags.txt")
MEGATRON_HELP = pathlib.Path(__file__).with_name("megatron_help.txt")
# What megatron-core and torch print while Megatron-LM's parser is imported without Apex, TE
# or a CUDA toolkit (the start-up notes say the fallbacks), or validates outside torchrun (rank
# 0), ten lines before every message.
_IMPORT_NOTICES = ".*(Apex (is|are) not installed|supports MoE experts|Could not determine rank)"


@contextlib.contextmanager
def _without_import_notices():
    cuda_home = logging.getLogger("torch.utils.cpp_extension")  # "No CUDA runtime is found"
    level = cuda_home.level
    cuda_home.setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_IMPORT_NOTICES)
        try:
            yield
        finally:
            cuda_home.setLevel(level)


def build_parser() -> argparse.ArgumentParser:
    """Megatron-LM's parser with the fork's flags; parses without validating."""
    with _without_import_notices():
        from megatron.training.arguments import add_megatron_arguments
    parser = argparse.ArgumentParser(description="Megatron-LM arguments (packed CUDA graphs)",
                                     allow_abbrev=False)
    return extra_args_provider(add_megatron_arguments(parser))


def extra_args_provider(parser, raise_on_error: bool = False) -> argparse.ArgumentParser:
    """Megatron-LM's ``extra_args_provider``: the fork's flags on its parser. With
    ``raise_on_error`` argparse's every error raises ``ValueError`` instead of exiting."""
    from megatron.packed_upstream.training_loop import megatron_parser_flaws_fixed
    from megatron.packed_training.extra_args import add_packed_args

    parser = add_packed_args(parser)
    megatron_parser_flaws_fixed(parser)
    if raise_on_error:  # a library caller gets a ValueError, not an exit
        def error(message):  # an ArgumentError's message included
            raise ValueError(f"arguments are wrong: {message}.") from None

        parser.error = error
    return parser


def parse_args(argv=None, model: str = "gpt", raise_on_error: bool = False,
               dump=None) -> argparse.Namespace:
    """Parse and validate ``argv`` (default ``sys.argv[1:]``) for ``model`` ('gpt' | 'hybrid'):
    Megatron-LM's ``parse_args`` (with `extra_args_provider`) and ``validate_args``, then the
    fork's rules; then Megatron-LM's argument dump goes to stdout, or to the file ``dump``.
    Raises ``ValueError`` with the value and the fix; argparse's own errors (an unknown flag,
    a bad choice) exit 2, or raise ``ValueError`` with ``raise_on_error``."""
    with _without_import_notices():
        from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding
        from megatron.training.arguments import parse_args as megatron_parse_args, validate_args
        from megatron.training.checkpointing import load_args_from_checkpoint

        from megatron.packed_training import extra_args
        from megatron.packed_training.datasets.sources import has_validation_data

    if model not in MODELS:
        raise ValueError(f"model is wrong: {model!r}. Use one of {', '.join(MODELS)}.")
    saved_argv = sys.argv  # Megatron-LM's parse_args reads the command line from sys.argv
    sys.argv = saved_argv if argv is None else [saved_argv[0] if saved_argv else "", *argv]
    try:
        args = megatron_parse_args(functools.partial(extra_args_provider,
                                                     raise_on_error=raise_on_error))
    finally:
        sys.argv = saved_argv
    # What the line leaves unset comes from --pretrained-checkpoint, then --load (rank 0's files).
    if args.use_checkpoint_args:
        if args.load is None and args.pretrained_checkpoint is None:
            raise ValueError("--use-checkpoint-args is given without a checkpoint. Add --load "
                             "or --pretrained-checkpoint, or drop --use-checkpoint-args.")
        load_args_from_checkpoint(args, load_arg="pretrained_checkpoint")
        load_args_from_checkpoint(args)
    extra_args.prepare_upstream_args(args, model)
    extra_args.hand_graph_flags_to_the_runtime(args)  # before upstream's checks of its graphs
    if args.tokenizer_type is None:  # pre-tokenized data: ids below --vocab-size
        args.tokenizer_type = "NullTokenizer"
        args.vocab_size = args.vocab_size or DEFAULT_VOCAB_SIZE
    args.dataloader_type = "external"  # the fork's data provider returns the iterators
    # No --split trains on the whole file (Megatron-LM would default to 969,30,1), and
    # --valid-data-path beside --data-path is the fork's (Megatron-LM takes one or the other).
    split, valid_data_path = args.split, args.valid_data_path
    args.split, args.valid_data_path = split or "1,0,0", None  # not its --split warning either
    held = io.StringIO()  # its argument dump, printed once the fork's rules have passed too
    try:
        with contextlib.redirect_stdout(held), _without_import_notices():
            validate_args(args, UPSTREAM_DEFAULTS)
    except AssertionError as err:  # Megatron-LM's checks are asserts; a bare one: its line
        frame = traceback.extract_tb(err.__traceback__)[-1]
        raise ValueError(str(err) or f"Megatron-LM's argument check `{frame.line}` failed "
                         f"({os.path.basename(frame.filename)}:{frame.lineno})") from None
    args.split, args.valid_data_path = split, valid_data_path
    extra_args.validate_packed_args(args, model)
    if args.tokenizer_type == "NullTokenizer":  # Megatron-LM pads it later, at start-up
        args.padded_vocab_size = vocab_size_with_padding(args.vocab_size, args,
                                                         logging_enabled=False)
    if args.eval_iters and not has_validation_data(args):
        args.eval_iters = 0  # Megatron-LM would evaluate an empty iterator
        args.packed_notes.append("no validation data (--valid-data-path, a --split with a "
                                 "validation share, or --mock-data): evaluation off")
    print(held.getvalue(), end="", flush=True, file=dump)
    return args


def parse_args_or_exit(model: str, script: str, argv=None, dump=None) -> argparse.Namespace:
    """`parse_args` for an entry script (``dump``: the file for the argument dump, which the
    scripts print after their start-up checks): a bad flag or value prints ``<script>: error:
    <message>`` from rank 0 only (every torchrun rank parses the line) and exits 2. ``--help``,
    an unknown flag or a missing data file answer before the ~10 s import of Megatron-LM's
    parser (MEGATRON_HELP, MEGATRON_FLAGS)."""
    argv = sys.argv[1:] if argv is None else argv
    rank0 = int(os.getenv("RANK", "0")) == 0  # every torchrun rank parses the line
    if "-h" in argv or "--help" in argv:
        if rank0:
            print(MEGATRON_HELP.read_text().replace("usage: PROG", f"usage: {script}", 1), end="")
        raise SystemExit(0)
    names = set(MEGATRON_FLAGS.read_text().split())
    unknown = [t for t in argv
               if t.startswith("--") and t != "--" and t.split("=", 1)[0] not in names]
    try:
        if unknown:  # argparse's own message
            raise ValueError(f"arguments are wrong: unrecognized arguments: {' '.join(unknown)}.")
        typed = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
        for flag, _ in DATA_PATHS:
            typed.add_argument(flag, nargs="*")
        typed = typed.parse_known_args(argv)[0]
        for flag, dest in DATA_PATHS:
            paths = getattr(typed, dest)
            if rank0 and paths:  # rank 0 reads the data
                for path in parse_blend(paths, flag).paths:
                    check_data_path(path, flag)
        return parse_args(argv, model, raise_on_error=True, dump=dump)
    except ValueError as err:
        if rank0:
            print(f"{script}: error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
