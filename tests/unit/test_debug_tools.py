import os
import sys
import traceback

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
import find_host_syncs as fhs  # noqa: E402


def _stack(*frames):
    return traceback.StackSummary.from_list([(f, line, "fn", "code") for f, line in frames])


# Megatron-LM's loop (the megatron-core wheel's megatron.training) runs every iteration.
UPSTREAM_LOOP = "/x/site-packages/megatron/training/training.py"


def test_syncs_grouped_by_call_site_and_split_model_vs_loop():
    model_sync = _stack((UPSTREAM_LOOP, 10),
                        ("/x/site-packages/megatron/core/ssm/mamba_mixer.py", 700),
                        ("/x/site-packages/torch/functional.py", 5))
    loop_sync = _stack((UPSTREAM_LOOP, 99),
                       ("/x/site-packages/torch/_tensor.py", 3))
    sites = fhs.group_syncs([model_sync, model_sync, loop_sync])
    assert list(sites) == ["/x/site-packages/megatron/core/ssm/mamba_mixer.py:700",
                           f"{UPSTREAM_LOOP}:99"]
    first, second = sites.values()
    assert first["count"] == 2 and first["in_model"]
    assert second["count"] == 1 and not second["in_model"]
    report = fhs.format_report(sites, 5)
    assert "host syncs in iteration 5: 3 calls at 2 sites (1 inside the model)" in report
    assert "mamba_mixer.py:700  x2" in report


def _framed(*frames):
    return traceback.StackSummary.from_list([(f, line, name, "code")
                                             for f, line, name in frames])


RERUN_READ = ("/x/megatron/packed_graphs/moe_rerun.py", 155, "read_rows")
LOOP = (UPSTREAM_LOOP, 10, "train_step")


def test_the_moe_reruns_per_iteration_read_is_reported_apart_from_model_syncs():
    read = _framed(LOOP, ("/x/megatron/packed_graphs/moe_rerun.py", 180,
                          "after_forward_backward"),
                   RERUN_READ, ("/x/site-packages/torch/_tensor.py", 3, "tolist"))
    module_call = ("/x/site-packages/torch/nn/modules/module.py", 1, "_call_impl")
    router = _framed(LOOP, module_call, ("/x/megatron/packed_model/moe.py", 90, "routing"))
    sites = fhs.group_syncs([read, router])
    assert [e["in_model"] for e in sites.values()] == [False, True]
    assert sites["/x/megatron/packed_graphs/moe_rerun.py:155"]["deliberate"].startswith(
        "MoE overflow rerun")
    report = fhs.format_report(sites, 5)
    assert "(1 inside the model)" in report
    assert "== deliberate once-per-iteration reads (outside graphs): 1" in report
    assert "   why: MoE overflow rerun (--moe-capacity-overflow rerun)" in report
    # The listed function reached from inside a forward is a sync in the model like any other.
    read_in_forward = _framed(LOOP, module_call, RERUN_READ)
    assert fhs.in_model(read_in_forward) and fhs.deliberate_read(read_in_forward) is None


def test_the_health_checks_read_is_reported_apart_and_its_passes_are_in_the_model():
    exit_ = ("/x/megatron/packed_graphs/runtime.py", 260, "iteration")
    check = ("/x/megatron/packed_graphs/health_check.py", 165, "run")
    read = _framed(LOOP, exit_, ("/x/megatron/packed_graphs/runtime.py", 363, "_check_health"),
                   check, ("/x/site-packages/torch/_tensor.py", 3, "tolist"))
    module_call = ("/x/site-packages/torch/nn/modules/module.py", 1, "_call_impl")
    eager_pass = _framed(LOOP, exit_, check, ("/x/megatron/packed_graphs/health_check.py", 191,
                                              "_pass"), module_call,
                         ("/x/site-packages/megatron/core/ssm/mamba_mixer.py", 700, "forward"))
    sites = fhs.group_syncs([read, eager_pass])
    assert [e["in_model"] for e in sites.values()] == [False, True]
    assert sites["/x/megatron/packed_graphs/health_check.py:165"]["deliberate"].startswith(
        "graph health check (--cuda-graph-check-interval)")
    assert sites["/x/site-packages/megatron/core/ssm/mamba_mixer.py:700"]["deliberate"] is None


