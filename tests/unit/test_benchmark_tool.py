"""tools/benchmark.py: the table, variant flags, a failed row, the torchrun launch without a
port race, --from-metrics, --help, the MoE and MLA presets (every launch command through the
real training parser, Megatron-LM's with the fork's flags, and megatron-core's config; the old
fork's model shape; expert parallelism against --nproc; the MoE columns), peak memory from
Megatron-LM's memory report (CPU)."""

import importlib.metadata
import json
import os
import re
import signal
import sys
from argparse import Namespace
from unittest import mock

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
import benchmark  # noqa: E402

CUDA_PROBLEM = benchmark.cuda_problem  # the real check (the fixture below stands in for it)


@pytest.fixture(autouse=True)
def _no_gpu_query(monkeypatch):
    """The table's header asks nvidia-smi for the GPUs; tests that stand in for
    subprocess.run must not get that query. They run as on a machine with enough GPUs."""
    monkeypatch.setattr(benchmark, "machine_description", lambda: "2 x Test GPU")
    monkeypatch.setattr(benchmark, "cuda_problem", lambda nproc: None)


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


def test_profile_needs_a_timed_interval_past_the_warmup(capsys):
    with pytest.raises(SystemExit):
        benchmark.main(["--profile", "--steps", "20", "--warmup", "10", "--log-interval", "10"])
    err = capsys.readouterr().err
    assert "--steps is wrong: 20" in err and "--log-interval (30)" in err


def test_dynamic_cp_sets_keep_the_positions_per_rank():
    assert benchmark.dynamic_cp_flags("2", 2048) == ["--dynamic-cp-sizes", "2", "--seq-length",
                                                     "4096"]
    assert benchmark.dynamic_cp_flags("1,2,4", 1024) == [
        "--dynamic-cp-sizes", "1", "2", "4", "--seq-length", "4096"]


def _args(**over):
    base = dict(steps=30, warmup=5, log_interval=1, global_batch_size=4, doc_length_median=512,
                nproc=2, pipeline_model_parallel_size=1, extra_args="", tokens_per_rank=2048,
                profile=False, expert_model_parallel_size=1, keep_traces=None)
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
    """A metrics file as the runs write it now: no memory, no grad norm."""
    with open(path, "w") as f:
        for it in range(1, iters + 1):
            f.write(json.dumps({"iteration": it, "consumed_samples": 4 * it, "lm_loss": 5.0,
                                "iteration_time_ms": 100.0, "tokens_per_sec": tps}) + "\n")


def _memory_line(iteration, max_allocated_mb, rank=0):
    """Megatron-LM's report_memory line (megatron/training/utils)."""
    return (f"[Rank {rank}] (after {iteration} iterations) memory (MB) | allocated: 812.25 | "
            f"max allocated: {max_allocated_mb:.2f} | reserved: 2048.00 | max reserved: "
            f"2048.00\n")


def test_a_failed_row_shows_its_error_and_the_other_rows_still_run(monkeypatch, capsys):
    def fake_run(cmd, **kwargs):
        metrics = cmd[cmd.index("--metrics-file") + 1]
        if "--cuda-graph-impl" in cmd:
            return _Completed(1, "iteration 1\n", "Traceback (most recent call last):\n"
                              "torch.OutOfMemoryError: CUDA out of memory | tried 2 GiB\n")
        _metrics(metrics, 1000.0)
        return _Completed(0, _memory_line(1, 900.0) + _memory_line(10, 1024.0))

    monkeypatch.setattr(benchmark.subprocess, "run", fake_run)
    code = benchmark.main(["--presets", "gpt-small", "--variants", "layer-graphs", "eager",
                           "--steps", "10", "--warmup", "5"])
    out, err = capsys.readouterr()
    assert code == 1
    rows = [ln for ln in out.splitlines() if ln.startswith("| gpt-small")]
    assert rows[0] == ("| gpt-small | layer-graphs | failed: exit 1: torch.OutOfMemoryError: CUDA out "
                       "of memory / tried 2 GiB |" + " - |" * 9)
    assert rows[1].startswith("| gpt-small | eager | 100.0 |") and "| 1,000 | 1.00x |" in rows[1]
    assert "| 1.00x | 1.00 |" in rows[1]  # peak: 1024 MB max allocated, the last report
    assert "failed: gpt-small/layer-graphs" in err and "Traceback" in err  # the log tail
    assert "benchmark: 1 of 2 runs failed: gpt-small/layer-graphs" in err


def test_a_time_limit_prints_the_rows_measured_so_far(monkeypatch, capsys, tmp_path):
    """SIGTERM (timeout, Slurm) during the second run: the first run's row is printed and
    kept in --json, the exit status is timeout's, and SIGTERM's handler is restored."""
    calls = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # a real signal, handled in this process
        _metrics(cmd[cmd.index("--metrics-file") + 1], 1000.0)
        return _Completed(0)

    monkeypatch.setattr(benchmark.subprocess, "run", fake_run)
    before = signal.getsignal(signal.SIGTERM)
    code = benchmark.main(["--presets", "gpt-small", "--variants", "eager", "layer-graphs",
                           "chunk-graphs", "--steps", "10", "--json", str(tmp_path / "r.json")])
    out, err = capsys.readouterr()
    assert code == 124 and len(calls) == 2
    rows = [ln for ln in out.splitlines() if ln.startswith("| gpt-small")]
    assert len(rows) == 1 and rows[0].startswith("| gpt-small | eager | 100.0 |")
    assert "Command: python tools/benchmark.py" in out
    assert "benchmark: stopped by SIGTERM after 1 of 3 runs" in err
    assert [r["variant"] for r in json.loads((tmp_path / "r.json").read_text())] == ["eager"]
    assert signal.getsignal(signal.SIGTERM) is before


def test_the_table_is_headed_by_machine_date_software_and_command(monkeypatch, capsys):
    def fake_run(cmd, **kwargs):
        _metrics(cmd[cmd.index("--metrics-file") + 1], 1000.0)
        return _Completed(0)

    monkeypatch.setattr(benchmark.subprocess, "run", fake_run)
    argv = ["--presets", "gpt-small", "--variants", "eager", "--steps", "10"]
    assert benchmark.main(argv) == 0
    out = capsys.readouterr().out
    header = out[:out.index("| preset |")]
    assert re.search(r"Machine: 2 x Test GPU\. Date: \d{4}-\d\d-\d\d \d\d:\d\d UTC\.", header)
    assert f"torch {importlib.metadata.version('torch')}" in header
    assert f"megatron-core {importlib.metadata.version('megatron-core')}" in header
    assert "Command: python tools/benchmark.py --presets gpt-small --variants eager --steps 10" \
        in header


def test_the_machine_is_unknown_without_nvidia_smi(monkeypatch):
    monkeypatch.undo()  # the real machine_description
    monkeypatch.setattr(benchmark.shutil, "which", lambda name: None)
    assert benchmark.machine_description() == "no NVIDIA GPU (nvidia-smi not found)"


def test_json_holds_every_finished_row_while_later_runs_go_on(monkeypatch, tmp_path):
    out = tmp_path / "rows.json"
    seen = []

    def fake_run(cmd, **kwargs):
        seen.append(json.loads(out.read_text()) if out.exists() else [])
        _metrics(cmd[cmd.index("--metrics-file") + 1], 1000.0)
        return _Completed(0)

    monkeypatch.setattr(benchmark.subprocess, "run", fake_run)
    assert benchmark.main(["--presets", "gpt-small", "--variants", "eager", "layer-graphs",
                           "--steps", "10", "--json", str(out)]) == 0
    assert [[r["variant"] for r in rows] for rows in seen] == [[], ["eager"]]
    assert [r["variant"] for r in json.loads(out.read_text())] == ["eager", "layer-graphs"]


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
    # No memory report without the run's output: peak memory "-".
    assert "| hybrid-small | layer-graphs | 100.0 | 0.0 | 2,500 | 2.50x | - |" in out
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


def test_kept_traces_go_to_one_directory_per_row_label_and_variant(monkeypatch, tmp_path):
    launched = _launched_runs(monkeypatch)
    root = tmp_path / "traces"
    assert benchmark.main(["--presets", "gpt-small", "--variants", "eager", "layer-graphs",
                           "--steps", "10", "--profile", "--keep-traces", str(root)]) == 0
    dirs = [cmd[cmd.index("--profile-trace-dir") + 1] for cmd in launched]
    assert dirs == [str(root / "gpt-small" / "eager"), str(root / "gpt-small" / "layer-graphs")]
    assert all(cmd[cmd.index("--profile-step-start") + 1] == "9" for cmd in launched)
    # A row label with spaces (MoE experts, expert parallelism, a dynamic CP set).
    assert benchmark.trace_dir("/t", "gpt-moe-small", "eager", _args(expert_model_parallel_size=2),
                               "1,2", "grouped-gemm") == "/t/gpt-moe-small_grouped-gemm_ep2_cp1,2/eager"


