"""Export rate of `PackedPolicy.export_weights`: GB/s of Hugging Face tensors handed to an
inference engine (docs/rl.md, "Weights for an inference engine"; docs/benchmarks.md).

    python tools/export_benchmark.py --num-layers 4 --repeats 5
    torchrun --nproc-per-node 2 tools/export_benchmark.py -- --tensor-model-parallel-size 2

Builds a bf16 policy with Llama 3 8B's layer shapes and ``--num-layers`` layers (hidden 4096,
FFN 14336, 32 heads / 8 KV heads, vocabulary 128256, untied output layer; random weights, no
checkpoint) from a Llama ``config.json`` written for it: its launch flags are the converter's
(the family table, as `tools/convert_hf.py import` writes them), so the export maps the model
it builds. Flags after ``--`` are added to the policy's (a parallel layout under torchrun).
The optimizer is SGD: it plays no part in an export, and keeps no state.

Each row exports ``--repeats`` times after ``--warmup`` exports:

* ``pairs, yield only``: iterate ``export_weights()`` and drop the pairs (what the export
  itself costs; a tensor that is a view of a parameter is not read);
* ``pairs, copied``: each tensor copied into an engine-side buffer of its name, allocated at
  the first export (an engine's ``load_weights`` copies into its parameters the same way);
* ``buckets, yield only`` / ``buckets, copied``: the same with ``bucket_bytes``
  (``--bucket-mib``);
* ``copy only (reference)``: the same copies from tensors put together beforehand: the
  device's copy rate, the ceiling of the copied rows.

A repeat is timed from before the ``export_weights`` call (its layout exchange, shown apart as
``setup ms``) to after the last tensor or copy: CUDA events on the current stream, the device
synchronized before and after. Bytes are the exported tensors' (each once); GB/s is bytes /
median seconds / 1e9. Every rank exports (each yields every tensor); rank 0 prints one
Markdown table headed by the machine, the date, the software and the command, and writes the
rows to ``--json``.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Callable, Dict, Iterable, List, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = "tools/export_benchmark.py"

# Llama 3 8B's config.json less its layer count (plain RoPE: no scaling to map).
LLAMA3_8B = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
             "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
             "vocab_size": 128256, "max_position_embeddings": 8192, "rope_theta": 500000.0,
             "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False,
             "torch_dtype": "bfloat16"}
# The policy's training flags besides the model's (nothing is trained).
TRAINING = ["--sft", "--mock-data", "--bf16", "--seq-length", "4096", "--micro-batch-size", "1",
            "--train-iters", "1", "--lr", "1e-4", "--eval-iters", "0", "--seed", "1234",
            "--optimizer", "sgd", "--make-vocab-size-divisible-by", "128"]
ROWS = ("pairs, yield only", "pairs, copied", "buckets, yield only", "buckets, copied",
        "copy only (reference)")


@dataclass
class Row:
    """One row of the table: ``seconds`` and ``setup_ms`` are medians over the repeats."""

    row: str
    tensors: int
    nbytes: int
    setup_ms: float
    seconds: float

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


def llama_config(num_layers: int) -> dict:
    return {**LLAMA3_8B, "num_hidden_layers": num_layers}


def model_flags(config: dict) -> List[str]:
    """The launch flags of ``config``'s model, from the converter's family table."""
    from megatron.packed_training.hf.config import HFConfig
    from megatron.packed_training.hf.convert import flag_tokens
    from megatron.packed_training.hf.families import describe

    return flag_tokens(describe(HFConfig(config)).flags) + [f"--vocab-size={config['vocab_size']}"]


def policy_flags(config: dict, world_size: int, extra: Iterable[str] = ()) -> List[str]:
    return [*TRAINING, "--global-batch-size", str(world_size), *model_flags(config), *extra]


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-layers", type=int, default=4,
                        help="transformer layers of the 8B-shaped model (32: the whole depth)")
    parser.add_argument("--repeats", type=int, default=5, help="timed exports per row")
    parser.add_argument("--warmup", type=int, default=1, help="exports before the timed ones")
    parser.add_argument("--bucket-mib", type=int, default=1024,
                        help="bucket_bytes of the bucket rows, in MiB")
    parser.add_argument("--json", help="rank 0 writes the rows here")
    parser.add_argument("flags", nargs=argparse.REMAINDER,
                        help="-- then more training flags (Megatron-LM's command line)")
    options = parser.parse_args(argv)
    flags = options.flags[1:] if options.flags[:1] == ["--"] else options.flags
    for name in ("num_layers", "repeats", "bucket_mib"):
        if getattr(options, name) < 1:
            parser.error(f"--{name.replace('_', '-')} is wrong: {getattr(options, name)}. Give "
                         f"at least 1.")
    if options.warmup < 0:
        parser.error(f"--warmup is wrong: {options.warmup}. Give 0 or more.")
    return options, flags


def format_table(rows: List[Row], header: str) -> str:
    """The Markdown table of ``rows`` under ``header`` (`benchmark.run_header`)."""
    lines = [header, "| export | tensors | GB | setup ms | total ms | GB/s |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for row in rows:
        lines.append(f"| {row.row} | {row.tensors} | {row.nbytes / 1e9:.2f} | "
                     f"{row.setup_ms:.1f} | {1000 * row.seconds:.1f} | {row.gb_per_s:.1f} |")
    return "\n".join(lines)


class EngineBuffers:
    """An engine's parameters, as far as a refit sees them: one buffer per name, allocated at
    its first tensor (`measure_all` fills them before any timing), copied into after."""

    def __init__(self):
        self.buffers: Dict[str, object] = {}

    def load(self, name: str, tensor) -> None:
        import torch

        buffer = self.buffers.get(name)
        if buffer is None:
            buffer = torch.empty_like(tensor, memory_format=torch.contiguous_format)
            self.buffers[name] = buffer
        buffer.copy_(tensor, non_blocking=True)


def consume(exported, bucketed: bool, engine: Optional[EngineBuffers]) -> tuple:
    """Iterate an export (pairs, or buckets of them): (tensors, bytes); each tensor copied into
    ``engine`` when given."""
    count = size = 0
    for item in exported:
        for name, tensor in (item if bucketed else (item,)):
            count += 1
            size += tensor.numel() * tensor.element_size()
            if engine is not None:
                engine.load(name, tensor)
    return count, size


def timed(run: Callable[[], tuple]) -> tuple:
    """``run()`` on the device, synchronized before and after: (its result, seconds by CUDA
    events on the current stream, setup seconds it reports)."""
    import torch

    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    result, setup = run()
    end.record()
    torch.cuda.synchronize()
    return result, start.elapsed_time(end) / 1000, setup


def measure(label: str, run: Callable[[], tuple], repeats: int, warmup: int) -> Row:
    for _ in range(warmup):
        timed(run)
    results = [timed(run) for _ in range(repeats)]
    (count, size), _, _ = results[-1]
    return Row(label, count, size, 1000 * statistics.median(r[2] for r in results),
               statistics.median(r[1] for r in results))


def export_run(policy, bucket_bytes: Optional[int], engine: Optional[EngineBuffers]):
    """One export, consumed: ((tensors, bytes), seconds of the export_weights call)."""
    def run():
        begin = time.perf_counter()
        exported = policy.export_weights(bucket_bytes=bucket_bytes)
        setup = time.perf_counter() - begin
        return consume(exported, bucket_bytes is not None, engine), setup
    return run


def copy_run(pairs: list, engine: EngineBuffers):
    """The copies alone, from tensors put together beforehand."""
    def run():
        return consume(pairs, False, engine), 0.0
    return run


def measure_all(policy, options) -> List[Row]:
    bucket_bytes = options.bucket_mib << 20
    engine = EngineBuffers()
    consume(policy.export_weights(), False, engine)  # the engine's buffers, once
    rows = []
    for label, buckets, copied in (("pairs, yield only", None, False),
                                   ("pairs, copied", None, True),
                                   ("buckets, yield only", bucket_bytes, False),
                                   ("buckets, copied", bucket_bytes, True)):
        rows.append(measure(label, export_run(policy, buckets, engine if copied else None),
                            options.repeats, options.warmup))
    together = [(name, tensor.clone()) for name, tensor in policy.export_weights()]
    rows.append(measure(ROWS[-1], copy_run(together, engine), options.repeats, options.warmup))
    return rows


def build_policy(num_layers: int, extra: List[str]):
    """The 8B-shaped policy and its config.json folder (module doc)."""
    from megatron.packed_training.arguments import parse_args
    from megatron.packed_training.rl import PackedPolicy, PolicyConfig

    folder = tempfile.mkdtemp(prefix="export_benchmark_")
    config = llama_config(num_layers)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    args = parse_args(policy_flags(config, world_size, extra), "gpt", raise_on_error=True)
    return PackedPolicy.build(PolicyConfig(args, model="gpt", hf_config=folder))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    options, flags = parse(argv)
    import torch

    sys.path.insert(0, os.path.join(REPO, "tools"))
    from benchmark import cuda_problem, run_header

    problem = cuda_problem(1)
    if problem:
        print(f"{TOOL}: {problem}", file=sys.stderr)
        return 1
    for name, value in (("WORLD_SIZE", "1"), ("RANK", "0"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(name, value)  # a plain `python` run is a world of one
    policy = build_policy(options.num_layers, flags)
    rows = measure_all(policy, options)
    if torch.distributed.get_rank() == 0:
        print(format_table(rows, run_header(argv, tool=TOOL)), flush=True)
        if options.json:
            with open(options.json, "w") as f:
                json.dump([{**asdict(row), "gb_per_s": row.gb_per_s} for row in rows], f,
                          indent=1)
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
