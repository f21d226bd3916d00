import os
import sys
import traceback

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
import find_host_syncs as fhs  # noqa: E402


def _stack(*frames):
    return traceback.StackSummary.from_list([(f, line, "fn", "code") for f, line in frames])


def test_syncs_grouped_by_call_site_and_split_model_vs_loop():
    model_sync = _stack(("/x/megatron/packed_training/training.py", 10),
                        ("/x/site-packages/megatron/core/ssm/mamba_mixer.py", 700),
                        ("/x/site-packages/torch/functional.py", 5))
    loop_sync = _stack(("/x/megatron/packed_training/training.py", 99),
                       ("/x/site-packages/torch/_tensor.py", 3))
    sites = fhs.group_syncs([model_sync, model_sync, loop_sync])
    assert list(sites) == ["/x/site-packages/megatron/core/ssm/mamba_mixer.py:700",
                           "/x/megatron/packed_training/training.py:99"]
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
LOOP = ("/x/megatron/packed_training/training.py", 10, "train_step")


def test_the_moe_reruns_per_iteration_read_is_reported_apart_from_model_syncs():
    read = _framed(LOOP, ("/x/megatron/packed_graphs/moe_rerun.py", 180,
                          "after_forward_backward"),
                   RERUN_READ, ("/x/site-packages/torch/_tensor.py", 3, "tolist"))
    module_call = ("/x/site-packages/torch/nn/modules/module.py", 1, "_call_impl")
    router = _framed(LOOP, module_call, ("/x/megatron/packed_graphs/moe.py", 90, "routing"))
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
