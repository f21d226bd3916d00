"""The graph package's typed settings (megatron/packed_graphs/settings.py).

megatron.packed_graphs never reads the command line's ``argparse.Namespace``: an AST scan of
its modules. The settings are built once per run from the parsed arguments
(packed_training.config.graph_settings_from_args), with the launch line's values: real
``parse_args`` calls, as the scripts make them.
"""

import ast
import dataclasses
import pathlib
from types import SimpleNamespace

import pytest
import torch

from megatron.packed_graphs.runtime import GraphRuntime
from megatron.packed_graphs.settings import (
    CPBanks,
    GraphSettings,
    HealthCheckConfig,
    MoEGraphSettings,
)
from megatron.packed_training import config as training_config
from megatron.packed_training import extra_args
from megatron.packed_training.arguments import parse_args
from megatron.packed_training.config import graph_settings_from_args

GRAPHS_PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "megatron" / "packed_graphs"
BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "128", "--max-position-embeddings", "128", "--micro-batch-size", "1",
        "--global-batch-size", "8", "--train-iters", "10", "--lr", "1e-3", "--mock-data",
        "--attention-backend", "local"]


@pytest.fixture(autouse=True)
def no_optional_packages(monkeypatch):
    monkeypatch.setattr(extra_args, "is_importable", lambda package: False)
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


# -- no argparse Namespace in the graph package ---------------------------------------------

