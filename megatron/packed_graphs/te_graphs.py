"""Layer CUDA graphs through Transformer Engine (``--cuda-graph-impl transformer_engine``), packed.

TE's ``make_graphed_callables`` captures each graphable layer's forward and backward, but
takes only tensors as inputs, while a packed micro-batch reaches the layers as a
`PackedBatchParams` dataclass with host ints in it. So:

* `PackedGraphInputs` owns one static buffer per packed-metadata tensor (``cu_seqlens``
  padded to the capacity, ``position_ids``, Mamba's ``seq_idx``, the MoE ``padding_mask``,
  and ``cu_seqlens_padded`` when it is a tensor of its own) plus the host values fixed at
  capture (``max_seqlen``, whether the padded boundaries are ``cu_seqlens`` itself, as with
  CP). Every layer's graph reads the same buffers. A graphed micro-batch is copied
  into them once (`PackedGraphInputs.load`), before the model runs; the params it then
  carries point at the buffers, so no layer's replay copies anything.
* `TEGraphDispatch` (a layer mixin, see layers.py) splits the params into those tensors at
  replay and rebuilds them inside the captured callable; micro-batches planned eager
  (overflow, warm-up) and evaluation run the layer's plain forward.
* `TELayerGraphs.capture` captures every layer once, after ``--cuda-graph-warmup-steps``
  eager iterations, before the schedule of the first graphed iteration (the graph runtime,
  runtime.py, calls it).

* Dynamic CP: one **bank** of layer graphs per CP size, each captured with that size's
  process group baked in and its own `PackedGraphInputs`; a micro-batch is loaded into its
  size's buffers (`TELayerGraphs.load`) and each layer replays the bank of its plan's key
  (``plan.key.cp_size``). Every rank captures every bank, in ascending size order, so the
  members of a group meet the capture's collectives together.

* FP8: each layer is captured in the autocast eager runs it in (`fp8_state.te_capture_keywords`);
  the captured linears read TE's weight-cache flag, which the graph runtime writes per
  micro-batch (`fp8_state.WeightCacheFlag`).

Pipeline parallelism is not supported here (TE's capture order would have to follow the
1F1B schedule; the local implementation's layer and chunk graphs cover PP); with PP = 1 a
micro-batch's backward finishes before the next one's forward, so one graph per layer and one
set of buffers serve every micro-batch.
"""

import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.utils import unwrap_model

from megatron.packed_upstream import graph_engine, megatron_ddp
from megatron.packed_graphs.graph_memory import reserved_without_cache
from megatron.packed_graphs.fp8_state import te_capture_keywords
from megatron.packed_graphs.packed_seq import PackedBatchParams
from megatron.packed_graphs.plan import active_plan, graphs_bypassed

# PackedBatchParams tensor fields that become graph inputs (keyword -> field). Self-attention
# only: cu_seqlens_kv(_padded) is the same tensor as cu_seqlens_q(_padded).
_GRAPH_FIELDS = {
    "cu_seqlens": "cu_seqlens_q",
    "cu_seqlens_padded": "cu_seqlens_q_padded",
    "position_ids": "position_ids",
    "seq_idx": "seq_idx",
    "padding_mask": "padding_mask",
}


