"""Train a GPT model on packed (THD) sequences.

    torchrun --nproc-per-node 8 pretrain_gpt.py --sft --data-path data.jsonl \
        --num-layers 16 --hidden-size 1024 --num-attention-heads 16 --seq-length 4096 ...

See docs/quickstart.md and docs/flags.md.
"""

import sys


def model_provider(args, config, pre_process=True, post_process=True, vp_stage=None):
    """GPTModel with the packed-sequence layer spec of ``--attention-backend``
    (megatron.packed_training.models.gpt_model; the library API builds it too)."""
    from megatron.packed_training.models import gpt_model

    return gpt_model(args, config, pre_process=pre_process, post_process=post_process,
                     vp_stage=vp_stage)


def main(argv=None):
    from megatron.packed_training.pretrain import run_pretraining

    run_pretraining("gpt", model_provider, "pretrain_gpt.py", argv)


if __name__ == "__main__":
    sys.exit(main())
