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
    """HybridModel built from the packed hybrid stack spec of ``--attention-backend``
    (megatron.packed_training.models.hybrid_model; the library API builds it too)."""
    from megatron.packed_training.models import hybrid_model

    return hybrid_model(args, config, pre_process=pre_process, post_process=post_process,
                        vp_stage=vp_stage)


def main(argv=None):
    from megatron.packed_training.pretrain import run_pretraining

    run_pretraining("hybrid", model_provider, "pretrain_mamba.py", argv)


if __name__ == "__main__":
    sys.exit(main())