@dataclass
class PackedGraphInputs:
    """Static packed metadata shared by every layer graph of a model (see module doc).

    ``buffers``: graph keyword -> static tensor (only the ones this model uses);
    ``max_seqlen``: host int, the static ``max_seqlen_q/kv``;
    ``local_cp_size``/``cp_group``: the micro-batch CP choice baked into these graphs (dynamic
    CP; None/None: the layers' static CP group).
    """

    buffers: Dict[str, Tensor]
    max_seqlen: int
    # CP: the padded boundaries are the cu_seqlens tensor itself (no padding between docs).
    padded_is_cu_seqlens: bool = False
    local_cp_size: Optional[int] = None
    cp_group: Optional[torch.distributed.ProcessGroup] = None

    @classmethod
    def like(cls, params: PackedBatchParams) -> "PackedGraphInputs":
        """Buffers shaped like a (capacity-padded) micro-batch's params, holding its values."""
        buffers = {key: value.detach().clone() for key, value in graph_tensors(params).items()}
        return cls(buffers, params.max_seqlen_q,
                   padded_is_cu_seqlens=params.cu_seqlens_q_padded is params.cu_seqlens_q,
                   local_cp_size=params.local_cp_size, cp_group=params.cp_group)

    def load(self, params: PackedBatchParams) -> PackedBatchParams:
        """Copy a graphed micro-batch's metadata into the buffers (device copies, no sync).

        Returns params that point at the buffers. Raises ValueError when the micro-batch
        does not match the captured layout (another capacity, token count or max_seqlen).
        """
        if params.max_seqlen_q != self.max_seqlen:
            raise ValueError(f"micro-batch max_seqlen {params.max_seqlen_q} differs from the "
                             f"captured {self.max_seqlen}")
        if params.local_cp_size != self.local_cp_size or params.cp_group is not self.cp_group:
            raise ValueError(f"micro-batch CP size {params.local_cp_size} (or its group) differs "
                             f"from the captured {self.local_cp_size}")
        tensors = graph_tensors(params)
        layout = {key: tuple(value.shape) for key, value in tensors.items()}
        captured = {key: tuple(value.shape) for key, value in self.buffers.items()}
        if layout != captured or self.padded_is_cu_seqlens != (
                params.cu_seqlens_q_padded is params.cu_seqlens_q):
            raise ValueError(f"micro-batch packed tensors {layout} do not match the captured "
                             f"{captured}")
        for key, value in tensors.items():
            self.buffers[key].copy_(value, non_blocking=True)
        return self.params(self.buffers)

    def params(self, tensors: Dict[str, Tensor]) -> PackedBatchParams:
        """PackedBatchParams over graph-input tensors (inside a capture: the buffers)."""
        cu_seqlens = tensors["cu_seqlens"]
        padded = cu_seqlens if self.padded_is_cu_seqlens else tensors.get("cu_seqlens_padded")
        return PackedBatchParams(
            qkv_format="thd",
            cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
            cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded,
            max_seqlen_q=self.max_seqlen, max_seqlen_kv=self.max_seqlen,
            position_ids=tensors.get("position_ids"), seq_idx=tensors.get("seq_idx"),
            padding_mask=tensors.get("padding_mask"),
            local_cp_size=self.local_cp_size, cp_group=self.cp_group,
        )


def graph_tensors(params: PackedBatchParams) -> Dict[str, Tensor]:
    """params' distinct packed tensors by graph keyword (one tensor is one graph input)."""
    if params.cu_seqlens_kv is not params.cu_seqlens_q or (
            params.cu_seqlens_kv_padded is not params.cu_seqlens_q_padded):
        raise ValueError("TE layer graphs take self-attention params (key/value boundaries "
                         "are the query boundaries); got separate key/value boundaries")
    tensors = {key: getattr(params, name) for key, name in _GRAPH_FIELDS.items()
               if getattr(params, name) is not None}
    if params.cu_seqlens_q_padded is params.cu_seqlens_q:
        del tensors["cu_seqlens_padded"]
    return tensors


def graph_kwargs(params: PackedBatchParams, rotary_pos_emb: Optional[Tensor]) -> Dict[str, Tensor]:
    """The tensor keywords a layer graph is called with: params' tensors (+ the RoPE table)."""
    kwargs = graph_tensors(params)
    if rotary_pos_emb is not None:
        kwargs["rotary_pos_emb"] = rotary_pos_emb
    return kwargs


