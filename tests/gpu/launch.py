"""Run the real training scripts (Megatron-LM's training loop with the graph runtime at its
seam) under torchrun and read back what they report: the fork's metrics file (loss, time,
throughput, the runtime's counters) and Megatron-LM's log line (learning rate, grad norm,
batch size, MoE losses)."""

import os
import random
import re
import socket
import subprocess
import sys

from megatron.packed_training.metrics import read_metrics

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# What megatron-core writes into the process environment for --attention-backend, refusing
# another backend's values later (tests/conftest.py puts them back after every test).
NVTE_ATTENTION_VARIABLES = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")

# What the old fork's parser defaulted to and the suite's numbers were measured with, as
# Megatron-LM's flags (upstream's defaults differ: docs/flags.md). Part of TRAIN.
FORK_NUMERICS = [
    "--normalization", "RMSNorm", "--disable-bias-linear", "--hidden-dropout", "0",
    "--attention-dropout", "0", "--adam-beta2", "0.95", "--lr-decay-style", "cosine",
    "--calculate-per-token-loss",
]
# Small models that still exercise every layer type; shared by the GPU tests. Each names its
# position embedding (the old fork: RoPE for GPT, none for the hybrid), its query groups
# (Megatron-LM reads --num-query-groups only with --group-query-attention) and, with SwiGLU,
# the 4 x hidden FFN width the old fork used (Megatron-LM shrinks it to 2/3).
TINY_GPT = [
    "--num-layers", "4", "--hidden-size", "256", "--ffn-hidden-size", "1024",
    "--num-attention-heads", "8", "--group-query-attention", "--num-query-groups", "4",
    "--swiglu", "--seq-length", "1024", "--max-position-embeddings", "1024",
    "--vocab-size", "1024", "--position-embedding-type", "rope",
]
HYBRID_LAYERS = [
    "--hidden-size", "256", "--num-attention-heads", "8", "--group-query-attention",
    "--num-query-groups", "4", "--mamba-head-dim", "32", "--mamba-num-groups", "2",
    "--mamba-state-dim", "64", "--seq-length", "1024", "--max-position-embeddings", "1024",
    "--vocab-size", "1024", "--position-embedding-type", "none",
]
TINY_HYBRID = ["--hybrid-layer-pattern", "M*-M*-M-", *HYBRID_LAYERS]
# MoE: 8 experts, top-2, aux and z losses, the alltoall dispatcher (the old fork's default);
# DROP_AND_PAD (capacity 1.0 x an even share, padded to it) is what whole-layer graphs need,
# and random routing overflows it now and then.
MOE = ["--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "256",
       "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001",
       "--moe-token-dispatcher-type", "alltoall"]
DROP_AND_PAD = ["--moe-expert-capacity-factor", "1.0", "--moe-pad-expert-input-to-capacity"]
TINY_GPT_MOE = TINY_GPT + MOE
TINY_HYBRID_MOE = ["--hybrid-layer-pattern", "M*EM*E", *HYBRID_LAYERS, *MOE]
# Local layer graphs at capacity 16 after two eager iterations (the graph tests' default).
LAYER_GRAPHS = ["--cuda-graph-impl", "local", "--cuda-graph-max-packed-seqs", "16",
                "--cuda-graph-warmup-steps", "2"]
CHUNK_GRAPHS = LAYER_GRAPHS + ["--cuda-graph-granularity", "chunk"]
# Transformer Engine's attention, and its layer graphs at the same capacity (need TE).
TE = ["--attention-backend", "auto", "--te-rng-tracker"]
TE_GRAPHS = ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-max-packed-seqs", "16",
             "--cuda-graph-warmup-steps", "2"]
# Mock data, no evaluation (--eval-iters 0: mock data has a validation split of its own).
TRAIN = [
    "--sft", "--mock-data", "--mock-doc-length-median", "128", "--bf16",
    "--lr", "1e-3", "--min-lr", "1e-4", "--seed", "1234",
    "--micro-batch-size", "1", "--log-interval", "1", "--eval-iters", "0", *FORK_NUMERICS,
]
# Values of Megatron-LM's per-iteration log line that the metrics file does not hold, under
# the metrics-style names run_training gives them (MoE losses keep their own names).
LOG_LINE_KEYS = {"learning rate": "learning_rate", "grad norm": "grad_norm",
                 "global batch size": "global_batch_size", "num zeros": "num_zeros",
                 "loss scale": "loss_scale"}
