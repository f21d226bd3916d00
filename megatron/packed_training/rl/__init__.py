"""The graphed packed training step as a library (docs/rl.md): a framework's own loop calls
`PackedPolicy.train_step` with a loss function, `PackedPolicy.logprobs` on forward-only
graphs, swaps or reloads weights in place, exports them to an inference engine, and
offloads the policy around a rollout engine on the same GPU.

    from megatron.packed_training.rl import PackedPolicy, PolicyConfig, PackedSequences
    from megatron.packed_training.rl.losses import clipped_policy_loss
"""

from megatron.packed_training.rl.batches import PackedSequences, deal_micro_batches, pack_sequences
from megatron.packed_training.rl.offload import MemoryMove
from megatron.packed_training.rl.policy import (
    LogProbOutputs,
    PackedPolicy,
    PolicyConfig,
    TrainResult,
)
from megatron.packed_training.rl.steps import LossInputs
from megatron.packed_training.rl.weights import WeightStore, policy_weights

__all__ = ["LogProbOutputs", "LossInputs", "MemoryMove", "PackedPolicy", "PackedSequences",
           "PolicyConfig", "TrainResult", "WeightStore", "deal_micro_batches", "pack_sequences",
           "policy_weights"]
