"""The data pipeline at scale: token-cache build, warm start and a reading rank's memory.

Generates a synthetic corpus (skipped when it is there already), then measures, each in a
fresh Python process so that time and resident memory are that process's own:

* **cache build**: the first rank's data check (`preflight.check_data`) on a cold token cache
  (``DIR/cache`` deleted first): its wall time and documents/s, and the builder's peak RSS;
* **warm start**: from the start of a process to the first micro-batch dict of
  `builder.build_data_iterator` with the cache built (``pack_data`` + ``build_datasets`` +
  one ``next()``: what every rank does at launch), as a non-first rank (``RANK=1``);
* **reading rank's memory**: a non-first rank (``RANK=1``, it never builds) that opens the
  data and reads ``--micro-batches`` micro-batches of one row: RSS after the imports, after
  opening and packing, after reading, and its peak (``ru_maxrss``);
* **packing**: ``pack_data`` with ``--packing-algorithm best-fit-decreasing`` and
  ``in-order``: rows and the padding share of the row positions (`builder.describe_packing`);
* **balance**: the start-up line `builder.describe_balance` that rank 0 of a run with
  several data-parallel ranks computes (``--balance RANKSxBATCH ...``), and the time one
  global batch's ``--sequence-packing-scheduler dp_balanced`` order takes.

    python tools/data_benchmark.py --documents 1000000 --seq-length 4096 --out /tmp/databench/1m
    python tools/data_benchmark.py --documents 100000 --chat --out /tmp/databench/chat-100k

The corpus: ``--documents`` documents of log-normal length (``--median-tokens``,
``--sigma``), token ids uniform in ``[1, --vocab-size)``. Pre-tokenized JSONL
(``{"input_ids": [...], "loss_mask": [...]}``, the first 10-50 % of each document a prompt,
masked) or, with ``--chat``, chat JSONL (``{"messages": [...]}``: one to three user /
assistant exchanges of words drawn from this repository's docs, about as many tokens as the
pre-tokenized lengths), tokenized by a small byte-level BPE trained here on the repo's docs
(as tests/unit/test_chat_data.py's fixture does; no download) with the ChatML template.
The runs read the data as an SFT run does (``--sft``: loss masks read from the cache).

Prints a Markdown table headed by the machine, the date, the software and the command; ``--json
FILE`` writes the numbers too. A benchmark, not a test: it checks nothing.
"""

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import re
import resource
import shlex
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

