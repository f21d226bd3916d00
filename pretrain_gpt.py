"""Train a GPT model on packed (THD) sequences.

    torchrun --nproc-per-node 8 pretrain_gpt.py --sft --data-path data.jsonl \
        --num-layers 16 --hidden-size 1024 --num-attention-heads 16 --seq-length 4096 ...

See docs/quickstart.md and docs/flags.md.
"""

import sys


def model_provider(args, config, pre_process=True, post_process=True, vp_stage=None):
    """GPTModel with the packed-sequence layer spec of ``--attention-backend``."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron.packed_graphs.attention import resolve_attention_backend
    from megatron.packed_training.extra_args import packed_attention_backend
    from megatron.packed_graphs.chunk_graphs import use_chunk_graph_block
    from megatron.packed_graphs.specs import gpt_decoder_spec

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
        vp_stage=vp_stage,
    )
    use_chunk_graph_block(model.decoder)
    return model


def main(argv=None):
    from megatron.packed_training.pretrain import run_pretraining

    run_pretraining("gpt", model_provider, "pretrain_gpt.py", argv)


if __name__ == "__main__":
    sys.exit(main())
