"""Fine-tune a Hugging Face model on chat data under CUDA graphs and give it back.

    python examples/hf/sft_from_hugging_face.py --hf Qwen3-0.6B --data chat.jsonl \
        --work runs/qwen3-sft --gpus 8 --train-iters 200

Four steps, each a function a script or test can call on its own:

1. `convert`: the Hugging Face folder -> a Megatron-LM torch_dist release checkpoint, its
   tokenizer and the launch flags of the matching model (tools/convert_hf.py import).
2. `train`: pretrain_gpt.py / pretrain_mamba.py with those flags, ``--pretrained-checkpoint``
   and ``--sft`` on the chat JSONL, local layer graphs at a document capacity per micro-batch
   (``--cuda-graph-impl local --cuda-graph-max-packed-seqs``); saves at the last iteration.
3. `export`: the trained checkpoint -> a Hugging Face folder (tools/convert_hf.py export).
4. `generate`: the exported model in transformers, greedy tokens for the first conversation's
   prompt (``AutoModelForCausalLM.from_pretrained``).

MoE models under whole-layer graphs need drop-and-pad: pass ``--extra
"--moe-expert-capacity-factor 1.5 --moe-pad-expert-input-to-capacity"`` (docs/moe.md).
docs/hf-checkpoints.md walks through the same run by hand.

A failed step ends the script with one line naming the step and its cause (for training, the
error its log ends with, and the log's path) and exit status 1.
"""

import argparse
import json
import os
import re
import shlex
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)


def convert(hf_folder: str, work: str, tensor_parallel_size: int = 1):
    """Step 1; returns `ConversionResult` (``.flags``: the model's launch flags)."""
    from megatron.packed_training.hf import import_hf

    return import_hf(hf_folder, os.path.join(work, "megatron"),
                     tensor_parallel_size=tensor_parallel_size)