CORPUS_FILE = "data.jsonl"
DONE_FILE = "corpus.json"  # what was generated; written last
TOKENIZER_FOLDER = "tokenizer"
SPECIAL_TOKENS = ["<pad>", "<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CHUNK = 20_000  # documents generated per numpy draw


# ---------------------------------------------------------------------------------------------
# The corpus
# ---------------------------------------------------------------------------------------------

def document_lengths(rng, count: int, median: float, sigma: float):
    """int64 ``[count]``: log-normal token counts, at least 2."""
    import numpy as np

    lengths = np.rint(rng.lognormal(np.log(median), sigma, count)).astype(np.int64)
    return np.maximum(lengths, 2)


def write_pretokenized(path: str, documents: int, median: float, sigma: float,
                       vocab_size: int, seed: int) -> dict:
    """Pre-tokenized JSONL at ``path``; returns ``{"documents", "tokens"}``. Ids are turned
    into text through a table of their decimal strings, one join per document."""
    import numpy as np

    rng = np.random.default_rng(seed)
    names = [str(i) for i in range(vocab_size)]
    tokens = 0
    with open(path, "w", buffering=1 << 24) as stream:
        for first in range(0, documents, CHUNK):
            count = min(CHUNK, documents - first)
            lengths = document_lengths(rng, count, median, sigma)
            ids = rng.integers(1, vocab_size, int(lengths.sum())).tolist()
            prompts = (lengths * rng.uniform(0.1, 0.5, count)).astype(np.int64)
            text = list(map(names.__getitem__, ids))
            lines, at = [], 0
            for n, prompt in zip(lengths.tolist(), prompts.tolist()):
                lines.append('{"input_ids":[' + ",".join(text[at:at + n]) + '],"loss_mask":['
                             + "0," * prompt + "1," * (n - prompt - 1) + '1]}\n')
                at += n
            stream.write("".join(lines))
            tokens += int(lengths.sum())
    return {"documents": documents, "tokens": tokens}


def doc_words() -> list:
    """Words of this repository's README and docs, with their frequencies (a list with
    repeats)."""
    words = []
    for name in ["README.md"] + [os.path.join("docs", f)
                                 for f in sorted(os.listdir(os.path.join(REPO, "docs")))]:
        if name.endswith(".md"):
            with open(os.path.join(REPO, name), encoding="utf-8") as stream:
                words += re.findall(r"[A-Za-z]+[.,]?", stream.read())
    return words


def make_tokenizer(folder: str, vocab_size: int) -> str:
    """A byte-level BPE of up to ``vocab_size`` tokens trained on the repo's README and docs,
    saved as a tokenizer folder with the ChatML template (tests/unit/test_chat_data.py's
    fixture, larger)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    files = [os.path.join(REPO, "README.md")] + [
        os.path.join(REPO, "docs", f) for f in sorted(os.listdir(os.path.join(REPO, "docs")))
        if f.endswith(".md")]
    tokenizer.train(files, trainer)
    os.makedirs(folder, exist_ok=True)
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
              "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>",
              "chat_template": CHATML}
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as stream:
        json.dump(config, stream)
    return folder


def tokens_per_word(tokenizer_folder: str, words: list, rng) -> float:
    """Tokens per word of ``words`` (a 50 000-word sample) under the tokenizer."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(os.path.join(tokenizer_folder, "tokenizer.json"))
    sample = [words[i] for i in rng.integers(0, len(words), 50_000).tolist()]
    return len(tokenizer.encode(" ".join(sample)).ids) / len(sample)


def write_chat(path: str, tokenizer_folder: str, documents: int, median: float, sigma: float,
               seed: int) -> dict:
    """Chat JSONL at ``path``: per conversation one to three user / assistant exchanges whose
    words (drawn from the repo's docs) come to about a log-normal number of tokens (the
    user turns about a third of it). Returns ``{"documents", "words", "tokens_per_word"}``."""
    import numpy as np

    rng = np.random.default_rng(seed)
    words = doc_words()
    ratio = tokens_per_word(tokenizer_folder, words, rng)
    total_words = 0
    with open(path, "w", buffering=1 << 24) as stream:
        for first in range(0, documents, CHUNK):
            count = min(CHUNK, documents - first)
            # ~10 template tokens per exchange; the rest is words.
            exchanges = rng.integers(1, 4, count)
            budget = document_lengths(rng, count, median, sigma) - 10 * exchanges
            counts = np.maximum(np.rint(budget / ratio), 2 * exchanges).astype(np.int64)
            drawn = [words[i] for i in rng.integers(0, len(words), int(counts.sum())).tolist()]
            user_share = rng.uniform(0.2, 0.45, count)
            lines, at = [], 0
            for n, k, share in zip(counts.tolist(), exchanges.tolist(), user_share.tolist()):
                messages, per = [], n // k
                for e in range(k):
                    size = per if e < k - 1 else n - per * (k - 1)
                    user = max(1, int(size * share))
                    turn = drawn[at:at + size]
                    at += size
                    messages.append({"role": "user", "content": " ".join(turn[:user])})
                    messages.append({"role": "assistant", "content": " ".join(turn[user:])})
                lines.append(json.dumps({"messages": messages}) + "\n")
            stream.write("".join(lines))
            total_words += int(counts.sum())
    return {"documents": documents, "words": total_words, "tokens_per_word": round(ratio, 3)}


def ensure_corpus(args) -> dict:
    """Generate the corpus into ``--out`` unless the same one is there; its description."""
    wanted = {"documents": args.documents, "chat": args.chat, "median": args.median_tokens,
              "sigma": args.sigma, "seed": args.seed,
              "vocab_size": None if args.chat else args.vocab_size,
              "tokenizer_vocab": args.tokenizer_vocab if args.chat else None}
    done = os.path.join(args.out, DONE_FILE)
    if os.path.isfile(done):
        with open(done) as stream:
            found = json.load(stream)
        if {k: found.get(k) for k in wanted} == wanted:
            found["generated_now"] = False
            return found
    os.makedirs(args.out, exist_ok=True)
    for stale in (done, os.path.join(args.out, CORPUS_FILE)):
        if os.path.exists(stale):
            os.remove(stale)
    shutil.rmtree(os.path.join(args.out, "cache"), ignore_errors=True)
    started = time.time()
    path = os.path.join(args.out, CORPUS_FILE)
    if args.chat:
        folder = make_tokenizer(os.path.join(args.out, TOKENIZER_FOLDER), args.tokenizer_vocab)
        made = write_chat(path, folder, args.documents, args.median_tokens, args.sigma,
                          args.seed)
    else:
        made = write_pretokenized(path, args.documents, args.median_tokens, args.sigma,
                                  args.vocab_size, args.seed)
    described = wanted | made | {"bytes": os.path.getsize(path),
                                 "seconds": round(time.time() - started, 1)}
    with open(done, "w") as stream:
        json.dump(described, stream, indent=1)
    described["generated_now"] = True
    return described


# ---------------------------------------------------------------------------------------------
# The measured processes
# ---------------------------------------------------------------------------------------------

def memory() -> dict:
    """This process's memory now, MiB: VmRSS, RssAnon, RssFile (mapped files' pages), VmHWM
    (the peak so far, = ru_maxrss)."""
    values = {}
    with open("/proc/self/status") as stream:
        for line in stream:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                values[key] = round(int(rest.split()[0]) / 1024, 1)
    return values


def run_args(config: dict):
    """The Namespace the data code reads (tests/unit/test_preflight.py's `args_for`)."""
    from argparse import Namespace

    values = dict(mock_data=False, data_path=config["data_path"], valid_data_path=None,
                  split=None, vocab_size=config["vocab_size"], tokenizer_type=None,
                  tokenizer_model=None, sft=config["sft"], seq_length=config["seq_length"],
                  long_document_policy="split", max_truncated_token_fraction=None,
                  dynamic_cp_sizes=None, context_parallel_size=1,
                  train_iters=config["micro_batches"], global_batch_size=1, micro_batch_size=1,
                  eval_interval=1000, eval_iters=0, seed=1234,
                  packing_algorithm=config["algorithm"], packing_window=None,
                  data_cache_path=None)
    if config.get("tokenizer"):
        values |= dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=config["tokenizer"])
    return Namespace(**values)


