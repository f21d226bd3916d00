"""Train a hybrid Mamba-Transformer model on packed (THD) sequences.

    torchrun --nproc-per-node 8 pretrain_mamba.py --sft --data-path data.jsonl \
        --hybrid-override-pattern "M-M*-M*-" --hidden-size 1024 --num-attention-heads 16 ...

The pattern has one character per layer: 'M' Mamba, '*' attention, '-' MLP, 'E' MoE
(with --num-experts; docs/moe.md), '+' multi-latent attention (with --multi-latent-attention;
docs/mla.md).
See docs/quickstart.md and docs/flags.md.
"""

import sys


def model_provider(args, config, pre_process=True, post_process=True, vp_stage=None):
    """HybridModel built from the packed hybrid stack spec of ``--attention-backend``."""
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    from megatron.packed_graphs.attention import resolve_attention_backend
    from megatron.packed_training.extra_args import packed_attention_backend
    from megatron.packed_graphs.specs import hybrid_stack_spec

    backend = resolve_attention_backend(packed_attention_backend(args))
    return HybridModel(
        config=config,
        hybrid_stack_spec=hybrid_stack_spec(
            backend, args.normalization, num_experts=getattr(args, "num_experts", None),
            moe_grouped_gemm=getattr(args, "moe_grouped_gemm", False),
            multi_latent_attention=getattr(args, "multi_latent_attention", False),
            qk_layernorm=args.qk_layernorm),
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


def main(argv=None):
    from megatron.packed_training.pretrain import run_pretraining

    run_pretraining("hybrid", model_provider, "pretrain_mamba.py", argv)


if __name__ == "__main__":
    sys.exit(main())
