"""tools/benchmark.py --mode logprobs and its worker, tools/logprobs_benchmark.py, on CPU: the
launch command (its training flags through the real training parser), the rows from the
worker's file, the refusals, and the worker's synthetic calls and timing with the GPU parts
stood in for. The GPU measurement: docs/rl.md, "Performance"."""

import json
import os
import sys
from argparse import Namespace
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
import benchmark  # noqa: E402
import logprobs_benchmark  # noqa: E402

LOGPROB_PRESETS = benchmark.PRESET_GROUPS["logprobs"]


@pytest.fixture(autouse=True)
def _no_gpu_query(monkeypatch):
    """No nvidia-smi query; the runs, stood in for, start as on a machine with a GPU."""
    monkeypatch.setattr(benchmark, "machine_description", lambda: "1 x Test GPU")
    monkeypatch.setattr(benchmark, "cuda_problem", lambda nproc: None)


def _args(**over):
    base = dict(steps=30, warmup=5, log_interval=1, global_batch_size=8, doc_length_median=512,
                nproc=1, pipeline_model_parallel_size=1, extra_args="", tokens_per_rank=2048,
                profile=False, expert_model_parallel_size=1, keep_traces=None, mode="logprobs")
    return Namespace(**{**base, **over})


def test_the_issues_sizes_are_the_logprobs_group():
    assert LOGPROB_PRESETS == ["gpt-8x512x2048", "gpt-16x1024x4096", "hybrid-8x512x2048",
                               "hybrid-16x1024x4096", "hybrid-moe-small"]


@pytest.mark.parametrize("preset", LOGPROB_PRESETS)
@pytest.mark.parametrize("variant", ["eager", "layer-graphs"])
def test_every_logprobs_command_passes_the_training_parser(preset, variant, monkeypatch):
    from megatron.packed_training import extra_args
    from megatron.packed_training.arguments import parse_args

    monkeypatch.setattr(extra_args, "is_importable", lambda package: False)
    cmd = benchmark.logprobs_command(preset, variant, _args(), "/tmp/row.json")
    assert cmd[1:4] == ["-m", "torch.distributed.run", "--standalone"]
    worker = next(i for i, word in enumerate(cmd) if word.endswith("logprobs_benchmark.py"))
    options, flags = logprobs_benchmark.parse(cmd[worker + 1:])
    assert (options.calls, options.warmup, options.micro_batches, options.json) == (
        30, 5, 8, "/tmp/row.json")
    assert options.model == ("hybrid" if preset.startswith("hybrid") else "gpt")
    with mock.patch.dict(os.environ, {"WORLD_SIZE": "1", "RANK": "0"}):
        args = parse_args(flags, options.model)
    assert args.packed_graph_impl == ("none" if variant == "eager" else "local")
    if preset == "hybrid-moe-small":  # drop-and-pad: forward-only graphs can run it
        from megatron.packed_graphs.runtime import forward_graphs_unavailable
        from megatron.packed_training.config import graph_settings_from_args

        assert args.num_experts == 16 and (variant == "eager") == bool(
            forward_graphs_unavailable(graph_settings_from_args(args)))


def test_two_ranks_split_the_micro_batches_of_a_call():
    cmd = benchmark.logprobs_command("gpt-8x512x2048", "eager", _args(nproc=2), "/tmp/r.json")
    assert cmd[cmd.index("--micro-batches") + 1] == "4" and cmd[cmd.index(
        "--nproc-per-node") + 1] == "2"


def _completed(code, out=""):
    return SimpleNamespace(returncode=code, stdout=out, stderr="")


def test_the_table_compares_graphed_calls_with_eager_ones(monkeypatch, capsys):
    def fake_run(cmd, **kwargs):
        graphs = "--cuda-graph-impl" in cmd
        row = {"call_ms": 20.0 if graphs else 100.0, "call_iqr_ms": 1.0,
               "tokens_per_sec": 5e5 if graphs else 1e5, "peak_mem_gib": 2.0,
               "capture_s": 1.5 if graphs else 0.0, "graph_mem_mib": 64.0 if graphs else 0.0,
               "fallback_rate": 0.125 if graphs else 0.0, "stats": {}}
        with open(cmd[cmd.index("--json") + 1], "w") as f:
            json.dump(row, f)
        return _completed(0)

    monkeypatch.setattr(benchmark.subprocess, "run", fake_run)
    code = benchmark.main(["--mode", "logprobs", "--presets", "gpt-8x512x2048",
                           "--variants", "eager", "layer-graphs", "--global-batch-size", "8"])
    out = capsys.readouterr().out
    assert code == 0
    assert "a step is one call over 8 micro-batches per rank" in out
    rows = [line for line in out.splitlines() if line.startswith("| gpt-8x512x2048")]
    assert rows[0].startswith("| gpt-8x512x2048 | eager | 100.0 | 1.0 | 100,000 | 1.00x |")
    assert rows[1].startswith("| gpt-8x512x2048 | layer-graphs | 20.0 | 1.0 | 500,000 | 5.00x |")
    assert "| 12.5% | 1.50 | 64 | - | - |" in rows[1]


def test_an_moe_row_and_a_run_without_its_row_file(monkeypatch, capsys):
    monkeypatch.setattr(benchmark.subprocess, "run", lambda cmd, **kwargs: _completed(0))
    code = benchmark.main(["--mode", "logprobs", "--presets", "hybrid-moe-small",
                           "--variants", "eager"])
    out, err = capsys.readouterr()
    assert code == 1 and "failed: no row file" in out
    assert "| dropped tokens | rerun rate |" in out