def test_every_deliberate_read_names_a_function_that_reads_back():
    """The allow-list follows the code: each entry is a function of that file that makes a
    host read, so a rename or a removed read shows here."""
    import importlib
    import inspect

    for (path, function), why in fhs.DELIBERATE_READS.items():
        module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
        found = [obj for _, cls in inspect.getmembers(module, inspect.isclass)
                 if cls.__module__ == module.__name__
                 for name, obj in vars(cls).items() if name == function]
        assert len(found) == 1 and why, (path, function)
        assert ".tolist()" in inspect.getsource(found[0]), (path, function)


SEAM_CALL = ("/x/megatron/packed_graphs/schedule.py", 110, "__call__")
SEAM_STEP = ("/x/megatron/packed_graphs/schedule.py", 150, "step_then_close")


def test_the_loops_seam_is_loop_code_and_the_model_under_it_is_the_model():
    """Megatron-LM's loop reaches the schedule and the optimizer step through the graph
    runtime's seam (packed_graphs/schedule.py): a sync of the optimizer step is the loop's, a
    forward's under the seam the model's."""
    grad_norm = _framed(LOOP, SEAM_STEP,
                        ("/x/site-packages/megatron/core/optimizer/optimizer.py", 90, "step"),
                        ("/x/site-packages/torch/_tensor.py", 3, "item"))
    module_call = ("/x/site-packages/torch/nn/modules/module.py", 1, "_call_impl")
    forward = _framed(LOOP, SEAM_CALL, ("/x/megatron/packed_graphs/runtime.py", 460, "run"),
                      module_call, ("/x/megatron/packed_model/attention.py", 200, "forward"))
    # a logging iteration's loss read, under the loop's patched training_log (the shim's)
    log_read = _framed(LOOP, ("/x/megatron/packed_upstream/training_loop.py", 255, "training_log"),
                       ("/x/site-packages/megatron/training/training.py", 2878, "training_log"),
                       ("/x/site-packages/torch/_tensor.py", 3, "item"))
    sites = fhs.group_syncs([grad_norm, forward, log_read])
    assert [e["in_model"] for e in sites.values()] == [False, True, False]
    assert "(1 inside the model)" in fhs.format_report(sites, 3)


def test_train_iters_is_raised_to_the_watched_iteration():
    assert fhs.with_train_iters_at_least(["--lr", "1", "--train-iters", "3"], 5) == [
        "--lr", "1", "--train-iters", "3", "--train-iters", "5"]
    assert fhs.with_train_iters_at_least(["--train-iters=9"], 5) == ["--train-iters=9"]
    assert fhs.with_train_iters_at_least(["--train-samples", "64"], 5) == [
        "--train-samples", "64"]


def test_bad_arguments_are_usage_errors():
    with pytest.raises(SystemExit) as err:
        fhs.main(["pretrain_bert.py"])
    assert err.value.code == 2
    with pytest.raises(SystemExit):
        fhs.main(["pretrain_gpt.py", "--iteration", "0"])


def test_sync_watch_brackets_only_its_iteration(monkeypatch):
    import torch

    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: calls.append("synchronize"))
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", calls.append)
    watch = fhs.SyncWatch(iteration=2)
    with watch(1):
        assert calls == []
    with pytest.raises(RuntimeError):
        with watch(2):
            assert calls == ["synchronize", "warn"]
            raise RuntimeError("the step failed")
    assert calls == ["synchronize", "warn", 0]  # debug mode off again


