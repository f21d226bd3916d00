"""tools/plot_metrics.py: metrics parsing (train vs valid, golden layouts) and the PNG (CPU)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from tools.plot_metrics import (  # noqa: E402
    build_parser,
    golden_curve,
    load_curve,
    load_run,
    main,
    parse_run_spec,
    plot,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_metrics(path, losses, valid=(), ms=100.0):
    """A metrics file as RuntimeLog writes it: train records, valid records between."""
    with open(path, "w") as f:
        for i, loss in enumerate(losses, start=1):
            f.write(json.dumps({"iteration": i, "consumed_samples": 4 * i, "lm_loss": loss,
                                "grad_norm": 1.0, "iteration_time_ms": ms * (20 if i == 4 else 1),
                                "tokens_per_sec": 1e5, "graph fallbacks": 0}) + "\n")
            for step, value in valid:
                if step == i:
                    f.write(json.dumps({"split": "valid", "iteration": i, "lm_loss": value}) + "\n")
    return str(path)


@pytest.fixture
def two_runs(tmp_path):
    losses = [10.5 - 0.4 * i for i in range(20)]
    eager = _write_metrics(tmp_path / "eager.jsonl", losses, valid=[(10, 7.0), (20, 3.0)])
    graphs = _write_metrics(tmp_path / "graphs.jsonl", [x + 0.01 for x in losses], ms=60.0)
    golden = tmp_path / "golden_values.json"
    golden.write_text(json.dumps({"lm loss": {
        "start_step": 1, "end_step": 20, "step_interval": 1,
        "values": {str(i + 1): v for i, v in enumerate(losses)}}}))
    return eager, graphs, str(golden)


def test_load_curve_splits_train_and_valid(two_runs):
    eager, _, _ = two_runs
    steps, values = load_curve(eager)
    assert steps == list(range(1, 21))
    assert values[0] == 10.5 and values[-1] == pytest.approx(10.5 - 0.4 * 19)
    assert load_curve(eager, split="valid") == ([10, 20], [7.0, 3.0])
    assert load_curve(eager, key="iteration_time_ms")[1][3] == 2000.0


def test_load_curve_keeps_the_last_value_of_a_repeated_step(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join(json.dumps({"iteration": i, "lm_loss": v})
                              for i, v in [(1, 5.0), (2, 4.0), (2, 3.5), (3, 3.0)]) + "\n\n")
    assert load_curve(str(path)) == ([1, 2, 3], [5.0, 3.5, 3.0])


def test_golden_curve_reads_dict_and_list_layouts():
    as_dict = {"lm loss": {"start_step": 1, "end_step": 3, "step_interval": 1,
                           "values": {"3": 8.0, "1": 10.0, "2": "nan"}}}
    steps, values = golden_curve(as_dict)
    assert steps == [1, 2, 3] and values[0] == 10.0 and math.isnan(values[1])
    as_list = {"lm loss": {"start_step": 5, "end_step": 25, "step_interval": 10,
                           "values": [9.0, 8.0, 7.0]}}
    assert golden_curve(as_list) == ([5, 15, 25], [9.0, 8.0, 7.0])
    with pytest.raises(ValueError, match="golden values is wrong: no 'lm loss' key"):
        golden_curve({"num-zeros": {}})


def test_run_spec_label_defaults_to_file_stem(two_runs, tmp_path):
    eager, _, _ = two_runs
    assert parse_run_spec(eager) == (eager, None)
    assert parse_run_spec(f"{eager}:eager run") == (eager, "eager run")
    assert load_run(eager).label == "eager"
    assert load_run(eager, "x").valid_loss == ([10, 20], [7.0, 3.0])


def _assert_png(path, min_bytes=10_000):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > min_bytes
    return data


@pytest.mark.parametrize("step_time", [False, True])
def test_plot_writes_a_png(two_runs, tmp_path, step_time):
    eager, graphs, golden = two_runs
    out = tmp_path / f"loss_{step_time}.png"
    runs = [load_run(eager, "eager"), load_run(graphs, "graphs")]
    plot(runs, str(out), golden=golden_curve(json.load(open(golden))), step_time=step_time)
    _assert_png(out)


def test_step_time_panel_makes_a_taller_image(two_runs, tmp_path):
    eager, graphs, _ = two_runs
    sizes = {}
    for step_time in (False, True):
        out = tmp_path / f"{step_time}.png"
        plot([load_run(eager), load_run(graphs)], str(out), step_time=step_time)
        data = _assert_png(out)
        sizes[step_time] = int.from_bytes(data[20:24], "big")  # IHDR height
    assert sizes[True] > sizes[False]


def test_cli(two_runs, tmp_path, capsys):
    eager, graphs, golden = two_runs
    out = tmp_path / "plots" / "loss.png"
    assert main([f"{eager}:eager", f"{graphs}:graphs", "--golden", golden,
                 "--step-time", "--out", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    _assert_png(out)


# --- missing or truncated input files: one line naming the file, exit 1, no traceback ----------

def _cli(*argv):
    """The tool as a program, in a fresh interpreter."""
    repo = Path(__file__).resolve().parents[2]
    return subprocess.run([sys.executable, str(repo / "tools" / "plot_metrics.py"), *argv],
                          capture_output=True, text=True, timeout=120)


def test_a_missing_metrics_file_is_named_in_one_line(tmp_path):
    missing = tmp_path / "nope.jsonl"
    proc = _cli(f"{missing}:eager", "--out", str(tmp_path / "x.png"))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"plot_metrics: metrics file is wrong: {missing} does not exist. Check the path."]
    assert not (tmp_path / "x.png").exists()


def test_a_truncated_metrics_file_is_named_with_its_line(tmp_path, capsys):
    cut = tmp_path / "cut.jsonl"
    cut.write_text('{"iteration": 1, "lm_loss": 5.0}\n{"iteration": 2, "lm_lo')
    assert main([str(cut), "--out", str(tmp_path / "x.png")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"plot_metrics: metrics file is wrong: {cut} line 2 "
                                               "is not complete JSON")
    assert "truncated" in err[0]


def test_a_truncated_golden_file_is_named(two_runs, tmp_path):
    eager, _, _ = two_runs
    golden = tmp_path / "golden_values.json"
    golden.write_text('{"lm loss": {"start_step": 1, "values": {"1": 10.')
    proc = _cli(eager, "--golden", str(golden), "--out", str(tmp_path / "x.png"))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"golden values file is wrong: {golden} is not complete JSON" in lines[0]


def test_help_shows_the_defaults():
    text = " ".join(build_parser().format_help().split())
    assert "(default: None)" in text and "(default: False)" in text