def test_a_launch_command_keeping_traces_passes_the_training_parser(te_importable):
    cmd = benchmark.launch_command("gpt-small", "layer-graphs",
                                   _args(nproc=1, profile=True, keep_traces="/tmp/tr"), "/m.jsonl")
    args = _validated(cmd, world_size=1)
    # --profile is the fork's profiler's (GPU-busy time, the traces; Megatron-LM's own nsys
    # path stays off).
    assert args.packed_profile and args.profile_trace_dir == "/tmp/tr/gpt-small/layer-graphs"


@pytest.mark.parametrize("argv, match", [
    (["--keep-traces", "{new}"], "--keep-traces is wrong: {new}. Traces are recorded in the "
                                 "profiled iterations only; add --profile."),
    (["--profile", "--keep-traces", "{full}"], "--keep-traces is wrong: {full} exists and is not "
                                               "an empty directory."),
    (["--profile", "--keep-traces", "{file}"], "--keep-traces is wrong: {file} exists and is not "
                                               "an empty directory."),
    (["--profile", "--keep-traces", "{new}", "--from-metrics", "eager=m.jsonl"],
     "--keep-traces is wrong: {new}. --from-metrics trains nothing"),
])
def test_keep_traces_is_checked_at_parse_time(argv, match, tmp_path, capsys):
    paths = {"new": tmp_path / "new", "full": tmp_path / "full", "file": tmp_path / "f.json"}
    paths["full"].mkdir()
    (paths["full"] / "trace_iter9_rank0.json").write_text("{}")
    paths["file"].write_text("{}")
    with pytest.raises(SystemExit):
        benchmark.main([a.format(**paths) for a in argv])
    assert match.format(**paths) in capsys.readouterr().err


def test_keep_traces_takes_an_empty_directory(monkeypatch, tmp_path):
    monkeypatch.setattr(benchmark.subprocess, "run", lambda cmd, **kw: (
        _metrics(cmd[cmd.index("--metrics-file") + 1], 1.0), _Completed(0))[1])
    assert benchmark.main(["--presets", "gpt-small", "--steps", "10", "--profile",
                           "--keep-traces", str(tmp_path)]) == 0


# ------------------------------------------------------------------------------ MoE presets

MODEL_OF_SCRIPT = {"pretrain_gpt.py": "gpt", "pretrain_mamba.py": "hybrid"}
MOE_PRESETS = benchmark.PRESET_GROUPS["moe"]
MLA_PRESETS = benchmark.PRESET_GROUPS["mla"]
QWEN3_PRESETS = benchmark.PRESET_GROUPS["qwen3-moe"]
NEEDS_TE = {"te-layer-graphs"}


def _flag(preset, flag):
    flags = benchmark.PRESETS[preset][1]
    return flags[flags.index(flag) + 1] if flag in flags else None


def _needs_te(preset):
    """An MLA preset: TE attention whatever the variant."""
    return benchmark.needs_transformer_engine(preset, "eager")


def _validated(cmd, world_size):
    """Parse and validate a launch command's training flags as the training script does
    (Megatron-LM's parser and validate_args plus the fork's rules; the world size is
    torchrun's WORLD_SIZE)."""
    from megatron.packed_training.arguments import parse_args

    at = next(i for i, w in enumerate(cmd) if os.path.basename(w) in MODEL_OF_SCRIPT)
    model = MODEL_OF_SCRIPT[os.path.basename(cmd[at])]
    with mock.patch.dict(os.environ, {"WORLD_SIZE": str(world_size), "RANK": "0"}):
        return parse_args(cmd[at + 1:], model)


@pytest.fixture
def te_importable(monkeypatch):
    """set_te(present): Transformer Engine importable or not, for the fork's argument rules,
    the attention backend's resolution and the benchmark's own check alike; with TE, triton too
    (it ships with the CUDA builds TE runs on; MLA's fused RoPE needs it). TE-free runs must
    need neither. Megatron-LM's check of --moe-grouped-gemm asks the GPU for its compute
    capability: an H100's here."""
    from megatron.packed_model import attention
    from megatron.packed_training import extra_args

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))

    def set_te(present):
        monkeypatch.setattr(extra_args, "is_importable",
                            lambda package: present and package in ("transformer_engine",
                                                                    "triton"))
        monkeypatch.setattr(attention, "is_te_available", lambda: present)
        monkeypatch.setattr(benchmark, "transformer_engine_importable", lambda: present)
    set_te(False)
    return set_te


def test_moe_presets_are_drop_and_pad_without_grouped_gemm():
    assert set(MOE_PRESETS) == {"gpt-moe-small", "hybrid-moe-small"}
    assert ([p for p in benchmark.PRESETS if benchmark.is_moe(p)]
            == MOE_PRESETS + QWEN3_PRESETS + MLA_PRESETS)
    for preset in MOE_PRESETS:
        flags = benchmark.PRESETS[preset][1]
        value = dict(zip(flags, flags[1:]))
        assert (value["--num-experts"], value["--moe-router-topk"]) == ("16", "2")
        assert value["--moe-token-dispatcher-type"] == "alltoall"
        assert "--moe-expert-capacity-factor" in flags
        assert "--moe-pad-expert-input-to-capacity" in flags
        assert "--moe-grouped-gemm" not in flags and "--attention-backend" not in flags
        assert not _needs_te(preset)
    pattern = benchmark.PRESETS["hybrid-moe-small"][1]
    pattern = pattern[pattern.index("--hybrid-layer-pattern") + 1]
    assert set(pattern) == {"M", "*", "E"} and pattern.count("E") == 7
    assert benchmark.num_experts("gpt-small") is None


def test_mla_presets_are_moe_presets_on_te_attention():
    assert MLA_PRESETS == ["moonlight-small"]
    assert not set(MLA_PRESETS) & set(MOE_PRESETS)  # the moe group stays TE-free
    assert not any(_needs_te(p) for p in benchmark.PRESETS
                   if p not in MLA_PRESETS + ["qwen3-30b-a3b-layers"])
    for preset in MLA_PRESETS:
        flags = benchmark.PRESETS[preset][1]
        assert "--multi-latent-attention" in flags and _needs_te(preset)
        assert _flag(preset, "--attention-backend") == "auto"  # TE where importable
        assert (_flag(preset, "--num-experts"), _flag(preset, "--moe-router-topk")) == ("64", "6")
        assert _flag(preset, "--moe-token-dispatcher-type") == "alltoall"
        assert "--moe-pad-expert-input-to-capacity" in flags
        assert "--moe-grouped-gemm" not in flags  # --moe-experts chooses, as for every MoE preset


def test_mla_presets_are_refused_without_transformer_engine(te_importable, monkeypatch, capsys):
    """Without TE the row fails at once, naming TE, and nothing trains: auto would resolve to
    the TE-free attention, on which the model's MLA layers are refused."""
    import pretrain_gpt
    from megatron.packed_training.config import transformer_config_from_args

    launched = []
    monkeypatch.setattr(benchmark.subprocess, "run", lambda cmd, **kw: launched.append(cmd))
    assert benchmark.main(["--presets", "mla", "--steps", "10"]) == 1
    assert launched == []
    assert ("| moonlight-small | eager | failed: needs Transformer Engine, which is not "
            "importable here" in capsys.readouterr().out)
    # What the run would meet: its launch command parses, and the model build refuses MLA.
    te_importable(True)
    cmd = benchmark.launch_command("moonlight-small", "eager", _args(nproc=1), "/tmp/m.jsonl")
    args = _validated(cmd, world_size=1)
    config = transformer_config_from_args(args)
    te_importable(False)
    with pytest.raises(ValueError, match="Packed multi-latent attention runs only on "
                                         "Transformer Engine attention"):
        pretrain_gpt.model_provider(args, config)


def test_the_mla_group_runs_moonlight_small_with_its_experts_and_label(monkeypatch, capsys,
                                                                       te_importable):
    te_importable(True)
    commands = _launched_runs(monkeypatch, moe=True)
    assert benchmark.main(["--presets", "mla", "--steps", "10", "--nproc", "4",
                           "--global-batch-size", "16", "--expert-model-parallel-size", "4",
                           "--moe-experts", "grouped-gemm"]) == 0
    out = capsys.readouterr().out
    assert "| moonlight-small grouped-gemm ep4 | eager |" in out
    assert len(commands) == 1 and "--multi-latent-attention" in commands[0]
    assert "--moe-grouped-gemm" in commands[0]


def test_expert_parallel_size_must_divide_moonlight_smalls_experts(capsys):
    with pytest.raises(SystemExit):
        benchmark.main(["--presets", "mla", "--nproc", "3", "--expert-model-parallel-size", "3"])
    assert "It must divide moonlight-small's 64 experts" in capsys.readouterr().err


