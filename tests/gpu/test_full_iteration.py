"""Full-iteration graphs (--cuda-graph-impl full_iteration) train like eager.

Mock documents (median 128 tokens) in 1024-token rows hold 1 to 15 segments per micro-batch;
capacity 9 with 4 micro-batches per iteration makes about half the iterations one graph and
sends the others through layer graphs (eager for the micro-batch that overflows), so both
paths and their hand-overs run. Each run prints its max |dloss| and max relative grad-norm
difference against eager with the same flags.
"""

import pytest

from megatron.packed_training.extra_args import is_importable
from tests.gpu.launch import (
    STREAM_MISMATCH_WARNING,
    TINY_GPT,
    TINY_HYBRID,
    TRAIN,
    find_host_syncs,
    losses,
    run_training,
    train_then_resume,
)

# DDP's NaN check syncs; the eager reference runs without it too, so only graphs differ.
# Graphs on TE attention switch TE's RNG tracker on: the eager reference takes it too.
GRAPH_REFERENCE = ["--no-check-for-nan-in-loss-and-grad"] + (
    ["--te-rng-tracker"] if is_importable("transformer_engine") else [])
COMMON = TRAIN + GRAPH_REFERENCE


def full_iteration(capacity: int, warmup: int, granularity: str = "layer") -> list:
    return ["--cuda-graph-impl", "full_iteration", "--cuda-graph-max-packed-seqs", str(capacity),
            "--cuda-graph-warmup-steps", str(warmup), "--cuda-graph-granularity", granularity]


def compare(eager: list, graphs: list, what: str, loss_tol: float, norm_tol: float) -> None:
    assert [r["iteration"] for r in eager] == [r["iteration"] for r in graphs]
    dloss = max(abs(e["lm_loss"] - g["lm_loss"]) for e, g in zip(eager, graphs))
    dnorm = max(abs(e["grad_norm"] - g["grad_norm"]) / max(abs(e["grad_norm"]), 1e-12)
                for e, g in zip(eager, graphs))
    print(f"{what}: max |dloss| {dloss:.3e}, max rel |dgrad_norm| {dnorm:.3e}")
    assert dloss <= loss_tol, (losses(eager), losses(graphs))
    assert dnorm <= norm_tol


def counts(records: list) -> dict:
    keys = ("iteration graphs", "iteration graph misses", "iteration graph miss overflow",
            "eager overflow", "eager warmup")
    return {key: sum(r.get(key, 0) for r in records) for key in keys}


@pytest.mark.parametrize("kind, warmup, granularity", [
    ("gpt", 2, "layer"),     # the iteration graph is captured first (iteration 3)
    ("hybrid", 1, "layer"),  # iteration 2 overflows: layer graphs first, then the iteration graph
    ("gpt", 2, "chunk"),     # chunk graphs for the iterations that miss
])
def test_fifty_steps_match_eager_with_misses_mixed_in(tmp_path, kind, warmup, granularity):
    script, model = ("pretrain_gpt.py", TINY_GPT) if kind == "gpt" else ("pretrain_mamba.py",
                                                                         TINY_HYBRID)
    common = model + COMMON + ["--train-iters", "50", "--global-batch-size", "4"]
    eager = run_training(script, common, tmp_path, name="eager")
    graphs = run_training(script, common + full_iteration(9, warmup, granularity), tmp_path,
                          name="full_iteration")
    n = counts(graphs)
    print(f"{kind} {granularity}: {n}")
    assert n["eager warmup"] == 4 * warmup
    assert n["iteration graphs"] > 5 and n["iteration graph misses"] > 5
    assert n["iteration graphs"] + n["iteration graph misses"] == 50 - warmup
    assert n["iteration graph miss overflow"] == n["iteration graph misses"]
    # A miss runs only the overflowing micro-batches eager, never the whole iteration.
    assert 0 < n["eager overflow"] < 4 * n["iteration graph misses"]
    assert sum(1 for r in graphs if "iteration graph capture (s)" in r) == 1
    assert sum(1 for r in graphs if "graph capture (s)" in r) == 1  # the misses' graphs
    compare(eager, graphs, f"{kind} {granularity}", 5e-3, 1e-2)


