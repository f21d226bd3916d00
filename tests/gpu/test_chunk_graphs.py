"""Chunk graphs (one graph pair per model chunk and slot) reproduce eager training.

Results (H200, session 3): docs/cuda-graphs.md, "Chunk granularity".
"""

import pytest

from megatron.packed_graphs.slots import PipelineShape, slot_counts
from tests.gpu.launch import TINY_GPT, TINY_HYBRID, TRAIN, losses, run_training

STEPS = 30
# Capacity 9: some micro-batches overflow and run the chunk eager (docs/cuda-graphs.md).
CHUNK = ["--cuda-graph-impl", "local", "--cuda-graph-granularity", "chunk",
         "--cuda-graph-max-packed-seqs", "9", "--cuda-graph-warmup-steps", "2"]


def _compare(tmp_path, script, model, layout, nproc):
    # The ramp-up changes the micro-batch count after capture: 4 (capture at iteration 3),
    # then 6, then 8 per iteration; the same graphs replay for each.
    common = model + TRAIN + layout + ["--train-iters", str(STEPS), "--global-batch-size", "8",
                                       "--rampup-batch-size", "4", "2", "32"]
    eager = run_training(script, common, tmp_path, nproc=nproc, name="eager")
    graphs = run_training(script, common + CHUNK, tmp_path, nproc=nproc, name="chunk")
    captured = [r for r in graphs if r.get("graph capture (s)")]
    assert len(captured) == 1, "captured once, never again"
    assert captured[0]["global_batch_size"] == 4
    assert {r["global_batch_size"] for r in graphs} == {4, 6, 8}
    dloss = max(abs(e["lm_loss"] - g["lm_loss"]) for e, g in zip(eager, graphs))
    print(f"{script} {layout}: max |dloss| {dloss:.2e}, graphs {captured[0]['graphs captured']}")
    assert dloss < 5e-3, (losses(eager), losses(graphs))
    return captured[0]


@pytest.mark.parametrize("script,model", [("pretrain_gpt.py", TINY_GPT),
                                          ("pretrain_mamba.py", TINY_HYBRID)],
                         ids=["gpt", "hybrid"])
def test_chunk_graphs_match_eager_on_one_gpu(tmp_path, script, model):
    capture = _compare(tmp_path, script, model, [], nproc=1)
    assert capture["graphs captured"] == 2  # one chunk, one slot, forward + backward


@pytest.mark.gpus(2)
@pytest.mark.parametrize("script,model,vpp", [("pretrain_gpt.py", TINY_GPT, 1),
                                              ("pretrain_gpt.py", TINY_GPT, 2),
                                              ("pretrain_mamba.py", TINY_HYBRID, 1)],
                         ids=["gpt", "gpt-vpp2", "hybrid"])
def test_chunk_graphs_match_eager_with_pipeline_parallelism(tmp_path, script, model, vpp):
    layout = ["--pipeline-model-parallel-size", "2"]
    if vpp > 1:
        layout += ["--num-virtual-stages-per-pipeline-rank", str(vpp)]
    capture = _compare(tmp_path, script, model, layout, nproc=2)
    # The metrics come from the last stage: its slots per chunk, two graphs each.
    slots = slot_counts(PipelineShape(pp_size=2, pp_rank=1, num_model_chunks=vpp))
    assert capture["graphs captured"] == 2 * sum(slots)
