"""Reaches into megatron-core's model modules, for megatron-core 0.19.2 (`gate.PATCHED_VERSION`).

* `te_cross_entropy_capturable` (patch): TE's fused cross entropy asked for its capturable
  backward under every graph kind, not only upstream's full-iteration graphs.
* `megatron_core_linears_unfused_without_apex` (patch, installed by the model builders):
  megatron-core's own linears accumulate unfused where apex is missing, so
  ``--gradient-accumulation-fusion`` stays on for TE's linears.
* `switch_block_class`: GPTModel builds ``TransformerBlock`` by name; chunk graphs need the
  decoder to be the graph-safe subclass.
* `set_dispatcher_graph_state`, `dispatch_dropless`: the MoE token dispatcher's graph state
  and its dropless mode for reruns.
* `yarn_channel_mask_and_scale`: YaRN RoPE's channel mask and attention scale, computed
  where upstream keeps them private.
* per-call swaps of a field upstream builds once at init (`field_for_this_call`), a
  megatron-core class's method skipped on the way to its parent's, and the norm that saves
  TE's ``_extra_state`` (`norm_saving_te_extra_state`), a mixin put ahead of a built linear's
  class (`mix_into_linear`).
"""

import contextlib
import copy
import functools
from typing import Iterator, Tuple
import torch
from megatron.core import tensor_parallel

from megatron.packed_upstream.gate import patch



UPSTREAM_COLUMN_PARALLEL_INIT = tensor_parallel.ColumnParallelLinear.__init__


UPSTREAM_ROW_PARALLEL_INIT = tensor_parallel.RowParallelLinear.__init__


@patch
def te_cross_entropy_capturable() -> str:
    """Always ask TE's fused cross entropy (``--cross-entropy-fusion-impl te``) to be capturable.

    language_module.py passes ``is_cg_capturable`` only when ``config.cuda_graph_impl`` is
    upstream's "full_iteration"; this fork's graphs keep it "local" (config.py). TE versions
    whose Triton backward still takes the flag (2.7 to at least 2.11) otherwise compare the
    gradient with ``torch.tensor(1.0, device=...)``, a host-to-device copy per micro-batch that
    fails inside a graph capture and stalls the host outside one. With the flag the backward
    always scales by the gradient: one small kernel, the same values. TE versions where the
    flag is deprecated are always capturable, and the patch is not needed there.
    """
    import inspect

    from megatron.core.models.common.language_module import language_module

    upstream = language_module.te_parallel_cross_entropy
    if upstream is None:
        return "not needed: Transformer Engine is not installed"
    from transformer_engine.pytorch.triton import cross_entropy as te_triton_cross_entropy

    if "is_cg_capturable" not in inspect.signature(
            te_triton_cross_entropy.cross_entropy_backward).parameters:
        return "not needed: this TE's cross entropy is always capturable"

    def capturable_cross_entropy(logits, labels, tp_group, is_cg_capturable=False):
        return upstream(logits, labels, tp_group, True)

    language_module.te_parallel_cross_entropy = capturable_cross_entropy
    return "applied"


@patch
def megatron_core_linears_unfused_without_apex() -> str:
    """megatron-core's own linears (``ColumnParallelLinear``, ``RowParallelLinear``: the output
    layer, and every linear of a TE-free spec) accumulate their weight gradient unfused where
    apex's ``fused_weight_gradient_mlp_cuda`` is missing, so ``--gradient-accumulation-fusion``
    can stay on for TE's linears, which fuse with TE's own GEMM. Upstream reads the flag from
    the shared config at build: ``ColumnParallelLinear`` raises without apex and
    ``RowParallelLinear`` would fail at its first backward. The flag is off only while such a
    linear is built; it keeps its own copy (``self.gradient_accumulation_fusion``). Applied
    (once) by the fork's model builders (packed_training/models.py), so every path that builds
    a model from arguments that kept the flag on (`extra_args.check_gradient_accumulation_fusion`)
    has it."""
    from megatron.core.tensor_parallel import layers

    if layers._grad_accum_fusion_available:
        return "not needed: apex's fused_weight_gradient_mlp_cuda is importable"

    def unfused(upstream_init):
        @functools.wraps(upstream_init)
        def __init__(self, *args, config, **kwargs):
            fused, config.gradient_accumulation_fusion = config.gradient_accumulation_fusion, False
            try:
                upstream_init(self, *args, config=config, **kwargs)
            finally:
                config.gradient_accumulation_fusion = fused

        return __init__

    for linear in (layers.ColumnParallelLinear, layers.RowParallelLinear):
        linear.__init__ = unfused(linear.__init__)
    return "applied"


def switch_block_class(block, subclass) -> None:
    """Give a built ``TransformerBlock`` the methods of ``subclass``, in place.

    0.19.2's GPTModel (deprecated upstream, still the GPT path) constructs ``TransformerBlock``
    by name with no spec hook for the block class, so the chunk-graph dispatch enters by
    switching the built block's class to a subclass that adds methods only (no state of its
    own before first use): same parameters, same initialisation.
    """
    from megatron.core.transformer.transformer_block import TransformerBlock

    if not issubclass(subclass, TransformerBlock) or vars(subclass).get("__init__"):
        raise TypeError(f"{subclass.__name__} must subclass TransformerBlock without an __init__")
    if type(block) is TransformerBlock:
        block.__class__ = subclass