CONFIGS = [(preset, variant, experts, ep)
           for preset in benchmark.PRESETS
           for variant in [*benchmark.VARIANTS, "layer-graphs-c16"]
           for experts in (benchmark.MOE_EXPERTS if benchmark.is_moe(preset) else ["sequential"])
           for ep in ((1, 4) if benchmark.is_moe(preset) else (1,))
           if not (variant == "full-iteration" and benchmark.is_moe(preset))]  # refused for MoE


def _each_once_then_slow(configs):
    """The default lane takes each preset, variant and (experts, EP) once; the other
    combinations are marked slow (the full lane runs them all)."""
    seen, params = set(), []
    for config in configs:
        preset, variant, experts, ep = config
        keys = {("preset", preset), ("variant", variant), ("moe", experts, ep)}
        params.append(pytest.param(*config, id="-".join(map(str, config)),
                                   marks=() if keys - seen else pytest.mark.slow))
        seen |= keys
    return params


@pytest.mark.parametrize("preset,variant,experts,ep", _each_once_then_slow(CONFIGS))
def test_every_launch_command_passes_the_training_parser(te_importable, preset, variant,
                                                         experts, ep):
    """Every preset x variant (x expert implementation x EP for MoE) as the tool launches it,
    with --profile, through the training parser (and megatron-core's TransformerConfig at
    the preset's full size); without TE wherever the run does not need it, TE faked
    importable where it does (MLA presets, TE graphs, grouped GEMM)."""
    needs_te = variant in NEEDS_TE or experts == "grouped-gemm" or _needs_te(preset)
    assert benchmark.needs_transformer_engine(preset, variant, experts) == needs_te
    te_importable(needs_te)
    args = _args(nproc=ep, expert_model_parallel_size=ep, global_batch_size=4 * ep, profile=True)
    cmd = benchmark.launch_command(preset, variant, args, "/tmp/m.jsonl", "", experts)
    parsed = _validated(cmd, world_size=ep)
    assert parsed.train_iters == 30 and parsed.metrics_file == "/tmp/m.jsonl"
    assert parsed.eval_iters == 0 and parsed.log_memory_interval == 30
    assert parsed.packed_profile  # the fork's profiler: GPU-busy time of the last two steps
    assert (parsed.profile_step_start, parsed.profile_step_end) == (29, 31)
    assert parsed.packed_graph_impl == {"eager": "none", "full-iteration": "full_iteration",
                                        "te-layer-graphs": "transformer_engine"}.get(variant,
                                                                                     "local")
    assert parsed.check_for_nan_in_loss_and_grad == (variant != "full-iteration")
    # megatron-core's config imports TE's fused RoPE for standard attention on TE, which a
    # faked TE cannot give; MLA's fused RoPE is a Triton kernel, so MLA runs check it too.
    if not needs_te or preset in MLA_PRESETS:
        from megatron.packed_training.config import transformer_config_from_args

        config = transformer_config_from_args(parsed)
        assert not config.apply_rope_fusion or needs_te  # TE's fused RoPE on the TE path only
        assert config.num_moe_experts == parsed.num_experts
        assert config.multi_latent_attention == (preset in MLA_PRESETS)
    if benchmark.is_moe(preset):
        assert parsed.num_experts == benchmark.num_experts(preset)
        assert parsed.num_experts == {"qwen3-30b-a3b-layers": 128, "qwen3-moe-small": 64,
                                      "moonlight-small": 64}.get(preset, 16)
        assert parsed.expert_model_parallel_size == ep
        assert parsed.moe_grouped_gemm == (experts == "grouped-gemm"
                                           or preset == "qwen3-30b-a3b-layers")
        assert parsed.attention_backend.name == "auto"
    else:
        assert parsed.num_experts is None and "--expert-model-parallel-size" not in cmd


@pytest.mark.parametrize("preset", MOE_PRESETS)
@pytest.mark.parametrize("variant", ["layer-graphs", "chunk-graphs"])
def test_graphed_moe_presets_take_the_rerun_mode_through_extra_args(te_importable, preset,
                                                                   variant):
    """docs/benchmarks.md: the rerun-rate column's runs (graph variants only)."""
    args = _args(nproc=1, extra_args="--moe-capacity-overflow rerun")
    cmd = benchmark.launch_command(preset, variant, args, "/tmp/m.jsonl")
    assert _validated(cmd, world_size=1).moe_capacity_overflow == "rerun"


def test_grouped_gemm_rows_need_transformer_engine(te_importable, monkeypatch, capsys):
    """Without TE a grouped-gemm row fails before training (auto attention would not give it
    TE's layer spec); the sequential row of the same preset still trains."""
    launched = _launched_runs(monkeypatch, moe=True)
    assert benchmark.main(["--presets", "gpt-moe-small", "--steps", "10", "--moe-experts",
                           "sequential", "grouped-gemm"]) == 1
    out = capsys.readouterr().out
    assert "| gpt-moe-small grouped-gemm | eager | failed: needs Transformer Engine" in out
    assert len(launched) == 1 and "--moe-grouped-gemm" not in launched[0]


@pytest.mark.parametrize("argv,match", [
    (["--expert-model-parallel-size", "4"], r"It must divide the data-parallel ranks.*\(1 / 1 = 1\)"),
    (["--expert-model-parallel-size", "4", "--nproc", "4", "--pipeline-model-parallel-size",
      "2"], r"\(4 / 2 = 2\)"),
    (["--expert-model-parallel-size", "0"], "--expert-model-parallel-size is wrong: 0"),
    (["--expert-model-parallel-size", "3", "--nproc", "3"],
     "--expert-model-parallel-size is wrong: 3. It must divide gpt-moe-small's 16 experts"),
])
def test_expert_parallel_size_is_checked_against_nproc_and_experts(argv, match, capsys):
    with pytest.raises(SystemExit) as done:
        benchmark.main(["--presets", "moe", *argv])
    assert done.value.code == 2 and re.search(match, capsys.readouterr().err)


@pytest.mark.parametrize("flag", [["--expert-model-parallel-size", "2", "--nproc", "2"],
                                  ["--moe-experts", "grouped-gemm"]])
def test_moe_options_need_an_moe_preset(flag, capsys):
    with pytest.raises(SystemExit):
        benchmark.main(["--presets", "gpt-small", "hybrid-small", *flag])
    assert f"{flag[0]} is wrong: no MoE preset in ['gpt-small', 'hybrid-small']" in \
        capsys.readouterr().err


def _launched_runs(monkeypatch, moe: bool = False) -> list:
    """The benchmark's training launches, faked: each writes a finished run's metrics (1000
    tokens/s; ``moe``: an MoE run's, nothing dropped) and succeeds; returns the list the
    launched commands go into."""
    launched = []

    def fake_run(cmd, **kwargs):
        launched.append(cmd)
        metrics = cmd[cmd.index("--metrics-file") + 1]
        if moe:
            _moe_metrics(metrics, [0.0] * 10)
        else:
            _metrics(metrics, 1000.0)
        return _Completed(0)

    monkeypatch.setattr(benchmark.subprocess, "run", fake_run)
    return launched


def _moe_metrics(path, dropped, reruns=None):
    with open(path, "w") as f:
        for it, fraction in enumerate(dropped, 1):
            record = {"iteration": it, "lm_loss": 5.0, "iteration_time_ms": 100.0,
                      "tokens_per_sec": 1000.0, "mem_max_allocated_bytes": 2**30,
                      "load_balancing_loss": 1.01, benchmark.DROPPED_KEY: fraction}
            if reruns is not None:
                record[benchmark.RERUN_KEY] = reruns[it - 1]
            f.write(json.dumps(record) + "\n")


def test_moe_rows_average_dropped_tokens_and_reruns_over_the_timed_steps(tmp_path):
    # Steps 1-2 are warm-up: their 50% drops are left out.
    _moe_metrics(tmp_path / "m.jsonl", [0.5, 0.5, 0.01, 0.03], reruns=[4, 4, 1, 0])
    records = benchmark.read_metrics(str(tmp_path / "m.jsonl"))
    row = benchmark.summarise("hybrid-moe-small", "eager", _args(warmup=2, nproc=1), records)
    assert row["moe"] and row["dropped_token_fraction"] == pytest.approx(0.02)
    # 1 rerun over 2 timed steps x 4 micro-batches
    assert row["rerun_rate"] == pytest.approx(1 / 8)
    _moe_metrics(tmp_path / "n.jsonl", [0.0, 0.0, 0.0])
    row = benchmark.summarise("gpt-moe-small", "eager", _args(warmup=1, nproc=1),
                              benchmark.read_metrics(str(tmp_path / "n.jsonl")))
    assert row["dropped_token_fraction"] == 0.0 and row["rerun_rate"] is None
    dense = benchmark.summarise("gpt-small", "eager", _args(warmup=1, nproc=1),
                                benchmark.read_metrics(str(tmp_path / "n.jsonl")))
    assert dense["moe"]  # MoE keys in the records make an MoE row under any name


