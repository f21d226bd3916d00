"""megatron-core's config objects for the fork's layers, and the library config.

``transformer_config_from_args(args)`` is the one place a `TransformerConfig` is built from
validated arguments: Megatron-LM's own ``core_transformer_config_from_args`` (every Megatron
flag: recompute, FP8, RoPE scaling, MoE, MLA, ...) in the fork's config class, with what only
the fork's layers and graphs read set on top.

``graph_settings_from_args(args)`` is the one place the graph package's settings are built
from validated arguments: the frozen `GraphSettings` (with its `MoEGraphSettings`, `CPBanks`
and `HealthCheckConfig`; megatron/packed_graphs/settings.py) that the graph runtime, the MoE
overflow monitor and the optimizer graph take. megatron.packed_graphs never reads ``args``.

The library config is for frameworks that drive training without a command line:
``load_training_config`` turns a YAML file or a dict keyed by the flags' dest names into the
``args`` the command line would give (the same parser and checks). docs/config-api.md.
"""

import argparse
import dataclasses
import os
from dataclasses import dataclass

import yaml

from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from megatron.packed_graphs.settings import (
    CPBanks,
    GraphSettings,
    HealthCheckConfig,
    MoEGraphSettings,
)


@dataclass
class PackedTransformerConfig(TransformerConfig):
    """megatron-core's TransformerConfig plus what only this fork's modules read."""

    cuda_graph_granularity: str = "layer"
    """'layer': one graph per layer; 'chunk': one per model chunk (packed_graphs/chunk_graphs.py)."""

    moe_dropless_graphs: bool = False
    """MoE layers dropless with static shapes, whole-layer graphs capture them
    (--moe-dropless-graphs; packed_model/moe_dropless.py)."""

    zero_padding_rows: bool = False
    """Padding rows of every layer input and output-projection input held at exactly zero,
    so that FP8 scales see only document tokens (set with --fp8-format;
    packed_model/padding_rows.py)."""

    moe_router_skew: float = 0.0
    """Benchmarks of unbalanced routing (--moe-router-skew): a fixed logit bias on the first
    eighth of the experts that sends about this fraction of the routed slots there; 0: off
    (packed_model/moe.py, `PackedTopKRouter`)."""


# Megatron-LM's YaRN flags (their args names) -> megatron-core's MLATransformerConfig fields.
MLA_YARN_FIELDS = {"yarn_original_max_position_embeddings": "original_max_position_embeddings",
                   "yarn_beta_fast": "beta_fast", "yarn_beta_slow": "beta_slow"}


@dataclass
class PackedMLATransformerConfig(PackedTransformerConfig, MLATransformerConfig):
    """PackedTransformerConfig with megatron-core's MLA fields (--multi-latent-attention)."""

    mla_pad_v: bool = True
    """Pad V to the query head size on packed data, as megatron-core does (--mla-pad-v);
    False hands TE's attention the narrower V (packed_model/mla.py)."""


def transformer_config_from_args(args) -> TransformerConfig:
    """The model's TransformerConfig from validated ``args`` (arguments.parse_args).

    On top of Megatron-LM's: the graph settings the layers read (the runtime's full-iteration
    graph is not megatron-core's: layers carry local graphs for the iterations it misses, and
    megatron-core's warm-up count means passes inside a capture, where
    ``--cuda-graph-warmup-steps`` counts eager iterations before it); TE's fused THD RoPE on the
    TE path (sync-free); and pipeline outputs never freed by the schedule (a graphed stage's
    output lives in the graph's static buffers)."""
    from megatron.training.arguments import core_transformer_config_from_args

    from megatron.packed_training.extra_args import uses_te_attention

    cls = PackedMLATransformerConfig if args.multi_latent_attention else PackedTransformerConfig
    config = core_transformer_config_from_args(args, cls)
    if not isinstance(config, cls):  # upstream picks MLATransformerConfig itself under MLA
        config = cls(**{field.name: getattr(config, field.name)
                        for field in dataclasses.fields(config) if field.init})
    impl = args.packed_graph_impl
    config.cuda_graph_impl = "local" if impl == "full_iteration" else impl
    config.cuda_graph_warmup_steps = 1
    config.cuda_graph_granularity = args.cuda_graph_granularity
    config.apply_rope_fusion = uses_te_attention(args)  # off on the TE-free path already
    config.deallocate_pipeline_outputs = False
    config.moe_dropless_graphs = getattr(args, "moe_dropless_graphs", False)
    config.moe_router_skew = getattr(args, "moe_router_skew", 0.0)
    config.zero_padding_rows = bool(getattr(args, "fp8", None))
    if args.multi_latent_attention:
        config.mla_pad_v = args.mla_pad_v == "always"
        # Megatron-LM's --yarn-* flags set only non-MLA YaRN fields; MLA's have other names.
        for dest, field_name in MLA_YARN_FIELDS.items():
            if getattr(args, dest, None) is not None:
                setattr(config, field_name, getattr(args, dest))
    return config


