"""The models the fork trains, built from validated arguments: the model providers of
``pretrain_gpt.py`` and ``pretrain_mamba.py``, importable from the installed package (the
library API builds them without the scripts).

Each builder is Megatron-LM's model-provider body: ``build(args, config, pre_process,
post_process, vp_stage)`` -> the model chunk, with the packed layer specs of
``--attention-backend`` (packed_graphs/specs.py). Without apex, megatron-core's own linears
(the output layer) are built with unfused gradient accumulation while TE's fuse
(`model_layers.megatron_core_linears_unfused_without_apex`).
"""

from megatron.packed_upstream import model_layers


def gpt_model(args, config, pre_process=True, post_process=True, vp_stage=None):
    """GPTModel with the packed-sequence layer spec of ``--attention-backend``."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron.packed_model.attention import resolve_attention_backend
    from megatron.packed_graphs.chunk_graphs import use_chunk_graph_block
    from megatron.packed_graphs.specs import gpt_decoder_spec

    model_layers.megatron_core_linears_unfused_without_apex()
    backend = resolve_attention_backend(packed_attention_backend(args))
    model = GPTModel(
        config=config,
        transformer_layer_spec=gpt_decoder_spec(
            config, backend, args.normalization, num_experts=getattr(args, "num_experts", None),
            moe_grouped_gemm=getattr(args, "moe_grouped_gemm", False),
            multi_latent_attention=getattr(args, "multi_latent_attention", False),
            qk_layernorm=args.qk_layernorm, vp_stage=vp_stage),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        # Llama 3.x frequency scaling (--use-rope-scaling), as Megatron-LM's GPT builder
        # passes it: without it a converted Llama 3.1+ would rotate with unscaled RoPE.
        rope_scaling=args.use_rope_scaling,
        rope_scaling_factor=args.rope_scaling_factor,
        vp_stage=vp_stage,
    )
    use_chunk_graph_block(model.decoder)
    return model


def hybrid_model(args, config, pre_process=True, post_process=True, vp_stage=None):
    """HybridModel built from the packed hybrid stack spec of ``--attention-backend``."""
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    from megatron.packed_model.attention import resolve_attention_backend
    from megatron.packed_graphs.specs import hybrid_stack_spec

    model_layers.megatron_core_linears_unfused_without_apex()
    backend = resolve_attention_backend(packed_attention_backend(args))
    return HybridModel(
        config=config,
        hybrid_stack_spec=hybrid_stack_spec(
            backend, args.normalization, num_experts=getattr(args, "num_experts", None),
            moe_grouped_gemm=getattr(args, "moe_grouped_gemm", False),
            multi_latent_attention=getattr(args, "multi_latent_attention", False),
            qk_layernorm=args.qk_layernorm,
            mamba_conv_kernel_size=getattr(args, "mamba_conv_kernel_size", 4)),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        hybrid_layer_pattern=args.hybrid_layer_pattern,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
    )


def packed_attention_backend(args) -> str:
    """The fork's attention for Megatron-LM's ``--attention-backend``: TE's backends (flash,
    fused, unfused) run TE attention ('te'); local runs the TE-free varlen attention
    (flash-attn where importable, else PyTorch's); auto prefers TE, then as local."""
    from megatron.packed_training.extra_args import TE_ATTENTION, is_importable

    name = args.attention_backend.name
    if name in TE_ATTENTION:
        return "te"
    if name == "local":
        return "flash" if is_importable("flash_attn") else "torch"
    return "auto"


MODEL_BUILDERS = {"gpt": gpt_model, "hybrid": hybrid_model}
"""Builder by model kind, the ``model`` argument of load_training_config."""
