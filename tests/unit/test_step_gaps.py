import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
import step_gaps  # noqa: E402


def _event(cat, name, ts, dur, tid=1):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid}


def test_idle_gaps_merge_overlapping_work_and_skip_short_gaps():
    assert step_gaps.idle_gaps([(0, 10), (5, 20), (25, 30), (100, 110)], min_gap=10) == [(30, 100)]


def test_idle_time_goes_to_the_innermost_host_frame():
    # GPU: kernels at [0, 10) and [60, 70); idle 10..60 while the host sits in
    # train_step -> clip_grads (10..50) -> item (20..50) and then train_step alone (50..60).
    trace = {"traceEvents": [
        _event("kernel", "gemm", 0, 10, tid=7), _event("kernel", "adam", 60, 10, tid=7),
        _event("python_function", "train_step", 0, 70),
        _event("python_function", "clip_grads", 10, 40),
        _event("cpu_op", "aten::item", 20, 30),
        _event("python_function", "clip_grads", 25, 5),  # recursion: inclusive counts once
        _event("python_function", "other_thread", 0, 70, tid=2),
    ]}
    result = step_gaps.analyse(trace, min_gap_us=5)
    assert result["idle_us"] == 50 and result["gaps"] == 1 and result["span_us"] == 70
    assert result["self"] == {"train_step": 10, "clip_grads": 15, "aten::item": 25}
    assert result["inclusive"] == {"train_step": 50, "clip_grads": 40, "aten::item": 30}


def test_main_prints_the_tables(tmp_path, capsys):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": [
        _event("kernel", "k", 0, 10), _event("kernel", "k", 100, 10),
        _event("cuda_runtime", "cudaStreamSynchronize", 10, 90)]}))
    assert step_gaps.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "GPU idle 0.09 ms in 1 gaps" in out and "| `cudaStreamSynchronize` | 0.09 | 100% |" in out


# --- missing or truncated traces: one line naming the file, exit 1, no traceback ----------------

def _cli(*argv):
    tool = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "step_gaps.py")
    return subprocess.run([sys.executable, tool, *argv], capture_output=True, text=True,
                          timeout=120)


def test_a_missing_trace_is_named_in_one_line(tmp_path):
    missing = tmp_path / "trace_iter9_rank0.json"
    proc = _cli(str(missing))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"step_gaps: trace is wrong: {missing} does not exist. Pass a "
        "trace_iter<N>_rank<R>.json from --profile-trace-dir."]


def test_a_truncated_trace_is_named_in_one_line(tmp_path, capsys):
    cut = tmp_path / "trace.json"
    cut.write_text('{"traceEvents": [{"ph": "X", "cat": "kernel", "ts": 0, "du')
    assert step_gaps.main([str(cut)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith(f"step_gaps: trace is wrong: {cut} is not complete JSON")
    assert "truncated" in err[0]


def test_a_trace_without_kernels_says_so(tmp_path, capsys):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": [_event("python_function", "f", 0, 10)]}))
    assert step_gaps.main([str(path)]) == 1
    assert "holds no GPU kernels" in capsys.readouterr().err


def test_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        step_gaps.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 20.0)" in text and "(default: 15)" in text


# --- --census: gaps of a graph-bound step, inside graphs or not ---------------------------------

def _launched(cat, name, ts, dur, correlation):
    return {**_event(cat, name, ts, dur), "args": {"correlation": correlation}}


def test_census_splits_gaps_by_length_and_by_graph(tmp_path, capsys):
    trace = {"traceEvents": [
        _launched("cuda_runtime", "cudaGraphLaunch", 0, 5, 1),
        _launched("cuda_runtime", "cudaMemcpyAsync", 6, 5, 2),
        # One graph launch: three kernels 1 us and 5 us apart, then an eager copy 100 us later.
        _launched("kernel", "gemm<float>(int)", 10, 10, 1),
        _launched("kernel", "add_kernel<4>", 21, 10, 1),
        _launched("gpu_memset", "Memset (Device)", 36, 1, 1),
        _launched("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 137, 2, 2)]}
    result = step_gaps.census(trace)
    assert (result["ops"], result["graph_ops"]) == (4, 3)
    assert result["buckets"][(2.0, True)] == [1, 1.0]
    assert result["buckets"][(10.0, True)] == [1, 5.0]
    assert result["buckets"][(float("inf"), False)] == [1, 100.0]
    assert result["pairs"][("gemm", "add_kernel")] == [1, 1.0]

    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    assert step_gaps.main([str(path), "--census"]) == 0
    out = capsys.readouterr().out
    assert "4 GPU operations, 3 launched from CUDA graphs" in out
    assert "| 2-10 us | yes | 1 | 0.005 |" in out and "| >= 50 us | no | 1 | 0.100 |" in out