def set_dispatcher_graph_state(dispatcher, values) -> None:
    """Write the MoE preprocess graph's outputs into the dispatcher fields megatron-core lists
    in ``valid_cudagraph_attrs`` (dotted paths), as its own TE replay does before dispatch."""
    names = dispatcher.valid_cudagraph_attrs
    if len(values) != len(names):
        raise RuntimeError(f"the MoE preprocess graph returned {len(values)} dispatcher "
                           f"tensors for the attributes {names}")
    for name, value in zip(names, values):
        *path, leaf = name.split(".")
        owner = dispatcher
        for part in path:
            owner = getattr(owner, part)
        setattr(owner, leaf, value)


# What the alltoall dispatcher holds per call or per mode: saved and restored around a
# dropless pass of a drop-and-pad layer.
DISPATCHER_STATE = ("drop_and_pad", "config", "cuda_sync_point", "input_splits",
                    "output_splits", "output_splits_tp")


@contextlib.contextmanager
def dispatch_dropless(dispatcher) -> Iterator[None]:
    """Within the scope, a drop-and-pad ``MoEAlltoAllTokenDispatcher`` dispatches dropless.

    The dispatcher reads its mode from its config copy (``moe_expert_capacity_factor``,
    ``moe_pad_expert_input_to_capacity``) and ``drop_and_pad``, and keeps per-call split
    sizes and its sync point in fields; all of it (`DISPATCHER_STATE`) is restored after."""
    saved = {name: getattr(dispatcher, name) for name in DISPATCHER_STATE}
    dropless_config = copy.copy(dispatcher.config)
    dropless_config.moe_expert_capacity_factor = None
    dropless_config.moe_pad_expert_input_to_capacity = False
    dispatcher.config, dispatcher.drop_and_pad = dropless_config, False
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(dispatcher, name, value)


def yarn_channel_mask_and_scale(rope, device) -> Tuple[torch.Tensor, float]:
    """megatron-core's yarn pieces for the settings of ``rope`` (a ``YarnRotaryEmbedding``):
    per frequency channel 1.0 where it keeps its original frequency and 0.0 where it is
    interpolated (``[dim // 2]`` fp32 on ``device``), and the concentration factor.

    Upstream keeps them as private helpers of its yarn module; the packed MLA tables reuse
    them so that they stay upstream's tables bit for bit.
    """
    from megatron.core.models.common.embeddings import yarn_rotary_pos_embedding as yarn

    low, high = yarn._yarn_find_correction_range(
        rope.beta_fast, rope.beta_slow, rope.dim, rope.rotary_base,
        rope.original_max_position_embeddings, rope.correction_range_round_to_int)
    kept = 1.0 - yarn._yarn_linear_ramp_mask(low, high, rope.dim // 2, device=device)
    return kept, yarn._yarn_get_concentration_factor(rope.scaling_factor, rope.mscale,
                                                     rope.mscale_all_dim)



@contextlib.contextmanager
def field_for_this_call(module, name: str, value) -> Iterator[None]:
    """``module.<name>`` is ``value`` for the duration of one call, then what it was.

    megatron-core builds some objects once at init and reads them inside ``forward``
    (``MambaMixer.cp``, an attention's ``pg_collection``); a micro-batch with its own CP group
    (dynamic CP) needs them over that group for its call only."""
    static = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, static)


def te_dot_product_attention_forward(module, *args, **kwargs):
    """Transformer Engine's own ``DotProductAttention.forward`` for a subclass of megatron-core's
    ``TEDotProductAttention``, skipping megatron-core's override, which would leave
    ``pad_between_seqs`` to TE's detection (a host sync) on packed THD input."""
    from megatron.core.extensions.transformer_engine import TEDotProductAttention

    return super(TEDotProductAttention, module).forward(*args, **kwargs)


def create_whole_layer_graph_manager(layer, config) -> None:
    """Build a ``TransformerLayer``'s whole-layer graph manager on an ``MoETransformerLayer``,
    whose own ``create_mcore_cudagraph_manager`` would build the partial (router /
    postprocess) managers instead."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    TransformerLayer.create_mcore_cudagraph_manager(layer, config)


def norm_saving_te_extra_state(norm, norm_classes: dict):
    """``norm`` (a torch norm) as its class in ``norm_classes`` ({torch class: subclass that
    adds TE's ``get_extra_state`` / ``set_extra_state``}): the same module and parameters,
    whose state_dict gains TE's ``_extra_state`` entry."""
    norm.__class__ = norm_classes[type(norm)]
    return norm


@functools.cache
def _mixed_class(mixin: type, cls: type) -> type:
    return type(f"{mixin.__name__}{cls.__name__}", (mixin, cls), {})


def mix_into_linear(linear, mixin: type) -> None:
    """Put ``mixin`` ahead of a built ``linear``'s class, in place: the same module, parameters
    and checkpoint keys, with the mixin's ``forward`` first. For a change to a linear's input
    that megatron-core's layer graphs would refuse as a forward pre-hook (they allow DDP's
    only: ``CudaGraphManager.call_ddp_preforward_hook``). One class per (mixin, linear class)."""
    linear.__class__ = _mixed_class(mixin, type(linear))
