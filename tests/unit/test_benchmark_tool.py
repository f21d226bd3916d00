import os
import sys

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
