"""MoE layers on packed (THD) micro-batches: padding never competes with documents.

A packed row ends in a padding tail (loss mask 0) when its documents do not fill it. Upstream
routes those positions like any token: they take expert capacity (under drop-and-pad a
padding token can evict a document token) and, with dropless dispatch, expert compute and
all-to-all traffic. megatron-core 0.19.2's ``padding_mask`` (True = padding) only takes them
out of the aux loss, the z-loss and the expert-bias counts.

* `PackedTopKRouter` (entered through the spec as the MoE layer's ``router``) takes them out
  of the routing too: it routes without the capacity (upstream's routing, padding mask
  included), zeroes the padding rows of the probabilities and the routing map, then applies
  the capacity with upstream's ``apply_router_token_dropping``. Document tokens are routed
  and dropped exactly as they would be without the padding (for the same capacity);
  drop-and-pad fills unused slots with zero-probability rows, as upstream does. All of it
  runs on the device: no host sync, the same shapes every step.
* `PackedMoEMaskMixin` hands the MoE layer this rank's padding mask from
  ``packed_seq_params.padding_mask`` (built once per micro-batch by the training step), so the
  mask travels with the packed params into every graph path (local and TE layer graphs,
  chunk graphs), not as a separate argument that a graph could drop.

* `moe_mlp_spec` builds megatron-core's MoE layer, or with ``--moe-dropless-graphs`` (the
  config's ``moe_dropless_graphs``) the static-shape dropless layer of moe_dropless.py, which
  graphs capture whole whatever the routing (`build_moe_layer`). Its routers count routed
  slots too, so the log's drop fraction (0) is measured. ``--moe-router-skew`` gives the
  routers a fixed logit bias toward the first eighth of the experts (benchmarks).

* `dropless_moe` (``--moe-capacity-overflow rerun``) switches the MoE layers of some model
  chunks to upstream's dropless alltoall for the enclosed eager calls: no capacity, every
  routed token reaches its experts. It syncs with the host (dropless dispatch reads token
  counts back), so it runs eager only; moe_rerun.py uses it to rerun overflowed micro-batches.

Expert-bias counts (``--moe-router-enable-expert-bias``, aux-loss-free balancing) are
upstream's: taken inside the routing, so they leave out the padding and count every
document token's top-k choice, before the capacity drops any (upstream counts after it). The
bias moves toward balanced choices, which is what it steers; drops are counted apart.
"""

import copy
from contextlib import ExitStack, contextmanager
from functools import partial
from typing import Iterator, List, Optional, Sequence

import torch
from torch import Tensor

from megatron.core.models.backends import BackendSpecProvider
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.moe_utils import (
    apply_router_token_dropping,
    router_gating_linear,
)
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

from megatron.packed_upstream import model_layers
from megatron.packed_model.moe_dropless import DroplessMoELayer
from megatron.packed_model.moe_experts import TorchGroupedMLP
from megatron.packed_model.padding_rows import layer_padding_mask

_ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


