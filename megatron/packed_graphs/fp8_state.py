"""FP8 state under the graph runtime: the recipe each capture runs, which graphed micro-batch
re-quantizes the weights, and which graph kinds delayed scaling refuses (docs/fp8.md).

Only Transformer Engine's linear layers run FP8 (``--fp8-format``, ``--fp8-recipe``); the
blocks enter TE's autocast themselves (megatron-core ``get_fp8_context``: per layer for
tensorwise and blockwise, around the block for delayed), so every graph kind whose captured
region contains the block's forward (chunk, full-iteration, forward-only) captures FP8 as
eager runs it, and megatron-core's local layer graphs capture inside the same context. TE's
``make_graphed_callables`` instead wraps each layer in an autocast of its own: it is given the
eager recipe here (`te_capture_keywords`).

Weight caching. A TE linear keeps its quantized weight in a workspace. Eager, it re-quantizes
when ``is_first_microbatch`` is True (megatron-core's schedule sets it for a pass's first
micro-batch). A captured linear instead reads one process-global device flag, TE's "skip
weight update" tensor, at every replay: 1 reuses the workspace, 0 re-quantizes into it.
`WeightCacheFlag` is the one writer of that flag under the runtime:

* `begin_pass` at the start of every pass (training iteration, forward-only pass, health
  check: the weights may have changed since, by the optimizer or an RL refit): writes 0,
  which also creates the flag before any capture of the pass (a linear captured without it
  bakes its ``is_first_microbatch`` in, and a forward-only graph would then never
  re-quantize), and marks the eager layers' ``is_first_microbatch``;
* `before_graphed` before each graphed micro-batch: 0 for the first graphed micro-batch of a
  model chunk in the pass, 1 for the later ones. Inside a full-iteration capture the write is
  itself captured, so each replay re-quantizes at its first micro-batch.

megatron-core's own replay writes (per-runner memo, stale with several runners per layer)
are switched off by ``packed_upstream.graph_engine.graph_runtime_owns_fp8_weight_flag``.

Delayed scaling keeps amax histories and scales that TE updates on the host side of an
autocast's exit. Inside a chunk or full-iteration capture that exit is captured (the update
would replay with every micro-batch, its amax all-reduce included): `check_fp8_graphs` refuses
those, at parse time (fp8_flags.py) and again at graph setup for library users. Layer graphs
run it, with forward-only passes eager: megatron-core's (``--cuda-graph-impl local``)
re-register the FP8 state at each replay and update outside the graphs; TE's
``make_graphed_callables`` captures under ``_graph=True`` autocasts (no update inside),
registers each replayed module in the block's autocast, and updates the backward scales once
per micro-batch after the first graphed layer's backward, as eager does.
"""

from typing import Callable, Iterable, Optional

DELAYED = "delayed"
RECIPES_FOR_EVERY_GRAPH_KIND = ("tensorwise", "blockwise")


def fp8_recipe(model_config) -> Optional[str]:
    """The run's FP8 recipe name ('tensorwise', 'blockwise', 'delayed', ...), or None when
    the model runs without ``--fp8-format`` (BF16: nothing here changes anything)."""
    if model_config is None or not getattr(model_config, "fp8", None):
        return None
    recipe = getattr(model_config, "fp8_recipe", None)
    return str(getattr(recipe, "value", recipe))


def check_fp8_graphs(impl: str, granularity: str, recipe: Optional[str]) -> None:
    """Raise ValueError where ``recipe`` cannot run under the graph kind ``impl`` /
    ``granularity`` (`settings.GraphSettings` names). Host only."""
    if recipe != DELAYED or impl == "none":
        return
    if impl == "transformer_engine" or (impl == "local" and granularity == "layer"):
        return
    kind = (f"--cuda-graph-impl {impl}" if impl != "local"
            else f"--cuda-graph-impl local --cuda-graph-granularity {granularity}")
    raise ValueError(
        f"--fp8-recipe is wrong for {kind}: {recipe}. Delayed scaling updates its amax "
        f"history and scales at the exit of TE's autocast, which these graphs would capture "
        f"(or replay unverified). Use --fp8-recipe tensorwise or blockwise (every graph kind), "
        f"or keep delayed with layer graphs (--cuda-graph-impl local --cuda-graph-granularity "
        f"layer, or --cuda-graph-impl transformer_engine).")


def forward_graphs_unavailable(recipe: Optional[str]) -> Optional[str]:
    """Why forward-only passes run eager under this recipe (None: they may replay graphs)."""
    if recipe == DELAYED:
        return ("--fp8-recipe delayed (a captured forward would record amaxes into the "
                "training scales' history)")
    return None


def te_capture_keywords(model_config, layers) -> dict:
    """The FP8 keywords of TE's ``make_graphed_callables`` for ``layers`` (in order): the
    autocast eager runs them in (megatron-core ``get_fp8_context``: its recipe, its amax
    reduction group, BF16 for ``--first-last-layers-bf16`` layers). {} without FP8.

    ``cache_quantized_params`` stays off: `WeightCacheFlag` writes the flag the captured
    linears read, so replays need no ``is_first_microbatch`` keyword."""
    if fp8_recipe(model_config) is None:
        return {}
    from megatron.core import parallel_state
    from megatron.core.fp8_utils import get_fp8_recipe, is_first_last_bf16_layer

    group = None
    if parallel_state.model_parallel_is_initialized():
        group = parallel_state.get_amax_reduction_group(
            with_context_parallel=True, tp_only_amax_red=model_config.tp_only_amax_red)
    enabled = tuple(not is_first_last_bf16_layer(model_config, layer.layer_number - 1)
                    for layer in layers)
    return {"enabled": enabled, "recipe": get_fp8_recipe(model_config),
            "amax_reduction_group": group}


def te_skip_flag_writer() -> Callable[[bool], None]:
    """Writes TE's process-global skip flag (made on first write, on the current device): a
    one-element device fill, no sync; captured when called inside a capture."""
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    return FP8GlobalStateManager.set_skip_fp8_weight_update_tensor


class WeightCacheFlag:
    """The one writer of TE's skip flag under the graph runtime (module doc).

    ``write(skip)``: sets the device flag (`te_skip_flag_writer`); None: the run has no FP8
    and every method does nothing. Host bookkeeping: the model chunks whose graphs have
    re-quantized in the running pass.
    """

    def __init__(self, write: Optional[Callable[[bool], None]] = None):
        self._write = write
        self._quantized: set = set()

    @classmethod
    def for_run(cls, model_config) -> "WeightCacheFlag":
        """The run's flag writer: TE's flag with FP8, a no-op without."""
        return cls(te_skip_flag_writer() if fp8_recipe(model_config) else None)

    @property
    def enabled(self) -> bool:
        return self._write is not None

    def begin_pass(self, chunks: Iterable = ()) -> None:
        """A new pass over possibly new weights: the next graphed micro-batch of each chunk
        re-quantizes, and so does each chunk's next eager TE call. Writes 0 (creating the flag
        before any capture of the pass; never a stale 1 into a capture's warm-up)."""
        if self._write is None:
            return
        self._quantized.clear()
        for chunk in chunks:
            mark = getattr(chunk, "set_is_first_microbatch", None)  # megatron-core module
            if mark is not None:
                mark()
        self._write(False)

    def before_graphed(self, chunk) -> bool:
        """Before a graphed micro-batch of ``chunk``: writes the flag; returns whether this
        micro-batch re-quantizes (the chunk's first graphed one in the pass)."""
        if self._write is None:
            return False
        requantize = id(chunk) not in self._quantized
        self._quantized.add(id(chunk))
        self._write(not requantize)
        return requantize
