"""tools/benchmark.py: the table, variant flags, a failed row, the torchrun launch without a
port race, --from-metrics, --help (CPU)."""

import json
import os
import sys
from argparse import Namespace

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
import benchmark  # noqa: E402


def _row(variant, step_ms, tps, busy=None, **extra):
    return dict(preset="p", variant=variant, step_ms=step_ms, step_iqr_ms=2.5, tokens_per_sec=tps,
                peak_mem_gib=1.0,
                first_step_ms=1.0, final_loss=1.0, fallback_rate=extra.get("fallback", 0.0),
                capture_s=extra.get("capture", 0.0), graph_mem_mib=extra.get("mem", 0.0),
                gpu_busy_ms=busy)


def test_table_reports_speedup_against_eager_and_step_over_busy():
    table = benchmark.format_table([_row("eager", 300.0, 1000.0, busy=100.0),
                                    _row("layer-graphs", 100.0, 3000.0, busy=90.0,
                                         fallback=0.05, capture=1.5, mem=512)])
    lines = table.splitlines()
    assert "| p | eager | 300.0 | 2.5 | 1,000 | 1.00x |" in lines[2] and "| 100.0 | 3.00 |" in lines[2]
    assert "| p | layer-graphs | 100.0 | 2.5 | 3,000 | 3.00x |" in lines[3]
    assert "5.0% | 1.50 | 512 | 90.0 | 1.11 |" in lines[3]
    assert benchmark.format_table([_row("eager", 1.0, 1.0)]).splitlines()[2].endswith("- | - |")


def test_capacity_variants_override_the_capacity_only():
    flags = benchmark.variant_flags("layer-graphs-c256")
    assert flags[flags.index("--cuda-graph-max-packed-seqs") + 1] == "256"
    assert "--cuda-graph-impl" in flags and benchmark.variant_flags("eager") == []
    with pytest.raises(KeyError):
        benchmark.variant_flags("tensor-graphs")


def test_chunk_variant_asks_for_chunk_granularity():
    flags = benchmark.variant_flags("chunk-graphs")
    assert flags[flags.index("--cuda-graph-granularity") + 1] == "chunk"


@pytest.mark.parametrize("argv", [["--log-interval", "0"], ["--log-interval", "2"],
                                  ["--log-interval", "5", "--steps", "32"]])
def test_log_interval_must_divide_warmup_and_steps(argv, capsys):
    with pytest.raises(SystemExit):
        benchmark.main(["--warmup", "5", *argv])
    assert "--log-interval is wrong" in capsys.readouterr().err


def test_dynamic_cp_sets_keep_the_positions_per_rank():
    assert benchmark.dynamic_cp_flags("2", 2048) == ["--dynamic-cp-sizes", "2", "--seq-length",
                                                     "4096"]
    assert benchmark.dynamic_cp_flags("1,2,4", 1024) == [
        "--dynamic-cp-sizes", "1", "2", "4", "--seq-length", "4096"]


def _args(**over):
    base = dict(steps=30, warmup=5, log_interval=1, global_batch_size=4, doc_length_median=512,
                nproc=2, pipeline_model_parallel_size=1, extra_args="", tokens_per_rank=2048,
                profile=False)
    return Namespace(**{**base, **over})


def test_torchrun_starts_standalone_without_a_chosen_port():
    """--standalone: torchrun's c10d rendezvous store binds localhost:0 and the ranks reuse it,
    so benchmarks side by side on one machine never pick the same port."""
    cmd = benchmark.launch_command("hybrid-small", "eager", _args(), "/tmp/m.jsonl")
    launcher = cmd[:next(i for i, w in enumerate(cmd) if w.endswith("pretrain_mamba.py"))]
    assert launcher[1:] == ["-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
                            "--nproc-per-node", "2"]
    assert not any("port" in w or "rdzv" in w for w in cmd)