_LOG_LINE = re.compile(r"\biteration\s+(\d+)/\s*\d+\s*\|(.*)$")


def megatron_log_values(log: str) -> dict:
    """Megatron-LM's training log lines in ``log`` (`` [date] iteration N/ M | consumed
    samples: ... | learning rate: 1.000000E-05 | ... | grad norm: 2.480 | ...``), by
    iteration: ``{N: {name: value}}`` with the names of `LOG_LINE_KEYS` and the MoE losses'
    own (``load_balancing_loss``, ``z_loss``, ...). Values are numbers."""
    values = {}
    for line in log.splitlines():
        match = _LOG_LINE.search(line)
        if match is None:
            continue
        found = {}
        for part in match.group(2).split("|"):
            name, _, value = part.partition(":")
            name = name.strip()
            key = LOG_LINE_KEYS.get(name, name if "_" in name else None)
            if key is None:
                continue
            value = value.strip()
            try:
                found[key] = int(value) if value.isdigit() else float(value)
            except ValueError:
                continue
        values[int(match.group(1))] = found
    return values


def free_port() -> int:
    """A port torchrun's rendezvous store can bind: free now, and below Linux's ephemeral
    range (32768-60999), so the outgoing NCCL and gloo connections of runs beside this one
    cannot take it before torchrun binds it (a port the kernel handed out, as bind(0) does,
    can)."""
    while True:
        port = random.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port


def _lost_port_race(output: str) -> bool:
    return "EADDRINUSE" in output and "TCPStore" in output


# torch's one-time warning when a weight gradient crosses streams into DDP's accumulation
# (megatron_ddp.ddp_on_the_process_stream keeps them on one stream).
STREAM_MISMATCH_WARNING = "AccumulateGrad node's stream does not match"


def torchrun_command(path: str, args: list, *, nproc: int) -> list:
    """The command line of ``torchrun --nproc-per-node nproc REPO/path args`` on a free port."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-port", str(free_port()), os.path.join(REPO, path), *args]


def torchrun(path: str, args: list, *, nproc: int, env: dict | None = None,
             timeout: int = 900, log: str | None = None) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node nproc REPO/path args`` on a free port, its output captured
    (``log``: written to that file as it comes, so that a run cut short leaves it, and read
    back as ``stdout``; ``stderr`` is then "").

    ``CUDA_DEVICE_MAX_CONNECTIONS`` is 1 unless the environment sets it: Megatron-LM requires
    it for tensor and context parallelism (before Blackwell), as the launchers in examples/
    export it. A run beside this one may bind the port between the check and torchrun: a run
    that lost that race is started again on another port (three tries)."""
    # A model built in this process leaves its attention backend's NVTE_*_ATTN variables
    # behind, and megatron-core refuses another backend's values: runs start without them.
    inherited = {name: value for name, value in os.environ.items()
                 if name not in NVTE_ATTENTION_VARIABLES}
    env = {"CUDA_DEVICE_MAX_CONNECTIONS": "1", **inherited, **(env or {})}
    for _ in range(3):
        command = torchrun_command(path, args, nproc=nproc)
        if log is None:
            proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env,
                                  timeout=timeout)
        else:
            with open(log, "w") as out:
                proc = subprocess.run(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                      text=True, env=env, timeout=timeout)
            with open(log) as out:
                proc.stdout, proc.stderr = out.read(), ""
        if proc.returncode == 0 or not _lost_port_race(proc.stdout + proc.stderr):
            break
    return proc


# A Python exception's last line ("AssertionError: ...") or torchrun's per-rank failure line.
_ERROR_LINE = re.compile(r"^(?:\[rank\d+\]: )?(?:[\w.]+(?:Error|Exception)\b.*|exitcode .*)$")


