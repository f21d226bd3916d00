"""Build megatron-core's config objects from parsed training arguments, and the library config.

One place turns `args` into `TransformerConfig`, `OptimizerConfig` and
`DistributedDataParallelConfig`, so the CLI and any programmatic driver produce the same
configs.

The library config is for frameworks that drive training without a command line:
``load_training_config`` turns a YAML file or a dict keyed by the flags' dest names into the
``argparse.Namespace`` the CLI would produce (same parser, same ``validate_args``), and
``CudaGraphConfig`` / ``resolve_cuda_graph_config`` are its typed CUDA graph part. Every key,
the mapping to the CLI flags and where the two differ: docs/config-api.md.
"""

import argparse
import dataclasses
import os
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import yaml

from megatron.core.activations import squared_relu
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig
from megatron.core.transformer.enums import CudaGraphModule
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
from megatron.packed_training import argument_checks as checks
from megatron.packed_training.arguments import build_parser, validate_args
from megatron.packed_graphs.attention import resolve_attention_backend


def params_dtype(args) -> torch.dtype:
    return torch.bfloat16 if args.bf16 else torch.float32


def _pipeline_peers_coincide(args) -> bool:
    """PP=2 with interleaving: a rank's previous and next stage are the same rank.

    megatron-core 0.16.1's batched p2p posts [send_prev, recv_prev, send_next, recv_next] in
    one batch_isend_irecv; when both peers are one rank, the steady state of the interleaved
    schedule sends a gradient and an activation of the same shape to it and they are received
    swapped, silently (loss off from the third micro-batch). The unbatched path keeps the two
    directions apart, so it is used there.
    """
    return (args.pipeline_model_parallel_size == 2
            and args.virtual_pipeline_model_parallel_size is not None)


@dataclass
class PackedTransformerConfig(TransformerConfig):
    """megatron-core's TransformerConfig plus what only this fork's modules read."""

    cuda_graph_granularity: str = "layer"
    """'layer': one graph per layer; 'chunk': one per model chunk (packed_graphs/chunk_graphs.py)."""


@dataclass
class PackedMLATransformerConfig(PackedTransformerConfig, MLATransformerConfig):
    """PackedTransformerConfig with megatron-core's MLA fields (--multi-latent-attention)."""

    mla_pad_v: bool = True
    """Pad V to the query head size on packed data, as megatron-core does (--mla-pad-v);
    False hands TE's attention the narrower V (packed_graphs/mla.py)."""


def transformer_config_from_args(args) -> TransformerConfig:
    """TransformerConfig for a packed GPT or hybrid model (``args.model``: 'gpt' | 'hybrid')."""
    dtype = params_dtype(args)
    kwargs = dict(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        sequence_parallel=args.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=args.bf16,
        normalization=args.normalization,
        layernorm_epsilon=args.layernorm_epsilon,
        gated_linear_unit=args.swiglu,
        qk_layernorm=args.qk_layernorm,  # per-head norms; MLA: latent norms
        activation_func=mlp_activation(args),
        add_bias_linear=False,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        # TE-free runs use unfused kernels; TE runs pick TE's fused paths through the spec.
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        # TE's fused THD RoPE is the sync-free one on the TE path (see packed_graphs/specs.py).
        apply_rope_fusion=resolve_attention_backend(args.attention_backend) == "te",
        calculate_per_token_loss=args.calculate_per_token_loss,
        cross_entropy_loss_fusion=args.cross_entropy_loss_fusion,
        cross_entropy_fusion_impl=args.cross_entropy_fusion_impl or "native",
        deterministic_mode=args.deterministic_mode,
        batch_p2p_comm=not _pipeline_peers_coincide(args),
        # full_iteration: the iteration graph is the graph runtime's (full_iteration.py); the
        # model's layers carry local graphs for the iterations it misses.
        cuda_graph_impl=("local" if args.cuda_graph_impl == "full_iteration"
                         else args.cuda_graph_impl),
        use_te_rng_tracker=args.te_rng_tracker,
        # [] = the whole layer (megatron-core's deprecated "full").
        cuda_graph_modules=[CudaGraphModule[name] for name in args.cuda_graph_modules],
        # megatron-core's meaning: warm-up passes inside each capture. Our
        # --cuda-graph-warmup-steps counts eager iterations before capture instead.
        cuda_graph_warmup_steps=1,
        cuda_graph_granularity=args.cuda_graph_granularity,
    )
    kwargs.update(moe_kwargs(args))
    kwargs.update(mla_kwargs(args))
    if args.model == "hybrid":
        kwargs.update(
            mamba_state_dim=args.mamba_state_dim,
            mamba_head_dim=args.mamba_head_dim,
            mamba_num_groups=args.mamba_num_groups,
            mamba_num_heads=args.mamba_num_heads,
        )
    if getattr(args, "multi_latent_attention", False):
        return PackedMLATransformerConfig(**kwargs)
    return PackedTransformerConfig(**kwargs)


