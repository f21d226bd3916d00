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

Checkpoints (`sharded_state_dict`): megatron-core's SequentialMLP layout, which TEGroupedMLP
and the Hugging Face converter (packed_training/hf/families/moe.py) share, so a checkpoint's
weights move between a run with these experts and one without, both ways, and export to
Hugging Face. Each linear is ``...experts.experts.linear_fc1.weight`` (``linear_fc2``) of global
shape ``[*sharded_offsets, experts, out, in]`` (the stacked GPT block's layer axis first);
this rank's experts are one chunk of it at their global index, the parameter itself (no
copy), replicated over expert data parallelism. A gated fc1 is the gate rows, then the linear
rows, as SequentialMLP's SwiGLU factory saves them at expert tensor parallel size 1 (the only
size these experts run at). Like megatron-core's linears, every expert and linear also saves
an empty ``..._extra_state`` object (a loader with Transformer Engine's linears asks for
them); loading drops them. With ``singleton_local_shards`` the keys are SequentialMLP's
per-expert ones (``experts.{expert}.linear_fc1.weight_w`` / ``_v``), views of the
parameters, stacked back on load. The optimizer state is kept per parameter, and the
parameters differ from SequentialMLP's: a run that switches loads the weights only
(docs/moe.md).

Activations follow megatron-core's MLP: SwiGLU (``--swiglu``, fused unless
``--no-bias-swiglu-fusion``, megatron-core's ``weighted_bias_swiglu_impl``), squared ReLU
(``--squared-relu``; fused with ``use_fused_weighted_squared_relu``), and any other
``activation_func``, gated or not; the routing probability scales the activation before fc2.
"""

import re
from typing import Optional

import torch
from torch import Tensor
from torch.nn import Parameter

from megatron.core.activations import squared_relu
from megatron.core.dist_checkpointing.mapping import (
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
)
from megatron.core.fusions.fused_bias_geglu import quick_gelu, weighted_bias_quick_geglu_impl
from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl
from megatron.core.fusions.fused_weighted_squared_relu import weighted_squared_relu_impl
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.random import (
    get_cuda_rng_tracker,
    get_expert_parallel_rng_tracker_name,
)
from megatron.core.transformer.module import MegatronModule

from megatron.packed_model.grouped_gemm import grouped_linear
from megatron.packed_model.refusals import refuse

INIT_ORDERS = ("per_expert", "per_linear")
# megatron-core's expert linears (SequentialMLP's names) of this module's two parameters.
_LINEARS = (("fc1_weight", "linear_fc1"), ("fc2_weight", "linear_fc2"))
_EXTRA_STATE = "._extra_state"
_EXTRA_STATE_KEY = re.compile(r"linear_fc[12]\._extra_state\d+")
_EXPERT = "{expert}"  # the global expert index in a per-expert checkpoint key


def grouped_expert_refusals(settings) -> list:
    """What these experts do not run, as ``(refused, flag, value, what to do)`` rules on
    ``settings``: a TransformerConfig, or the parsed arguments at parse time (which name these
    settings alike). Part of moe_dropless.dropless_refusals."""
    s, recompute = settings, settings.recompute_modules or ()
    low_precision = s.fp8 or getattr(s, "fp4", None)
    return [
        (bool(low_precision), "--fp8-format", low_precision,
         "The grouped experts run in bf16: drop FP8/FP4 (drop-and-pad MoE takes them)"),
        (s.add_bias_linear, "--disable-bias-linear", False,
         "The grouped experts have no biases: add --disable-bias-linear"),
        (s.use_te_activation_func, "--use-te-activation-func", True,
         "The grouped experts use megatron-core's activations: drop it"),
        (s.recompute_granularity == "selective" and "moe_act" in recompute,
         "--recompute-modules", " ".join(recompute),
         "The grouped experts do not recompute their activation: drop moe_act"),
    ]


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
        refuse(*grouped_expert_refusals(config))
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
        self.register_load_state_dict_pre_hook(self._drop_extra_states)
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
        """megatron-core's SequentialMLP checkpoint layout (module doc): under the dict keys
        ``{prefix}fc1_weight`` / ``{prefix}fc2_weight`` (this module's parameters) one
        ShardedTensor of this rank's experts, ``{prefix}experts.linear_fc{1,2}.weight`` at
        their global index on the expert axis (after ``sharded_offsets``, e.g. the layer
        axis), one replica per expert-data-parallel rank; and an empty ``_extra_state``
        object per expert and linear. With ``singleton_local_shards`` in ``metadata``, one
        key per expert (``{prefix}experts.{expert}.linear_fc1.weight``, a gated fc1 as its
        ``_w`` and ``_v`` halves), as SequentialMLP saves then."""
        ep_rank, ep_size = _rank_and_size(self.ep_group)
        replica = (0, 0, _rank_and_size(self.expert_dp_group)[0])
        first, total = ep_rank * self.num_local_experts, ep_size * self.num_local_experts
        singleton = bool((metadata or {}).get("singleton_local_shards", False))
        expert_axis = len(sharded_offsets)
        state = {}
        for param_name, linear in _LINEARS:
            weight = getattr(self, param_name)
            if singleton:
                state[f"{prefix}{param_name}"] = self._per_expert_factory(
                    f"{prefix}experts.{_EXPERT}.{linear}.weight", weight, sharded_offsets,
                    replica, gated=linear == "linear_fc1" and self.config.gated_linear_unit)
            else:
                state[f"{prefix}{param_name}"] = ShardedTensor.from_rank_offsets(
                    f"{prefix}experts.{linear}.weight", weight, *sharded_offsets,
                    (expert_axis, ep_rank, ep_size), replica_id=replica,
                    prepend_axis_num=expert_axis)
            for i in range(self.num_local_experts):
                if singleton:
                    key = f"{prefix}experts.{first + i}.{linear}._extra_state"
                    offsets = sharded_offsets
                else:
                    key = f"{prefix}experts.{linear}._extra_state"
                    offsets = (*sharded_offsets, (expert_axis, first + i, total))
                state[f"{prefix}{linear}{_EXTRA_STATE}{i}"] = _empty_object(key, offsets, replica)
        return state

    def _per_expert_factory(self, key: str, weight: Tensor, sharded_offsets: tuple,
                            replica: tuple, gated: bool) -> ShardedTensorFactory:
        """One ShardedTensor per local expert (``_EXPERT`` in the key is its global index),
        views of ``weight``; a gated fc1 as two, its gate (``_w``) and linear (``_v``)
        halves. Loaded, they stack back into ``weight``'s shape."""
        first = _rank_and_size(self.ep_group)[0] * self.num_local_experts

        def build(key, data, replica_id, flattened_range):
            del flattened_range  # never flattened: the model's own checkpoint
            shards = []
            for i in range(data.shape[0]):
                name = key.replace(_EXPERT, str(first + i))
                parts = (zip((f"{name}_w", f"{name}_v"), torch.chunk(data[i], 2, dim=0))
                         if gated else [(name, data[i])])
                shards.append([ShardedTensor.from_rank_offsets(
                    part_key, part, *sharded_offsets, replica_id=replica_id,
                    prepend_axis_num=len(sharded_offsets)) for part_key, part in parts])
            return shards

        def merge(loaded):
            return torch.stack([torch.cat(parts, dim=0) for parts in loaded])

        return ShardedTensorFactory(key, weight, build, merge, replica)

    def _drop_extra_states(self, module, state_dict, prefix, *args) -> None:
        """Load pre-hook: the ``_extra_state`` entries `sharded_state_dict` adds hold
        nothing and have no module here (as megatron-core's linears ignore theirs)."""
        for key in [k for k in state_dict if k.startswith(prefix)
                    and _EXTRA_STATE_KEY.fullmatch(k[len(prefix):])]:
            del state_dict[key]

    def backward_dw(self) -> None:
        """Weight gradients are computed in the backward pass (no delayed wgrad)."""


def _empty_object(key: str, sharded_offsets: tuple, replica: tuple) -> ShardedObject:
    """An ``_extra_state`` entry holding None at ``sharded_offsets`` (whole shards: the
    object's offset and shape on each axis), as megatron-core saves a linear's empty one."""
    offsets = sorted(sharded_offsets)
    if [axis for axis, _, _ in offsets] != list(range(len(offsets))):
        raise ValueError(f"sharded_offsets are wrong for {key}: {sharded_offsets}; "
                         "expected one entry for each leading axis")
    shape = tuple(size for _, _, size in offsets) or (1,)
    offset = tuple(position for _, position, _ in offsets) or (0,)
    return ShardedObject(key, None, shape, offset, replica_id=replica)


def _rank_and_size(group) -> tuple:
    if group is None or not torch.distributed.is_initialized():
        return 0, 1
    return group.rank(), group.size()
