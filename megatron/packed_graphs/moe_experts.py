"""`TorchGroupedMLP`: an MoE layer's local experts as one grouped GEMM per linear, over group
boundaries that stay on the device (grouped_gemm.py).

It takes the rows the dropless dispatcher (moe_dropless.py) lays out, one group per local
expert in expert order, each padded to the grouped-GEMM alignment with zero rows of
probability zero, and ``tokens_per_expert``, the group sizes as a device tensor. The group
ends are a ``cumsum`` on the device: nothing is read on the host, so the experts replay in a
CUDA graph whatever the routing.

Parameters: every local expert's ``linear_fc1`` and ``linear_fc2`` weights stacked,
``fc1_weight [experts, fc1 out, hidden]`` and ``fc2_weight [experts, hidden, ffn]``; each
slice is the weight of that expert's linear in megatron-core's layout (with a gated linear
unit the fc1 rows hold the gate half, then the linear half). One parameter per linear (as
megatron-core's legacy GroupedMLP had) lets the GEMM read the weights where they live:
megatron-core's per-expert parameters would be copied into a stacked tensor on every call
(the whole expert weight, twice per micro-batch), and DDP moves per-expert parameters into
its own buffers, so they cannot be made views of one tensor.

Initialisation draws like megatron-core's experts, in the same order and from the same
generators: ``init_order="per_expert"`` as SequentialMLP (each expert's fc1, then its fc2),
``"per_linear"`` as TEGroupedMLP (every expert's fc1, then every fc2). The experts of a run
that switches to these start where megatron-core's would (for the TE-free SequentialMLP that
is exact; tests/unit/test_moe_dropless.py).

Checkpoints (`sharded_state_dict`): ``fc1_weight`` and ``fc2_weight`` as tensors of all the
layer's experts, ``[experts, ...]``, the expert axis split over the expert-parallel ranks and
replicated over expert data parallelism. megatron-core's per-expert experts save other keys
(``experts.linear_fc1.weight`` per expert): a checkpoint does not move between the two yet.

Activations follow megatron-core's MLP: SwiGLU (``--swiglu``, fused unless
``--no-bias-swiglu-fusion``, megatron-core's ``weighted_bias_swiglu_impl``), squared ReLU
(``--squared-relu``; fused with ``use_fused_weighted_squared_relu``), and any other
``activation_func``, gated or not; the routing probability scales the activation before fc2.
"""

from typing import Optional

import torch
from torch import Tensor
from torch.nn import Parameter

from megatron.core.activations import squared_relu
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.fusions.fused_bias_geglu import quick_gelu, weighted_bias_quick_geglu_impl
from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl
from megatron.core.fusions.fused_weighted_squared_relu import weighted_squared_relu_impl
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.random import (
    get_cuda_rng_tracker,
    get_expert_parallel_rng_tracker_name,
)
from megatron.core.transformer.module import MegatronModule

from megatron.packed_graphs.grouped_gemm import grouped_linear

INIT_ORDERS = ("per_expert", "per_linear")