def mlp_activation(args):
    """The MLP's (and the experts') activation: SiLU gated (--swiglu), relu(x)^2
    (--squared-relu, megatron-core's own function), else GELU."""
    if args.swiglu:
        return F.silu
    return squared_relu if args.squared_relu else F.gelu


def moe_kwargs(args) -> dict:
    """TransformerConfig fields of the MoE flags (each flag's dest is Megatron's; the config
    names are megatron-core's). Empty without --num-experts."""
    if getattr(args, "num_experts", None) is None:
        return {}
    return dict(
        num_moe_experts=args.num_experts,
        moe_layer_freq=args.moe_layer_freq,
        moe_router_topk=args.moe_router_topk,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        moe_router_load_balancing_type=args.moe_router_load_balancing_type,
        moe_aux_loss_coeff=args.moe_aux_loss_coeff,
        moe_z_loss_coeff=args.moe_z_loss_coeff,
        moe_router_score_function=args.moe_router_score_function,
        moe_router_pre_softmax=args.moe_router_pre_softmax,
        moe_router_enable_expert_bias=args.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=args.moe_router_bias_update_rate,
        moe_router_topk_scaling_factor=args.moe_router_topk_scaling_factor,
        moe_router_num_groups=args.moe_router_num_groups,
        moe_router_group_topk=args.moe_router_group_topk,
        moe_router_dtype=args.moe_router_dtype,
        moe_token_dispatcher_type=args.moe_token_dispatcher_type,
        moe_expert_capacity_factor=args.moe_expert_capacity_factor,
        moe_pad_expert_input_to_capacity=args.moe_pad_expert_input_to_capacity,
        moe_grouped_gemm=args.moe_grouped_gemm,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
    )


def mla_kwargs(args) -> dict:
    """MLATransformerConfig fields of the MLA flags (Megatron's names; yarn RoPE, fused by the
    TE backend's ``apply_rope_fusion``). Empty without --multi-latent-attention."""
    if not getattr(args, "multi_latent_attention", False):
        return {}
    return dict(
        multi_latent_attention=True,
        q_lora_rank=args.q_lora_rank,
        kv_lora_rank=args.kv_lora_rank,
        qk_head_dim=args.qk_head_dim,
        qk_pos_emb_head_dim=args.qk_pos_emb_head_dim,
        v_head_dim=args.v_head_dim,
        rope_type="yarn",
        rotary_base=args.rotary_base,
        rotary_scaling_factor=args.rotary_scaling_factor,
        original_max_position_embeddings=args.original_max_position_embeddings,
        beta_fast=args.beta_fast,
        beta_slow=args.beta_slow,
        mscale=args.mscale,
        mscale_all_dim=args.mscale_all_dim,
        mla_pad_v=getattr(args, "mla_pad_v", "always") == "always",
    )


def optimizer_config_from_args(args) -> OptimizerConfig:
    return OptimizerConfig(
        optimizer="adam",
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        clip_grad=args.clip_grad,
        bf16=args.bf16,
        params_dtype=params_dtype(args),
        use_distributed_optimizer=args.use_distributed_optimizer,
        log_num_zeros_in_grad=args.log_num_zeros_in_grad,
        # Capturable Adam kernels (lr and step count read on the device): optimizer_graph.py.
        optimizer_cuda_graph=args.optimizer_cuda_graph,
    )


