"""Find every GPU->CPU synchronisation of one training iteration, with its Python stack.

Runs the real training (one process, one GPU) up to ``--iteration`` and runs that iteration
under ``torch.cuda.set_sync_debug_mode("warn")``. Each synchronising call is reported once
per call site, with a count and the Python stack, split into syncs inside the model's
forward/backward (these break CUDA graph capture), deliberate once-per-iteration reads by
model-side code outside any graph (``DELIBERATE_READS``, each with its reason: e.g. the MoE
overflow rerun's read) and syncs in the training loop around it (loss, grad norm, logging:
expected, outside any graph).

    python tools/find_host_syncs.py pretrain_mamba.py --iteration 5 -- \\
        --sft --mock-data --hybrid-override-pattern "M*-M*-" --hidden-size 256 \\
        --num-attention-heads 8 --seq-length 2048 --train-iters 5 --lr 1e-4 --bf16 \\
        --cuda-graph-impl local --cuda-graph-max-packed-seqs 32 --cuda-graph-warmup-steps 2

The training arguments after ``--`` are the script's own; ``--train-iters`` is raised to
``--iteration`` if smaller.
"""

import argparse
import contextlib
import importlib
import os
import sys
import traceback
import warnings
from collections import OrderedDict

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

SCRIPTS = {"pretrain_gpt.py": "gpt", "pretrain_mamba.py": "hybrid"}
# A stack that passes through one of these ran inside the model (graph territory).
MODEL_PATHS = ("megatron/packed_graphs/", "megatron/core/transformer/", "megatron/core/ssm/",
               "megatron/core/models/", "megatron/core/tensor_parallel/layers",
               "mamba_ssm/", "causal_conv1d/")
SYNC_MESSAGE = "called a synchronizing CUDA operation"
MODULE_CALL = "torch/nn/modules/module.py"  # a frame here: an nn.Module call is running
# Host reads made on purpose once per iteration, outside every graph, by code that lives
# under a model path: (file, function) -> why. A sync under such a frame, with no module call
# in its stack, is reported apart, not as a sync inside the model. (The full-iteration ranks'
# agreement, full_iteration.all_ranks_fit, is a Gloo all-reduce of a CPU tensor: no device
# sync, never reported.)
DELIBERATE_READS = {
    ("megatron/packed_graphs/moe_rerun.py", "read_rows"):
        "MoE overflow rerun (--moe-capacity-overflow rerun): the iteration's overflow rows, "
        "one all-reduce and host read after the schedule, before the optimizer step",
    ("megatron/packed_graphs/health_check.py", "run"):
        "graph health check (--cuda-graph-check-interval): the replayed and eager values, one "
        "all-reduce and host read at the end of a due iteration, after the optimizer step",
}


def call_site(stack: list) -> str:
    """``file:line`` of the innermost frame outside torch and the warnings machinery.

    That is where the sync was asked for (the stack is taken inside the warning's display).
    """
    for frame in reversed(stack):
        if "/torch/" not in frame.filename and not frame.filename.endswith("/warnings.py"):
            return f"{os.path.relpath(frame.filename, REPO) if frame.filename.startswith(REPO) else frame.filename}:{frame.lineno}"
    return f"{stack[-1].filename}:{stack[-1].lineno}" if stack else "?"


def deliberate_read(stack: list) -> str | None:
    """Why the sync is a deliberate per-iteration read (`DELIBERATE_READS`), else None. Only
    when it runs outside every module call: a listed read reached from a forward, or a model
    forward a listed function runs (the health check's passes), syncs inside the model like
    any other."""
    filenames = [frame.filename.replace(os.sep, "/") for frame in stack]
    if any(filename.endswith(MODULE_CALL) for filename in filenames):
        return None
    for frame, filename in zip(stack, filenames):  # outermost first
        for (path, function), why in DELIBERATE_READS.items():
            if frame.name == function and filename.endswith(path):
                return why
    return None


def in_model(stack: list) -> bool:
    """Whether the sync ran inside the model: a frame under a model path, and not a
    deliberate per-iteration read."""
    return (any(any(p in frame.filename for p in MODEL_PATHS) for frame in stack)
            and deliberate_read(stack) is None)


def group_syncs(stacks: list) -> "OrderedDict[str, dict]":
    """Group captured stacks by call site:
    ``{site: {"count", "in_model", "deliberate" (why, or None), "stack"}}``."""
    sites: "OrderedDict[str, dict]" = OrderedDict()
    for stack in stacks:
        site = call_site(stack)
        entry = sites.setdefault(site, {"count": 0, "in_model": in_model(stack),
                                        "deliberate": deliberate_read(stack), "stack": stack})
        entry["count"] += 1
    return sites


def format_report(sites: "OrderedDict[str, dict]", iteration: int) -> str:
    model = [(s, e) for s, e in sites.items() if e["in_model"]]
    deliberate = [(s, e) for s, e in sites.items() if e.get("deliberate")]
    loop = [(s, e) for s, e in sites.items() if not e["in_model"] and not e.get("deliberate")]
    lines = [f"host syncs in iteration {iteration}: {sum(e['count'] for e in sites.values())} "
             f"calls at {len(sites)} sites ({len(model)} inside the model)"]
    for title, group in (("inside the model forward/backward (break graph capture)", model),
                         ("deliberate once-per-iteration reads (outside graphs)", deliberate),
                         ("in the training loop (outside graphs)", loop)):
        lines.append(f"\n== {title}: {len(group)}")
        for site, entry in group:
            lines.append(f"-- {site}  x{entry['count']}")
            if entry.get("deliberate"):
                lines.append(f"   why: {entry['deliberate']}")
            lines += ["   " + line for line in
                      "".join(traceback.format_list(entry["stack"][-12:])).rstrip().splitlines()]
    return "\n".join(lines)


class SyncWatch:
    """The training loop's iteration hook: runs one iteration's step (planning, schedule,
    optimizer step) under sync debug mode 'warn'."""

    def __init__(self, iteration: int):
        self.iteration = iteration

    @contextlib.contextmanager
    def __call__(self, iteration: int):
        import torch

        if iteration != self.iteration:
            yield
            return
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(0)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, train_argv = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("script", choices=sorted(SCRIPTS))
    parser.add_argument("--iteration", type=int, default=5, help="1-based iteration to check")
    opts = parser.parse_args(own)
    if opts.iteration < 1:
        parser.error(f"--iteration is wrong: {opts.iteration}. It must be >= 1.")

    from megatron.packed_training.arguments import parse_args
    from megatron.packed_training.initialize import require_cuda
    from megatron.packed_training.packed_step import PackedForwardStep
    from megatron.packed_training.training import pretrain

    model_kind = SCRIPTS[opts.script]
    args = parse_args(train_argv, model=model_kind)
    require_cuda("find_host_syncs.py")
    args.train_iters = max(args.train_iters, opts.iteration)
    module = importlib.import_module(opts.script.removesuffix(".py"))

    stacks: list = []

    def record(message, category, filename, lineno, file=None, line=None):
        if SYNC_MESSAGE in str(message):
            stacks.append(traceback.extract_stack()[:-1])
        else:
            original(message, category, filename, lineno, file, line)

    original = warnings.showwarning
    warnings.showwarning = record
    warnings.filterwarnings("always", message=f".*{SYNC_MESSAGE}.*")
    step = PackedForwardStep.from_args(args, with_seq_idx=model_kind == "hybrid")
    pretrain(args, module.model_provider, step, iteration_hook=SyncWatch(opts.iteration))
    print(format_report(group_syncs(stacks), opts.iteration))
    return 0


if __name__ == "__main__":
    sys.exit(main())