def graph_settings_from_args(args) -> GraphSettings:
    """The run's graph settings from validated ``args`` (arguments.parse_args or
    `load_training_config`); build them once, where the graph runtime is built.

    ``impl`` is the launch line's ``--cuda-graph-impl`` as given (``args.packed_graph_impl``),
    not ``args.cuda_graph_impl``, which Megatron-LM's loop sees ('local' or 'none'; why:
    `GraphSettings`). ``moe`` is None without ``--num-experts``, ``cp_banks`` None without
    ``--dynamic-cp-sizes``."""
    moe = banks = None
    if args.num_experts is not None:
        moe = MoEGraphSettings(
            dropless_graphs=args.moe_dropless_graphs,
            capacity_overflow=args.moe_capacity_overflow,
            expert_capacity_factor=args.moe_expert_capacity_factor,
            pad_expert_input_to_capacity=args.moe_pad_expert_input_to_capacity)
    if args.dynamic_cp_sizes:
        banks = CPBanks(sizes=tuple(args.dynamic_cp_sizes),
                        max_packed_seqs=tuple(args.dynamic_cp_max_packed_seqs),
                        tokens_per_rank=args.dynamic_cp_tokens_per_rank)
    return GraphSettings(
        impl=args.packed_graph_impl, granularity=args.cuda_graph_granularity,
        capacity=args.cuda_graph_max_packed_seqs,
        ladder=tuple(args.cuda_graph_capacity_ladder or ()),
        warmup_steps=args.cuda_graph_warmup_steps, optimizer_graph=args.packed_optimizer_graph,
        micro_batch_size=args.micro_batch_size, seq_length=args.seq_length,
        global_batch_size=args.global_batch_size, num_microbatches=args.num_microbatches,
        data_parallel_size=args.data_parallel_size,
        tensor_parallel_size=args.tensor_model_parallel_size,
        sequence_parallel=args.sequence_parallel,
        context_parallel_size=args.context_parallel_size,
        pipeline_parallel_size=args.pipeline_model_parallel_size,
        overlap_param_gather=args.overlap_param_gather, moe=moe, cp_banks=banks,
        health_check=HealthCheckConfig(interval=args.cuda_graph_check_interval,
                                       tolerance=args.cuda_graph_check_tolerance,
                                       action=args.cuda_graph_check_action))


def load_training_config(source: str | os.PathLike | dict, model: str = "gpt"
                         ) -> argparse.Namespace:
    """A YAML file or dict of training settings -> the validated ``args`` the command line
    would give for ``model`` ('gpt' or 'hybrid').

    Keys are the flags' dest names (``num_layers`` for ``--num-layers``; docs/flags.md);
    a list is a flag's values, a bool an on/off flag (``check_for_nan_in_loss_and_grad:
    false`` is ``--no-check-for-nan-in-loss-and-grad``). An unknown key or a bad value raises
    ``ValueError`` naming it."""
    from megatron.packed_training.arguments import build_parser, parse_args

    raw = read_training_mapping(source)
    actions = {action.dest: action for action in build_parser()._actions
               if action.option_strings and action.dest != "help"}
    unknown = sorted(str(key) for key in raw if key not in actions)
    if unknown:
        raise ValueError(f"training config key is wrong: {', '.join(unknown)}. Keys are the "
                         "flags' dest names (docs/flags.md).")
    argv = [token for dest, value in raw.items() for token in _argv(actions[dest], value)]
    return parse_args(argv, model, raise_on_error=True)


def read_training_mapping(source) -> dict:
    """A training config as a ``{dest: value}`` dict (a copy): from a mapping, or read from a
    YAML file. ValueError where the file holds something else."""
    if isinstance(source, dict):
        return dict(source)
    with open(source) as f:
        raw = yaml.safe_load(f)
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ValueError(f"{os.fspath(source)} is wrong: a {type(raw).__name__}. A training "
                         "config file holds one mapping of key: value.")
    return raw


def _argv(action: argparse.Action, value) -> list[str]:
    """The command-line tokens that set ``action``'s dest to ``value`` (None: the default)."""
    flag = action.option_strings[0]
    if value is None:
        return []
    if action.nargs == 0:  # store_true / store_false
        if not isinstance(value, bool):
            raise ValueError(f"{action.dest} is wrong: {value!r}. It is an on/off flag; use "
                             "true or false.")
        return [flag] if value != action.default else []
    if isinstance(value, (bool, dict, set)):
        raise ValueError(f"{action.dest} is wrong: {value!r}. It takes a value.")
    if isinstance(value, (list, tuple)):
        if action.nargs not in ("+", "*") and not isinstance(action.nargs, int):
            raise ValueError(f"{action.dest} is wrong: {value!r}. It takes one value.")
        return [flag, *map(str, value)] if value else []
    return [f"{flag}={value}"]  # '=' keeps a value such as '-M*M' from reading as a flag