def ddp_config_from_args(args) -> DistributedDataParallelConfig:
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        use_distributed_optimizer=args.use_distributed_optimizer,
        check_for_nan_in_grad=args.check_for_nan_in_loss_and_grad,
    )


# ------------------------------------------------------------------------- library config


@dataclass(frozen=True)
class CudaGraphConfig:
    """CUDA graph keys of the library config. Every key is optional; all unset = graphs off.

    Each key is the dest name of a CLI flag (``cuda_graph_impl`` = ``--cuda-graph-impl``) and
    None means "the CLI default". ``resolve_cuda_graph_config`` validates it.
    """

    cuda_graph_impl: str | None = None
    """'none' (default), 'local' (megatron-core CudaGraphManager), 'transformer_engine' or
    'full_iteration' (a training iteration as one graph, local layer graphs for the rest)."""
    cuda_graph_modules: str | list[str] | None = None
    """CudaGraphModule names, comma- or space-separated or a list; unset = the whole layer."""
    cuda_graph_max_packed_seqs: int | None = None
    """Graph capacity: packed documents per micro-batch; > 0 exactly when graphs are on."""
    cuda_graph_granularity: str | None = None
    """'layer' (default): one graph per layer; 'chunk': one per model chunk (local only)."""
    cuda_graph_capacity_ladder: list[int] | None = None
    """Smaller capacities below cuda_graph_max_packed_seqs, ascending (PP=1 only)."""
    cuda_graph_warmup_steps: int | None = None
    """Eager training steps before capture (default 3)."""
    enable_cuda_graph: bool | None = None
    """Deprecated: True means cuda_graph_impl 'local' and warns; prefer cuda_graph_impl."""
    cuda_graph_scope: str | list[str] | None = None
    """Deprecated spelling of cuda_graph_modules; warns. Not together with cuda_graph_modules."""


GRAPH_KEYS = tuple(field.name for field in dataclasses.fields(CudaGraphConfig))


@dataclass(frozen=True)
class ResolvedCudaGraphConfig:
    """Validated graph settings: the values ``validate_args`` leaves on ``args``, plus RNG."""

    cuda_graph_impl: str
    """'none', 'local', 'transformer_engine' or 'full_iteration'."""
    cuda_graph_modules: tuple[str, ...]
    """De-duplicated CudaGraphModule names; () = the whole layer."""
    cuda_graph_max_packed_seqs: int
    """Graph capacity; 0 exactly when graphs are off."""
    cuda_graph_granularity: str
    """'layer' or 'chunk'."""
    cuda_graph_capacity_ladder: tuple[int, ...]
    """Capacities below cuda_graph_max_packed_seqs, ascending; () = one capacity."""
    cuda_graph_warmup_steps: int
    """Eager training steps before capture."""
    rng_tracker_for_graphs: bool
    """True whenever graphs are on: the CUDA RNG tracker must be megatron-core's graph-safe
    one. ``initialize.set_seeds`` installs it (``use_cudagraphable_rng=True``) on every run,
    so this records the requirement rather than switching anything."""


def cuda_graph_config_from_args(args) -> ResolvedCudaGraphConfig:
    """The resolved graph config of validated CLI ``args`` (the same type the library gives)."""
    return ResolvedCudaGraphConfig(
        cuda_graph_impl=args.cuda_graph_impl,
        cuda_graph_modules=tuple(args.cuda_graph_modules),
        cuda_graph_max_packed_seqs=args.cuda_graph_max_packed_seqs,
        cuda_graph_granularity=args.cuda_graph_granularity,
        cuda_graph_capacity_ladder=tuple(args.cuda_graph_capacity_ladder),
        cuda_graph_warmup_steps=args.cuda_graph_warmup_steps,
        rng_tracker_for_graphs=args.cuda_graph_impl != "none",
    )