class PackedTopKRouter(TopKRouter):
    """TopKRouter whose padding tokens (``padding_mask`` True) are routed to no expert and
    take no expert capacity (see module doc)."""

    def __init__(self, config, pg_collection=None, is_mtp_layer=False):
        super().__init__(config=config, pg_collection=pg_collection, is_mtp_layer=is_mtp_layer)
        # [routed, dropped] token slots (token, expert) under the capacity, added up on the
        # device (inside graphs too) until `read_dropped_token_fraction` reads and zeroes them.
        self.register_buffer("token_slots", torch.zeros(2, dtype=torch.int64), persistent=False)
        # Upstream drops by capacity inside routing(), before a padding mask could apply;
        # routing runs on a copy of the config without the capacity and it is applied here.
        self.capacity_factor = config.moe_expert_capacity_factor
        if self.capacity_factor is not None:
            self.config = copy.copy(config)
            self.config.moe_expert_capacity_factor = None
        # Set inside `dropless_moe`: route without the capacity (eager calls only).
        self.dropless = False
        # int64 [2] device buffer shared by the routers of a model (moe_rerun.OverflowMonitor):
        # max over routers of [slots dropped, peak tokens routed to one expert] in the current
        # forward call. Its address is baked into graphs, so it is set before any capture.
        self.overflow_counter: Optional[Tensor] = None
        self.num_tokens: Optional[int] = None  # of the last call (static under graphs)
        # --moe-dropless-graphs: routed slots are counted (none is dropped), so the drop
        # fraction the log reports is a measurement.
        self.count_routed = getattr(config, "moe_dropless_graphs", False)
        # --moe-router-skew (benchmarks): a fixed logit bias on the first eighth of the experts.
        skew = getattr(config, "moe_router_skew", 0.0)
        if skew:
            bias = torch.zeros(config.num_moe_experts, device=self.weight.device)
            bias[:hot_experts(config.num_moe_experts)] = skew_logit_bias(
                config.num_moe_experts, self.topk, skew,
                config.init_method_std * config.hidden_size ** 0.5)
            self.register_buffer("logit_skew", bias, persistent=False)
        else:
            self.logit_skew: Optional[Tensor] = None

    def route_dropless(self, dropless: bool) -> None:
        """Route without the capacity (True; `dropless_moe` sets it around eager calls)."""
        self.dropless = dropless

    def gating(self, input: Tensor) -> Tensor:
        if input.device.type == "cuda":
            logits = super().gating(input)
        else:
            # Upstream moves CPU weights to CUDA unconditionally (router.py gating); training
            # moves the whole model to the GPU first, so this branch serves CPU runs only.
            dtype = _ROUTER_DTYPES.get(self.config.moe_router_dtype, input.dtype)
            logits = router_gating_linear(input, self.weight, self.bias, dtype)
        if self.logit_skew is not None:
            logits = logits + self.logit_skew
        return logits

    def _apply_expert_bias(self, routing_map: Tensor, padding_mask: Optional[Tensor] = None):
        # megatron-core 0.19.2 ands the [tokens, experts] map with the flattened [tokens]
        # mask, which does not broadcast: expert bias with any padding mask fails there.
        # A [tokens, 1] mask masks whole rows, as meant (tests/unit/test_moe.py pins the line).
        if padding_mask is not None:
            padding_mask = padding_mask.reshape(-1, 1)
        super()._apply_expert_bias(routing_map, padding_mask=padding_mask)

    def routing(self, logits: Tensor, padding_mask: Optional[Tensor] = None):
        probs, routing_map = super().routing(logits, padding_mask=padding_mask)
        documents_map = routing_map
        if padding_mask is not None:
            keep = ~padding_mask.reshape(-1, 1)
            probs = probs * keep
            documents_map = routing_map & keep
        if self.capacity_factor is None:
            # Dropless dispatch sizes its rows as tokens x top-k (static): padding keeps its
            # slots, at probability zero, and adds nothing to any output or gradient (the
            # static dropless layer takes them out of the map itself, moe_dropless.py).
            if self.count_routed:
                routed = documents_map.sum()
                self.token_slots += torch.stack([routed, torch.zeros_like(routed)])
            return probs, routing_map
        # The demand before the capacity: what overflow detection and the advisor read.
        self.num_tokens = routing_map.shape[0]  # host int: the capacity's token count
        loads = documents_map.sum(dim=0)
        routed = loads.sum()
        if self.dropless:  # as without a capacity (above)
            if logits.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("dropless MoE routing inside a CUDA graph capture: dropless "
                                   "dispatch syncs with the host; run the micro-batch eager")
            dropped = torch.zeros_like(routed)
        else:
            probs, routing_map = apply_router_token_dropping(
                probs, documents_map, router_topk=self.topk,
                capacity_factor=self.capacity_factor,
                drop_policy=self.config.moe_token_drop_policy,
                pad_to_capacity=self.config.moe_pad_expert_input_to_capacity)
            # Pad-to-capacity slots carry zero probability: only weighted slots were kept.
            dropped = routed - (routing_map & (probs != 0)).sum()
        self.token_slots += torch.stack([routed, dropped])
        if self.overflow_counter is not None:
            torch.maximum(self.overflow_counter, torch.stack([dropped, loads.max()]),
                          out=self.overflow_counter)
        return probs, routing_map


