"""The launch scripts under examples/: syntax, and the --dry-run launch command, whose training
flags must pass the real parser (Megatron-LM's, with its validate_args, plus the fork's flags and
rules: megatron.packed_training.arguments.parse_args), so a typo or a flag Megatron-LM does not
know fails here; the flags that keep the fork's numerics on Megatron-LM's defaults; every
script's --dry-run runs nothing; te_patches on PYTHONPATH exactly where Transformer Engine runs
context parallelism; the first-run script (capacity from the advisor, eager reference, graphed
run, both tokens/s) end to end with a fake torchrun (CPU).

The first parse in a process costs ~10 s (Megatron-LM's imports), every later one well under a
second: the parses stay in this process."""

import os
import shlex
import subprocess
import sys
from unittest import mock
from pathlib import Path

import pytest

from megatron.packed_training.arguments import build_parser, parse_args

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
SCRIPTS = sorted(p for p in EXAMPLES.rglob("*") if p.suffix in (".sh", ".sbatch"))
SBATCH = {"gpt": "examples/slurm/sft_gpt.sbatch", "hybrid": "examples/slurm/sft_hybrid.sbatch"}
LOCAL = {"gpt": "examples/local/run_gpt.sh", "hybrid": "examples/local/run_hybrid.sh"}
SYNTHETIC = "examples/local/train_hybrid_synthetic.sh"
SOURCED = {"examples/common.sh"}  # sourced by the scripts, not run
# What parse_args derives from the graph flags: the ladder ([] once checked), upstream's
# inference graph scope, and TE's RNG tracker (Megatron-LM turns it on for any graph run with
# --transformer-impl transformer_engine, its default).
GRAPH_DERIVED = {"cuda_graph_capacity_ladder", "inference_cuda_graph_scope", "te_rng_tracker"}
MODEL_OF_SCRIPT = {"pretrain_gpt.py": "gpt", "pretrain_mamba.py": "hybrid"}
KNOBS = ("NNODES", "GPUS_PER_NODE", "LAUNCHER", "CONTAINER_IMAGE", "CONTAINER_MOUNTS",
         "DATA_PATH", "VALID_DATA_PATH", "SAVE_DIR", "LOG_DIR", "SEQ_LENGTH", "MICRO_BATCH_SIZE",
         "GLOBAL_BATCH_SIZE", "TRAIN_ITERS", "TP", "PP", "CUDA_GRAPH_IMPL",
         "CUDA_GRAPH_MAX_PACKED_SEQS", "CUDA_GRAPH_WARMUP_STEPS", "CUDA_GRAPH_MODULES",
         "CUDA_GRAPH_SCOPE", "NSYS", "NSYS_OUTPUT", "EXTRA_ARGS", "DRY_RUN", "MASTER_ADDR", "MASTER_PORT", "REPO_DIR",
         "RUN_NAME", "LAUNCH_MODE", "LOAD_DIR", "SAVE_INTERVAL", "WORLD_SIZE", "CP",
         "TE_PATCHES", "NGPUS", "EAGER_ITERS", "CUDA_GRAPH_GRANULARITY", "TARGET_FALLBACK_RATE",
         "OUT_DIR", "JOB_TAG", "LOG_INTERVAL", "SEED", "PYTHON")
TE_PATCHES_EXPORT = (f"export PYTHONPATH={REPO / 'te_patches'}"
                     "${PYTHONPATH:+:$PYTHONPATH}")


@pytest.fixture(autouse=True)
def hopper_without_a_gpu(monkeypatch):
    """Megatron-LM's validate_args reads the GPU's architecture for TP > 1 or CP > 1; on a CPU
    machine it stands for an H100 (compute capability 9)."""
    import torch

    if not torch.cuda.is_available():
        import megatron.training.arguments as upstream

        monkeypatch.setattr(upstream, "get_device_arch_version", lambda: 9)


@pytest.fixture
def fake_bin(tmp_path):
    """A PATH entry with an `scontrol` that records each call and names two fake hosts."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/scontrol_calls\n'
                        'printf "fakehost1\\nfakehost2\\n"\n')
    scontrol.chmod(0o755)
    return bin_dir


def run_script(script, *args, env=None, fake_bin=None):
    """Run a script with bash, outside Slurm (no SLURM_* and no knob from the caller's env)."""
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith("SLURM_") and k not in KNOBS}
    if fake_bin is not None:
        clean["PATH"] = f"{fake_bin}{os.pathsep}{clean['PATH']}"
    clean.update(env or {})
    return subprocess.run(["bash", script, *args], cwd=REPO, env=clean, capture_output=True,
                          text=True, timeout=60)