def test_compare_graph_grads_relative_differences():
    import torch

    import compare_graph_grads as cgg

    ref = {"a": torch.tensor([3.0, 4.0]), "b": torch.tensor([1.0, 0.0])}
    got = {"a": torch.tensor([3.0, 4.0]), "b": torch.tensor([1.0, 1.0])}
    total, rows = cgg.relative_differences(got, ref)
    assert rows[0][1] == "b" and rows[0][0] == pytest.approx(1.0)
    assert rows[1][0] == pytest.approx(0.0)
    assert total == pytest.approx(1.0 / 26 ** 0.5)


def test_the_watch_brackets_train_step_through_training_log(monkeypatch):
    """watch_training_iteration wraps Megatron-LM's loop functions by their module names (the
    names train() calls): the watched iteration's debug mode is on from its train_step through
    its training_log, and only there; a failing step closes the window; restore puts upstream's
    functions back."""
    import inspect

    import torch

    import megatron.training.training as loop

    source = inspect.getsource(loop.train)  # the order the window relies on
    assert source.index("train_step(") < source.index(
        "optimizer.get_loss_scale().item()") < source.index("training_log(")

    calls, mode = [], {"now": 0}

    def set_mode(value):
        calls.append(value)
        mode["now"] = value

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: calls.append("synchronize"))
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", set_mode)
    seen = []

    def train_step(*args, **kwargs):
        seen.append(("step", mode["now"]))
        if kwargs.get("fail"):
            raise RuntimeError("the step failed")

    monkeypatch.setattr(loop, "train_step", train_step)
    monkeypatch.setattr(loop, "training_log", lambda *a, **k: seen.append(("log", mode["now"])))
    iteration = {"now": 0}
    restore = fhs.watch_training_iteration(fhs.SyncWatch(iteration=2), lambda: iteration["now"])
    try:
        for it in (1, 2, 3):
            iteration["now"] = it
            loop.train_step("forward_step", "data", iteration=it)
            loop.training_log({}, {})
        assert seen == [("step", 0), ("log", 0), ("step", "warn"), ("log", "warn"),
                        ("step", 0), ("log", 0)]
        assert calls == ["synchronize", "warn", 0]
        iteration["now"] = 2
        with pytest.raises(RuntimeError, match="the step failed"):
            loop.train_step(fail=True)
        assert mode["now"] == 0  # the failed step's window is closed
    finally:
        restore()
    assert loop.train_step is train_step


def test_compare_graph_grads_builds_the_model_setup_of_megatron_lms_training(monkeypatch):
    """The tool's flags for a model (the old fork's defaults first, the caller's flags win)
    pass the training parser; the DDP config and padded vocabulary are what Megatron-LM's
    training builds from them (CPU: no model is built)."""
    from unittest import mock

    import compare_graph_grads as cgg
    from megatron.packed_training.arguments import parse_args

    model = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "128", "--vocab-size", "1000", "--hidden-dropout", "0.1"]
    defaults = cgg.model_defaults("gpt", model)
    assert defaults[-2:] == ["--max-position-embeddings", "128"]
    assert "--max-position-embeddings" not in cgg.model_defaults("hybrid", model[:-8])
    with mock.patch.dict(os.environ, {"WORLD_SIZE": "1", "RANK": "0"}):
        args = parse_args(defaults + model + ["--mock-data", "--sft", "--bf16", "--lr", "1e-4",
                                              "--train-iters", "4", "--micro-batch-size", "1",
                                              "--global-batch-size", "2"], model="gpt")
    assert (args.normalization, args.position_embedding_type) == ("RMSNorm", "rope")
    assert args.hidden_dropout == 0.1 and args.attention_dropout == 0.0  # the caller's wins
    ddp = cgg.ddp_config(args)
    assert ddp.grad_reduce_in_fp32 and ddp.check_for_nan_in_grad
    assert not ddp.use_distributed_optimizer
    assert args.padded_vocab_size == 1024  # parse_args rounds up as Megatron-LM's start-up