def resolve_cuda_graph_config(raw: dict | CudaGraphConfig,
                              model: str | None = None) -> ResolvedCudaGraphConfig:
    """Validate library graph keys with the CLI's rules and fill the CLI's defaults.

    Differences from the CLI: the deprecated ``enable_cuda_graph`` is accepted (True means
    impl 'local', with a ``DeprecationWarning``; conflicting values are a ``ValueError``), and
    modules with impl 'none' warn (``UserWarning``) and are dropped instead of being an error.
    ``cuda_graph_scope`` is the deprecated spelling of ``cuda_graph_modules`` (a
    ``FutureWarning``, as ``--cuda-graph-scope``). ``model`` ('gpt' | 'hybrid') enables the
    model-specific module check (no 'mamba' on gpt).
    """
    if isinstance(raw, CudaGraphConfig):
        raw = dataclasses.asdict(raw)
    _reject_unknown(raw, GRAPH_KEYS, "cuda graph config")
    parser = build_parser(model or "gpt")
    actions = _flag_actions(parser)
    given = {key: value for key, value in raw.items() if value is not None}
    for key in ("cuda_graph_impl", "cuda_graph_granularity"):
        if key in given and given[key] not in actions[key].choices:
            choices = [c for c in actions[key].choices if c not in checks.REFUSED_GRAPH_IMPLS]
            checks.fail(key, repr(given[key]), f"Use one of {', '.join(choices)}")
    for key in ("cuda_graph_max_packed_seqs", "cuda_graph_warmup_steps"):
        if key in given and (isinstance(given[key], bool) or not isinstance(given[key], int)):
            checks.fail(key, repr(given[key]), "Use an integer")
    ladder = given.get("cuda_graph_capacity_ladder")
    if ladder is not None and (not isinstance(ladder, (list, tuple)) or not all(
            isinstance(n, int) and not isinstance(n, bool) for n in ladder)):
        checks.fail("cuda_graph_capacity_ladder", repr(ladder), "Use a list of integers, e.g. "
                                                                "[16, 64, 256]")
    impl = _impl_from_deprecated(given.get("cuda_graph_impl"), given.get("enable_cuda_graph"))
    impl = impl or parser.get_default("cuda_graph_impl")
    values, key = checks.cuda_graph_modules_given(given.get("cuda_graph_modules"),
                                                  given.get("cuda_graph_scope"),
                                                  "cuda_graph_modules", "cuda_graph_scope")
    modules = checks.normalise_cuda_graph_modules(_module_values(values, key),
                                                  "--" + key.replace("_", "-"))
    if modules and impl == "none":
        warnings.warn(f"{key} {','.join(modules)} is not applied: cuda_graph_impl is none. Set "
                      f"cuda_graph_impl: local to capture it, or drop {key}.",
                      UserWarning, stacklevel=2)
        modules = []
    args = argparse.Namespace(model=model, cuda_graph_impl=impl, cuda_graph_modules=modules)
    for key in ("cuda_graph_max_packed_seqs", "cuda_graph_granularity",
                "cuda_graph_capacity_ladder", "cuda_graph_warmup_steps"):
        setattr(args, key, given.get(key, parser.get_default(key)))
    checks.check_cuda_graphs(args)  # the CLI's rules: capacity, granularity, TE, mamba on gpt
    return cuda_graph_config_from_args(args)


def _impl_from_deprecated(impl: str | None, enable: bool | None) -> str | None:
    """cuda_graph_impl after the deprecated enable_cuda_graph (None when neither is given)."""
    if enable is None:
        return impl
    if not isinstance(enable, bool):
        checks.fail("enable_cuda_graph", repr(enable), "Use true or false, or better drop it "
                                                       "and set cuda_graph_impl")
    warnings.warn("enable_cuda_graph is deprecated; set cuda_graph_impl: local (graphs on) or "
                  "none (graphs off) instead.", DeprecationWarning, stacklevel=3)
    if enable and impl not in (None, "local"):
        checks.fail("enable_cuda_graph", True, f"It means cuda_graph_impl 'local' and conflicts "
                                               f"with cuda_graph_impl {impl!r}; drop "
                                               "enable_cuda_graph")
    if not enable and impl == "local":
        checks.fail("enable_cuda_graph", False, "It conflicts with cuda_graph_impl 'local'; "
                                                "drop enable_cuda_graph")
    return "local" if enable else impl


