"""Megatron-LM's MoE metric reduction over a two-stage pipeline, one stage without MoE layers.

Two CPU processes (gloo) run megatron-core's own ``MoEMetricsTracker.report`` as
``training_log`` calls it for a hybrid model: the stage with the MoE layer records through a
router's call (one slot per layer, 6), the stage without has nothing and is force-initialised
at the number of MoE layers (1). Alone, the pipeline all-reduce pairs tensors of two sizes and
fails (gloo; NCCL hangs). With `training_loop.size_moe_metrics_as_the_routers_do` first, both
stages report the same value.
"""

import datetime
import os
import types

import pytest
import torch
import torch.multiprocessing as mp

LAYERS = 6  # "M*-EM*": the routers' slots
MOE_LAYERS = 1  # what training_log passes for a hybrid model
MOE_LAYER_NUMBER = 4  # "E", the first layer of the second stage

pytestmark = pytest.mark.slow  # two spawned processes per test


def _stage(rank: int, store: str, sized: bool, results: str) -> None:
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    from megatron.packed_upstream import training_loop

    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                         world_size=2, timeout=datetime.timedelta(seconds=20))
    data_parallel = [torch.distributed.new_group([r]) for r in range(2)][rank]
    groups = types.SimpleNamespace(pp=torch.distributed.group.WORLD,
                                   dp_cp_gtp_remat=data_parallel)
    tracker = get_moe_metrics_tracker()  # the process's, as in training
    if sized:
        args = types.SimpleNamespace(num_experts=4, moe_router_load_balancing_type="none",
                                     moe_z_loss_coeff=1e-3)
        config = types.SimpleNamespace(num_layers=LAYERS, mtp_num_layers=None)
        training_loop.size_moe_metrics_as_the_routers_do(args, config)
    if rank == 1:  # the router of the stage's MoE layer
        tracker.record("z_loss", torch.tensor(3.0), MOE_LAYER_NUMBER, LAYERS)
    totals = {}
    tracker.report(1.0, 1, force_initialize=True, track_names=["z_loss"],
                   num_layers=MOE_LAYERS, total_loss_dict=totals, pg_collection=groups)
    torch.save(float(totals["z_loss"]), os.path.join(results, f"{rank}.pt"))
    torch.distributed.destroy_process_group()


def _run_stages(tmp_path, sized: bool) -> list:
    mp.start_processes(_stage, args=(str(tmp_path / "store"), sized, str(tmp_path)), nprocs=2,
                       start_method="spawn")
    return [torch.load(tmp_path / f"{rank}.pt") for rank in range(2)]


def test_upstream_alone_reduces_two_shapes(tmp_path):
    # gloo aborts the process ("Received data size doesn't match expected size"); NCCL hangs.
    with pytest.raises((mp.ProcessExitedException, mp.ProcessRaisedException)):
        _run_stages(tmp_path, sized=False)


def test_sized_first_every_stage_reports_the_moe_layers_value(tmp_path):
    assert _run_stages(tmp_path, sized=True) == [3.0, 3.0]  # one MoE layer, on both stages