def hot_experts(num_experts: int) -> int:
    """The experts `--moe-router-skew` favours: the first eighth (at least one)."""
    return max(1, num_experts // 8)


def skew_limit(num_experts: int, topk: int) -> float:
    """The share of a top-``topk`` router's slots that the `hot_experts` get when every token
    picks all of them it can: a bias reaches any share below it, never it."""
    return min(topk, hot_experts(num_experts)) / topk


def skew_error(fraction: float, num_experts: int, topk: int) -> str:
    hot = hot_experts(num_experts)
    return (f"--moe-router-skew is wrong: {fraction}. With {num_experts} experts, top-{topk}, "
            f"the first {hot} can get a share in (0, {skew_limit(num_experts, topk):g}) of the "
            f"routed slots ({hot / num_experts:g} without a skew); choose one inside")


def skew_logit_bias(num_experts: int, topk: int, fraction: float, logit_std: float,
                    samples: int = 4096) -> float:
    """The logit bias on the `hot_experts` that sends about ``fraction`` of a top-``topk``
    router's slots to them, for logits drawn independently from N(0, ``logit_std``^2) (a
    router at initialisation: weights of std ``init_method_std`` over unit-RMS hidden
    states). Found by bisection over a fixed sample (seeded: the same bias every run); host
    only, once per router. Benchmarks of unbalanced routing only (--moe-router-skew)."""
    hot = hot_experts(num_experts)
    if not 0.0 < fraction < skew_limit(num_experts, topk):
        raise ValueError(skew_error(fraction, num_experts, topk))
    logits = torch.randn(samples, num_experts, generator=torch.Generator().manual_seed(0))
    logits *= logit_std

    def share(bias: float) -> float:
        chosen = torch.topk(logits + torch.tensor([bias] * hot + [0.0] * (num_experts - hot)),
                            topk, dim=1).indices
        return (chosen < hot).float().mean().item()

    low, high = -20.0 * logit_std, 20.0 * logit_std
    for _ in range(40):
        middle = (low + high) / 2
        low, high = (middle, high) if share(middle) < fraction else (low, middle)
    return (low + high) / 2


def read_dropped_token_fraction(model_chunks) -> float:
    """Fraction of routed token slots the expert capacity dropped, over every MoE layer and
    rank since the last call; zeroes the counts. Syncs: one all-reduce and a host read, so
    call it at log points only, on every rank. Padding is never routed, so never counted.

    Ranks that hold the same tokens (TP without sequence parallelism) count them alike in
    both sums, which leaves the ratio exact.
    """
    # Every rank takes part in the all-reduce, also a pipeline stage without MoE layers.
    slots = torch.zeros(2, dtype=torch.int64,
                        device="cuda" if torch.cuda.is_available() else "cpu")
    for chunk in model_chunks:
        for router in (m for m in chunk.modules() if isinstance(m, PackedTopKRouter)):
            slots += router.token_slots
            router.token_slots.zero_()
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(slots)
    routed, dropped = slots.tolist()
    return dropped / routed if routed else 0.0


class MoEAccumulators:
    """A device copy of what an MoE forward pass adds to across a training step: megatron-
    core's MoE metrics tracker (aux and z-loss per layer), every router's dropped-slot counts
    and, with --moe-router-enable-expert-bias, its tokens per expert and the expert bias that
    finalize_model_grads moves with them at the end of a step. `restore` puts them back, for
    passes that are not training's own: graph warm-up and capture (placeholder inputs), the
    health check's eager pass, and the first pass of a rerun iteration (whose end already
    moved the bias once).

    Device copies only, no host sync. A tracker entry first created after the snapshot is
    zeroed by `restore`.
    """

    def __init__(self, model_chunks: Sequence[torch.nn.Module]):
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

        self._tracker = get_moe_metrics_tracker()
        self._values = {name: entry.values.clone()
                        for name, entry in self._tracker.metrics.items()}
        self._routers = [router for chunk in model_chunks for router in packed_routers(chunk)]
        self._slots = [router.token_slots.clone() for router in self._routers]
        self._biased = [router for router in self._routers if router.enable_expert_bias]
        self._tokens = [router.local_tokens_per_expert.clone() for router in self._biased]
        self._bias = [router.expert_bias.clone() for router in self._biased]

    def restore(self) -> None:
        for name, entry in self._tracker.metrics.items():
            if name in self._values:
                entry.values.copy_(self._values[name])
            else:
                entry.values.zero_()
        for router, saved in zip(self._routers, self._slots):
            router.token_slots.copy_(saved)
        for router, tokens, bias in zip(self._biased, self._tokens, self._bias):
            router.local_tokens_per_expert.copy_(tokens)
            router.expert_bias.copy_(bias)


@contextmanager
def moe_accumulators_kept(model_chunks: Sequence[torch.nn.Module]) -> Iterator[None]:
    """Run the enclosed passes without leaving a trace in the MoE step accumulators (see
    `MoEAccumulators`). Restores them also when the passes raise."""
    saved = MoEAccumulators(model_chunks)
    try:
        yield
    finally:
        saved.restore()


def packed_routers(module: torch.nn.Module) -> List[PackedTopKRouter]:
    """The `PackedTopKRouter` of every MoE layer in ``module``, in module order."""
    return [m for m in module.modules() if isinstance(m, PackedTopKRouter)]


@contextmanager
def dropless_moe(modules) -> Iterator[None]:
    """Within the block, every MoE layer of ``modules`` (a module or a list of them) routes
    without its capacity and dispatches with upstream's dropless alltoall: no token dropped.

    For eager calls only: dropless dispatch reads token counts back to the host in every MoE
    layer (the router raises if asked inside a graph capture, and a graph replay would keep
    its captured drop-and-pad). Only the forward needs the scope: backward replays what the
    forward recorded. Routers keep counting routed slots (none dropped) and their peak load.
    """
    modules = modules if isinstance(modules, (list, tuple)) else [modules]
    layers = [m for module in modules for m in module.modules() if isinstance(m, MoELayer)]
    with ExitStack() as restore:
        for layer in layers:
            router, dispatcher = layer.router, layer.token_dispatcher
            if not isinstance(router, PackedTopKRouter) or not isinstance(
                    dispatcher, MoEAlltoAllTokenDispatcher):
                raise TypeError(f"dropless_moe needs PackedTopKRouter and the alltoall "
                                f"dispatcher, not {type(router).__name__} and "
                                f"{type(dispatcher).__name__}")
            restore.callback(router.route_dropless, router.dropless)
            router.route_dropless(True)
            restore.enter_context(model_layers.dispatch_dropless(dispatcher))
        yield


def moe_mlp_spec(provider: BackendSpecProvider, num_experts: int, grouped_gemm: bool):
    """megatron-core's MoE builder for ``provider`` (SequentialMLP experts over the provider's
    linears, or TEGroupedMLP with TE and grouped GEMM; shared experts from the same linears),
    with `PackedTopKRouter` as its router.

    The layer is built by `build_moe_layer`, which reads the config's ``moe_dropless_graphs``
    (as megatron-core's MoE spec picks its shared-expert class from the config)."""
    builder = get_moe_module_spec_for_backend(provider, num_experts=num_experts,
                                              moe_grouped_gemm=grouped_gemm)
    submodules = copy.copy(builder.keywords["submodules"])
    submodules.router = PackedTopKRouter
    return partial(build_moe_layer, builder.func, *builder.args, submodules=submodules)


def build_moe_layer(layer_class, *args, config, submodules: MoESubmodules, **kwargs):
    """``layer_class(*args, config=config, submodules=submodules, **kwargs)`` (megatron-core's
    MoELayer), or with ``config.moe_dropless_graphs`` (``--moe-dropless-graphs``, a field of
    the fork's PackedTransformerConfig) `moe_dropless.DroplessMoELayer` over
    `moe_experts.TorchGroupedMLP` experts, drawn in the order of the experts they stand in
    for (TEGroupedMLP's with TE grouped GEMM, else SequentialMLP's)."""
    if getattr(config, "moe_dropless_graphs", False):
        experts = getattr(submodules.experts, "func", submodules.experts)
        order = "per_expert" if experts is SequentialMLP else "per_linear"
        submodules = copy.copy(submodules)
        submodules.experts = partial(TorchGroupedMLP, init_order=order)
        layer_class = DroplessMoELayer
    return layer_class(*args, config=config, submodules=submodules, **kwargs)


class PackedMoEMaskMixin:
    """Mixin for a TransformerLayer: an MoE MLP gets the micro-batch's padding mask from the
    packed params when no ``padding_mask`` argument is given."""

    def _forward_mlp(self, hidden_states, inference_context=None, padding_mask=None,
                     packed_seq_params=None):
        if padding_mask is None and isinstance(self.mlp, MoELayer):
            padding_mask = layer_padding_mask(packed_seq_params, hidden_states.shape[0],
                                              self.pg_collection.tp,
                                              self.config.sequence_parallel)
        return super()._forward_mlp(hidden_states, inference_context,
                                    padding_mask=padding_mask,
                                    packed_seq_params=packed_seq_params)
