"""The command line of pretrain_gpt.py / pretrain_mamba.py: Megatron-LM's own parser and checks
(the megatron-core wheel's ``megatron.training.arguments``) plus the fork's flags and rules
(extra_args.py).

``parse_args(argv, model)`` returns the validated ``args``; a bad value raises ``ValueError``
(Megatron-LM's own checks are asserts: their message is kept). ``parse_args_or_exit`` is the
scripts' form: one line, ``<script>: error: <message>``, exit status 2.

Every flag and where the fork differs from Megatron-LM: docs/flags.md.
"""

import argparse
import os
import sys
import traceback

MODELS = ("gpt", "hybrid")

# What a packed launch line may leave unset where Megatron-LM has no default (validate_args
# fills values still None): evaluation every 1000 iterations, as Megatron-LM's scripts do.
UPSTREAM_DEFAULTS = {"eval_interval": 1000}
DEFAULT_VOCAB_SIZE = 32000  # pre-tokenized data without --vocab-size (NullTokenizer)


def build_parser() -> argparse.ArgumentParser:
    """Megatron-LM's parser with the fork's flags; parses without validating."""
    from megatron.training.arguments import add_megatron_arguments

    from megatron.packed_training.extra_args import add_packed_args

    parser = argparse.ArgumentParser(description="Megatron-LM arguments (packed CUDA graphs)",
                                     allow_abbrev=False)
    return add_packed_args(add_megatron_arguments(parser))


def parse_args(argv=None, model: str = "gpt") -> argparse.Namespace:
    """Parse and validate ``argv`` (default ``sys.argv[1:]``) for ``model`` ('gpt' | 'hybrid').

    Runs Megatron-LM's ``validate_args`` and the fork's rules; sets no global state. Raises
    ``ValueError`` with the value and the fix; argparse's own errors exit with status 2."""
    from megatron.training.arguments import validate_args

    from megatron.packed_training.extra_args import (
        hand_graph_flags_to_the_runtime,
        prepare_upstream_args,
        validate_packed_args,
    )

    if model not in MODELS:
        raise ValueError(f"model is wrong: {model!r}. Use one of {', '.join(MODELS)}.")
    args = build_parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    # What Megatron-LM's own parse_args adds after parsing.
    args._is_global_batch_size_explicitly_specified = args.global_batch_size is not None
    args.rank = int(os.getenv("RANK", "0"))
    args.world_size = int(os.getenv("WORLD_SIZE", "1"))
    prepare_upstream_args(args, model)
    hand_graph_flags_to_the_runtime(args)  # before upstream's checks of its own graphs
    if args.tokenizer_type is None:  # pre-tokenized data: ids below --vocab-size
        args.tokenizer_type = "NullTokenizer"
        args.vocab_size = args.vocab_size or DEFAULT_VOCAB_SIZE
    args.dataloader_type = "external"  # the fork's data provider returns the iterators
    try:
        validate_args(args, UPSTREAM_DEFAULTS)
    except AssertionError as err:  # Megatron-LM's checks are asserts
        raise ValueError(str(err) or _failed_check(err)) from None
    return validate_packed_args(args, model)


def _failed_check(err: AssertionError) -> str:
    """An assert without a message: the check's own source line, which names the flags."""
    frame = traceback.extract_tb(err.__traceback__)[-1]
    return (f"Megatron-LM's argument check `{frame.line}` failed "
            f"({os.path.basename(frame.filename)}:{frame.lineno})")


def parse_args_or_exit(model: str, script: str, argv=None) -> argparse.Namespace:
    """`parse_args` for an entry script: a bad value prints ``<script>: error: <message>`` and
    exits with status 2, as argparse does for a bad flag."""
    try:
        return parse_args(argv, model)
    except ValueError as err:
        print(f"{script}: error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
