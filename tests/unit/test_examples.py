"""The launch scripts under examples/: syntax, and the --dry-run launch command, whose training
flags must pass the real parser and validate_args (so a typo in a script fails here) (CPU)."""

import os
import shlex
import subprocess
from pathlib import Path

import pytest

from megatron.training.arguments import build_parser, validate_args

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
SCRIPTS = sorted(p for p in EXAMPLES.rglob("*") if p.suffix in (".sh", ".sbatch"))
SBATCH = {"gpt": "examples/slurm/sft_gpt.sbatch", "hybrid": "examples/slurm/sft_hybrid.sbatch"}
LOCAL = {"gpt": "examples/local/run_gpt.sh", "hybrid": "examples/local/run_hybrid.sh"}
MODEL_OF_SCRIPT = {"pretrain_gpt.py": "gpt", "pretrain_mamba.py": "hybrid"}
KNOBS = ("NNODES", "GPUS_PER_NODE", "LAUNCHER", "CONTAINER_IMAGE", "CONTAINER_MOUNTS",
         "DATA_PATH", "VALID_DATA_PATH", "SAVE_DIR", "LOG_DIR", "SEQ_LENGTH", "MICRO_BATCH_SIZE",
         "GLOBAL_BATCH_SIZE", "TRAIN_ITERS", "TP", "PP", "CUDA_GRAPH_IMPL",
         "CUDA_GRAPH_MAX_PACKED_SEQS", "CUDA_GRAPH_WARMUP_STEPS", "CUDA_GRAPH_SCOPE", "NSYS",
         "NSYS_OUTPUT", "EXTRA_ARGS", "DRY_RUN", "MASTER_ADDR", "MASTER_PORT", "REPO_DIR",
         "RUN_NAME", "LAUNCH_MODE", "LOAD_DIR", "SAVE_INTERVAL", "WORLD_SIZE")


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


def validated(line, world_size):
    """Parse and validate the training args of a launch line; returns (args, launcher words)."""
    launcher, script, argv = split_launch(line)
    model = MODEL_OF_SCRIPT[script]
    args = build_parser(model).parse_args(argv)
    return validate_args(args, model, world_size=world_size), launcher


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
    assert args.cuda_graph_impl == "local" and args.cuda_graph_max_packed_seqs == 64
    assert args.sft and args.bf16 and args.mock_data and args.seq_length == 4096
    assert args.hidden_size == 1024 and args.num_attention_heads == 16
    assert args.num_query_groups == 8
    assert args.metrics_file.startswith(str(REPO / "runs"))
    assert os.path.dirname(args.metrics_file).endswith("/logs")
    # Four micro-batches per iteration by default.
    assert args.num_microbatches == 4 and args.global_batch_size == 32
    if model == "gpt":
        assert "pretrain_gpt.py" in line and args.num_layers == 16 and args.swiglu
    else:
        assert "pretrain_mamba.py" in line and "--hybrid-override-pattern" in line
        assert args.hybrid_override_pattern == "M-M-M*-M-M-M*-M-" and args.num_layers == 16


@pytest.mark.parametrize("model", ["gpt", "hybrid"])
def test_local_dry_run(model):
    line = launch_line(dry_run(LOCAL[model], {"GPUS_PER_NODE": "2"}))
    assert line.startswith("torchrun --standalone --nnodes 1 --nproc-per-node 2 ")
    args, _ = validated(line, world_size=2)
    assert args.global_batch_size == 8 and args.cuda_graph_max_packed_seqs == 64
    assert args.model == model


def test_env_overrides_reach_the_command():
    env = {"CUDA_GRAPH_MAX_PACKED_SEQS": "32", "CUDA_GRAPH_WARMUP_STEPS": "5",
           "CUDA_GRAPH_SCOPE": "attn mlp", "NNODES": "2", "GPUS_PER_NODE": "4", "TP": "2",
           "PP": "2", "SEQ_LENGTH": "2048", "MICRO_BATCH_SIZE": "2", "TRAIN_ITERS": "7",
           "DATA_PATH": "/data/train.jsonl", "VALID_DATA_PATH": "/data/valid.jsonl",
           "SAVE_DIR": "/ckpt/run1", "MASTER_PORT": "12345",
           "EXTRA_ARGS": "--attention-backend torch --log-interval 1"}
    line = launch_line(dry_run(SBATCH["gpt"], env, "--lr", "1e-3"))
    assert "--cuda-graph-max-packed-seqs 32" in line
    args, launcher = validated(line, world_size=8)
    assert (args.cuda_graph_max_packed_seqs, args.cuda_graph_warmup_steps) == (32, 5)
    assert "--cuda-graph-modules attn mlp" in line
    assert args.cuda_graph_modules == ["attn", "mlp"]
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (2, 2)
    assert args.data_parallel_size == 2 and args.global_batch_size == 16
    assert (args.seq_length, args.micro_batch_size, args.train_iters) == (2048, 2, 7)
    assert args.lr_warmup_iters == 7  # min(10, TRAIN_ITERS): short smoke runs validate
    assert args.data_path == "/data/train.jsonl" and not args.mock_data
    assert args.valid_data_path == "/data/valid.jsonl" and args.eval_interval == 100
    assert args.save == "/ckpt/run1/checkpoints"
    assert args.metrics_file.startswith("/ckpt/run1/logs/")
    assert args.attention_backend == "torch" and args.log_interval == 1
    assert args.lr == 1e-3  # arguments after --dry-run are appended and win
    assert flag_value(launcher, "--nnodes") == "2" and "--nodes=2" in launcher
    assert flag_value(launcher, "--master-port") == "12345"


def test_chunk_granularity_from_the_environment():
    env = {"CUDA_GRAPH_GRANULARITY": "chunk", "PP": "2", "GPUS_PER_NODE": "2"}
    line = launch_line(dry_run(SBATCH["hybrid"], env))
    args, _ = validated(line, world_size=2)
    assert args.cuda_graph_granularity == "chunk" and args.pipeline_model_parallel_size == 2
    assert validated(launch_line(dry_run(SBATCH["gpt"], {})), world_size=8)[0].cuda_graph_granularity == "layer"


def test_graphs_off_drops_every_graph_flag():
    line = launch_line(dry_run(SBATCH["hybrid"], {"CUDA_GRAPH_IMPL": "none"}))
    assert "--cuda-graph" not in line
    args, _ = validated(line, world_size=8)
    assert args.cuda_graph_impl == "none"


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
    # nsys records the range the training loop brackets with cudaProfilerStart/Stop.
    assert args.profile and (args.profile_step_start, args.profile_step_end) == (10, 12)


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
    assert "--hybrid-override-pattern M-M-M*-M-M-M*-M- " in log  # the quoting survived