def training_command(converted, data: str, work: str, *, gpus: int = 1, train_iters: int = 100,
                     seq_length: int = 4096, global_batch_size: int = 8, lr: float = 1e-5,
                     graphs: str = "local", capacity: int = 64, extra=()) -> list:
    """The torchrun command of step 2 (the converted flags first, training flags after)."""
    training = [
        "--sft", "--data-path", data, "--seq-length", str(seq_length),
        "--micro-batch-size", "1", "--global-batch-size", str(global_batch_size),
        "--train-iters", str(train_iters), "--lr", str(lr), "--min-lr", str(lr / 10),
        "--lr-decay-style", "cosine", "--lr-warmup-iters", str(max(train_iters // 10, 1)),
        "--bf16", "--calculate-per-token-loss", "--eval-iters", "0", "--log-interval", "1",
        "--save", os.path.join(work, "sft"), "--save-interval", str(train_iters),
        "--metrics-file", os.path.join(work, "metrics.jsonl"),
    ]
    if graphs != "none":
        training += ["--cuda-graph-impl", graphs, "--cuda-graph-max-packed-seqs", str(capacity)]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(gpus), os.path.join(REPO, converted.script),
            *converted.flags, *training, *extra]


class StepFailed(RuntimeError):
    """A step failed; the message is one line: the step, its cause and where the log is."""


# A rank's prefix that torchrun may put before each line of a child's output.
_RANK_PREFIX = re.compile(r"^\[(?:default)?(?:rank)?\d+\]:\s?")
# A script's own one-line refusal: "pretrain_gpt.py: error: ...", "pretrain_gpt.py: no CUDA ..."
_SCRIPT_LINE = re.compile(r"^[\w./-]+\.py: \S")
# torchrun's own report after a child failed: never the cause.
_LAUNCHER_LINE = re.compile(r"ChildFailedError|torch[./]distributed[./]elastic|^[=-]+$")
# ... except where a rank died of a signal (no traceback then): torchrun names the signal.
_SIGNAL_LINE = re.compile(r"Signal \d+ \(\w+\) received")


def failure_cause(output: str) -> str:
    """The line of a failed run's output that says why: the last exception a traceback ended
    with, a script's own ``script.py: ...`` message or the signal that killed a rank,
    whichever came last (torchrun's report of the failed child left out); else the last
    line that is not torchrun's. "" for empty output."""
    lines = [_RANK_PREFIX.sub("", line).rstrip() for line in output.splitlines()]
    lines = [line for line in lines if line.strip()]
    causes, in_traceback = [], False
    for line in lines:
        signal = _SIGNAL_LINE.search(line)
        if line.startswith("Traceback (most recent call last)"):
            in_traceback = True
        elif in_traceback and not line[:1].isspace():
            in_traceback = False  # the exception line ends the traceback
            if not _LAUNCHER_LINE.search(line):
                causes.append(line)
        elif signal:
            causes.append(line[signal.start():])
        elif not in_traceback and _SCRIPT_LINE.match(line) and not _LAUNCHER_LINE.search(line):
            causes.append(line)
    plain = [line for line in lines if not line[:1].isspace() and not _LAUNCHER_LINE.search(line)]
    return (causes or plain or [""])[-1].strip()


def train(command: list, log: str) -> None:
    """Step 2: run ``command``; its output goes to ``log``. Raises `StepFailed` naming the
    cause (`failure_cause` of the log) on failure."""
    with open(log, "w") as out:
        proc = subprocess.run(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                              env={"CUDA_DEVICE_MAX_CONNECTIONS": "1", **os.environ})
    if proc.returncode:
        with open(log, errors="replace") as f:
            cause = failure_cause(f.read())
        raise StepFailed(f"training failed (exit {proc.returncode}): "
                         f"{cause or 'no output'} (full log: {log})")


def export(work: str):
    """Step 3: the last checkpoint of ``work/sft`` -> ``work/hf``."""
    from megatron.packed_training.hf import export_hf

    return export_hf(os.path.join(work, "sft"), os.path.join(work, "hf"),
                     hf_config=os.path.join(work, "megatron"))


def first_prompt(data: str) -> list:
    """The first conversation's messages up to its first assistant turn."""
    with open(data) as f:
        messages = json.loads(f.readline())["messages"]
    return messages[:[m["role"] for m in messages].index("assistant")]


def generate(hf_folder: str, messages: list, max_new_tokens: int = 32) -> list:
    """Step 4: greedy token ids of the Hugging Face model in ``hf_folder`` after ``messages``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_folder)
    model = AutoModelForCausalLM.from_pretrained(hf_folder, dtype=torch.bfloat16).eval()
    if torch.cuda.is_available():
        model = model.cuda()
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    prompt = {key: value.to(model.device) for key, value in prompt.items()}
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, prompt["input_ids"].shape[1]:].tolist()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf", required=True, help="Hugging Face model folder")
    parser.add_argument("--data", required=True, help="chat JSONL ({\"messages\": [...]})")
    parser.add_argument("--work", required=True, help="folder for every output")
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--train-iters", type=int, default=100)
    parser.add_argument("--seq-length", type=int, default=4096)
    parser.add_argument("--global-batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--cuda-graph-impl", default="local",
                        choices=["none", "local", "transformer_engine", "full_iteration"])
    parser.add_argument("--cuda-graph-max-packed-seqs", type=int, default=64)
    parser.add_argument("--extra", default="", help="more training flags, one string")
    args = parser.parse_args(argv)
    try:
        return run(args)
    except StepFailed as failed:
        print(f"sft_from_hugging_face.py: {failed}", file=sys.stderr)
        return 1


def run(args) -> int:
    """The four steps of `main`; a failed step raises `StepFailed` (one line)."""
    try:
        from megatron.packed_training.hf import ConversionError
    except ImportError as error:
        raise StepFailed(f"conversion failed: {error}; install the converter's dependencies: "
                         "pip install -e \".[hf]\"") from None

    os.makedirs(args.work, exist_ok=True)
    try:
        converted = convert(args.hf, args.work, args.tensor_parallel_size)
    except ConversionError as error:
        raise StepFailed(f"conversion failed: {error}") from None
    extra = shlex.split(args.extra)
    if args.tensor_parallel_size > 1:
        extra = ["--tensor-model-parallel-size", str(args.tensor_parallel_size), *extra]
    command = training_command(converted, args.data, args.work, gpus=args.gpus,
                               train_iters=args.train_iters, seq_length=args.seq_length,
                               global_batch_size=args.global_batch_size, lr=args.lr,
                               graphs=args.cuda_graph_impl,
                               capacity=args.cuda_graph_max_packed_seqs, extra=extra)
    print(" ".join(shlex.quote(word) for word in command), flush=True)
    train(command, os.path.join(args.work, "train.log"))
    try:
        exported = export(args.work)
    except ConversionError as error:
        raise StepFailed(f"export failed: {error}") from None
    print(f"exported {exported.destination}")
    try:
        tokens = generate(exported.destination, first_prompt(args.data))
    except (ImportError, OSError, ValueError) as error:
        reason = " ".join(str(error).split())  # one line
        raise StepFailed(f"generation failed: {type(error).__name__}: {reason}") from None
    print(f"greedy tokens after the first prompt: {tokens}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