def dry_run(script, env=None, *args, fake_bin=None):
    proc = run_script(script, "--dry-run", *args, env=env, fake_bin=fake_bin)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def launch_line(stdout):
    """The launch command of a dry run: the line that starts with srun, torchrun or nsys."""
    lines = [ln for ln in stdout.splitlines() if ln.split(" ", 1)[0] in ("srun", "torchrun", "nsys")]
    assert len(lines) == 1, stdout
    return lines[0]


def split_launch(line):
    """(launcher words, training script, training args) of a printed launch command."""
    words = shlex.split(line)
    if "bash" in words and words[words.index("bash") + 1] == "-c":
        outer = words[:words.index("bash")]
        words = outer + shlex.split(words[words.index("bash") + 2])
    script_at = next(i for i, w in enumerate(words) if w in MODEL_OF_SCRIPT)
    end = words.index("2>&1") if "2>&1" in words else len(words)
    return words[:script_at], words[script_at], words[script_at + 1:end]


def parsed(argv, model, world_size):
    """``parse_args(argv, model)`` as rank 0 of ``world_size`` processes (Megatron-LM reads the
    world size from torchrun's WORLD_SIZE) in the scripts' launch environment (common.sh's
    launch_environment: Megatron-LM wants CUDA_DEVICE_MAX_CONNECTIONS=1 for TP or CP > 1)."""
    env = {"WORLD_SIZE": str(world_size), "RANK": "0", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    with mock.patch.dict(os.environ, env):  # the launcher's environment, put back after
        return parse_args(argv, model)


def validated(line, world_size):
    """Parse and validate the training args of a launch line; returns (args, launcher words)."""
    launcher, script, argv = split_launch(line)
    return parsed(argv, MODEL_OF_SCRIPT[script], world_size), launcher


def assert_fork_numerics(args, model):
    """The old fork's defaults, which Megatron-LM's differ from, are on the launch line."""
    assert args.normalization == "RMSNorm" and not args.add_bias_linear
    assert args.hidden_dropout == 0 and args.attention_dropout == 0
    assert args.adam_beta2 == 0.95 and args.lr_decay_style == "cosine"
    assert args.calculate_per_token_loss
    assert args.max_position_embeddings == args.seq_length
    # Megatron-LM ignores --num-query-groups without --group-query-attention.
    assert args.group_query_attention and args.num_query_groups < args.num_attention_heads
    if model == "gpt":
        assert args.position_embedding_type == "rope"
        assert args.swiglu and args.ffn_hidden_size == 4 * args.hidden_size  # not 2/3 of it
    else:
        assert args.position_embedding_type == "none"


def flag_value(words, flag):
    return words[words.index(flag) + 1]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_example_script_parses(script):
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_the_scripts_under_test_exist():
    names = {str(p.relative_to(REPO)) for p in SCRIPTS}
    assert set(SBATCH.values()) | set(LOCAL.values()) <= names


@pytest.mark.parametrize("model", ["gpt", "hybrid"])
def test_sbatch_dry_run_defaults(model, fake_bin, tmp_path):
    out = dry_run(SBATCH[model], fake_bin=fake_bin)
    assert not (tmp_path / "scontrol_calls").exists(), "scontrol called outside Slurm"
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=1 NCCL_NVLS_ENABLE=0" in out
    line = launch_line(out)
    assert line.startswith("srun --nodes=1 ") and "--ntasks=1 --ntasks-per-node=1" in line
    assert "--container-image" not in line  # no image: the host environment
    assert "| tee -a " in line and "2>&1" in line
    args, launcher = validated(line, world_size=8)
    assert launcher[:3] == ["srun", "--nodes=1", "--kill-on-bad-exit=1"]
    assert "torchrun" in launcher and flag_value(launcher, "--nproc-per-node") == "8"
    assert flag_value(launcher, "--master-addr") == "localhost"
    assert "--node-rank $SLURM_NODEID" in line  # expanded by each task's shell
    assert "--cuda-graph-impl local" in line and "--cuda-graph-max-packed-seqs 64" in line
    assert args.packed_graph_impl == "local" and args.cuda_graph_max_packed_seqs == 64
    assert args.sft and args.bf16 and args.mock_data and args.seq_length == 4096
    assert args.hidden_size == 1024 and args.num_attention_heads == 16
    assert args.num_query_groups == 8
    assert_fork_numerics(args, model)
    assert args.eval_iters == 0  # no validation data: no evaluation
    assert args.attention_backend.name == "auto"  # TE where importable
    # One checkpoint, at the end: Megatron-LM wants --save-interval with --save.
    assert args.save == str(REPO / "runs" / f"sft_{model}" / "checkpoints")
    assert args.save_interval == args.train_iters == 500
    assert args.metrics_file.startswith(str(REPO / "runs"))
    assert os.path.dirname(args.metrics_file).endswith("/logs")
    # Four micro-batches per iteration by default.
    assert args.num_microbatches == 4 and args.global_batch_size == 32
    if model == "gpt":
        assert "pretrain_gpt.py" in line and args.num_layers == 16
    else:
        assert "pretrain_mamba.py" in line and "--hybrid-layer-pattern" in line
        assert "--num-layers" not in line  # Megatron-LM counts the pattern
        assert args.hybrid_layer_pattern == "M-M-M*-M-M-M*-M-" and args.num_layers == 16


@pytest.mark.parametrize("model", ["gpt", "hybrid"])
def test_local_dry_run(model):
    line = launch_line(dry_run(LOCAL[model], {"GPUS_PER_NODE": "2"}))
    assert line.startswith("torchrun --standalone --nnodes 1 --nproc-per-node 2 ")
    args, _ = validated(line, world_size=2)
    assert args.global_batch_size == 8 and args.cuda_graph_max_packed_seqs == 64
    assert args.model == model


def test_env_overrides_reach_the_command():
    env = {"CUDA_GRAPH_MAX_PACKED_SEQS": "32", "CUDA_GRAPH_WARMUP_STEPS": "5",
           "CUDA_GRAPH_MODULES": "attn mlp", "NNODES": "2", "GPUS_PER_NODE": "4", "TP": "2",
           "PP": "2", "SEQ_LENGTH": "2048", "MICRO_BATCH_SIZE": "2", "TRAIN_ITERS": "7",
           "SAVE_INTERVAL": "5", "DATA_PATH": "/data/train.jsonl",
           "SAVE_DIR": "/ckpt/run1", "MASTER_PORT": "12345",
           "EXTRA_ARGS": "--attention-backend local --log-interval 1"}
    line = launch_line(dry_run(SBATCH["gpt"], env, "--lr", "1e-3"))
    assert "--cuda-graph-max-packed-seqs 32" in line
    args, launcher = validated(line, world_size=8)
    assert (args.cuda_graph_max_packed_seqs, args.cuda_graph_warmup_steps) == (32, 5)
    assert "--cuda-graph-modules attn mlp" in line
    assert args.packed_cuda_graph_modules == ["attn", "mlp"]
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (2, 2)
    assert args.data_parallel_size == 2 and args.global_batch_size == 16
    assert (args.seq_length, args.micro_batch_size, args.train_iters) == (2048, 2, 7)
    assert args.max_position_embeddings == 2048
    assert args.lr_warmup_iters == 7  # min(10, TRAIN_ITERS): short smoke runs validate
    # One JSONL file, all of it training (not Megatron-LM's 3% validation share), no evaluation.
    assert args.data_path == ["/data/train.jsonl"] and not args.mock_data
    assert args.split == "100,0,0" and args.eval_iters == 0 and args.valid_data_path is None
    assert args.save == "/ckpt/run1/checkpoints" and args.save_interval == 5
    assert args.metrics_file.startswith("/ckpt/run1/logs/")
    assert args.attention_backend.name == "local" and args.log_interval == 1
    assert args.lr == 1e-3  # arguments after --dry-run are appended and win
    assert flag_value(launcher, "--nnodes") == "2" and "--nodes=2" in launcher
    assert flag_value(launcher, "--master-port") == "12345"


def _valid_data_line():
    env = {"DATA_PATH": "/data/train.jsonl", "VALID_DATA_PATH": "/data/valid.jsonl",
           "EVAL_INTERVAL": "50", "EVAL_ITERS": "5"}
    return launch_line(dry_run(SBATCH["gpt"], env))


def test_valid_data_path_adds_evaluation():
    _, _, argv = split_launch(_valid_data_line())
    assert argv[argv.index("--data-path"):argv.index("--data-path") + 8] == [
        "--data-path", "/data/train.jsonl", "--valid-data-path", "/data/valid.jsonl",
        "--eval-interval", "50", "--eval-iters", "5"]
    assert "--split" not in argv and argv.count("--eval-iters") == 1


def test_valid_data_path_launch_line_parses():
    args, _ = validated(_valid_data_line(), world_size=8)
    assert args.valid_data_path == ["/data/valid.jsonl"] and args.eval_interval == 50


def test_chunk_granularity_from_the_environment():
    env = {"CUDA_GRAPH_GRANULARITY": "chunk", "PP": "2", "GPUS_PER_NODE": "2"}
    line = launch_line(dry_run(SBATCH["hybrid"], env))
    args, _ = validated(line, world_size=2)
    assert args.cuda_graph_granularity == "chunk" and args.pipeline_model_parallel_size == 2
    assert args.num_layers == 16 and args.num_microbatches == 4
    assert validated(launch_line(dry_run(SBATCH["gpt"], {})), world_size=8)[0].cuda_graph_granularity == "layer"


def test_graphs_off_drops_every_graph_flag():
    line = launch_line(dry_run(SBATCH["hybrid"], {"CUDA_GRAPH_IMPL": "none"}))
    assert "--cuda-graph" not in line
    args, _ = validated(line, world_size=8)
    assert args.packed_graph_impl == args.cuda_graph_impl == "none"


def test_full_iteration_graphs_turn_ddps_nan_check_off():
    """Megatron-LM and the fork refuse full-iteration graphs with DDP's host-side NaN check."""
    line = launch_line(dry_run(SBATCH["gpt"], {"CUDA_GRAPH_IMPL": "full_iteration"}))
    assert "--no-check-for-nan-in-loss-and-grad" in line
    args, _ = validated(line, world_size=8)
    assert args.packed_graph_impl == "full_iteration"
    assert args.cuda_graph_impl == "local"  # what Megatron-LM's loop is shown
    assert not args.check_for_nan_in_loss_and_grad
    line = launch_line(dry_run(SBATCH["gpt"], {}))
    assert "--no-check-for-nan-in-loss-and-grad" not in line  # the check stays elsewhere


def test_srun_launcher_container_and_nsys(fake_bin, tmp_path):
    env = {"LAUNCHER": "srun", "CONTAINER_IMAGE": "nvcr.io/nvidia/pytorch:25.09-py3",
           "CONTAINER_MOUNTS": "/lustre:/lustre", "NSYS": "1", "NSYS_OUTPUT": "/tmp/prof_%p",
           "SLURM_JOB_NODELIST": "fakehost[1-2]", "NNODES": "2"}
    line = launch_line(dry_run(SBATCH["hybrid"], env, fake_bin=fake_bin))
    assert (tmp_path / "scontrol_calls").read_text().split() == ["show", "hostnames",
                                                                  "fakehost[1-2]"]
    assert "--ntasks=16 --ntasks-per-node=8" in line and "torchrun" not in line
    assert "--container-image=nvcr.io/nvidia/pytorch:25.09-py3" in line
    assert "--container-mounts=/lustre:/lustre" in line
    assert "RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS" in line
    assert "MASTER_ADDR=fakehost1" in line
    args, launcher = validated(line, world_size=16)
    nsys = launcher[launcher.index("nsys"):]
    assert nsys[:2] == ["nsys", "profile"] and "--cuda-graph-trace=node" in nsys
    assert "--capture-range=cudaProfilerApi" in nsys and "--capture-range-end=stop" in nsys
    assert flag_value(nsys, "-o") == "/tmp/prof_%p" and nsys[-1] == "python"
    # nsys records the range the fork's profiler brackets with cudaProfilerStart/Stop
    # (Megatron-LM's own nsys path is handed over: args.profile is off for its loop).
    assert args.packed_profile and not args.profile
    assert (args.profile_step_start, args.profile_step_end) == (10, 12)


def test_dry_run_from_the_environment():
    out = run_script(LOCAL["gpt"], env={"DRY_RUN": "1", "GPUS_PER_NODE": "1"})
    assert out.returncode == 0 and "dry run, nothing is launched" in out.stdout


@pytest.mark.parametrize("env, message", [
    ({}, "SLURM_JOB_ID is wrong: unset. Submit with sbatch"),
    ({"DRY_RUN": "1", "TP": "3"}, "TP x PP is wrong: 3 x 1. It must divide NNODES x GPUS_PER_NODE = 8"),
    ({"DRY_RUN": "1", "LAUNCHER": "mpirun"}, "LAUNCHER is wrong: mpirun. Use srun or torchrun"),
    ({"DRY_RUN": "1", "NSYS": "yes"}, "NSYS is wrong: yes. Use 0 or 1"),
])
def test_sbatch_rejects(env, message):
    proc = run_script(SBATCH["gpt"], env=env)
    assert proc.returncode == 1 and message in proc.stderr
    assert "srun" not in proc.stdout


def test_local_without_gpu_refuses_to_launch():
    proc = run_script(LOCAL["hybrid"], env={"GPUS_PER_NODE": "0"})
    assert proc.returncode == 1
    assert "GPUS_PER_NODE is wrong: 0. No CUDA GPU is visible" in proc.stderr


def test_a_submitted_job_runs_srun_tees_the_log_and_keeps_its_exit_code(fake_bin, tmp_path):
    """Inside a (fake) allocation: srun runs the task command, whose output lands in LOG_FILE,
    and the training's exit status is the job's."""
    srun = fake_bin / "srun"
    srun.write_text('#!/bin/bash\nfor a in "$@"; do last=$a; done\n'
                    'SLURM_NODEID=0 bash -c "$last"\n')
    torchrun = fake_bin / "torchrun"
    torchrun.write_text('#!/bin/bash\necho "torchrun $*"\nexit 3\n')
    for tool in (srun, torchrun):
        tool.chmod(0o755)
    env = {"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "fakehost[1-2]",
           "SAVE_DIR": str(tmp_path / "run")}
    proc = run_script(SBATCH["hybrid"], env=env, fake_bin=fake_bin)
    assert proc.returncode == 3, proc.stderr
    log = (tmp_path / "run" / "logs" / "sft_hybrid_77.log").read_text()
    assert "--node-rank 0 --master-addr fakehost1" in log
    assert "--hybrid-layer-pattern M-M-M*-M-M-M*-M- " in log  # the quoting survived


# --- every script: --dry-run runs nothing ------------------------------------------------------

def _recording_tools(bin_dir: Path, calls: Path, names=("torchrun", "srun", "nsys", "python",
                                                        "python3", "scontrol")):
    """Fake tools on PATH that only record that they were called."""
    bin_dir.mkdir(exist_ok=True)
    for name in names:
        tool = bin_dir / name
        tool.write_text(f'#!/bin/sh\necho "{name} $*" >> {calls}\n')
        tool.chmod(0o755)


RUNNABLE = [p for p in SCRIPTS if str(p.relative_to(REPO)) not in SOURCED]


@pytest.mark.parametrize("script", RUNNABLE, ids=lambda p: str(p.relative_to(REPO)))
def test_every_script_dry_run_prints_and_runs_nothing(script, tmp_path):
    calls = tmp_path / "calls"
    _recording_tools(tmp_path / "bin", calls)
    out_dir = tmp_path / "out"
    env = {"GPUS_PER_NODE": "1", "NGPUS": "1", "SAVE_DIR": str(out_dir), "OUT_DIR": str(out_dir),
           "PYTHON": str(tmp_path / "bin" / "python3")}
    proc = run_script(str(script.relative_to(REPO)), "--dry-run", env=env,
                      fake_bin=tmp_path / "bin")
    assert proc.returncode == 0, proc.stderr
    assert "dry run, nothing is launched" in proc.stdout
    assert any(ln.split(" ", 1)[0] in ("srun", "torchrun") for ln in proc.stdout.splitlines())
    assert not calls.exists(), calls.read_text()  # no launcher, no python, nothing
    assert not out_dir.exists()


# --- te_patches on PYTHONPATH where TE runs context parallelism --------------------------------

@pytest.mark.parametrize("env, args, on", [
    ({}, [], False),
    ({"CP": "2", "GPUS_PER_NODE": "2"}, [], True),
    ({"GPUS_PER_NODE": "2"}, ["--context-parallel-size", "2"], True),
    ({"GPUS_PER_NODE": "2", "EXTRA_ARGS": "--context-parallel-size=2"}, [], True),
    ({"GPUS_PER_NODE": "2"}, ["--dynamic-cp-sizes", "1", "2", "--seed", "3"], True),
    ({"GPUS_PER_NODE": "2"}, ["--dynamic-cp-sizes", "1"], False),
    ({"CP": "2", "GPUS_PER_NODE": "2"}, ["--context-parallel-size", "1"], False),  # last wins
    ({"CP": "2", "GPUS_PER_NODE": "2", "TE_PATCHES": "0"}, [], False),
    ({"TE_PATCHES": "1"}, [], True),
])
def test_te_patches_go_on_pythonpath_with_te_context_parallelism(env, args, on):
    out = dry_run(LOCAL["gpt"], env, *args)
    assert (TE_PATCHES_EXPORT in out.splitlines()) == on, out
    assert ("te_patches" in out) == on


def test_cp_knob_reaches_the_command_and_the_world_check():
    line = launch_line(dry_run(SBATCH["hybrid"], {"CP": "2", "GPUS_PER_NODE": "4"}))
    launcher, script, argv = split_launch(line)
    args = build_parser().parse_args(argv)  # CP validation needs TE
    assert args.context_parallel_size == 2 and args.global_batch_size == 8  # DP = 2
    proc = run_script(SBATCH["gpt"], env={"DRY_RUN": "1", "CP": "3"})
    assert proc.returncode == 1
    assert "TP x PP x CP is wrong: 1 x 1 x 3. It must divide NNODES x GPUS_PER_NODE = 8" in proc.stderr


def test_bad_te_patches_knob_is_refused():
    proc = run_script(SBATCH["gpt"], env={"DRY_RUN": "1", "TE_PATCHES": "yes"})
    assert proc.returncode == 1 and "TE_PATCHES is wrong: yes. Use auto, 1 or 0" in proc.stderr


def test_a_submitted_cp_job_trains_with_te_patches_on_pythonpath(fake_bin, tmp_path):
    srun = fake_bin / "srun"
    srun.write_text('#!/bin/bash\nfor a in "$@"; do last=$a; done\n'
                    'SLURM_NODEID=0 bash -c "$last"\n')
    torchrun = fake_bin / "torchrun"
    torchrun.write_text('#!/bin/bash\necho "PYTHONPATH=$PYTHONPATH"\n')
    for tool in (srun, torchrun):
        tool.chmod(0o755)
    env = {"SLURM_JOB_ID": "78", "SAVE_DIR": str(tmp_path / "run"), "CP": "2",
           "PYTHONPATH": "/elsewhere"}
    proc = run_script(SBATCH["gpt"], env=env, fake_bin=fake_bin)
    assert proc.returncode == 0, proc.stderr
    log = (tmp_path / "run" / "logs" / "sft_gpt_78.log").read_text()
    assert f"PYTHONPATH={REPO / 'te_patches'}:/elsewhere" in log


# --- examples/local/train_hybrid_synthetic.sh ---------------------------------------------------

def _synthetic_dry_run(env=None, *args):
    out = dry_run(SYNTHETIC, {"NGPUS": "2", **(env or {})}, *args)
    lines = out.splitlines()
    runs = [ln for ln in lines if ln.startswith("torchrun ")]
    capacity = [ln for ln in lines if ln.startswith("CAPACITY=")]
    summary = [ln for ln in lines if "tools/benchmark.py" in ln]
    assert len(runs) == 2 and len(capacity) == 1 and len(summary) == 1, out
    return out, runs, capacity[0], summary[0]


def test_synthetic_dry_run_eager_reference_then_graphs_with_the_advised_capacity():
    out, (eager, graphs), capacity, summary = _synthetic_dry_run()
    assert "dry run, nothing is launched" in out and "te_patches" not in out
    eager_args, launcher = validated(eager, world_size=2)
    assert launcher[:5] == ["torchrun", "--standalone", "--nnodes", "1", "--nproc-per-node"]
    assert eager_args.packed_graph_impl == "none" and "--cuda-graph" not in eager
    assert eager_args.train_iters == 30 and eager_args.model == "hybrid"
    assert_fork_numerics(eager_args, "hybrid")
    assert eager_args.eval_iters == 0 and eager_args.save is None
    # The capacity is the advisor's, read from the same synthetic data at run time.
    assert '--cuda-graph-max-packed-seqs "$CAPACITY"' in graphs
    graph_args, _ = validated(graphs.replace('"$CAPACITY"', "11"), world_size=2)
    assert (graph_args.packed_graph_impl, graph_args.cuda_graph_granularity) == ("local", "layer")
    assert graph_args.cuda_graph_max_packed_seqs == 11 and graph_args.train_iters == 200
    assert graph_args.hybrid_layer_pattern == "M-M-M*-M-M-M*-M-" and graph_args.num_layers == 16
    advisor = shlex.split(capacity.removeprefix("CAPACITY=$(").removesuffix(")"))
    assert advisor[1] == "tools/capacity_advisor.py" and "--print-capacity" in advisor
    for flag, value in (("--seq-length", graph_args.seq_length),
                        ("--vocab-size", graph_args.vocab_size),
                        ("--mock-doc-length-median", graph_args.mock_doc_length_median),
                        ("--seed", graph_args.seed),
                        ("--micro-batch-size", graph_args.micro_batch_size)):
        assert float(flag_value(advisor, flag)) == float(value), flag
    assert "--mock-data" in advisor
    # Both runs are the same model and data; only the graph flags and the length differ.
    strip = {"train_iters", "lr_decay_iters", "metrics_file", "cuda_graph_impl",
             "packed_graph_impl", "cuda_graph_granularity", "cuda_graph_max_packed_seqs",
             "cuda_graph_warmup_steps", *GRAPH_DERIVED}
    assert ({k: v for k, v in vars(eager_args).items() if k not in strip}
            == {k: v for k, v in vars(graph_args).items() if k not in strip})
    words = shlex.split(summary)
    assert words[1] == "tools/benchmark.py" and "--from-metrics" in words
    assert f"eager={eager_args.metrics_file}" in words
    assert f"layer-graphs={graph_args.metrics_file}" in words


def test_synthetic_knobs_chunk_graphs_fixed_capacity_and_extra_flags():
    env = {"CUDA_GRAPH_GRANULARITY": "chunk", "CUDA_GRAPH_MAX_PACKED_SEQS": "32",
           "EAGER_ITERS": "20", "TRAIN_ITERS": "50"}
    out, (eager, graphs), capacity, summary = _synthetic_dry_run(env, "--log-interval", "5")
    assert capacity == "CAPACITY=32"
    graph_args, _ = validated(graphs.replace('"$CAPACITY"', "32"), world_size=2)
    assert graph_args.cuda_graph_granularity == "chunk" and graph_args.train_iters == 50
    eager_args, _ = validated(eager, world_size=2)
    assert eager_args.train_iters == 20 and eager_args.packed_graph_impl == "none"
    assert eager_args.log_interval == graph_args.log_interval == 5  # arguments win
    assert "chunk-graphs=" in summary


def test_synthetic_with_context_parallelism_puts_te_patches_on_pythonpath():
    out, *_ = _synthetic_dry_run({}, "--context-parallel-size", "2")
    assert TE_PATCHES_EXPORT in out.splitlines()


@pytest.mark.parametrize("env, message", [
    ({"CUDA_GRAPH_GRANULARITY": "block"}, "CUDA_GRAPH_GRANULARITY is wrong: block. Use layer or chunk"),
    ({"EAGER_ITERS": "10"}, "EAGER_ITERS / TRAIN_ITERS is wrong: 10 / 200. Both must exceed LOG_INTERVAL (10)"),
    ({"NGPUS": "two"}, "NGPUS is wrong: two"),
])
def test_synthetic_rejects_bad_knobs(env, message):
    proc = run_script(SYNTHETIC, "--dry-run", env={"NGPUS": "1", **env})
    assert proc.returncode == 1 and message in proc.stderr


def test_the_advisor_command_prints_the_recommended_capacity(capsys):
    """What the script's CAPACITY=$(...) line reads: one integer, the report's recommendation."""
    import tools.capacity_advisor as advisor
    _, _, capacity, _ = _synthetic_dry_run()
    argv = shlex.split(capacity.removeprefix("CAPACITY=$(").removesuffix(")"))[2:]
    argv = [a for a in argv if a != "--print-capacity"] + ["--num-samples", "400"]
    assert advisor.main([*argv, "--print-capacity"]) == 0
    printed = capsys.readouterr().out
    assert printed.strip().isdigit() and printed.count("\n") == 1
    assert advisor.main(argv) == 0
    report = capsys.readouterr().out
    assert f"recommended: --cuda-graph-max-packed-seqs {printed.strip()} " in report


FAKE_TORCHRUN = r'''#!{python}
"""Records its command line and writes the metrics file a training run would."""
import json, sys
argv = sys.argv[1:]
with open({calls!r}, "a") as f:
    f.write(" ".join(argv) + "\n")
graphs = "--cuda-graph-impl" in argv
if graphs and {fail_graphs!r}:
    print("RuntimeError: CUDA error: out of memory", file=sys.stderr)
    sys.exit(3)
iters = int(argv[argv.index("--train-iters") + 1])
interval = int(argv[argv.index("--log-interval") + 1])
batch = int(argv[argv.index("--global-batch-size") + 1])
# The keys the fork's metrics file has on Megatron-LM's loop (megatron/packed_training/metrics.py,
# RuntimeLog): no grad norm, learning rate or memory any more.
with open(argv[argv.index("--metrics-file") + 1], "w") as f:
    for it in range(interval, iters + 1, interval):
        f.write(json.dumps({{"iteration": it, "consumed_samples": it * batch, "lm_loss": 5.0,
                            "iteration_time_ms": 100.0,
                            "tokens_per_sec": (3000.0 if graphs else 1000.0) if it > interval
                            else 10.0, "graph fallbacks": 0}}) + "\n")
'''


def _fake_torchrun(tmp_path, fail_graphs=False):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "torchrun_calls"
    tool = bin_dir / "torchrun"
    tool.write_text(FAKE_TORCHRUN.format(python=sys.executable, calls=str(calls),
                                         fail_graphs=fail_graphs))
    tool.chmod(0o755)
    return bin_dir, calls


def test_synthetic_runs_eager_then_graphs_and_prints_both_tokens_per_sec(tmp_path):
    bin_dir, calls = _fake_torchrun(tmp_path)
    env = {"NGPUS": "1", "CUDA_GRAPH_MAX_PACKED_SEQS": "16", "OUT_DIR": str(tmp_path / "out"),
           "JOB_TAG": "t", "PYTHON": sys.executable, "EAGER_ITERS": "20", "TRAIN_ITERS": "40"}
    proc = run_script(SYNTHETIC, env=env, fake_bin=bin_dir)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    eager, graphs = calls.read_text().splitlines()
    assert "--cuda-graph-impl" not in eager and "--train-iters 20" in eager
    assert "--cuda-graph-max-packed-seqs 16" in graphs and "--train-iters 40" in graphs
    table = proc.stdout[proc.stdout.index("tokens/s, eager reference vs layer graphs"):]
    assert "| hybrid-small | eager | 100.0 |" in table and "| 1,000 | 1.00x |" in table
    assert "| hybrid-small | layer-graphs | 100.0 |" in table and "| 3,000 | 3.00x |" in table
    assert (tmp_path / "out" / "eager_t.jsonl").exists()
    assert (tmp_path / "out" / "layer_graphs_t.jsonl").exists()


def test_synthetic_stops_when_the_graph_run_fails(tmp_path):
    bin_dir, calls = _fake_torchrun(tmp_path, fail_graphs=True)
    env = {"NGPUS": "1", "CUDA_GRAPH_MAX_PACKED_SEQS": "16", "OUT_DIR": str(tmp_path / "out"),
           "JOB_TAG": "t", "PYTHON": sys.executable}
    proc = run_script(SYNTHETIC, env=env, fake_bin=bin_dir)
    assert proc.returncode == 3
    assert "tokens/s, eager reference" not in proc.stdout
    assert len(calls.read_text().splitlines()) == 2


# --- --help of the graph flags and of the capacity advisor --------------------------------------

def test_every_graph_flag_has_help_text():
    parser = build_parser()
    graph_actions = [a for a in parser._actions
                     if any("graph" in opt or "dynamic-cp" in opt for opt in a.option_strings)]
    assert {"--cuda-graph-impl", "--cuda-graph-granularity", "--cuda-graph-max-packed-seqs",
            "--cuda-graph-warmup-steps"} <= {o for a in graph_actions for o in a.option_strings}
    for action in graph_actions:
        assert action.help and action.help.strip(), action.option_strings


def test_capacity_advisor_help_shows_defaults(capsys):
    import tools.capacity_advisor as advisor
    with pytest.raises(SystemExit) as done:
        advisor.parse_args(["--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 0.01)" in text and "(default: 2000)" in text and "--print-capacity" in text


def test_cuda_graph_scope_knob_is_the_older_name_of_cuda_graph_modules():
    line = launch_line(dry_run(SBATCH["gpt"], {"CUDA_GRAPH_SCOPE": "attn"}))
    assert "--cuda-graph-modules attn" in line and "--cuda-graph-scope" not in line


def test_a_blend_in_data_path_reaches_the_command_as_megatron_lm_takes_it():
    env = {"DATA_PATH": "0.3 /data/a_text_document 0.7 /data/b.jsonl"}
    _, _, argv = split_launch(launch_line(dry_run(SBATCH["gpt"], env)))
    at = argv.index("--data-path")
    assert argv[at:at + 5] == ["--data-path", "0.3", "/data/a_text_document", "0.7",
                               "/data/b.jsonl"]
