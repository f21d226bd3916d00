"""FP8 state under the graph runtime on CPU (fp8_state.py): which graphed micro-batch
re-quantizes the weights, the flag writes the runtime makes per pass and micro-batch (inside
a full-iteration capture too), the delayed-scaling refusals, and the upstream patch that
leaves the flag to the runtime. The device flag itself is TE's (tests/gpu/test_fp8_graphs.py);
here the writer records what would be written."""

import inspect

import pytest

from megatron.core.transformer import cuda_graphs
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.packed_graphs import fp8_state
from megatron.packed_graphs.fp8_state import WeightCacheFlag, check_fp8_graphs
from megatron.packed_graphs.plan import GraphRuntimeConfig
from megatron.packed_graphs.runtime import (GraphRuntime, forward_graphs_unavailable,
                                            runtime_config)
from megatron.packed_graphs.settings import GraphSettings
from megatron.packed_upstream import graph_engine
from tests.unit.conftest import TINY_LAYER
from tests.unit.test_graph_runtime import batches, run

LOCAL = GraphRuntimeConfig(impl="local", capacity=8, warmup_iterations=1)


class Chunk:
    """A model chunk as the flag sees it: megatron-core's ``set_is_first_microbatch``."""

    def __init__(self):
        self.marked = 0

    def set_is_first_microbatch(self):
        self.marked += 1


def recording_flag():
    writes = []
    return WeightCacheFlag(writes.append), writes


# -- which micro-batch re-quantizes ----------------------------------------------------------

def test_first_graphed_micro_batch_of_each_chunk_requantizes_later_ones_reuse():
    flag, writes = recording_flag()
    first, second = Chunk(), Chunk()
    flag.begin_pass([first, second])
    assert [flag.before_graphed(first), flag.before_graphed(second),
            flag.before_graphed(first), flag.before_graphed(second)] == [True, True, False, False]
    # begin_pass writes 0 (re-quantize) once; then skip = not requantize per micro-batch
    assert writes == [False, False, False, True, True]
    assert (first.marked, second.marked) == (1, 1)


def test_every_pass_requantizes_again():
    """A training step, a forward-only pass, a health check: the weights may be new."""
    flag, writes = recording_flag()
    chunk = Chunk()
    for _ in range(3):
        flag.begin_pass([chunk])
        assert flag.before_graphed(chunk) is True
        assert flag.before_graphed(chunk) is False
    assert writes == [False, False, True] * 3
    assert chunk.marked == 3


def test_without_fp8_nothing_is_written():
    flag = WeightCacheFlag.for_run(TransformerConfig(**TINY_LAYER))
    assert not flag.enabled
    flag.begin_pass([Chunk()])
    assert flag.before_graphed(Chunk()) is False


# -- the runtime's writes ----------------------------------------------------------------------

def fp8_runtime(config=LOCAL):
    runtime = GraphRuntime(config)
    runtime.fp8_weights, writes = recording_flag()
    return runtime, writes


def test_runtime_writes_per_pass_and_graphed_micro_batch_not_for_eager_ones():
    runtime, writes = fp8_runtime()
    run(runtime, batches(3, 5))  # warm-up: every micro-batch eager
    assert writes == [False]
    writes.clear()
    run(runtime, batches(3, 5, 9))  # capture iteration; 9 documents overflow (eager)
    assert writes == [False, False, True]
    writes.clear()
    run(runtime, batches(9, 3, 5))  # the overflow first: the first *graphed* one re-quantizes
    assert writes == [False, False, True]


def test_forward_only_pass_begins_a_new_pass():
    runtime, writes = fp8_runtime()
    run(runtime, batches(3))
    writes.clear()
    run(runtime, batches(3, 5), training=False)  # eager here (no forward-only graphs)
    assert writes == [False]


