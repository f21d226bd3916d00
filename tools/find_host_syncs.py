"""Find every GPU->CPU synchronisation of one training iteration, with its Python stack.

Runs the real training (the script's own entry point: Megatron-LM's ``pretrain()`` with the
fork's graph runtime; one process, one GPU) up to ``--iteration`` and runs that iteration
under ``torch.cuda.set_sync_debug_mode("warn")``. Each synchronising call is reported once
per call site, with a count and the Python stack, split into syncs inside the model's
forward/backward (these break CUDA graph capture), deliberate once-per-iteration reads by
model-side code outside any graph (``DELIBERATE_READS``, each with its reason: e.g. the MoE
overflow rerun's read) and syncs in the training loop around it (loss, grad norm, logging:
expected, outside any graph).

    python tools/find_host_syncs.py pretrain_mamba.py --iteration 5 -- \\
        --sft --mock-data --hybrid-layer-pattern "M*-M*-" --hidden-size 256 \\
        --num-attention-heads 8 --seq-length 2048 --max-position-embeddings 2048 \\
        --micro-batch-size 1 --train-iters 5 --lr 1e-4 --bf16 --eval-iters 0 \\
        --cuda-graph-impl local --cuda-graph-max-packed-seqs 32 --cuda-graph-warmup-steps 2

The training arguments after ``--`` are the script's own (Megatron-LM's command line);
``--train-iters`` is raised to ``--iteration`` if smaller.

The watched iteration is Megatron-LM's ``train_step`` (the graph runtime's seam with its
planning and megatron-core's schedule, the optimizer step, the step's statistics) through the
``training_log`` after it, so the loop's own reads are counted with the runtime's. This
process wraps the two functions before training starts (`watch_training_iteration`);
evaluation and checkpoints, which follow the log, are not counted. Use a ``--log-interval``
above the watched iteration to leave out the log line's reads.
"""

import functools
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
MODEL_PATHS = ("megatron/packed_graphs/", "megatron/packed_model/", "megatron/core/transformer/",
               "megatron/core/ssm/", "megatron/core/models/", "megatron/core/tensor_parallel/layers",
               "mamba_ssm/", "causal_conv1d/")
# The seam where Megatron-LM's loop calls the graph runtime (every schedule call and, wrapped,
# the optimizer step pass through it) and the loop's patched functions (the shim's
# training_loop.py: the training log, the update and rerun flags). They are the loop's code, not
# the model's: a frame here alone does not put a sync inside the model.
LOOP_SEAM = ("megatron/packed_graphs/schedule.py", "megatron/packed_upstream/training_loop.py")
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
    """Whether the sync ran inside the model: a frame under a model path (the loop's seam,
    `LOOP_SEAM`, aside), and not a deliberate per-iteration read."""
    return (any(any(p in frame.filename for p in MODEL_PATHS)
                and not frame.filename.replace(os.sep, "/").endswith(LOOP_SEAM)
                for frame in stack)
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
    """Runs one training iteration's step (planning, schedule, optimizer step) under sync debug
    mode 'warn': ``with watch(iteration):`` brackets the code of ``iteration`` (1-based); other
    iterations run as they are."""

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


def current_training_iteration() -> int:
    """The 1-based iteration Megatron-LM's loop is running (its ``args.curr_iteration`` counts
    the iterations done, a loaded checkpoint's included)."""
    from megatron.training import get_args

    return get_args().curr_iteration + 1


def watch_training_iteration(watch: SyncWatch, current_iteration=current_training_iteration):
    """Put ``watch`` around one training iteration of Megatron-LM's loop: from the start of its
    ``train_step`` (the graph runtime's seam and megatron-core's schedule, the optimizer step,
    the step's statistics) to the end of the ``training_log`` that follows it (``train()``
    reads the loss scale in between). Evaluation and checkpoints come after the log and are
    not watched. ``current_iteration()`` names the iteration a ``train_step`` runs. Wraps the
    loop module's two functions; returns a function that restores them."""
    import megatron.training.training as loop

    train_step, training_log = loop.train_step, loop.training_log
    state = {"window": None}

    def end_window(*exc_info):
        window, state["window"] = state["window"], None
        if window is not None:
            window.__exit__(*(exc_info or (None, None, None)))

    @functools.wraps(train_step)  # a wrapper above reads upstream's signature through it
    def watched_step(*args, **kwargs):
        end_window()  # a window a failed step left open
        iteration = current_iteration()
        if iteration == watch.iteration:
            state["window"] = watch(iteration)
            state["window"].__enter__()
        try:
            return train_step(*args, **kwargs)
        except BaseException:
            end_window(*sys.exc_info())
            raise

    @functools.wraps(training_log)
    def watched_log(*args, **kwargs):
        try:
            result = training_log(*args, **kwargs)
        except BaseException:
            end_window(*sys.exc_info())
            raise
        end_window()
        return result

    loop.train_step, loop.training_log = watched_step, watched_log

    def restore():
        loop.train_step, loop.training_log = train_step, training_log
        end_window()
    return restore


def with_train_iters_at_least(train_argv: list, iteration: int) -> list:
    """``train_argv`` with ``--train-iters`` raised to ``iteration`` where it is smaller (a
    later ``--train-iters`` wins in the parser); unchanged without it (``--train-samples``)."""
    given = None
    for at, word in enumerate(train_argv):
        if word == "--train-iters" and at + 1 < len(train_argv):
            given = train_argv[at + 1]
        elif word.startswith("--train-iters="):
            given = word.partition("=")[2]
    if given is None or not given.isdigit() or int(given) >= iteration:
        return list(train_argv)
    return [*train_argv, "--train-iters", str(iteration)]


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

    # One process: the torchrun environment of a world of one, unless launched under torchrun.
    for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29541"), ("RANK", "0"),
                        ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(name, value)

    train_argv = with_train_iters_at_least(train_argv, opts.iteration)
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
    restore = watch_training_iteration(SyncWatch(opts.iteration))
    try:
        module.main(train_argv)  # the script's own entry point (run_pretraining)
    except SystemExit as done:  # Megatron-LM's exit flags end training through sys.exit
        if done.code not in (None, 0):
            raise
    finally:
        restore()
        warnings.showwarning = original
    print(format_report(group_syncs(stacks), opts.iteration))
    return 0


if __name__ == "__main__":
    sys.exit(main())