class TorchGroupedMLP(MegatronModule):
    """The local experts of one MoE layer (module doc). megatron-core's ExpertsInterface:
    ``forward(rows, tokens_per_expert, probs) -> (output, None)``.

    ``rows`` ``[R, hidden]``: the dispatched rows, one group per local expert in order, each
    group holding ``tokens_per_expert[e]`` rows (a device int tensor, the aligned sizes), zero
    rows with probability zero where a group is padded, and rows past the last group that no
    GEMM reads. ``probs`` ``[R]``: each row's routing probability. Returns ``[R, hidden]``:
    rows past the last group are unspecified (torch's grouped GEMM leaves them unwritten).
    No host sync.
    """

    def __init__(self, num_local_experts: int, config, *, pg_collection=None,
                 name: str | None = None, init_order: str = "per_expert"):
        super().__init__(config=config)
        self.ep_group = pg_collection.ep if pg_collection is not None else None
        self.expert_dp_group = pg_collection.expt_dp if pg_collection is not None else None
        if init_order not in INIT_ORDERS:
            raise ValueError(f"init_order is wrong: {init_order!r}. Use one of {INIT_ORDERS}.")
        unsupported = [name for name, on in (
            ("add_bias_linear (expert biases)", config.add_bias_linear),
            ("use_te_activation_func", config.use_te_activation_func),
            ("moe_act recompute", config.recompute_granularity == "selective"
             and "moe_act" in (config.recompute_modules or ())),
            ("fp8", bool(config.fp8)), ("fp4", bool(config.fp4))) if on]
        if unsupported:
            raise ValueError(f"TorchGroupedMLP config is wrong: {', '.join(unsupported)} set. "
                             "The grouped experts of dropless MoE graphs take bf16 weights "
                             "without biases and megatron-core's plain activations: add "
                             "--disable-bias-linear and drop FP8/FP4 and moe_act recompute.")
        self.num_local_experts = num_local_experts
        hidden, ffn = config.hidden_size, config.moe_ffn_hidden_size
        fc1_out = 2 * ffn if config.gated_linear_unit else ffn
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.fc1_weight = Parameter(torch.empty(num_local_experts, fc1_out, hidden,
                                                dtype=config.params_dtype, device=device))
        self.fc2_weight = Parameter(torch.empty(num_local_experts, hidden, ffn,
                                                dtype=config.params_dtype, device=device))
        # megatron-core's expert linears: column-parallel fc1 (out dim, stride 2 with a gated
        # unit), row-parallel fc2 (in dim); here one axis further for the experts.
        set_tensor_model_parallel_attributes(self.fc1_weight, True, 1,
                                             2 if config.gated_linear_unit else 1)
        set_tensor_model_parallel_attributes(self.fc2_weight, True, 2, 1)
        # Reduced over expert data parallelism when experts are split over ranks or their
        # tensor-parallel size differs from the attention's (megatron-core's `allreduce`).
        expert_groups = (config.expert_model_parallel_size > 1
                         or config.expert_tensor_parallel_size
                         != config.tensor_model_parallel_size)
        for weight in (self.fc1_weight, self.fc2_weight):
            weight.allreduce = not expert_groups
        if config.perform_initialization:
            self._initialize(init_order)

    @torch.no_grad()
    def _initialize(self, init_order: str) -> None:
        """Draw each expert's weights as megatron-core's expert linears do (module doc): on
        CPU an fp32 master weight from the default generator, cast; on the GPU in place,
        under the expert-parallel RNG tracker."""
        fc1 = [(self.fc1_weight[e], self.config.init_method) for e in range(self.num_local_experts)]
        fc2 = [(self.fc2_weight[e], self.config.output_layer_init_method)
               for e in range(self.num_local_experts)]
        order = ([w for pair in zip(fc1, fc2) for w in pair] if init_order == "per_expert"
                 else fc1 + fc2)
        for weight, init_method in order:
            if self.config.use_cpu_initialization:
                master = torch.empty(weight.shape, dtype=torch.float)
                init_method(master)
                weight.copy_(master)
            else:
                with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
                    init_method(weight)

    def forward(self, rows: Tensor, tokens_per_expert: Tensor, probs: Tensor):
        offsets = tokens_per_expert.cumsum(0).to(torch.int32)
        if self.config.moe_apply_probs_on_input:  # top-1 only (megatron-core's check)
            rows = (probs.unsqueeze(-1) * rows).to(rows.dtype)
            probs = torch.ones_like(probs)
        hidden = grouped_linear(rows, self.fc1_weight, offsets)
        hidden = self._activation(hidden, probs.unsqueeze(-1))
        return grouped_linear(hidden, self.fc2_weight, offsets), None

    def _activation(self, x: Tensor, probs: Tensor) -> Tensor:
        """megatron-core's expert activation, scaled by each row's probability (TEGroupedMLP's
        bias_act_func without a bias)."""
        config = self.config
        activation = config.activation_func
        if config.bias_activation_fusion and config.gated_linear_unit:
            if activation == torch.nn.functional.silu:
                return weighted_bias_swiglu_impl(x, None, probs,
                                                 config.activation_func_fp8_input_store)
            if activation == quick_gelu:
                return weighted_bias_quick_geglu_impl(
                    x, None, probs, config.activation_func_fp8_input_store,
                    config.glu_linear_offset, config.activation_func_clamp_value)
            raise ValueError(f"bias_activation_fusion is wrong for {activation.__name__}: "
                             "megatron-core fuses SwiGLU and quick-GeGLU only; drop the "
                             "fusion flag")
        if activation == squared_relu and config.use_fused_weighted_squared_relu:
            return weighted_squared_relu_impl(x, probs)
        if config.gated_linear_unit:
            gate, linear = torch.chunk(x, 2, dim=-1)
            if (clamp := config.activation_func_clamp_value) is not None:
                gate = gate.clamp(min=None, max=clamp)
                linear = linear.clamp(min=-clamp, max=clamp)
            x = activation(gate) * (linear + config.glu_linear_offset)
        else:
            x = activation(x)
        dtype = x.dtype
        return (x * probs).to(dtype)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: Optional[dict] = None) -> dict:
        """``{prefix}fc1_weight`` and ``{prefix}fc2_weight`` of all the layer's experts (module
        doc): this rank's experts at their global index (expert-parallel rank x local
        experts), one replica per expert-data-parallel rank; ``sharded_offsets`` (e.g. the
        layer axis) go first."""
        ep_rank, ep_size = _rank_and_size(self.ep_group)
        replica = (0, 0, _rank_and_size(self.expert_dp_group)[0])
        axis = len(sharded_offsets)
        return {f"{prefix}{name}": ShardedTensor.from_rank_offsets(
                    f"{prefix}{name}", getattr(self, name), *sharded_offsets,
                    (axis, ep_rank, ep_size), replica_id=replica, prepend_axis_num=axis)
                for name in ("fc1_weight", "fc2_weight")}

    def backward_dw(self) -> None:
        """Weight gradients are computed in the backward pass (no delayed wgrad)."""


def _rank_and_size(group) -> tuple:
    if group is None or not torch.distributed.is_initialized():
        return 0, 1
    return group.rank(), group.size()
