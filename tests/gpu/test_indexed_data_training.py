"""Megatron-LM's indexed data (PREFIX.bin + PREFIX.idx, written through megatron-core's
IndexedDatasetBuilder as tools/preprocess_data.py writes it) trains with the real script,
eager and under layer graphs, and its losses equal the same documents read from JSONL; a
blend of an indexed source and a JSONL source trains under graphs."""

import numpy as np
import torch

from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
from tests.gpu.launch import LAYER_GRAPHS, TINY_GPT, TRAIN, losses, run_training

# TRAIN without its synthetic data: the data here is files.
FILES_TRAIN = [a for a in TRAIN if a not in ("--mock-data", "--mock-doc-length-median", "128")]
RUN = TINY_GPT + FILES_TRAIN + ["--global-batch-size", "4", "--train-iters", "8"]


def corpus(count: int, seed: int) -> list:
    """Documents of log-normal lengths (median 128 tokens), ids in [1, 1024)."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.exp(np.log(128) + rng.standard_normal(count)), 2, 3000).astype(int)
    return [rng.integers(1, 1024, size=n) for n in lengths]


def write_indexed(prefix: str, documents: list) -> str:
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for document in documents:
        builder.add_document(torch.from_numpy(document), [len(document)])
    builder.finalize(prefix + ".idx")
    return prefix


def write_jsonl(path: str, documents: list) -> str:
    with open(path, "w") as stream:
        for document in documents:
            stream.write('{"input_ids": [' + ", ".join(map(str, document.tolist())) + "]}\n")
    return path


def test_indexed_data_trains_eager_and_under_graphs_like_the_same_jsonl(tmp_path):
    documents = corpus(400, seed=7)
    prefix = write_indexed(str(tmp_path / "text_document"), documents)
    jsonl = write_jsonl(str(tmp_path / "text.jsonl"), documents)
    cache = ["--data-cache-path", str(tmp_path / "cache")]
    indexed = run_training("pretrain_gpt.py", RUN + ["--data-path", prefix], tmp_path,
                           name="indexed_eager")
    from_jsonl = run_training("pretrain_gpt.py", RUN + ["--data-path", jsonl] + cache, tmp_path,
                              name="jsonl_eager")
    graphs = run_training("pretrain_gpt.py", RUN + ["--data-path", prefix] + LAYER_GRAPHS,
                          tmp_path, name="indexed_graphs")
    print("indexed eager", losses(indexed), "\njsonl eager", losses(from_jsonl),
          "\nindexed graphs", losses(graphs))
    assert losses(indexed)[0] == losses(from_jsonl)[0]  # the same rows, bit for bit
    assert losses(indexed) == losses(from_jsonl)
    dloss = max(abs(e - g) for e, g in zip(losses(indexed), losses(graphs)))
    assert dloss < 5e-3, (losses(indexed), losses(graphs))


def test_a_blend_of_indexed_and_jsonl_sources_trains_under_graphs(tmp_path):
    prefix = write_indexed(str(tmp_path / "a"), corpus(300, seed=1))
    jsonl = write_jsonl(str(tmp_path / "b.jsonl"), corpus(300, seed=2))
    records = run_training("pretrain_gpt.py", RUN + LAYER_GRAPHS + [
        "--data-path", "0.3", prefix, "0.7", jsonl, "--split", "90,10,0", "--eval-iters", "1",
        "--eval-interval", "4"], tmp_path, name="blend_graphs")
    assert len(records) == 8 and all(np.isfinite(losses(records)))
    log = (tmp_path / "blend_graphs.log").read_text()
    assert "token cache built" in log and "(--split 90,10,0, valid)" in log