def _module_values(modules, key: str) -> list[str]:
    """A module string ('attn,mlp' or 'attn mlp') or list -> the words the CLI would receive."""
    if modules is None:
        return []
    if isinstance(modules, str):
        return modules.split()
    if isinstance(modules, (list, tuple)) and all(isinstance(name, str) for name in modules):
        return [word for name in modules for word in name.split()]
    checks.fail(key, repr(modules), "Use a string such as 'attn,mlp' or a list of "
                                    "CudaGraphModule names")


def load_training_config(source: str | os.PathLike | dict,
                         world_size: int | None = None) -> argparse.Namespace:
    """A YAML file or dict of training settings -> the validated ``args`` the CLI would give.

    Keys are the flags' dest names (``num_layers`` for ``--num-layers``, docs/flags.md), the
    graph keys of ``CudaGraphConfig`` and ``model`` ('gpt', the default, or 'hybrid'). Values
    go through the CLI's own parser (types, choices, defaults of ``build_parser(model)``) and
    ``validate_args``; ``world_size`` as there. Any bad key or value is a ``ValueError``.
    """
    raw = _read_mapping(source)
    model = raw.pop("model", "gpt")
    checks.check_model_name(model)
    parser = build_parser(model)
    actions = _flag_actions(parser)
    _reject_unknown(raw, set(actions) | set(GRAPH_KEYS), "training config")
    missing = [dest for dest, action in actions.items()
               if action.required and raw.get(dest) is None]
    if missing:
        checks.fail("training config", f"no {', '.join(missing)}",
                    f"Give every required key: {', '.join(missing)}")
    graphs = resolve_cuda_graph_config({key: raw.pop(key) for key in GRAPH_KEYS if key in raw},
                                       model=model)
    settings = {**raw, **dataclasses.asdict(graphs)}
    del settings["rng_tracker_for_graphs"]
    argv = [token for dest, value in settings.items() for token in _argv(actions[dest], value)]

    def _error(message):
        checks.fail("training config", message, "Keys are the flags' dest names; see "
                                                "docs/flags.md")

    parser.error = _error  # argparse would exit; a library caller gets a ValueError
    return validate_args(parser.parse_args(argv), model, world_size)


def _read_mapping(source) -> dict:
    if isinstance(source, dict):
        return dict(source)
    with open(source) as f:
        raw = yaml.safe_load(f)
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        checks.fail(os.fspath(source), type(raw).__name__,
                    "A training config file holds one mapping of key: value")
    return raw


def _flag_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """dest -> argparse action of every flag (not --help)."""
    return {action.dest: action for action in parser._actions
            if action.option_strings and action.dest != "help"}


def _reject_unknown(raw: dict, allowed, what: str):
    unknown = sorted(str(key) for key in raw if key not in allowed)
    if unknown:
        checks.fail(f"{what} key", ", ".join(unknown),
                    f"Allowed keys are {', '.join(sorted(allowed))}")


def _argv(action: argparse.Action, value) -> list[str]:
    """The CLI tokens that set ``action``'s dest to ``value`` (None: leave the default)."""
    flag = action.option_strings[0]
    if value is None:
        return []
    if action.nargs == 0:  # store_true or --x/--no-x
        if not isinstance(value, bool):
            checks.fail(action.dest, repr(value), "It is an on/off flag; use true or false")
        if isinstance(action, argparse.BooleanOptionalAction):
            return [flag if value else action.option_strings[1]]
        return [flag] if value else []
    if isinstance(value, bool) or isinstance(value, (dict, set)):
        checks.fail(action.dest, repr(value), "It takes a value, not an on/off switch or mapping")
    if isinstance(value, (list, tuple)) and getattr(action, "list_literal", False):
        return [flag, repr(list(value))]  # the CLI's list expression, e.g. [0, 1, 1]
    if isinstance(value, (list, tuple)):
        if action.nargs != "+":
            checks.fail(action.dest, repr(value), "It takes one value, not a list")
        return [flag, *map(str, value)] if value else []
    return [f"{flag}={value}"]  # '=' keeps a value such as '-M*M' from reading as a flag
