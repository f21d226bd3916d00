import megatron.core
from megatron.core.transformer import cuda_graphs

from megatron.packed_graphs import core_patches


def test_patches_target_the_pinned_version():
    assert megatron.core.__version__ == core_patches.PATCHED_VERSION


def test_upstream_warmup_flag_bug_is_still_there_and_patched():
    # When this first assertion fails, megatron-core fixed the bug: drop the patch.
    cuda_graphs._IS_GRAPH_WARMUP = True
    core_patches.UPSTREAM_SET_WARMUP_END()
    assert cuda_graphs.is_graph_warmup(), "upstream fixed _set_warmup_end; remove the patch"
    core_patches.apply_core_patches()
    cuda_graphs._set_warmup_start()
    cuda_graphs._set_warmup_end()
    assert not cuda_graphs.is_graph_warmup()


def test_capture_statistics_are_kept(monkeypatch):
    core_patches.apply_core_patches()
    from megatron.core.pipeline_parallel import schedules

    assert schedules.create_cudagraphs is not cuda_graphs.create_cudagraphs
    # Nothing recorded: upstream returns None and nothing is logged.
    before = len(core_patches.capture_log)
    schedules.create_cudagraphs()
    assert len(core_patches.capture_log) == before
