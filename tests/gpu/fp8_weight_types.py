"""``torchrun`` worker of test_fp8_graphs.py: build the tiny GPT with ``--fp8-param-gather``
through the fork's library and write each parameter's class name to the JSON file argv[1]."""

import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TRAINING = {
    "num_layers": 2, "hidden_size": 256, "ffn_hidden_size": 1024, "swiglu": True,
    "num_attention_heads": 8, "group_query_attention": True, "num_query_groups": 4,
    "seq_length": 1024, "max_position_embeddings": 1024, "vocab_size": 1024,
    "position_embedding_type": "rope", "normalization": "RMSNorm", "add_bias_linear": False,
    "hidden_dropout": 0.0, "attention_dropout": 0.0, "micro_batch_size": 1,
    "global_batch_size": 1, "train_iters": 1, "lr": 1e-4, "bf16": True, "sft": True,
    "mock_data": True, "eval_iters": 0, "fp8": "e4m3", "fp8_recipe": "tensorwise",
    "use_distributed_optimizer": True, "fp8_param_gather": True,
}


def main(out: str) -> None:
    sys.path.insert(0, REPO)
    import torch

    from megatron.packed_training.rl import PackedPolicy, PolicyConfig

    policy = PackedPolicy.build(PolicyConfig(TRAINING, model="gpt"))
    types = {name: type(param).__name__
             for chunk in policy.model for name, param in chunk.named_parameters()}
    with open(out, "w") as f:
        json.dump(types, f, indent=1)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