def worker(kind: str, config: dict) -> dict:
    """One measurement, in this (fresh) process; the numbers as a dict."""
    started, cpu_started = time.time(), time.process_time()
    out = {"memory_start": memory()}
    from megatron.packed_training.datasets.builder import (
        build_data_iterator,
        build_datasets,
        describe_balance,
        describe_packing,
    )
    from megatron.packed_training.datasets.preflight import check_data
    from megatron.packed_training.datasets.sources import pack_data

    args = run_args(config)
    out["import_s"] = time.time() - started
    out["import_cpu_s"] = time.process_time() - cpu_started
    out["memory_imported"] = memory()
    if kind == "build":
        began, cpu = time.time(), time.process_time()
        check = check_data(args)
        out["check_s"], out["check_cpu_s"] = time.time() - began, time.process_time() - cpu
        (cache,) = check.rows.caches
        out |= {"cache_s": cache.seconds, "cache_state": cache.built,
                "documents": cache.documents, "tokens": cache.tokens, "line": check.line,
                "cache_line": cache.describe()}
    elif kind == "pack":
        if config.get("tokenizer"):  # loaded once per process (lru_cache): timed apart
            from megatron.packed_training.tokenizer import tokenizer_from_args

            began = time.time()
            tokenizer_from_args(args)
            out["tokenizer_s"] = time.time() - began
        began, cpu = time.time(), time.process_time()
        packed = pack_data(args, with_valid=False)
        out["pack_s"], out["pack_cpu_s"] = time.time() - began, time.process_time() - cpu
        stats = packed["train"].stats
        slots = stats.tokens + stats.padding_tokens
        out |= {"rows": stats.rows, "documents": stats.documents, "tokens": stats.tokens,
                "padding_share": stats.padding_tokens / slots, "line": describe_packing(stats),
                "cache_state": packed.caches[0].built}
    elif kind == "balance":
        from megatron.packed_training.datasets.balance import DataParallelBalanced

        packed = pack_data(args, with_valid=False)
        out["balance"] = []
        for size, batch in config["balance"]:
            # Megatron-LM's run of `size` data-parallel ranks: the start-up line rank 0
            # computes (`describe_balance`, over the first 100 global batches), and one
            # global batch's dp_balanced order (what `--sequence-packing-scheduler dp_balanced`
            # adds to each step).
            args.global_batch_size, args.train_iters = batch, 1000
            args.sequence_packing_scheduler = "default"
            train, _, _ = build_datasets(args, packed)
            began = time.time()
            line = describe_balance(train, args, size)
            spent = time.time() - began
            balanced = DataParallelBalanced(train, batch, size, 1)
            began = time.time()
            for window in range(20):
                balanced[window * batch]  # orders that window, reads one row
            per_step = (time.time() - began) / 20
            out["balance"].append({"size": size, "batch": batch, "describe_s": spent,
                                   "step_s": per_step, "line": line})
    elif kind in ("warm", "read"):
        began, cpu = time.time(), time.process_time()
        packed = pack_data(args, with_valid=False)
        out["pack_s"], out["pack_cpu_s"] = time.time() - began, time.process_time() - cpu
        out["memory_packed"] = memory()
        began = time.time()
        train, _, stats = build_datasets(args, packed)
        out["datasets_s"] = time.time() - began
        out["cache_state"] = packed.caches[0].built
        out["line"] = describe_packing(stats)
        began = time.time()
        iterator = build_data_iterator(train, 0, 1, 0, 1)
        batch = next(iterator)
        out["first_batch_unix"] = time.time()
        out["first_batch_s"] = out["first_batch_unix"] - began
        out["memory_first_batch"] = memory()
        out["batch_shape"] = list(batch["tokens"].shape)
        if kind == "read":
            began, cpu, real = time.time(), time.process_time(), 0
            for _ in range(config["micro_batches"] - 1):
                batch = next(iterator)
                real += int((~batch["padding_mask"]).sum())
            out["read_s"], out["read_cpu_s"] = time.time() - began, time.process_time() - cpu
            out["read_real_tokens"] = real
            out["memory_read"] = memory()
    out["cpu_s"] = time.process_time() - cpu_started
    out["maxrss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    return out


def measure(kind: str, config: dict, rank: str) -> dict:
    """`worker` ``kind`` in a fresh Python process with ``RANK=rank``; adds ``process_s``
    (spawn to exit) and, for runs that reach a micro-batch, ``to_first_batch_s`` (spawn to
    the first micro-batch dict)."""
    return measure_together(kind, config, [rank])[0]


def measure_together(kind: str, config: dict, ranks: list) -> list:
    """`measure` for several ranks started at once, as torchrun starts a node's ranks: each
    process's numbers (``process_cpu_s`` is theirs together)."""
    before, load = resource.getrusage(resource.RUSAGE_CHILDREN), os.getloadavg()[0]
    spawned, processes = time.time(), []
    for rank in ranks:
        env = dict(os.environ, RANK=rank, WORLD_SIZE=str(max(2, len(ranks) + 1)),
                   PYTHONWARNINGS="ignore")
        command = [sys.executable, os.path.abspath(__file__), "--worker", kind,
                   "--worker-config", json.dumps(config)]
        processes.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
    outs = []
    for process in processes:
        stdout, stderr = process.communicate()
        ended = time.time()
        results = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
        if process.returncode or not results:
            raise RuntimeError(f"the {kind} process failed (exit status {process.returncode}):"
                               f"\n{stderr[-4000:]}")
        out = json.loads(results[-1].removeprefix("RESULT "))
        out["process_s"] = ended - spawned
        out["load_at_spawn"] = load
        if "first_batch_unix" in out:
            out["to_first_batch_s"] = out["first_batch_unix"] - spawned
        outs.append(out)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    for out in outs:
        out["process_cpu_s"] = (after.ru_utime + after.ru_stime) - (before.ru_utime
                                                                     + before.ru_stime)
    return outs


# ---------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------

def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as stream:
            for line in stream:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def header(argv: list, load_at_start: tuple) -> str:
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    try:
        with open("/proc/meminfo") as stream:
            ram = f", {int(stream.readline().split()[1]) / 2**20:.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        ram = ""
    software = [f"Python {platform.python_version()}"]
    for name in ("numpy", "torch", "megatron-core", "transformers", "tokenizers"):
        try:
            software.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    loads = [", ".join(f"{value:.1f}" for value in load)
             for load in (load_at_start, os.getloadavg())]
    try:
        head = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
        changed = subprocess.run(["git", "-C", REPO, "status", "--porcelain",
                                  "--untracked-files=no"],
                                 capture_output=True, text=True, check=True).stdout.splitlines()
        code = f"Code: commit {head}" + (f" with {len(changed)} files changed" if changed else "")
    except (OSError, subprocess.SubprocessError):
        code = "Code: not a git checkout"
    software.append(code.removeprefix("Code: "))
    return (f"Machine: {os.cpu_count()} CPUs ({cpu_model()}){ram}; load average (1, 5, 15 min) "
            f"{loads[0]} at the start, {loads[1]} at the end. Date: {date}.\n"
            f"Software: {', '.join(software)}.\n"
            f"Command: {shlex.join(['python', 'tools/data_benchmark.py', *argv])}\n")


def mib(value: float) -> str:
    return f"{value:,.0f} MiB"


def seconds(wall: float, cpu: float | None = None) -> str:
    """Wall time, and the process's CPU time beside it when given (on a busy machine the
    CPU time is the steadier number)."""
    return f"{wall:.1f} s" + ("" if cpu is None else f" (CPU {cpu:.1f} s)")


def table(corpus: dict, results: dict, args) -> str:
    kind = "chat JSONL" if args.chat else "pre-tokenized JSONL"
    built = results.get("build")
    tokens = built["tokens"] if built else corpus.get("tokens")
    what = (f"{corpus['documents']:,} documents ({kind}"
            + (f", {tokens:,} tokens" if tokens else "")
            + f", {corpus['bytes'] / 2**30:.2f} GiB), seq {args.seq_length}, "
            + ("pretraining (loss masks not read)" if args.pretraining
               else "SFT (loss masks read)"))
    rows = [f"Corpus: {what}; generated in {corpus['seconds']:.0f} s"
            + (" (now)" if corpus.get("generated_now") else " (earlier, reused)")
            + (f"; {corpus['tokens_per_word']} tokens per word" if args.chat else "") + ".", "",
            "| Measure | Value | Detail |", "|---|---|---|"]
    if built:
        rows.append(
            f"| Cache build: first `check_data`, cold cache (`RANK=0`) | "
            f"{seconds(built['check_s'], built['check_cpu_s'])}; "
            f"{built['documents'] / built['cache_s']:,.0f} documents/s | token cache "
            f"{built['cache_s']:.1f} s "
            f"({built['tokens'] / built['cache_s'] / 1e6:.2f} M tokens/s), "
            f"the rest of the check (tokenizer load, opening, packing) "
            f"{built['check_s'] - built['cache_s']:.1f} s; whole process "
            f"{seconds(built['process_s'], built['process_cpu_s'])}, of it imports "
            f"{built['import_s']:.1f} s; peak RSS {mib(built['maxrss_mib'])}; cache on disk "
            f"{results['cache_bytes'] / 2**30:.2f} GiB |")
    warm = results.get("warm")
    if warm:
        rest = warm["to_first_batch_s"] - warm["import_s"] - warm["pack_s"] - warm[
            "datasets_s"] - warm["first_batch_s"]
        rows.append(
            f"| Warm start: process start to first micro-batch dict (`RANK=1`) | "
            f"{warm['to_first_batch_s']:.1f} s | imports "
            f"{seconds(warm['import_s'], warm['import_cpu_s'])}, "
            f"`pack_data` {seconds(warm['pack_s'], warm['pack_cpu_s'])}, `build_datasets` "
            f"{warm['datasets_s']:.2f} s, iterator + first `next()` {warm['first_batch_s']:.3f} s, "
            f"interpreter start {rest:.1f} s; cache {warm['cache_state']} |")
    together = results.get("warm_ranks")
    if together:
        rows.append(
            f"| Warm start, {together['ranks']} ranks started at once | "
            f"{together['max_s']:.1f} s (slowest) | mean {together['mean_s']:.1f} s; each "
            f"process start to its first micro-batch dict |")
    read = results.get("read")
    if read:
        m0, m1, m2, m3 = (read["memory_imported"], read["memory_packed"],
                          read["memory_first_batch"], read["memory_read"])
        rows.append(
            f"| Peak RSS (`ru_maxrss`), `RANK=1` opening the data and reading {args.micro_batches} "
            f"micro-batches of 1 x {args.seq_length} | {mib(read['maxrss_mib'])} | after the "
            f"imports {mib(m0['VmRSS'])} (anonymous {mib(m0['RssAnon'])}); opening + packing "
            f"peaked {mib(m1['VmHWM'] - m0['VmRSS'])} above that and left "
            f"{mib(m1['VmRSS'] - m0['VmRSS'])} (anonymous +{mib(m1['RssAnon'] - m0['RssAnon'])}); "
            f"after {args.micro_batches} micro-batches {mib(m3['VmRSS'])}: anonymous "
            f"+{mib(m3['RssAnon'] - m2['RssAnon'])} since the first, mapped cache pages "
            f"+{mib(m3['RssFile'] - m2['RssFile'])} (page cache, shared, reclaimable) |")
        rows.append(
            f"| Reading speed, same process | "
            f"{(args.micro_batches - 1) / read['read_s']:,.0f} micro-batches/s | "
            f"{read['read_real_tokens'] / read['read_s'] / 1e6:.2f} M real tokens/s; "
            f"{seconds(read['read_s'], read['read_cpu_s'])} for {args.micro_batches - 1}; "
            f"main process, no DataLoader workers |")
    for algorithm in ("best-fit-decreasing", "in-order"):
        packed = results.get(f"pack {algorithm}")
        if packed:
            rows.append(
                f"| Padding, `--packing-algorithm {algorithm}` | "
                f"{100 * packed['padding_share']:.2f} % | {packed['rows']:,} rows of "
                f"{packed['documents']:,} pieces; `pack_data` "
                f"{seconds(packed['pack_s'], packed['pack_cpu_s'])}"
                + (f" after the tokenizer's load ({packed['tokenizer_s']:.1f} s)"
                   if "tokenizer_s" in packed else "") + " |")
    for each in (results.get("balance") or {}).get("balance", []):
        rows.append(
            f"| Start-up balance line (`describe_balance`), {each['size']} data-parallel ranks, "
            f"global batch {each['batch']} | {each['describe_s']:.1f} s | on rank 0, "
            f"over 100 global batches; `dp_balanced` adds {1000 * each['step_s']:.1f} ms per "
            f"global batch (its order; measured over 20) |")
    line = (results.get("build") or results.get("warm") or {}).get("line")
    if line:
        rows += ["", f"Packer's line (best-fit-decreasing): `{line}`"]
    return "\n".join(rows) + "\n"


# ---------------------------------------------------------------------------------------------

MEASURES = ("build", "warm", "read", "packing", "balance")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--documents", type=int, default=100_000)
    parser.add_argument("--chat", action="store_true",
                        help="chat JSONL (rendered with a local BPE tokenizer)")
    parser.add_argument("--seq-length", type=int, default=4096)
    parser.add_argument("--out", help="corpus folder (its cache goes to OUT/cache)")
    parser.add_argument("--micro-batches", type=int, default=2000,
                        help="micro-batches the reading rank reads")
    parser.add_argument("--median-tokens", type=float, default=256.0)
    parser.add_argument("--sigma", type=float, default=0.8,
                        help="log-normal sigma of the document lengths")
    parser.add_argument("--vocab-size", type=int, default=32000,
                        help="token ids of pre-tokenized data are in [1, vocab-size)")
    parser.add_argument("--tokenizer-vocab", type=int, default=8000,
                        help="the chat tokenizer's BPE vocabulary (at most)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--packing-algorithm", default="best-fit-decreasing",
                        help="packer of the warm-start and reading processes")
    parser.add_argument("--pretraining", action="store_true",
                        help="read as a pretraining run (loss masks not read), not --sft")
    parser.add_argument("--balance", nargs="+", default=["8x256", "64x1024"],
                        metavar="RANKSxBATCH",
                        help="data-parallel ranks x global batch of the balance measurements")
    parser.add_argument("--measure", nargs="+", choices=MEASURES, default=list(MEASURES))
    parser.add_argument("--ranks", type=int, default=1,
                        help="also time the warm start of this many ranks started at once "
                             "(as torchrun starts a node's ranks)")
    parser.add_argument("--json", help="also write the numbers to this file")
    parser.add_argument("--worker", choices=("build", "warm", "read", "pack", "balance"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--worker-config", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        result = worker(args.worker, json.loads(args.worker_config))
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    if not args.out:
        parser.error("--out is missing: give the folder of the corpus, e.g. /tmp/databench/100k")
    if args.documents < 1 or args.micro_batches < 1 or args.ranks < 1:
        parser.error("--documents, --micro-batches and --ranks must be >= 1")
    args.out = os.path.abspath(args.out)
    started, load_at_start = time.time(), os.getloadavg()

    def log(message: str) -> None:
        print(f"[{time.time() - started:7.1f} s] {message}", file=sys.stderr, flush=True)

    corpus = ensure_corpus(args)
    log(f"corpus {'generated' if corpus['generated_now'] else 'reused'}: "
        f"{corpus['documents']:,} documents, {corpus['bytes'] / 2**30:.2f} GiB "
        f"({corpus['seconds']:.0f} s to generate)")
    config = {"data_path": os.path.join(args.out, CORPUS_FILE), "sft": not args.pretraining,
              "seq_length": args.seq_length, "micro_batches": args.micro_batches,
              "algorithm": args.packing_algorithm, "vocab_size": args.vocab_size,
              "tokenizer": None}
    if args.chat:
        from tokenizers import Tokenizer

        folder = os.path.join(args.out, TOKENIZER_FOLDER)
        config["tokenizer"] = folder
        # The tokenizer's length (added tokens included), as tokenizer.py's vocab_size.
        config["vocab_size"] = Tokenizer.from_file(
            os.path.join(folder, "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    cache = os.path.join(args.out, "cache")
    results = {}
    if "build" in args.measure:
        shutil.rmtree(cache, ignore_errors=True)
        log("cache build (first check_data, cold cache) ...")
        results["build"] = measure("build", config, rank="0")
        results["cache_bytes"] = sum(
            os.path.getsize(os.path.join(root, name))
            for root, _, names in os.walk(cache) for name in names)
        log(f"  {results['build']['cache_line']}")
    else:  # the first rank's packing: builds a missing or stale cache (not measured)
        state = measure("pack", config, rank="0")["cache_state"]
        log(f"token cache {state} (not measured)")
    if "warm" in args.measure:
        log("warm start (RANK=1) ...")
        results["warm"] = measure("warm", config, rank="1")
        log(f"  first micro-batch {results['warm']['to_first_batch_s']:.1f} s after spawn")
        if args.ranks > 1:
            log(f"warm start, {args.ranks} ranks at once ...")
            starts = [out["to_first_batch_s"] for out in measure_together(
                "warm", config, [str(rank) for rank in range(1, args.ranks + 1)])]
            results["warm_ranks"] = {"ranks": args.ranks, "max_s": max(starts),
                                     "mean_s": sum(starts) / len(starts)}
            log(f"  slowest rank's first micro-batch {max(starts):.1f} s after spawn")
    if "read" in args.measure:
        log(f"reading rank (RANK=1), {args.micro_batches} micro-batches ...")
        results["read"] = measure("read", config, rank="1")
        log(f"  peak RSS {results['read']['maxrss_mib']:.0f} MiB")
    if "packing" in args.measure:
        for algorithm in ("best-fit-decreasing", "in-order"):
            log(f"packing with {algorithm} ...")
            results[f"pack {algorithm}"] = measure("pack", config | {"algorithm": algorithm},
                                                   rank="1")
            log(f"  {results[f'pack {algorithm}']['line']}")
    if "balance" in args.measure:
        log(f"balance lines for {args.balance} ...")
        results["balance"] = measure("balance", config | {"balance": [
            [int(v) for v in pair.split("x")] for pair in args.balance]}, rank="1")
        for each in results["balance"]["balance"]:
            log(f"  {each['describe_s']:.1f} s: {each['line']}")
    report = header(argv, load_at_start) + "\n" + table(corpus, results, args)
    print(report)
    log("done")
    if args.json:
        with open(args.json, "w") as stream:
            json.dump({"corpus": corpus, "results": results, "argv": argv}, stream, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