@pytest.mark.parametrize("argv, match", [
    (["--profile", "--keep-traces", "/nonexistent/traces"],
     "--keep-traces is wrong with --mode logprobs"),
    (["--pipeline-model-parallel-size", "2", "--nproc", "2"],
     "--pipeline-model-parallel-size is wrong with --mode logprobs"),
    (["--dynamic-cp-sets", "1,2"], "--dynamic-cp-sets is wrong with --mode logprobs"),
    (["--nproc", "3", "--global-batch-size", "8"], "--global-batch-size is wrong: 8"),
])
def test_what_logprobs_mode_refuses(argv, match, capsys):
    with pytest.raises(SystemExit):
        benchmark.main(["--mode", "logprobs", *argv])
    assert match in capsys.readouterr().err


# -- the worker ---------------------------------------------------------------------------------

def test_each_call_holds_its_micro_batches_of_whole_documents():
    from megatron.packed_training.rl.batches import lay_out_all

    calls = logprobs_benchmark.synthetic_calls(3, 4, 256, 1000, median=64, sigma=1.0)
    assert [len(call) for call in calls] == [4, 4, 4]
    assert not torch.equal(calls[0][0].tokens, calls[1][0].tokens)  # other documents per call
    for call in calls:
        batches = lay_out_all(call, 256)  # every micro-batch fits a row
        assert all(batch["num_documents"] >= 1 for batch in batches)


def test_the_worker_times_the_calls_after_its_warm_up(monkeypatch):
    class Policy:
        row_positions = 256

        def __init__(self):
            self.calls = 0

        def logprobs(self, micro_batches):
            self.calls += 1
            self.last_stats = ({"forward graphs captured": 1, "forward graph capture (s)": 2.0,
                                "forward graph memory (MiB)": 32.0, "forward graphs": 4}
                               if self.calls == 1 else {"forward graphs": 3,
                                                        "eager overflow": 1})

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 3 * 2**30)
    row = logprobs_benchmark.measure(Policy(), [[None] * 4] * 6, warmup=2)
    assert row["capture_s"] == 2.0 and row["graph_mem_mib"] == 32.0
    assert row["fallback_rate"] == 0.25 and row["peak_mem_gib"] == 3.0
    assert row["tokens_per_sec"] == pytest.approx(4 * 256 / (row["call_ms"] / 1000))


def test_profiled_calls_run_after_the_timed_ones_and_give_the_gpu_busy_and_host_time(
        monkeypatch):
    from megatron.packed_training import profiling

    class Profiler:  # the torch.profiler part stood in for: busy 5 ms, then 7 ms
        def __init__(self, enabled, start, end):
            assert (enabled, start, end) == (True, 1, 3)

        def begin(self, index):
            self.index = index

        def finish(self, index):
            return {"gpu busy (ms)": 3.0 + 2 * index}

    class Policy:
        row_positions, last_stats = 256, {}

        def __init__(self):
            self.seen = []

        def logprobs(self, micro_batches):
            self.seen.append(micro_batches[0])
            sum(i * i for i in range(20000))  # host work for cProfile to find

    monkeypatch.setattr(profiling, "StepProfiler", Profiler)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 0)
    policy = Policy()
    calls = [[call] * 4 for call in range(5)]
    row = logprobs_benchmark.measure(policy, calls, warmup=1, profile=True)
    # the last two calls once more under torch.profiler, the last once more under cProfile
    assert policy.seen == [0, 1, 2, 3, 4, 3, 4, 4]
    assert row["gpu_busy_ms"] == 6.0
    assert any("(logprobs)" in line for line in row["host_top"])
    assert any("<genexpr>" in line for line in row["host_top"])
    plain = logprobs_benchmark.measure(Policy(), calls, warmup=1)
    assert plain["gpu_busy_ms"] is None and plain["host_top"] == []


def test_profile_reaches_the_worker_and_its_row(tmp_path):
    cmd = benchmark.logprobs_command("gpt-8x512x2048", "eager", _args(profile=True), "/tmp/r")
    worker = next(i for i, word in enumerate(cmd) if word.endswith("logprobs_benchmark.py"))
    options, _ = logprobs_benchmark.parse(cmd[worker + 1:])
    assert options.profile
    row_file = tmp_path / "row.json"
    row_file.write_text(json.dumps({"call_ms": 10.0, "call_iqr_ms": 1.0, "tokens_per_sec": 1.0,
                                    "peak_mem_gib": 1.0, "fallback_rate": 0.0,
                                    "capture_s": 0.1, "graph_mem_mib": 8.0,
                                    "gpu_busy_ms": 8.0}))
    row = benchmark.logprobs_row("gpt-8x512x2048", "eager", _args(), str(row_file))
    assert row["gpu_busy_ms"] == 8.0 and row["host_top"] == []
    row_file.write_text(json.dumps(json.loads(row_file.read_text())
                                   | {"host_top": ["   12.00     40.00       4  a.py:3(f)"]}))
    row = benchmark.logprobs_row("gpt-8x512x2048", "eager", _args(), str(row_file))
    printed = benchmark.format_host_profiles([row, {"preset": "p", "variant": "v"}])
    assert "gpt-8x512x2048 / eager" in printed and "a.py:3(f)" in printed
    assert printed.count("Host time of one call") == 1
    assert benchmark.format_host_profiles([{"preset": "p", "variant": "v"}]) == ""


def test_the_worker_refuses_fewer_calls_than_its_warm_up(capsys):
    with pytest.raises(SystemExit):
        logprobs_benchmark.parse(["--model", "gpt", "--calls", "5", "--warmup", "5",
                                  "--json", "x"])
    assert "--calls is wrong: 5" in capsys.readouterr().err