def namespace_reads(source: str) -> list:
    """``(line, what)`` of every place ``source`` would read a run's parsed arguments: a
    parameter named ``args`` (``*args`` is a function's positional arguments, allowed), an
    attribute of a name ``args``, ``getattr``/``hasattr``/``vars`` of it, Megatron-LM's
    ``get_args``, and argparse."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            params = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            found += [(node.lineno, "parameter args") for p in params if p.arg == "args"]
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
              and node.value.id == "args"):
            found.append((node.lineno, f"args.{node.attr}"))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr", "vars") and node.args
              and isinstance(node.args[0], ast.Name) and node.args[0].id == "args"):
            found.append((node.lineno, f"{node.func.id}(args, ...)"))
        elif isinstance(node, ast.Name) and node.id == "get_args":
            found.append((node.lineno, "get_args"))
        elif isinstance(node, ast.Attribute) and node.attr == "get_args":
            found.append((node.lineno, "get_args"))
        elif isinstance(node, ast.Import) and any(a.name == "argparse" for a in node.names):
            found.append((node.lineno, "import argparse"))
        elif isinstance(node, ast.ImportFrom) and (
                node.module == "argparse" or any(a.name == "get_args" for a in node.names)):
            found.append((node.lineno, f"from {node.module} import ..."))
    return sorted(found)


def test_the_scan_finds_namespace_reads():
    source = '''
import argparse
from megatron.training import get_args
def f(args, *rest):
    return args.seq_length + getattr(args, "x", 0)
def g(*args, **kwargs):
    return args[0] if args else kwargs
hook = lambda module, args: None
'''
    assert [what for _, what in namespace_reads(source)] == [
        "import argparse", "from megatron.training import ...", "parameter args",
        "args.seq_length", "getattr(args, ...)", "parameter args"]


def test_the_graph_package_reads_no_parsed_arguments():
    files = sorted(GRAPHS_PACKAGE.rglob("*.py"))
    assert {path.name for path in files} >= {"runtime.py", "settings.py", "optimizer_graph.py"}
    reads = {path.name: found for path in files
             if (found := namespace_reads(path.read_text()))}
    assert not reads, ("megatron/packed_graphs reads the parsed arguments; take a field of "
                       f"settings.GraphSettings instead: {reads}")


# -- built once from the parsed arguments ---------------------------------------------------

def test_graphs_off_by_default():
    settings = graph_settings_from_args(parse_args(BASE))
    assert settings == GraphSettings(
        impl="none", granularity="layer", capacity=0, ladder=(), warmup_steps=3,
        optimizer_graph=False, micro_batch_size=1, seq_length=128, global_batch_size=8,
        num_microbatches=8, data_parallel_size=1, tensor_parallel_size=1,
        sequence_parallel=False, context_parallel_size=1, pipeline_parallel_size=1,
        overlap_param_gather=False, moe=None, cp_banks=None, health_check=HealthCheckConfig())
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.impl = "local"


def test_the_launch_lines_graph_flags_reach_the_settings():
    args = parse_args(BASE + [
        "--cuda-graph-impl", "full_iteration", "--cuda-graph-max-packed-seqs", "16",
        "--cuda-graph-warmup-steps", "3", "--cuda-graph-granularity", "chunk",
        "--no-check-for-nan-in-loss-and-grad", "--use-distributed-optimizer",
        "--optimizer-cuda-graph"])
    # Megatron-LM's loop sees 'local' and no optimizer graph; the settings hold the run's.
    assert (args.cuda_graph_impl, args.optimizer_cuda_graph) == ("local", False)
    settings = graph_settings_from_args(args)
    assert (settings.impl, settings.granularity, settings.capacity, settings.ladder,
            settings.warmup_steps, settings.optimizer_graph, settings.num_microbatches) == (
        "full_iteration", "chunk", 16, (), 3, True, 8)

    ladder = graph_settings_from_args(parse_args(BASE + [
        "--cuda-graph-impl", "local", "--cuda-graph-max-packed-seqs", "16",
        "--cuda-graph-capacity-ladder", "4", "8", "--cuda-graph-check-interval", "5",
        "--cuda-graph-check-tolerance", "0.001", "--cuda-graph-check-action", "disable"]))
    assert (ladder.impl, ladder.ladder, ladder.health_check) == (
        "local", (4, 8), HealthCheckConfig(5, 0.001, "disable"))


def test_moe_settings_from_the_launch_line():
    args = parse_args(BASE + [
        "--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type",
        "alltoall", "--moe-expert-capacity-factor", "1.5", "--moe-pad-expert-input-to-capacity",
        "--moe-capacity-overflow", "rerun", "--cuda-graph-impl", "local",
        "--cuda-graph-max-packed-seqs", "16"])
    assert graph_settings_from_args(args).moe == MoEGraphSettings(
        dropless_graphs=False, capacity_overflow="rerun", expert_capacity_factor=1.5,
        pad_expert_input_to_capacity=True)


def test_dynamic_cp_banks_from_the_launch_line(monkeypatch):
    monkeypatch.setattr(extra_args, "is_importable",
                        lambda package: package == "transformer_engine")
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = parse_args(BASE[:-2] + [
        "--attention-backend", "auto", "--calculate-per-token-loss", "--dynamic-cp-sizes", "1",
        "2", "--cuda-graph-impl", "transformer_engine", "--cuda-graph-max-packed-seqs", "16",
        "--dynamic-cp-max-packed-seqs", "16", "8"])
    settings = graph_settings_from_args(args)
    assert settings.cp_banks == CPBanks(sizes=(1, 2), max_packed_seqs=(16, 8), tokens_per_rank=64)
    assert (settings.impl, settings.data_parallel_size, settings.num_microbatches) == (
        "transformer_engine", 2, 4)


def test_the_run_builds_its_settings_once_with_its_runtime(cpu_dist, monkeypatch):
    """pretrain.PackedGraphRun (the scripts' and the library policy's set-up): one
    graph_settings_from_args call, when the model and optimizer exist; the runtime and every
    schedule it wraps use those settings."""
    from megatron.packed_training.pretrain import PackedGraphRun

    args = parse_args(BASE + ["--cuda-graph-impl", "local", "--cuda-graph-max-packed-seqs",
                              "16"])
    built = []

    def counted(parsed):
        built.append(graph_settings_from_args(parsed))
        return built[-1]

    monkeypatch.setattr(training_config, "graph_settings_from_args", counted)
    run = PackedGraphRun(args, log=False)
    assert run.settings is None and not built  # nothing before the model exists
    model = torch.nn.Linear(2, 2)
    model.config = SimpleNamespace(cuda_graph_granularity="layer")  # what get_model_config reads
    monkeypatch.setattr(run, "step_wrapped", True)  # no optimizer step to wrap here
    run([model], SimpleNamespace(step=lambda: None), None)
    assert len(built) == 1 and run.settings is built[0]
    assert (run.runtime.config.impl, run.runtime.config.capacity) == ("local", 16)
    assert run.moe_rerun is None
    seams = [run.wrap(lambda *a, **k: None) for _ in range(2)]
    assert len(built) == 1 and all(seam.stream_length == 128 for seam in seams)


def test_the_runtime_takes_settings_not_arguments():
    settings = GraphSettings(impl="local", capacity=8, ladder=(4,), warmup_steps=1,
                             micro_batch_size=2, seq_length=64, tensor_parallel_size=2,
                             sequence_parallel=True)
    runtime = GraphRuntime.from_settings(settings, [], None)
    assert (runtime.config.capacities, runtime.config.tokens_per_rank,
            runtime.config.warmup_iterations) == ((4, 8), 64, 1)
    with pytest.raises(ValueError, match="CUDA graph implementation is wrong: cudnn"):
        GraphSettings(impl="cudnn")