def test_a_full_iteration_capture_records_one_write_per_micro_batch():
    """The schedule runs once, at capture: its writes are what every replay repeats."""
    config = GraphRuntimeConfig(impl="local", capacity=8, warmup_iterations=0,
                                full_iteration=True, iteration_micro_batches=3)
    runtime, writes = fp8_runtime(config)

    class Captured:
        captured = False

        def run(self, mode, staged, schedule):
            self.captured = True
            return schedule(staged), {}

    runtime.iteration_graph = Captured()
    it, _, _ = run(runtime, batches(3, 5, 2))
    assert it.whole.uses_graph
    assert writes == [False, False, True, True]


# -- refusals ----------------------------------------------------------------------------------

@pytest.mark.parametrize("impl, granularity", [("local", "chunk"), ("full_iteration", "layer"),
                                               ("full_iteration", "chunk")])
def test_delayed_scaling_is_refused_where_a_graph_would_hold_its_update(impl, granularity):
    with pytest.raises(ValueError, match=r"--fp8-recipe is wrong for --cuda-graph-impl .*: "
                                         r"delayed\. .*tensorwise or blockwise"):
        check_fp8_graphs(impl, granularity, "delayed")


@pytest.mark.parametrize("impl", ["none", "local", "transformer_engine", "full_iteration"])
@pytest.mark.parametrize("granularity", ["layer", "chunk"])
@pytest.mark.parametrize("recipe", [None, "tensorwise", "blockwise"])
def test_current_and_block_scaling_run_under_every_graph_kind(impl, granularity, recipe):
    check_fp8_graphs(impl, granularity, recipe)


def test_delayed_scaling_runs_under_local_layer_graphs_with_forward_passes_eager():
    check_fp8_graphs("local", "layer", "delayed")
    check_fp8_graphs("transformer_engine", "layer", "delayed")
    check_fp8_graphs("none", "chunk", "delayed")
    settings = GraphSettings(impl="local", capacity=8, micro_batch_size=1, seq_length=64,
                             num_microbatches=2)
    assert "--fp8-recipe delayed" in forward_graphs_unavailable(settings, "delayed")
    assert not runtime_config(settings, fp8_recipe="delayed").forward_graphs
    assert forward_graphs_unavailable(settings, "tensorwise") is None
    assert runtime_config(settings, fp8_recipe="tensorwise") == runtime_config(settings)


def test_the_recipe_is_read_off_the_model_config():
    assert fp8_state.fp8_recipe(TransformerConfig(**TINY_LAYER)) is None
    for recipe in ("tensorwise", "blockwise", "delayed"):
        config = TransformerConfig(**TINY_LAYER, fp8="e4m3", fp8_recipe=recipe)
        assert fp8_state.fp8_recipe(config) == recipe


def test_bf16_te_captures_get_no_fp8_keywords():
    assert fp8_state.te_capture_keywords(TransformerConfig(**TINY_LAYER), []) == {}


# -- the upstream patch ------------------------------------------------------------------------

def test_upstream_still_memoizes_the_flag_per_runner():
    """Sentinel: megatron-core writes the flag only when *this runner's* memo differs
    (fails when upstream changes that, and the patch must be re-checked)."""
    replay = inspect.getsource(cuda_graphs._CudagraphReplayNode.forward)
    assert "runner.fp8_param_cache_updated != is_first_microbatch" in replay
    assert "_set_skip_fp8_weight_update_tensor(not is_first_microbatch)" in replay
    runner_init = inspect.getsource(cuda_graphs._CudaGraphRunner.__init__)
    assert "_set_skip_fp8_weight_update_tensor(False)" in runner_init


def test_patch_leaves_the_flag_to_the_runtime(monkeypatch):
    monkeypatch.setattr(cuda_graphs, "_set_skip_fp8_weight_update_tensor",
                        graph_engine.UPSTREAM_SET_SKIP_FP8_WEIGHT_UPDATE)
    graph_engine.graph_runtime_owns_fp8_weight_flag.body()
    patched = cuda_graphs._set_skip_fp8_weight_update_tensor
    assert patched is not graph_engine.UPSTREAM_SET_SKIP_FP8_WEIGHT_UPDATE
    assert patched(True) is None  # upstream's would need TE and a GPU here