class _Completed:
    def __init__(self, returncode, stdout="", stderr=""):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def _metrics(path, tps, iters=10):
    with open(path, "w") as f:
        for it in range(1, iters + 1):
            f.write(json.dumps({"iteration": it, "lm_loss": 5.0, "iteration_time_ms": 100.0,
                                "tokens_per_sec": tps, "mem_max_allocated_bytes": 2**30}) + "\n")


def test_a_failed_row_shows_its_error_and_the_other_rows_still_run(monkeypatch, capsys):
    def fake_run(cmd, **kwargs):
        metrics = cmd[cmd.index("--metrics-file") + 1]
        if "--cuda-graph-impl" in cmd:
            return _Completed(1, "iteration 1\n", "Traceback (most recent call last):\n"
                              "torch.OutOfMemoryError: CUDA out of memory | tried 2 GiB\n")
        _metrics(metrics, 1000.0)
        return _Completed(0)

    monkeypatch.setattr(benchmark.subprocess, "run", fake_run)
    code = benchmark.main(["--presets", "gpt-small", "--variants", "layer-graphs", "eager",
                           "--steps", "10", "--warmup", "5"])
    out, err = capsys.readouterr()
    assert code == 1
    rows = [ln for ln in out.splitlines() if ln.startswith("| gpt-small")]
    assert rows[0] == ("| gpt-small | layer-graphs | failed: exit 1: torch.OutOfMemoryError: CUDA out "
                       "of memory / tried 2 GiB |" + " - |" * 9)
    assert rows[1].startswith("| gpt-small | eager | 100.0 |") and "| 1,000 | 1.00x |" in rows[1]
    assert "failed: gpt-small/layer-graphs" in err and "Traceback" in err  # the log tail
    assert "benchmark: 1 of 2 runs failed: gpt-small/layer-graphs" in err


def test_a_run_without_metrics_is_a_failed_row(monkeypatch, capsys):
    monkeypatch.setattr(benchmark.subprocess, "run", lambda cmd, **kw: _Completed(0))
    assert benchmark.main(["--presets", "gpt-small", "--steps", "10"]) == 1
    assert "| gpt-small | eager | failed: no metrics file " in capsys.readouterr().out


def test_from_metrics_tabulates_finished_runs(tmp_path, capsys):
    _metrics(tmp_path / "eager.jsonl", 1000.0, iters=30)
    _metrics(tmp_path / "graphs.jsonl", 2500.0, iters=30)
    (tmp_path / "cut.jsonl").write_text('{"iteration": 1, "lm_loss": 5.0}\n{"iteration": 2, "lm_')
    code = benchmark.main(["--presets", "hybrid-small", "--from-metrics",
                           f"eager={tmp_path / 'eager.jsonl'}",
                           f"layer-graphs={tmp_path / 'graphs.jsonl'}",
                           f"chunk-graphs={tmp_path / 'missing.jsonl'}",
                           f"te-layer-graphs={tmp_path / 'cut.jsonl'}",
                           "--warmup", "10", "--log-interval", "10"])
    out = capsys.readouterr().out
    assert code == 1
    assert "| hybrid-small | layer-graphs | 100.0 | 0.0 | 2,500 | 2.50x |" in out
    assert f"| hybrid-small | chunk-graphs | failed: no metrics file {tmp_path / 'missing.jsonl'} |" in out
    assert "| hybrid-small | te-layer-graphs | failed: metrics file " in out
    assert "is truncated or not JSON lines" in out


def test_from_metrics_needs_variant_equals_file(capsys):
    with pytest.raises(SystemExit):
        benchmark.main(["--from-metrics", "runs/eager.jsonl"])
    assert "--from-metrics is wrong: runs/eager.jsonl. Give VARIANT=FILE" in capsys.readouterr().err


def test_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit) as done:
        benchmark.main(["--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for default in ("training iterations per run (default: 30)", "(default: 5)",
                    "(default: 2048)", "(default: ['eager'])"):
        assert default in text