def test_the_rerun_key_is_the_graph_runtimes_eager_count_of_moe_reruns():
    moe_rerun = pytest.importorskip("megatron.packed_graphs.moe_rerun",
                                    reason="dropless MoE reruns are not built in this tree")
    # runtime.py logs each eager reason's micro-batches as "eager <reason>".
    assert benchmark.RERUN_KEY == f"eager {moe_rerun.RERUN_REASON}"


def test_moe_columns_appear_only_in_tables_with_an_moe_row():
    moe = _row("layer-graphs", 100.0, 3000.0, busy=90.0) | dict(
        preset="gpt-moe-small", moe=True, dropped_token_fraction=0.0123, rerun_rate=None)
    failed = {"preset": "hybrid-moe-small", "variant": "eager", "error": "exit 1: boom",
              "moe": True}
    lines = benchmark.format_table([_row("eager", 300.0, 1000.0), moe, failed]).splitlines()
    assert lines[0].endswith("| step / busy | dropped tokens | rerun rate |")
    assert lines[1].count("---") == 14
    assert lines[2].endswith("| - | - | - | - |")  # a dense row in an MoE table
    assert lines[3].endswith("| 90.0 | 1.11 | 1.23% | - |")
    assert lines[4] == "| hybrid-moe-small | eager | failed: exit 1: boom |" + " - |" * 11
    dense = benchmark.format_table([_row("eager", 300.0, 1000.0)]).splitlines()
    assert dense[0].endswith("| GPU busy (ms) | step / busy |") and "dropped" not in dense[0]


def test_moe_runs_carry_experts_and_expert_parallelism_in_command_and_label(monkeypatch,
                                                                            capsys,
                                                                            te_importable):
    te_importable(True)
    commands = []

    def fake_run(cmd, **kwargs):
        commands.append(cmd)
        _moe_metrics(cmd[cmd.index("--metrics-file") + 1], [0.01] * 10,
                     reruns=None if "--moe-grouped-gemm" in cmd else [0] * 10)
        return _Completed(0)

    monkeypatch.setattr(benchmark.subprocess, "run", fake_run)
    assert benchmark.main(["--presets", "gpt-moe-small", "gpt-small", "--variants", "eager",
                           "--nproc", "4", "--global-batch-size", "16", "--steps", "10",
                           "--expert-model-parallel-size", "4",
                           "--moe-experts", "sequential", "grouped-gemm"]) == 0
    out = capsys.readouterr().out
    assert "| gpt-moe-small ep4 | eager |" in out
    assert "| gpt-moe-small grouped-gemm ep4 | eager |" in out
    assert "| gpt-small | eager |" in out  # dense: once, without EP
    assert len(commands) == 3
    sequential, grouped, dense = commands
    assert sequential[sequential.index("--expert-model-parallel-size") + 1] == "4"
    assert "--moe-grouped-gemm" not in sequential
    assert grouped[grouped.index("--attention-backend") + 1] == "auto"
    assert "--moe-grouped-gemm" in grouped and "--expert-model-parallel-size" in grouped
    assert "--expert-model-parallel-size" not in dense and "--num-experts" not in dense
    rows = {ln.split(" | ")[0]: ln for ln in out.splitlines() if ln.startswith("| gpt")}
    assert rows["| gpt-moe-small ep4"].endswith("| 1.00% | 0.0% |")
    assert rows["| gpt-moe-small grouped-gemm ep4"].endswith("| 1.00% | - |")


# Reduced sizes for building a preset on CPU; every MoE flag stays the preset's.
CPU_SIZES = {"--num-layers": "2", "--hidden-size": "64", "--num-attention-heads": "4",
             "--num-query-groups": "2", "--seq-length": "64", "--moe-ffn-hidden-size": "32"}


