"""Build megatron-core's config objects from parsed training arguments.

One place turns `args` into `TransformerConfig`, `OptimizerConfig` and
`DistributedDataParallelConfig`, so the CLI and any programmatic driver produce the same
configs.
"""

import torch
import torch.nn.functional as F

from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig
from megatron.core.transformer.enums import CudaGraphScope
from megatron.core.transformer.transformer_config import TransformerConfig


def params_dtype(args) -> torch.dtype:
    return torch.bfloat16 if args.bf16 else torch.float32


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
        activation_func=F.silu if args.swiglu else F.gelu,
        add_bias_linear=False,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        # TE-free runs use unfused kernels; TE runs pick TE's fused paths through the spec.
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        calculate_per_token_loss=args.calculate_per_token_loss,
        deterministic_mode=args.deterministic_mode,
        cuda_graph_impl=args.cuda_graph_impl,
        # [] = the whole layer (megatron-core's deprecated "full").
        cuda_graph_scope=[CudaGraphScope[name] for name in args.cuda_graph_scope],
        # megatron-core's meaning: warm-up passes inside each capture. Our
        # --cuda-graph-warmup-steps counts eager iterations before capture instead.
        cuda_graph_warmup_steps=1,
    )
    if args.model == "hybrid":
        kwargs.update(
            mamba_state_dim=args.mamba_state_dim,
            mamba_head_dim=args.mamba_head_dim,
            mamba_num_groups=args.mamba_num_groups,
            mamba_num_heads=args.mamba_num_heads,
        )
    return TransformerConfig(**kwargs)


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
    )


def ddp_config_from_args(args) -> DistributedDataParallelConfig:
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        use_distributed_optimizer=args.use_distributed_optimizer,
        check_for_nan_in_grad=True,
    )