def test_every_iteration_fits_and_replays_one_graph(tmp_path):
    common = TINY_GPT + COMMON + ["--train-iters", "20", "--global-batch-size", "4"]
    eager = run_training("pretrain_gpt.py", common, tmp_path, name="eager")
    graphs = run_training("pretrain_gpt.py", common + full_iteration(16, 2), tmp_path,
                          name="full_iteration")
    assert counts(graphs)["iteration graphs"] == 18
    assert not any("graph capture (s)" in r for r in graphs)  # no miss: no layer graphs
    assert [r.get("eager overflow", 0) for r in graphs] == [0] * 20
    compare(eager, graphs, "gpt, no misses", 5e-3, 1e-2)
    # DDP is built on the stream backward runs on (megatron_ddp.ddp_on_the_process_stream):
    # no weight gradient crosses streams, and torch's one-time warning never fires.
    for run in ("eager", "full_iteration"):
        log = (tmp_path / f"{run}.log").read_text()
        assert STREAM_MISMATCH_WARNING not in log, run


def test_per_token_loss(tmp_path):
    common = TINY_GPT + COMMON + ["--train-iters", "30", "--global-batch-size", "4",
                                  "--calculate-per-token-loss"]
    eager = run_training("pretrain_gpt.py", common, tmp_path, name="eager")
    graphs = run_training("pretrain_gpt.py", common + full_iteration(9, 2), tmp_path,
                          name="full_iteration")
    assert counts(graphs)["iteration graphs"] > 3
    compare(eager, graphs, "gpt, per-token loss", 5e-3, 1e-2)


@pytest.mark.gpus(2)
@pytest.mark.parametrize("kind", ["gpt", "hybrid"])
def test_data_parallel_ranks_take_the_same_path(tmp_path, kind):
    script, model = ("pretrain_gpt.py", TINY_GPT) if kind == "gpt" else ("pretrain_mamba.py",
                                                                         TINY_HYBRID)
    common = model + COMMON + ["--train-iters", "30", "--global-batch-size", "8"]
    eager = run_training(script, common, tmp_path, nproc=2, name="eager")
    graphs = run_training(script, common + full_iteration(10, 2), tmp_path, nproc=2,
                          name="full_iteration")
    n = counts(graphs)
    print(f"{kind} DP=2: {n}")
    # An overflow on either rank sends both per micro-batch (the graph holds the all-reduce).
    assert n["iteration graphs"] > 0 and n["iteration graph misses"] > 0
    compare(eager, graphs, f"{kind} DP=2", 5e-3, 1e-2)


def test_save_and_resume_continue_the_curve(tmp_path):
    common = TINY_GPT + COMMON + ["--train-iters", "30", "--global-batch-size", "4"]
    flags = common + full_iteration(9, 2)
    eager = run_training("pretrain_gpt.py", common, tmp_path, name="eager")
    full = run_training("pretrain_gpt.py", flags, tmp_path, name="full")
    first, second = train_then_resume("pretrain_gpt.py", flags, tmp_path, save_interval=15,
                                      exit_interval=15)
    assert [r["iteration"] for r in first] == list(range(1, 16))
    assert [r["iteration"] for r in second] == list(range(16, 31))
    # The resumed process warms up and captures again; the curve goes on where it stopped.
    assert counts(second)["eager warmup"] == 8 and counts(second)["iteration graphs"] > 0
    compare(full[15:], second, "resumed vs uninterrupted", 5e-3, 1e-2)
    compare(eager, first + second, "resumed vs eager", 5e-3, 1e-2)


def test_a_replayed_iteration_has_no_host_sync(tmp_path):
    """Iteration 5 replays the iteration graph: nothing in the model syncs, and Megatron-LM's
    loop around it (train_step's statistics, the loss scale; its log line is not due) reads
    nothing back either, so the host runs ahead into the next iteration."""
    flags = TINY_HYBRID + COMMON + ["--train-iters", "6", "--global-batch-size", "4",
                                    "--log-interval", "100", *full_iteration(16, 2)]
    out = find_host_syncs("pretrain_mamba.py", flags, tmp_path, iteration=5)
    report = out[out.find("host syncs in iteration"):]
    assert "(0 inside the model)" in report, report
    assert "== in the training loop (outside graphs): 0" in report, report