class TEGraphDispatch:
    """Layer mixin: TE-graph capture and replay of a packed layer (put before the layer class).

    megatron-core's ``GraphableMegatronModule.__call__`` asks `_should_call_te_cudagraph`, then
    calls `_te_cuda_graph_capture` while TE captures or `_te_cuda_graph_replay` once graphs
    exist. ``graph_engine.te_graphed_callables(self)[i]`` is this layer's graphed callable of
    bank ``i``, captured over ``self._graph_inputs[i]`` for CP size
    ``self._graph_bank_sizes[i]`` (one bank without dynamic CP).
    """

    _graph_inputs: Sequence[PackedGraphInputs] = ()
    _graph_bank_sizes: Sequence[int] = ()

    def open_graph_bank(self, inputs: PackedGraphInputs, cp_size: int) -> list:
        """Before TE captures a bank: its inputs and CP size become this layer's last bank, and
        an empty ``cuda_graphs`` makes megatron-core's dispatch capture, not replay. Returns
        the earlier banks' graphs, for `close_graph_bank`."""
        earlier = graph_engine.te_graphed_callables(self)
        graph_engine.set_te_graphed_callables(self, [])
        self._graph_inputs = [*self._graph_inputs, inputs]
        self._graph_bank_sizes = [*self._graph_bank_sizes, cp_size]
        return earlier

    def close_graph_bank(self, earlier: list, graphed) -> None:
        """After the capture: the bank's graphed callable follows the earlier banks'."""
        graph_engine.set_te_graphed_callables(self, [*earlier, graphed])

    def _should_call_te_cudagraph(self, *args, **kwargs):
        if graphs_bypassed():
            return False  # this micro-batch was planned eager (overflow, warm-up)
        return super()._should_call_te_cudagraph(*args, **kwargs)

    def _te_cuda_graph_capture(self, hidden_states, **tensors):
        """The captured callable: tensors in, the layer's hidden states out."""
        rotary_pos_emb = tensors.pop("rotary_pos_emb", None)
        params = self._graph_inputs[-1].params(tensors)  # the bank being captured
        output = self.forward(hidden_states, rotary_pos_emb=rotary_pos_emb,
                              packed_seq_params=params)
        return output[0] if isinstance(output, tuple) else output  # (hidden, context=None)

    def _te_cuda_graph_replay(self, *args, **kwargs):
        hidden_states = args[0] if args else kwargs["hidden_states"]
        output = self._replay_graph(hidden_states, kwargs.get("packed_seq_params"),
                                    kwargs.get("rotary_pos_emb"))
        return (output, None) if isinstance(self, TransformerLayer) else output

    def _replay_graph(self, hidden_states, params, rotary_pos_emb):
        """Replay this layer's graph of the running bank; returns its outputs (graph-owned)."""
        bank = self._replay_bank()
        buffers = self._graph_inputs[bank].buffers
        if params is None or params.cu_seqlens_q is not buffers["cu_seqlens"]:
            raise RuntimeError(
                "a graphed micro-batch must be loaded into its bank's static buffers "
                "(TELayerGraphs.load) before the model runs; the graph runtime does this")
        for hook, hook_args in graph_engine.te_replay_hooks(self):
            hook(*hook_args)
        graphed = graph_engine.te_graphed_callables(self)[bank]
        return graphed(hidden_states, **graph_kwargs(params, rotary_pos_emb))

    def _replay_bank(self) -> int:
        """The bank of the running plan's CP size (without a plan: the only bank)."""
        plan = active_plan()
        if plan is None or plan.key is None:
            if len(self._graph_bank_sizes) == 1:
                return 0
            raise RuntimeError("TE graph banks per CP size replay under the graph runtime's "
                               "plan, which names the micro-batch's CP size")
        try:
            return list(self._graph_bank_sizes).index(plan.key.cp_size)
        except ValueError:
            raise RuntimeError(f"no TE graph bank was captured for CP size {plan.key.cp_size} "
                               f"(banks: {list(self._graph_bank_sizes)})") from None


def graphable_layers(model_chunk) -> List[torch.nn.Module]:
    """The TE-graphable layers of one model chunk (DDP/Float16Module-wrapped), in forward order:
    every layer, or with ``cuda_graph_modules`` the layers megatron-core graphs for them
    (e.g. MoE layers for moe_router, Mamba layers for mamba)."""
    layers = unwrap_model(model_chunk).decoder.layers
    return [layer for layer in layers if isinstance(layer, TEGraphDispatch)
            and graph_engine.layer_graphed_for_modules(layer)]


def rotary_table(model_chunk, max_seqlen: int) -> Optional[Tensor]:
    """The model's RoPE table for packed micro-batches of ``max_seqlen`` (None without RoPE)."""
    rotary = getattr(unwrap_model(model_chunk), "rotary_pos_emb", None)
    return None if rotary is None else rotary(max_seqlen, packed_seq=True)


