"""tools/export_benchmark.py on CPU: its options and refusals, the policy's flags through the
real training parser (the 8B shapes, and the family table maps the model they build), the
table, the consumer that copies into engine-side buffers, and the one line without a GPU. The
GPU measurement: docs/benchmarks.md, "Weights for an inference engine"."""

import os
import sys
from unittest import mock

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
import export_benchmark  # noqa: E402
from export_benchmark import EngineBuffers, Row, consume, format_table, parse  # noqa: E402


def test_the_defaults_and_the_flags_after_the_separator():
    options, flags = parse(["--", "--tensor-model-parallel-size", "2"])
    assert (options.num_layers, options.repeats, options.warmup, options.bucket_mib,
            options.json) == (4, 5, 1, 1024, None)
    assert flags == ["--tensor-model-parallel-size", "2"]
    options, flags = parse(["--num-layers", "32", "--repeats", "3", "--warmup", "0"])
    assert (options.num_layers, options.repeats, options.warmup, flags) == (32, 3, 0, [])


@pytest.mark.parametrize("argv, message", [
    (["--num-layers", "0"], "--num-layers is wrong: 0. Give at least 1."),
    (["--repeats", "0"], "--repeats is wrong: 0. Give at least 1."),
    (["--bucket-mib", "0"], "--bucket-mib is wrong: 0. Give at least 1."),
    (["--warmup", "-1"], "--warmup is wrong: -1. Give 0 or more."),
])
def test_bad_options_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_the_policy_flags_build_llama_3_8b_layers_and_the_family_maps_them(monkeypatch):
    from megatron.packed_training import extra_args
    from megatron.packed_training.arguments import parse_args
    from megatron.packed_training.rl.export import hf_mapping

    monkeypatch.setattr(extra_args, "is_importable", lambda package: False)
    config = export_benchmark.llama_config(4)
    with mock.patch.dict(os.environ, {"WORLD_SIZE": "1", "RANK": "0"}):
        args = parse_args(export_benchmark.policy_flags(config, 1), "gpt", raise_on_error=True)
    assert (args.num_layers, args.hidden_size, args.ffn_hidden_size, args.num_attention_heads,
            args.num_query_groups, args.vocab_size) == (4, 4096, 14336, 32, 8, 128256)
    assert args.swiglu and args.untie_embeddings_and_output_weights and args.bf16
    assert args.optimizer == "sgd" and args.make_vocab_size_divisible_by == 128
    mapping = hf_mapping(config)
    assert len(mapping.layers) == 4 and mapping.dims.vocab_size == 128256


def test_the_table_gives_gigabytes_per_second():
    rows = [Row("pairs, yield only", 39, 3_000_000_000, 12.0, 0.1),
            Row("pairs, copied", 39, 3_000_000_000, 12.0, 0.15)]
    table = format_table(rows, "Machine: 1 x Test GPU.\n")
    lines = table.splitlines()
    assert lines[:2] == ["Machine: 1 x Test GPU.", ""]  # Markdown: a blank line before a table
    assert lines[2] == "| export | tensors | GB | setup ms | total ms | GB/s |"
    assert lines[4] == "| pairs, yield only | 39 | 3.00 | 12.0 | 100.0 | 30.0 |"
    assert lines[5] == "| pairs, copied | 39 | 3.00 | 12.0 | 150.0 | 20.0 |"


def test_the_consumer_copies_every_tensor_into_a_buffer_of_its_name():
    pairs = [("a", torch.arange(6.0).view(2, 3).t()), ("b", torch.ones(4, dtype=torch.bfloat16))]
    engine = EngineBuffers()
    assert consume(iter(pairs), False, engine) == (2, 6 * 4 + 4 * 2)
    first = engine.buffers["a"]
    assert first.is_contiguous() and torch.equal(first, pairs[0][1])
    moved = [("a", pairs[0][1] + 1), ("b", pairs[1][1] * 3)]
    assert consume(iter([moved]), True, engine) == (2, 32)  # one bucket
    assert engine.buffers["a"] is first  # copied into, not replaced
    assert all(torch.equal(engine.buffers[name], tensor) for name, tensor in moved)
    assert consume(iter(pairs), False, None) == (2, 32)  # yield only: nothing kept


def test_without_a_gpu_it_says_so_in_one_line(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert export_benchmark.main([]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tools/export_benchmark.py: needs a CUDA GPU") and err.count("\n") == 1