def assert_succeeded(name: str, returncode: int, output: str, tail: int = 6000) -> None:
    """Raise AssertionError when the run ``name`` failed: its exception lines first (each
    rank's, once), then the tail of its output (torchrun's summary of which rank failed).
    The report goes to stderr at once too: a session cut short (a timeout) never prints
    pytest's failure summary."""
    if returncode == 0:
        return
    errors = list(dict.fromkeys(line.strip() for line in output.splitlines()
                                if _ERROR_LINE.match(line.strip())))
    report = (f"{name} failed (exit {returncode}):\n  " + "\n  ".join(errors[-8:] or ["?"])
              + f"\n--- the last {tail} characters of its output ---\n{output[-tail:]}")
    print(f"\n{report}", file=sys.stderr, flush=True)
    raise AssertionError(report)


def run_training(script: str, args: list, tmp_path, *, nproc: int = 1, name: str = "run",
                 env: dict | None = None) -> list:
    """Train with ``torchrun --nproc-per-node nproc script args``; return train records: the
    metrics file's, each with the values of its iteration's Megatron-LM log line added
    (`megatron_log_values`: ``learning_rate``, ``grad_norm``, ``global_batch_size``, MoE
    losses), which the metrics file does not hold.

    The output is kept in ``tmp_path/<name>.log``, written as it comes (a run cut by a test
    timeout leaves it). Raises with the run's errors and output if it fails (`assert_succeeded`).
    """
    metrics = os.path.join(str(tmp_path), f"{name}.jsonl")
    proc = torchrun(script, [*map(str, args), "--metrics-file", metrics], nproc=nproc, env=env,
                    log=os.path.join(str(tmp_path), f"{name}.log"))
    output = proc.stdout
    assert_succeeded(name, proc.returncode, output)
    logged = megatron_log_values(output)
    return [logged.get(r["iteration"], {}) | r for r in read_metrics(metrics)]


def train_then_resume(script: str, args: list, tmp_path, *, save_interval: int,
                      exit_interval: int) -> tuple:
    """Train ``script args`` in two processes: the first saves to ``tmp_path/ckpt`` every
    ``save_interval`` iterations and stops after ``exit_interval``, the second resumes from
    the last save (``--load``) to the end. Returns both runs' train records."""
    ckpt = str(tmp_path / "ckpt")
    first = run_training(script, args + ["--save", ckpt, "--save-interval", str(save_interval),
                                         "--exit-interval", str(exit_interval)],
                         tmp_path, name="first_half")
    second = run_training(script, args + ["--load", ckpt], tmp_path, name="second_half")
    return first, second


def find_host_syncs(script: str, args: list, tmp_path, *, iteration: int) -> str:
    """Run tools/find_host_syncs.py on ``script args`` watching ``iteration``; return its
    whole output (kept in ``tmp_path/find_host_syncs.log``; the report, from the "host syncs
    in iteration" line on, is printed). Raises with the output if it fails."""
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", "find_host_syncs.py"), script,
         "--iteration", str(iteration), "--", *args],
        cwd=REPO, capture_output=True, text=True, timeout=900,
        # Its own rendezvous port: this process's one-GPU world may hold MASTER_PORT.
        env={**os.environ, "MASTER_PORT": str(free_port())})
    out = proc.stdout + proc.stderr
    with open(os.path.join(str(tmp_path), "find_host_syncs.log"), "w") as f:
        f.write(out)
    assert_succeeded("find_host_syncs", proc.returncode, out)
    print(out[out.find("host syncs in iteration"):][:3000])
    return out


def losses(records: list) -> list:
    return [r["lm_loss"] for r in records]


def assert_moe_follows_eager(eager: list, graphs: list, label: str) -> None:
    """MoE training under graphs follows eager: the largest per-iteration difference of the
    loss and of the load-balancing loss below 5e-3, the tolerance of the dense graph tests
    (eager runs at the micro-batch's max_seqlen, graphs at the static one). Prints both."""
    dloss = max(abs(e["lm_loss"] - g["lm_loss"]) for e, g in zip(eager, graphs))
    daux = max(abs(e["load_balancing_loss"] - g["load_balancing_loss"])
               for e, g in zip(eager, graphs))
    print(f"{label}: max |dloss| {dloss:.2e}, max |d aux| {daux:.2e}")
    assert dloss < 5e-3 and daux < 5e-3, (losses(eager), losses(graphs))