class TELayerGraphs:
    """Captures every graphable layer of a PP = 1 model with TE's ``make_graphed_callables``:
    one bank of graphs, or one per CP size under dynamic CP."""

    def __init__(self, model: list, config, tokens_per_rank: int, warmup_iters: int = 2):
        if len(model) != 1:
            raise ValueError("TE layer graphs support one model chunk (no pipeline parallelism)")
        self.model, self.config = model, config
        self.tokens_per_rank = tokens_per_rank
        self.warmup_iters = warmup_iters
        self.banks: Dict[int, PackedGraphInputs] = {}  # by CP size (GraphKey.cp_size)
        # --gradient-accumulation-fusion: TE's linears add weight gradients into main_grad.
        self.fused_wgrad = bool(getattr(config, "gradient_accumulation_fusion", False))
        if self.fused_wgrad:
            # A replay runs no Python: DDP must not clear the flag TE's fused wgrad sets.
            megatron_ddp.ddp_keeps_fused_wgrad_flags()

    @property
    def captured(self) -> bool:
        return bool(self.banks)

    def load(self, cp_size: int, params: PackedBatchParams) -> PackedBatchParams:
        """Copy a graphed micro-batch's metadata into the buffers of bank ``cp_size`` (no
        sync); returns params over them. Raises ValueError when no bank was captured for it."""
        bank = self.banks.get(cp_size)
        if bank is None:
            raise ValueError(f"no graphs were captured for CP size {cp_size} "
                             f"(banks: {sorted(self.banks)})")
        return bank.load(params)

    def capture(self, bank_params: Sequence[Tuple[int, PackedBatchParams]]) -> dict:
        """Capture all layers once per bank: ``(CP size, params)`` pairs, ascending sizes,
        params laid out like a graphed micro-batch of that bank (capacity-padded).

        Syncs the device (TE warms up on a side stream between synchronisations; the memory
        measurement empties the allocator cache). Every rank must call this with the same
        banks in the same order (captures run the banks' collectives). Returns the log-line
        statistics: capture time, graph memory (per bank under dynamic CP), graph count.
        With fused gradient accumulation it zeroes DDP's gradient buffers afterwards (TE's
        warm-up accumulated into them): call it before the iteration's first backward. With
        ``--overlap-param-gather`` it gathers all parameters first (a collective), captures
        with DDP's hooks removed, and each layer then runs those hooks before its replays.
        """
        layers = graphable_layers(self.model[0])
        stats = {"graphs captured": 2 * len(layers) * len(bank_params)}
        start = time.perf_counter()
        with megatron_ddp.ddp_gather_hooks_removed(self.model):
            for cp_size, params in bank_params:
                memory = self._capture_bank(cp_size, params, layers)
                name = ("graph memory (MiB)" if params.local_cp_size is None
                        else f"graph memory cp{params.local_cp_size} (MiB)")
                stats[name] = round(memory / 2**20, 1)
        megatron_ddp.ddp_param_gather_before_te_replays(self.model[0], layers)
        stats["graph capture (s)"] = round(time.perf_counter() - start, 2)
        return stats

    def _capture_bank(self, cp_size: int, params: PackedBatchParams,
                      layers: List[torch.nn.Module]) -> int:
        """Capture one bank of ``layers``; returns the graph memory it reserved (bytes)."""
        from transformer_engine.pytorch.graph import make_graphed_callables

        inputs = self.banks[cp_size] = PackedGraphInputs.like(params)
        kwargs = graph_kwargs(inputs.params(inputs.buffers),
                              rotary_table(self.model[0], inputs.max_seqlen))
        dtype = self.config.params_dtype
        sample_args = tuple(
            (torch.zeros(self.tokens_per_rank, 1, self.config.hidden_size, dtype=dtype,
                         device="cuda", requires_grad=True),)
            for _ in layers)
        earlier_banks = [layer.open_graph_bank(inputs, cp_size) for layer in layers]
        reserved = reserved_without_cache()
        with graph_engine.te_graph_capture(), graph_engine.stream_crossings_unreported():
            graphed = make_graphed_callables(
                tuple(layers), sample_args, sample_kwargs=tuple(kwargs for _ in layers),
                num_warmup_iters=self.warmup_iters, allow_unused_input=True,
                **graph_engine.te_layer_capture_keywords(make_graphed_callables, len(layers)),
                # FP8: the eager autocast (TE's default wraps each layer in a disabled one).
                **te_capture_keywords(self.config, layers))
        for layer, callable_, earlier in zip(layers, graphed, earlier_banks):
            layer.close_graph_bank(earlier, callable_)
        if self.fused_wgrad:
            # TE's eager warm-up passes accumulated their fused weight gradients into main_grad,
            # which DDP had zeroed for this iteration (captures run before its schedule).
            for chunk in self.model:
                chunk.zero_grad_buffer()
        torch.cuda.synchronize()
        return reserved_without_cache() - reserved