@pytest.fixture
def cpu_moe(cpu_dist, monkeypatch):
    """megatron-core's MoE modules on CPU: the alltoall dispatcher makes a CUDA stream in its
    constructor that drop-and-pad never uses (tests/unit/test_moe.py); a clean tracker."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    monkeypatch.setattr(MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream", object())
    get_moe_metrics_tracker().metrics.clear()
    yield
    get_moe_metrics_tracker().metrics.clear()


@pytest.mark.slow
@pytest.mark.parametrize("preset", MOE_PRESETS)
def test_moe_presets_build_and_train_on_cpu_at_a_reduced_size(te_importable, cpu_moe, preset):
    """The preset's launch command, at a reduced size, through the training scripts' parser,
    config and model provider, then forward and backward on a padded packed row. Reduced:
    hidden 64, 64 positions, no Mamba layers (MambaMixer needs mamba-ssm, a GPU package),
    no RoPE (megatron-core builds its table on the CUDA device), CPU initialisation."""
    import importlib

    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron.packed_model.moe import PackedTopKRouter
    from megatron.packed_graphs.packed_seq import build_packed_batch_params
    from megatron.packed_training.config import transformer_config_from_args

    cmd = benchmark.launch_command(preset, "eager", _args(nproc=1), "/tmp/m.jsonl")
    cmd = [CPU_SIZES.get(flag, word) for flag, word in zip([None, *cmd], cmd)]
    if "--hybrid-layer-pattern" in cmd:
        at = cmd.index("--hybrid-layer-pattern") + 1
        cmd[at] = cmd[at].replace("M", "")
        cmd += ["--mamba-num-groups", "1"]  # checked against hidden 64 though no M is left
    args = _validated(cmd + ["--position-embedding-type", "none", "--vocab-size", "128"], 1)
    args.padded_vocab_size = 128  # Megatron-LM's tokenizer start-up sets it in training
    config = transformer_config_from_args(args)
    config.use_cpu_initialization = True
    script = next(w for w in cmd if os.path.basename(w) in MODEL_OF_SCRIPT)
    provider = importlib.import_module(os.path.basename(script)[:-3]).model_provider
    torch.manual_seed(0)
    model = provider(args, config)
    moe_layers = [layer.mlp for layer in model.decoder.layers
                  if isinstance(getattr(layer, "mlp", None), MoELayer)]
    assert len(moe_layers) == (2 if args.model == "gpt" else 7)
    for moe in moe_layers:
        assert isinstance(moe.router, PackedTopKRouter) and isinstance(moe.experts, SequentialMLP)
        assert len(moe.experts.local_experts) == 16 and moe.token_dispatcher.drop_and_pad

    # Two documents (20 + 30 tokens) and 14 positions of padding.
    cu = torch.tensor([0, 20, 50, 64], dtype=torch.int32)
    positions = torch.cat([torch.arange(20), torch.arange(30), torch.arange(14)])
    params = build_packed_batch_params(cu, positions, 64, with_seq_idx=False)
    params.padding_mask = torch.arange(64) >= 50
    tokens = torch.randint(1, 128, (1, 64))
    losses = model(tokens, positions.view(1, -1), None, labels=tokens, packed_seq_params=params)
    assert losses.shape == (1, 64) and torch.isfinite(losses).all()
    losses.float().sum().backward()
    for moe in moe_layers:
        assert moe.router.weight.grad.abs().sum() > 0


def test_full_iteration_rows_add_the_iteration_graphs_capture_and_memory():
    base = {"lm_loss": 5.0, "iteration_time_ms": 100.0, "tokens_per_sec": 1000.0,
            "mem_max_allocated_bytes": 2**30}
    records = [{"iteration": 1, **base}, {"iteration": 2, **base},
               {"iteration": 3, **base, "iteration graph capture (s)": 1.5,
                "iteration graph memory (MiB)": 300.0},
               {"iteration": 4, **base, "graph capture (s)": 0.5, "graph memory (MiB)": 20.0}]
    row = benchmark.summarise("gpt-small", "full-iteration", _args(warmup=1, nproc=1), records)
    assert row["capture_s"] == 2.0 and row["graph_mem_mib"] == 320.0


@pytest.mark.parametrize("cp_set", ["1", "2", "4", "1,2,4"])
def test_the_documented_mla_dynamic_cp_benchmark_passes_the_training_parser(te_importable,
                                                                            cp_set):
    """docs/benchmarks.md's moonlight-small dynamic-CP command (four GPUs, TE layer graphs,
    grouped GEMM): every CP set's launch command carries the set's sizes and sequence length,
    and the training parser accepts it with 4096 positions per rank; the same command without
    the set passes it too."""
    te_importable(True)
    args = _args(nproc=4, global_batch_size=4, tokens_per_rank=4096, steps=40, warmup=10,
                 log_interval=10, profile=True,
                 extra_args="--no-check-for-nan-in-loss-and-grad")
    cmd = benchmark.launch_command("moonlight-small", "te-layer-graphs", args, "/tmp/m.jsonl",
                                   cp_set, "grouped-gemm")
    sizes = [int(size) for size in cp_set.split(",")]
    at = cmd.index("--dynamic-cp-sizes")
    assert cmd[at + 1:at + 1 + len(sizes)] == cp_set.split(",")
    # Positions up to the set's sequence length (4096 tokens per rank x its largest size).
    seq_length = str(4096 * max(sizes))
    assert benchmark.flag_value(cmd, "--seq-length") == seq_length
    assert int(benchmark.flag_value(cmd, "--max-position-embeddings")) >= int(seq_length)
    parsed = _validated(cmd, world_size=4)
    assert parsed.dynamic_cp_sizes == sizes and parsed.dynamic_cp_tokens_per_rank == 4096
    assert parsed.dynamic_cp_groups is (max(sizes) > 1)
    static = benchmark.launch_command("moonlight-small", "te-layer-graphs", args,
                                      "/tmp/m.jsonl", "", "grouped-gemm")
    parsed = _validated(static, world_size=4)
    assert parsed.multi_latent_attention and parsed.packed_graph_impl == "transformer_engine"


# ------------------------------------------------------- Megatron-LM's command line and memory

@pytest.mark.parametrize("preset", list(benchmark.PRESETS))
def test_presets_keep_the_old_forks_model_shape(te_importable, preset):
    """Megatron-LM's defaults are not the old fork's: every preset's launch command still
    builds the model docs/benchmarks.md measured (RMSNorm, no linear biases, no dropout; GPT
    RoPE, hybrid no position embedding; the query groups given; a 4 x hidden SwiGLU FFN;
    positions up to the sequence; hybrid layers from the pattern alone)."""
    te_importable(_needs_te(preset))
    cmd = benchmark.launch_command(preset, "eager", _args(nproc=1), "/tmp/m.jsonl")
    args = _validated(cmd, world_size=1)
    flags = benchmark.PRESETS[preset][1]
    assert (args.normalization, args.add_bias_linear) == ("RMSNorm", False)
    assert args.hidden_dropout == args.attention_dropout == 0.0
    assert (args.adam_beta2, args.lr_decay_style, args.calculate_per_token_loss) == (
        0.95, "cosine", True)
    assert args.max_position_embeddings == args.seq_length == int(_flag(preset, "--seq-length"))
    assert args.num_workers == 0 and args.eval_iters == 0
    if "--num-query-groups" in flags:
        assert args.group_query_attention
        assert args.num_query_groups == int(_flag(preset, "--num-query-groups"))
    if "--ffn-hidden-size" in flags:  # a real model's width (qwen3-8b-layers)
        assert args.ffn_hidden_size == int(_flag(preset, "--ffn-hidden-size"))
    elif "--swiglu" in flags:
        assert args.ffn_hidden_size == 4 * args.hidden_size
    if args.model == "gpt":
        assert args.position_embedding_type == "rope" and "--num-layers" in flags
    else:
        assert args.position_embedding_type == "none" and "--num-layers" not in flags
        pattern = _flag(preset, "--hybrid-layer-pattern")
        assert args.num_layers == len(pattern) and "--hybrid-override-pattern" not in flags


def test_a_longer_sequence_raises_the_position_limit_with_it():
    """Megatron-LM refuses --seq-length above --max-position-embeddings: a dynamic CP set or
    --extra-args that lengthens the sequence raises the limit too (the old fork's rule)."""
    base = benchmark.launch_command("gpt-small", "eager", _args(), "/m.jsonl")
    assert benchmark.position_limit(base[base.index("--seq-length") - 1:]) == []
    longer = benchmark.launch_command("gpt-small", "eager", _args(tokens_per_rank=4096),
                                      "/m.jsonl", "1,2")
    assert longer[-2:] == ["--max-position-embeddings", "8192"]
    given = benchmark.launch_command(
        "gpt-small", "eager", _args(extra_args="--seq-length 8192 --max-position-embeddings "
                                               "16384"), "/m.jsonl")
    assert benchmark.position_limit(given) == [] and given[-1] == "16384"


def test_peak_memory_is_megatrons_memory_report_at_the_last_step(monkeypatch, capsys):
    """The metrics file holds no memory now: the launch asks Megatron-LM for its memory report
    at the last step (--log-memory-interval --steps) and the row's peak is the largest max
    allocated any reporting rank printed."""
    launched = []

    def fake_run(cmd, **kwargs):
        launched.append(cmd)
        _metrics(cmd[cmd.index("--metrics-file") + 1], 1000.0)
        log = ("iteration 1\n" + _memory_line(1, 1536.0) + _memory_line(2, 2048.0)
               + _memory_line(10, 3072.0, rank=1) + _memory_line(10, 2560.0))
        return _Completed(0, log, "")

    monkeypatch.setattr(benchmark.subprocess, "run", fake_run)
    assert benchmark.main(["--presets", "gpt-small", "--steps", "10", "--nproc", "2",
                           "--pipeline-model-parallel-size", "2"]) == 0
    assert launched[0][launched[0].index("--log-memory-interval") + 1] == "10"
    row = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| gpt-small"))
    assert "| 1.00x | 3.00 |" in row


def test_memory_reports_read_every_report_line():
    log = ("noise\n" + _memory_line(1, 100.5) + " [2026-01-01] iteration 2/ 2 | lm loss: 1.0 |\n"
           + _memory_line(2, 200.0, rank=3))
    reports = benchmark.memory_reports(log)
    assert [r["iteration"] for r in reports] == [1, 2]
    assert reports[0]["mem_max_allocated_bytes"] == round(100.5 * 2**20)
    assert reports[1]["mem_allocated_bytes"] == round(812.25 * 2**20)
    assert reports[1]["mem_reserved_bytes"] == reports[1]["mem_max_reserved_bytes"] == 2048 * 2**20
    assert benchmark.memory_reports("no report here") == []


def test_an_older_metrics_file_still_gives_its_peak_memory(tmp_path):
    _moe_metrics(tmp_path / "old.jsonl", [0.0, 0.0, 0.0])  # has mem_max_allocated_bytes
    row = benchmark.summarise("gpt-moe-small", "eager", _args(warmup=1, nproc=1),
                              benchmark.read_metrics(str(tmp_path / "old.jsonl")))
    assert row["peak_mem_gib"] == 1.0
    _metrics(tmp_path / "new.jsonl", 1000.0, iters=3)
    row = benchmark.summarise("gpt-small", "eager", _args(warmup=1, nproc=1),
                              benchmark.read_metrics(str(tmp_path / "new.jsonl")))
    assert row["peak_mem_gib"] is None
    assert "| 1.00x | - |" in benchmark.format_table([row])


# ------------------------------------------------ MoE modes and routers (dropless MoE graphs)

def _parser_has(flag: str) -> bool:
    from megatron.packed_training.arguments import build_parser

    return any(flag in action.option_strings for action in build_parser()._actions)


def test_moe_modes_rewrite_the_capacity_flags_only():
    flags = benchmark.PRESETS["gpt-moe-small"][1]
    without = [f for f in flags if f not in benchmark.CAPACITY_FLAGS and f != "1.25"]
    assert benchmark.moe_mode_flags(flags, "drop-and-pad") == flags
    assert benchmark.moe_mode_flags(flags, "dropless") == without
    assert benchmark.moe_mode_flags(flags, "dropless-graphs") == without + [
        "--moe-dropless-graphs"]
    assert benchmark.moe_mode_flags(flags, "rerun") == flags + ["--moe-capacity-overflow",
                                                                "rerun"]
    factor = benchmark.moe_mode_flags(flags, "drop-and-pad", 2.0)
    assert factor[factor.index("--moe-expert-capacity-factor") + 1] == "2"


def test_moe_modes_run_where_training_takes_them():
    applies = benchmark.moe_mode_applies
    assert applies("eager", "dropless") and not applies("layer-graphs", "dropless")
    assert applies("layer-graphs", "rerun") and not applies("eager", "rerun")
    assert applies("eager", "dropless-graphs") and applies("te-layer-graphs", "dropless-graphs")


def test_mode_and_router_label_the_rows_and_eager_dropless_is_the_baseline(monkeypatch, capsys):
    launched = []

    def fake_run(cmd, **kwargs):
        launched.append(cmd)
        tps = 1000.0 if "--moe-dropless-graphs" not in cmd else 4000.0
        tps *= 2 if "--cuda-graph-impl" in cmd and "--moe-dropless-graphs" not in cmd else 1
        path = cmd[cmd.index("--metrics-file") + 1]
        with open(path, "w") as f:
            for it in range(1, 11):
                f.write(json.dumps({"iteration": it, "lm_loss": 5.0, "iteration_time_ms": 10.0,
                                    "tokens_per_sec": tps, benchmark.DROPPED_KEY: 0.0}) + "\n")
        return _Completed(0)

    monkeypatch.setattr(benchmark.subprocess, "run", fake_run)
    assert benchmark.main(["--presets", "gpt-moe-small", "--steps", "10", "--variants", "eager",
                           "layer-graphs", "--moe-modes", "dropless", "dropless-graphs",
                           "drop-and-pad", "--moe-routers", "balanced", "skewed"]) == 0
    out = capsys.readouterr().out
    # Per router: eager dropless, eager / layer-graphs dropless-graphs, eager / layer-graphs
    # drop-and-pad; megatron-core's dropless under layer graphs is left out.
    assert len(launched) == 10
    assert not any("--moe-expert-capacity-factor" not in cmd and "--cuda-graph-impl" in cmd
                   and "--moe-dropless-graphs" not in cmd for cmd in launched)
    assert "| gpt-moe-small | eager dropless | " in out
    assert "| gpt-moe-small | layer-graphs dropless-graphs | " in out
    assert "| gpt-moe-small skewed | layer-graphs | " in out  # drop-and-pad: plain variant
    assert sum("--moe-router-skew" in cmd for cmd in launched) == 5
    rows = [line for line in out.splitlines() if "| gpt-moe-small |" in line]
    speedups = {line.split("|")[2].strip(): line.split("|")[6].strip() for line in rows}
    assert speedups["eager dropless"] == "1.00x"  # the baseline of an MoE preset
    assert speedups["layer-graphs dropless-graphs"] == "4.00x"
    assert speedups["layer-graphs"] == "2.00x"


@pytest.mark.parametrize("mode,variant", [("dropless", "eager"), ("rerun", "layer-graphs"),
                                          ("drop-and-pad", "layer-graphs")])
def test_moe_mode_launch_commands_pass_the_training_parser(te_importable, mode, variant):
    args = _args(nproc=1, global_batch_size=4, moe_capacity_factor=1.5)
    cmd = benchmark.launch_command("qwen3-moe-small", variant, args, "/tmp/m.jsonl", mode=mode)
    parsed = _validated(cmd, world_size=1)
    assert parsed.num_experts == 64 and parsed.moe_router_topk == 8
    assert parsed.moe_expert_capacity_factor == (None if mode == "dropless" else 1.5)
    assert parsed.moe_capacity_overflow == ("rerun" if mode == "rerun" else "drop")


@pytest.mark.skipif(not _parser_has("--moe-dropless-graphs"),
                    reason="--moe-dropless-graphs is not in the training parser yet")
@pytest.mark.parametrize("preset", ["gpt-moe-small", "hybrid-moe-small", "qwen3-moe-small",
                                    "qwen3-30b-a3b-layers"])
@pytest.mark.parametrize("router", ["balanced", "skewed"])
def test_dropless_graph_launch_commands_pass_the_training_parser(te_importable, preset, router):
    te_importable(benchmark.needs_transformer_engine(preset, "layer-graphs"))
    cmd = benchmark.launch_command(preset, "layer-graphs", _args(nproc=1), "/tmp/m.jsonl",
                                   mode="dropless-graphs", router=router)
    parsed = _validated(cmd, world_size=1)
    assert parsed.moe_dropless_graphs and parsed.moe_expert_capacity_factor is None
    assert parsed.moe_router_skew == (0.5 if router == "skewed" else 0.0)
    if not benchmark.needs_transformer_engine(preset, "layer-graphs"):
        from megatron.packed_training.config import transformer_config_from_args

        config = transformer_config_from_args(parsed)  # what the MoE builder reads
        assert config.moe_dropless_graphs and config.moe_router_skew == parsed.moe_router_skew


def test_the_qwen3_layers_preset_has_qwen3_30b_a3b_shapes():
    value = dict(zip(benchmark.PRESETS["qwen3-30b-a3b-layers"][1],
                     benchmark.PRESETS["qwen3-30b-a3b-layers"][1][1:]))
    assert (value["--num-layers"], value["--hidden-size"], value["--num-attention-heads"],
            value["--num-query-groups"], value["--kv-channels"]) == ("4", "2048", "32", "4",
                                                                     "128")
    assert (value["--num-experts"], value["--moe-router-topk"],
            value["--moe-ffn-hidden-size"]) == ("128", "8", "768")
    assert "--moe-grouped-gemm" in value and value["--attention-backend"] == "auto"
    assert benchmark.needs_transformer_engine("qwen3-30b-a3b-layers", "eager")


@pytest.mark.slow
def test_without_a_cuda_gpu_it_says_so_in_one_line_and_starts_no_run(tmp_path):
    """The tool as a user runs it on a machine without a GPU (none visible here): one line,
    exit status 1, no torchrun and no table."""
    import subprocess

    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    run = subprocess.run([sys.executable, os.path.join(benchmark.REPO, "tools", "benchmark.py"),
                          "--presets", "gpt-small", "--steps", "10"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert (run.returncode, run.stdout) == (1, "")
    assert run.stderr.splitlines() == [
        "tools/benchmark.py: needs a CUDA GPU (torch.cuda.is_available() is False): run it on "
        "a GPU machine; --from-metrics tabulates finished runs' metrics files without one"]


def test_fewer_gpus_than_nproc_are_named_before_any_run(monkeypatch, capsys):
    monkeypatch.setattr(benchmark, "cuda_problem", CUDA_PROBLEM)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    launched = []
    monkeypatch.setattr(benchmark.subprocess, "run", lambda cmd, **kw: launched.append(cmd))
    assert benchmark.main(["--presets", "gpt-small", "--steps", "10", "--nproc", "4"]) == 1
    assert capsys.readouterr().err.splitlines() == [
        "tools/benchmark.py: --nproc 4 needs 4 CUDA GPUs and 2 are visible: lower --nproc or "
        "make more GPUs visible (CUDA_VISIBLE_DEVICES)"]
    assert launched == []


def test_from_metrics_needs_no_gpu(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(benchmark, "cuda_problem", CUDA_PROBLEM)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _metrics(tmp_path / "eager.jsonl", 1000.0, iters=30)
    assert benchmark.main(["--presets", "hybrid-small", "--from-metrics",
                           f"eager={tmp_path / 'eager.jsonl'}", "--warmup", "10",
                           "--log-interval", "10"]) == 0
    assert "| hybrid-small | eager |" in capsys.readouterr().out


def test_a_data_path_takes_the_place_of_mock_data(te_importable, tmp_path):
    """--data-path trains on the user's data (e.g. the data-parallel balance comparison of
    docs/benchmarks.md): the launch line carries it and no mock-data flag."""
    te_importable(False)
    data = tmp_path / "rows.jsonl"
    data.write_text('{"input_ids": [1, 2, 3]}\n')
    args = _args(data_path=[str(data)], extra_args="--sequence-packing-scheduler dp_balanced")
    cmd = benchmark.launch_command("gpt-small", "layer-graphs", args, "/tmp/m.jsonl")
    assert "--mock-data" not in cmd and "--mock-doc-length-median" not in cmd
    parsed = _validated(cmd, world_size=2)
    assert parsed.data_path == [str(data)] and not parsed.mock_data
    assert parsed.sequence_packing_scheduler == "dp_balanced"


# -------------------------------------------------------------- FP8 against BF16 (--precisions)

FP8_PRESETS = benchmark.PRESET_GROUPS["fp8"]
FP8_RECIPES = {"fp8-tensorwise": "tensorwise", "fp8-blockwise": "blockwise",
               "fp8-delayed": "delayed"}


def test_the_fp8_group_holds_8b_layer_shapes_dense_hybrid_and_moe():
    assert FP8_PRESETS == ["qwen3-8b-layers", "nemotron-h-8b-layers", "qwen3-30b-a3b-layers"]
    qwen = dict(zip(benchmark.PRESETS["qwen3-8b-layers"][1],
                    benchmark.PRESETS["qwen3-8b-layers"][1][1:]))
    assert (qwen["--num-layers"], qwen["--hidden-size"], qwen["--num-attention-heads"],
            qwen["--num-query-groups"], qwen["--kv-channels"], qwen["--ffn-hidden-size"],
            qwen["--seq-length"]) == ("4", "4096", "32", "8", "128", "12288", "8192")
    assert "--swiglu" in qwen and "--qk-layernorm" in qwen
    nemotron = dict(zip(benchmark.PRESETS["nemotron-h-8b-layers"][1],
                        benchmark.PRESETS["nemotron-h-8b-layers"][1][1:]))
    assert (nemotron["--hidden-size"], nemotron["--mamba-num-heads"], nemotron["--mamba-head-dim"],
            nemotron["--mamba-num-groups"], nemotron["--mamba-state-dim"],
            nemotron["--num-attention-heads"], nemotron["--num-query-groups"],
            nemotron["--ffn-hidden-size"], nemotron["--seq-length"]) == (
        "4096", "128", "64", "8", "128", "32", "8", "21504", "8192")
    assert "--squared-relu" in nemotron and "--swiglu" not in nemotron
    assert set(nemotron["--hybrid-layer-pattern"]) == {"M", "*", "-"}
    assert benchmark.is_moe("qwen3-30b-a3b-layers")


@pytest.mark.parametrize("preset", FP8_PRESETS)
@pytest.mark.parametrize("precision", list(FP8_RECIPES))
def test_fp8_launch_commands_carry_the_flags_and_pass_the_training_parser(te_importable, preset,
                                                                         precision):
    """An FP8 row's launch line: --fp8-format e4m3 --fp8-recipe <recipe> and TE attention
    (auto), through the training parser with the fork's FP8 rules (TE faked importable; the
    GPU's checks are the run's); the bf16 row of the same preset carries no FP8 flag."""
    te_importable(True)
    assert benchmark.needs_transformer_engine(preset, "eager", precision=precision)
    cmd = benchmark.launch_command(preset, "eager", _args(nproc=1, profile=True),
                                   "/tmp/m.jsonl", precision=precision)
    at = cmd.index("--fp8-format")
    assert cmd[at:at + 4] == ["--fp8-format", "e4m3", "--fp8-recipe", FP8_RECIPES[precision]]
    assert benchmark.flag_value(cmd, "--attention-backend") == "auto"
    assert benchmark.fp8_shape_problem(cmd) is None
    parsed = _validated(cmd, world_size=1)
    assert (parsed.fp8, parsed.fp8_recipe) == ("e4m3", FP8_RECIPES[precision])
    assert parsed.attention_backend.name == "auto" and parsed.seq_length == int(
        _flag(preset, "--seq-length"))
    assert any(note.startswith(f"FP8 (e4m3, {FP8_RECIPES[precision]} scaling)")
               for note in parsed.packed_notes)
    bf16 = benchmark.launch_command(preset, "eager", _args(nproc=1), "/tmp/m.jsonl")
    assert "--fp8-format" not in bf16 and "--fp8-recipe" not in bf16


@pytest.mark.parametrize("variant", ["full-iteration", "layer-graphs", "te-layer-graphs"])
def test_fp8_graph_variants_pass_the_training_parser(te_importable, variant):
    te_importable(True)
    cmd = benchmark.launch_command("qwen3-8b-layers", variant, _args(nproc=1), "/tmp/m.jsonl",
                                   precision="fp8-blockwise")
    parsed = _validated(cmd, world_size=1)
    assert parsed.fp8_recipe == "blockwise" and parsed.packed_graph_impl != "none"


def test_fp8_adds_te_attention_only_where_the_flags_name_none():
    add = benchmark.precision_flags
    fp8 = ["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise"]
    assert add(["--hidden-size", "8"], "fp8-tensorwise") == fp8 + ["--attention-backend", "auto"]
    assert add(["--attention-backend", "local"], "fp8-tensorwise") == fp8 + [
        "--attention-backend", "auto"]  # the later flag wins in the parser
    assert add(["--attention-backend", "flash"], "fp8-tensorwise") == fp8
    assert add(["--attention-backend", "auto"], "fp8-tensorwise") == fp8
    assert add(["--hidden-size", "8"], "bf16") == []
    # The MoE preset names auto itself: no second one.
    cmd = benchmark.launch_command("qwen3-30b-a3b-layers", "eager", _args(), "/m.jsonl",
                                   precision="fp8-tensorwise")
    assert cmd.count("--attention-backend") == 1


def _fp8_row(preset, variant, tps, precision):
    return _row(variant, 1000.0 / tps, tps) | {"preset": f"{preset} {precision}",
                                               "precision": precision}


def test_vs_bf16_is_the_same_preset_and_variant_at_bf16():
    rows = [_fp8_row("q", "eager", 1000.0, "bf16"), _fp8_row("q", "full-iteration", 2000.0, "bf16"),
            _fp8_row("q", "eager", 1200.0, "fp8-tensorwise"),
            _fp8_row("q", "full-iteration", 3000.0, "fp8-tensorwise"),
            _fp8_row("q", "layer-graphs", 2500.0, "fp8-tensorwise"),  # no bf16 layer-graphs row
            _fp8_row("n", "eager", 900.0, "fp8-blockwise"),
            {"preset": "n bf16", "variant": "eager", "precision": "bf16", "error": "exit 1"}]
    lines = benchmark.format_table(rows).splitlines()
    assert lines[0].startswith("| preset | variant | step (ms) | step IQR (ms) | tokens/s | "
                               "speedup | vs bf16 | peak mem (GiB) |")
    cells = {(ln.split("|")[1].strip(), ln.split("|")[2].strip()): ln.split("|")[6:8]
             for ln in lines[2:] if "failed" not in ln}
    assert [c.strip() for c in cells["q bf16", "eager"]] == ["1.00x", "1.00x"]
    assert [c.strip() for c in cells["q bf16", "full-iteration"]] == ["2.00x", "1.00x"]
    # speedup against eager at its own precision, vs bf16 against the same variant at bf16
    assert [c.strip() for c in cells["q fp8-tensorwise", "eager"]] == ["1.00x", "1.20x"]
    assert [c.strip() for c in cells["q fp8-tensorwise", "full-iteration"]] == ["2.50x", "1.50x"]
    assert [c.strip() for c in cells["q fp8-tensorwise", "layer-graphs"]] == ["2.08x", "-"]
    assert [c.strip() for c in cells["n fp8-blockwise", "eager"]] == ["1.00x", "-"]  # bf16 failed
    assert lines[-1] == "| n bf16 | eager | failed: exit 1 |" + " - |" * 10
    fastest = benchmark.format_fastest_per_precision(rows).splitlines()
    assert "- q: bf16 full-iteration 2,000; fp8-tensorwise full-iteration 3,000 (1.50x)" in fastest
    assert "- n: fp8-blockwise eager 900" in fastest


def test_a_bf16_only_table_has_no_vs_bf16_column_and_no_fastest_lines():
    rows = [_row("eager", 1.0, 1.0) | {"precision": "bf16"}]
    assert "vs bf16" not in benchmark.format_table(rows)
    assert benchmark.format_fastest_per_precision(rows) == ""
    assert benchmark.row_label("qwen3-8b-layers", _args(precisions=["bf16"])) == "qwen3-8b-layers"
    assert benchmark.row_label("qwen3-8b-layers", _args(precisions=["bf16", "fp8-delayed"]),
                               precision="bf16") == "qwen3-8b-layers bf16"


def test_precision_rows_are_labelled_and_compared_in_one_table(monkeypatch, capsys,
                                                               te_importable):
    te_importable(True)
    launched = []
    tokens = {("eager", False): 1000.0, ("eager", True): 1200.0,
              ("full-iteration", False): 2000.0, ("full-iteration", True): 3000.0}

    def fake_run(cmd, **kwargs):
        launched.append(cmd)
        variant = "full-iteration" if "full_iteration" in cmd else "eager"
        _metrics(cmd[cmd.index("--metrics-file") + 1], tokens[variant, "--fp8-format" in cmd])
        return _Completed(0)

    monkeypatch.setattr(benchmark.subprocess, "run", fake_run)
    assert benchmark.main(["--presets", "qwen3-8b-layers", "--variants", "eager",
                           "full-iteration", "--precisions", "bf16", "fp8-tensorwise",
                           "--steps", "10", "--json", "/dev/null"]) == 0
    out = capsys.readouterr().out
    assert len(launched) == 4 and sum("--fp8-format" in cmd for cmd in launched) == 2
    assert "| vs bf16 |" in out
    assert "| qwen3-8b-layers bf16 | eager | 100.0 | 0.0 | 1,000 | 1.00x | 1.00x |" in out
    assert ("| qwen3-8b-layers fp8-tensorwise | full-iteration | 100.0 | 0.0 | 3,000 | 2.50x "
            "| 1.50x |") in out
    assert ("- qwen3-8b-layers: bf16 full-iteration 2,000; fp8-tensorwise full-iteration "
            "3,000 (1.50x)") in out


def test_fp8_rows_without_transformer_engine_fail_at_once(monkeypatch, capsys, te_importable):
    launched = _launched_runs(monkeypatch)
    assert benchmark.main(["--presets", "gpt-small", "--precisions", "bf16", "fp8-tensorwise",
                           "--steps", "10"]) == 1
    out = capsys.readouterr().out
    assert len(launched) == 1 and "--fp8-format" not in launched[0]
    assert "| gpt-small fp8-tensorwise | eager | failed: needs Transformer Engine" in out


def test_moe_fp8_rows_leave_out_dropless_graphs_and_full_iteration(monkeypatch, capsys,
                                                                   te_importable):
    """Dropless graphs' grouped experts are BF16 only and full-iteration graphs hold no MoE
    layer: those rows are left out, the others run."""
    te_importable(True)
    launched = _launched_runs(monkeypatch, moe=True)
    assert benchmark.main(["--presets", "qwen3-30b-a3b-layers", "--variants", "eager",
                           "layer-graphs", "full-iteration", "--moe-modes", "dropless-graphs",
                           "drop-and-pad", "--precisions", "bf16", "fp8-blockwise",
                           "--steps", "10"]) == 0
    # bf16: eager and layer-graphs in both modes; FP8: drop-and-pad's two.
    assert len(launched) == 6
    assert not any("full_iteration" in cmd for cmd in launched)
    assert not any("--fp8-format" in cmd and "--moe-dropless-graphs" in cmd for cmd in launched)
    out = capsys.readouterr().out
    assert "| qwen3-30b-a3b-layers fp8-blockwise | layer-graphs | " in out
    assert "| qwen3-30b-a3b-layers bf16 | layer-graphs dropless-graphs | " in out
    assert benchmark.variant_applies("gpt-small", "full-iteration")
    assert benchmark.precision_applies("qwen3-30b-a3b-layers", "dropless", "fp8-tensorwise")


def test_the_bf16_experts_precision_runs_moe_presets_with_the_precision_file(
        te_importable, monkeypatch, capsys):
    """``fp8-tensorwise-bf16-experts``: tensorwise FP8 with Megatron-LM's per-module precision
    file keeping the routed experts BF16, through the training parser; MoE presets only."""
    te_importable(True)
    cmd = benchmark.launch_command("qwen3-30b-a3b-layers", "layer-graphs", _args(nproc=1),
                                   "/tmp/m.jsonl", precision=benchmark.BF16_EXPERTS_PRECISION)
    parsed = _validated(cmd, world_size=1)
    assert parsed.fp8_recipe == "tensorwise"
    assert parsed.te_precision_config_file.endswith("examples/fp8/moe_experts_bf16.yaml")
    assert os.path.isfile(parsed.te_precision_config_file)
    launched = _launched_runs(monkeypatch, moe=True)
    assert benchmark.main(["--presets", "qwen3-8b-layers", "qwen3-30b-a3b-layers", "--variants",
                           "layer-graphs", "--precisions", "bf16",
                           benchmark.BF16_EXPERTS_PRECISION, "--steps", "10"]) == 0
    assert [("--te-precision-config-file" in cmd, benchmark.flag_value(cmd, "--num-experts"))
            for cmd in launched] == [(False, None), (False, "128"), (True, "128")]
    assert ("| qwen3-30b-a3b-layers fp8-tensorwise-bf16-experts | layer-graphs | "
            in capsys.readouterr().out)


def _refused(argv, capsys, monkeypatch):
    launched = []
    monkeypatch.setattr(benchmark.subprocess, "run", lambda cmd, **kw: launched.append(cmd))
    with pytest.raises(SystemExit):
        benchmark.main(["--steps", "10", *argv])
    assert launched == []
    return " ".join(capsys.readouterr().err.split())


def test_an_unknown_precision_is_named_with_the_valid_ones(capsys, monkeypatch):
    err = _refused(["--precisions", "bf16", "fp16"], capsys, monkeypatch)
    assert ("--precisions is wrong: fp16. Choose from bf16, fp8-tensorwise, fp8-blockwise, "
            "fp8-delayed, fp8-tensorwise-bf16-experts.") in err


def test_precisions_do_not_apply_to_finished_runs(capsys, monkeypatch):
    err = _refused(["--precisions", "fp8-tensorwise", "--from-metrics", "eager=m.jsonl"],
                   capsys, monkeypatch)
    assert "--precisions is wrong with --from-metrics: fp8-tensorwise." in err


@pytest.mark.parametrize("argv,message", [
    # 4000 positions: whole 16-row blocks, not 128-row ones
    (["--presets", "qwen3-8b-layers", "--precisions", "bf16", "fp8-blockwise",
      "--extra-args=--seq-length 4000"],
     "--precisions is wrong: fp8-blockwise for preset qwen3-8b-layers. --seq-length is wrong: "
     "4000. FP8 (blockwise) GEMMs take a multiple of 128 rows per rank"),
    (["--presets", "gpt-small", "--precisions", "fp8-tensorwise",
      "--extra-args=--seq-length 4100"],
     "--precisions is wrong: fp8-tensorwise for preset gpt-small. --seq-length is wrong: 4100. "
     "FP8 (tensorwise) GEMMs take a multiple of 16 rows per rank"),
    # Dynamic CP: every rank holds the set's tokens per rank
    (["--presets", "gpt-small", "--precisions", "fp8-blockwise", "--nproc", "2",
      "--dynamic-cp-sets", "1,2", "--tokens-per-rank", "2000", "--variants", "te-layer-graphs"],
     "--precisions is wrong: fp8-blockwise for preset gpt-small. --seq-length is wrong: 4000. "
     "FP8 (blockwise) GEMMs take a multiple of 128 rows per rank and a micro-batch's 4000 "
     "positions split over 2 rank(s)"),
    (["--presets", "gpt-small", "--precisions", "fp8-tensorwise",
      "--extra-args=--attention-backend local"],
     "--precisions is wrong: fp8-tensorwise for preset gpt-small. --fp8-format is wrong: e4m3. "
     "FP8 GEMMs are Transformer Engine's"),
])
def test_fp8_rows_breaking_the_alignment_are_refused_before_any_run(argv, message, capsys,
                                                                     monkeypatch):
    assert message in _refused(argv, capsys, monkeypatch)


def test_a_hybrid_whose_mamba_projection_breaks_fp8_alignment_is_refused(capsys, monkeypatch):
    """24 Mamba heads of 64: the input projection is 2 x 1536 + 2 x 8 x 128 + 24 = 5144 wide,
    not a multiple of 16; bf16 rows of it are not checked."""
    monkeypatch.setitem(benchmark.PRESETS, "odd-mamba", benchmark.hybrid_preset(
        "--hybrid-layer-pattern", "M*", "--hidden-size", "512", "--mamba-num-heads", "24",
        "--num-attention-heads", "8", "--seq-length", "2048"))
    err = _refused(["--presets", "odd-mamba", "--precisions", "bf16", "fp8-delayed"], capsys,
                   monkeypatch)
    assert ("--precisions is wrong: fp8-delayed for preset odd-mamba. --mamba-num-heads is "
            "wrong: 24. Mamba's FP8 input projection is 5144 wide") in err
    cmd = benchmark.launch_command("odd-mamba", "eager", _args(), "/m.jsonl")
    assert benchmark.fp8_shape_problem(cmd) is None  # bf16: no FP8 flag, nothing to check


@pytest.mark.parametrize("preset,precision,extra", [
    ("qwen3-8b-layers", "fp8-blockwise", "--seq-length 4000"),
    ("odd-mamba", "fp8-tensorwise", ""),
])
def test_the_tools_refusal_is_the_training_parsers(te_importable, monkeypatch, preset, precision,
                                                  extra):
    """The same line through the training parser fails with the same message: the tool runs
    fp8_flags' rule on the line's flags and Megatron-LM's defaults."""
    te_importable(True)
    monkeypatch.setitem(benchmark.PRESETS, "odd-mamba", benchmark.hybrid_preset(
        "--hybrid-layer-pattern", "M*", "--hidden-size", "512", "--mamba-num-heads", "24",
        "--num-attention-heads", "8", "--seq-length", "2048"))
    cmd = benchmark.launch_command(preset, "eager", _args(nproc=1, extra_args=extra),
                                   "/m.jsonl", precision=precision)
    problem = benchmark.fp8_shape_problem(cmd)
    assert problem
    with pytest.raises(ValueError) as refused:
        _validated(cmd, world_size=1)
    assert str(refused.value) == problem


def test_fp8_traces_and_logprobs_lines_carry_the_precision():
    args = _args(precisions=["bf16", "fp8-tensorwise"], mode="logprobs")
    assert (benchmark.trace_dir("/t", "qwen3-8b-layers", "eager", args, precision="fp8-tensorwise")
            == "/t/qwen3-8b-layers_fp8-tensorwise/eager")
    cmd = benchmark.logprobs_command("qwen3-8b-layers", "eager", args, "/r.json",
                                     precision="fp8-tensorwise")
    flags = cmd[cmd.index("--") + 1:]
    assert benchmark.flag_value(flags, "--fp8-recipe") == "tensorwise"
