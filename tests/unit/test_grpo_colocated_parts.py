"""examples/rl/grpo_colocated.py on CPU: its arguments, the launch line it builds from a
converted checkpoint (through the real parser), and its generator side on tiny Hugging Face
models: the refit by name, sampling, the generator's log-probs, the rollouts and their way
back from micro-batches. The loop itself needs a GPU: tests/gpu/test_grpo_colocated.py runs
it."""

import pytest
import torch

from tests.unit.hf_tiny import VOCAB, tiny_llama, tiny_qwen3
from tests.unit.scripts import load_script


@pytest.fixture(scope="module")
def example():
    return load_script("examples", "rl", "grpo_colocated.py")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A tiny Qwen3 (tied embeddings) converted as a user converts one."""
    from megatron.packed_training.hf import import_hf

    root = tmp_path_factory.mktemp("qwen3")
    import_hf(tiny_qwen3(root / "hf"), root / "converted")
    return str(root / "converted")


def hf_model(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder).eval()


def test_the_launch_line_passes_the_parser(example, converted):
    from megatron.packed_training.arguments import parse_args

    options = example.parse([converted, "--seq-length", "256", "--max-new-tokens", "64"])
    assert example.model_kind(options.flags) == "gpt"
    args = parse_args([*example.training_flags(options), *options.flags], "gpt",
                      raise_on_error=True)
    assert (args.seq_length, args.cuda_graph_max_packed_seqs, args.bf16) == (256, 16, True)
    assert args.pretrained_checkpoint == converted and args.calculate_per_token_loss
    assert example.model_kind(["--num-layers=4", "--hybrid-layer-pattern=M*M-"]) == "hybrid"


@pytest.mark.parametrize("argv, match", [
    (["--group-size", "1"], "--group-size is wrong: 1. GRPO compares"),
    (["--prompts", "0"], "--prompts is wrong: 0"),
    (["--temperature", "0"], "--temperature is wrong: 0.0"),
    (["--prompt-length", "200", "--max-new-tokens", "100", "--seq-length", "256"],
     "--seq-length is wrong: 256. A sequence of --prompt-length + --max-new-tokens = 300 tokens "
     "takes 299 positions of a packed row: give --seq-length 299 or more."),
])
def test_bad_arguments(example, converted, argv, match, capsys):
    with pytest.raises(SystemExit):
        example.parse([converted, *argv])
    assert match in capsys.readouterr().err


def test_a_folder_without_launch_flags_is_refused_before_any_gpu_work(example, tmp_path,
                                                                       monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the folder is checked first
    with pytest.raises(SystemExit):
        example.main([str(tmp_path)])
    assert f"checkpoint is wrong: {tmp_path} has no megatron_flags.txt" in capsys.readouterr().err


def test_without_a_cuda_gpu_it_says_so_in_one_line(example, converted, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert example.main([converted]) == 1
    assert capsys.readouterr().err.splitlines() == [
        "examples/rl/grpo_colocated.py: needs a CUDA GPU (torch.cuda.is_available() is False): "
        "the policy and the generator run on the GPU; run it on a GPU machine"]


@pytest.mark.parametrize("make, buckets", [(tiny_qwen3, False), (tiny_llama, True)])
def test_the_refit_gives_the_generator_the_exported_weights(example, tmp_path, make, buckets):
    """Pairs under Hugging Face names, as export_weights yields them (a tied model without
    lm_head.weight), make another model of the config compute the same logits."""
    source = hf_model(make(tmp_path / "source", seed=1))
    target = hf_model(make(tmp_path / "target", seed=2))
    tokens = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    assert not torch.equal(source(tokens).logits, target(tokens).logits)
    pairs = [(name, tensor.clone()) for name, tensor in source.state_dict().items()
             if not (source.config.tie_word_embeddings and name == "lm_head.weight")]
    exported = [pairs[:3], pairs[3:]] if buckets else pairs
    assert example.refit(target, exported) == len(pairs)
    torch.testing.assert_close(target(tokens).logits, source(tokens).logits, rtol=0, atol=0)


def test_the_refit_refuses_an_unknown_name_and_a_tensor_left_unset(example, tmp_path):
    model = hf_model(tiny_llama(tmp_path / "hf"))
    pairs = list(model.state_dict().items())
    with pytest.raises(ValueError, match="the export names model.layers.9.mlp.up_proj.weight, "
                                         "which LlamaForCausalLM does not have"):
        example.refit(model, pairs + [("model.layers.9.mlp.up_proj.weight", pairs[0][1])])
    with pytest.raises(ValueError, match=r"left 1 tensors of LlamaForCausalLM unset "
                                         r"\(lm_head.weight, ...\)"):
        example.refit(model, [p for p in pairs if p[0] != "lm_head.weight"])


def test_a_response_ends_at_its_first_end_of_sequence_token(example):
    generated = torch.tensor([[7, 7, 1, 2, 3, 4], [7, 7, 5, 9, 2, 0], [7, 7, 9, 2, 8, 8]])
    responses = example.split_responses(generated, prompt_length=2, eos_ids=[9])
    assert [r.tolist() for r in responses] == [[1, 2, 3, 4], [5, 9], [9]]
    assert [r.tolist() for r in example.split_responses(generated, 2, [])][2] == [9, 2, 8, 8]


def test_rollouts_carry_the_generators_logprobs_and_pack(example, tmp_path):
    from megatron.packed_training.rl.batches import lay_out_all

    model = hf_model(tiny_qwen3(tmp_path / "hf"))
    options = example.parse([str(_flags_folder(tmp_path)), "--prompts", "3", "--group-size", "2",
                             "--prompt-length", "5", "--max-new-tokens", "9",
                             "--temperature", "0.7"])
    batch = example.rollouts(model, options, iteration=0, vocab=VOCAB)
    assert batch["groups"].tolist() == [0, 0, 1, 1, 2, 2]
    for i, (tokens, mask, lp) in enumerate(zip(batch["tokens"], batch["masks"],
                                               batch["logprobs"])):
        response = tokens[mask.bool()]
        assert 6 <= len(tokens) <= 14 and mask[:5].sum() == 0 and len(response) >= 1
        assert torch.equal(tokens[:5], batch["tokens"][i - i % 2][:5])  # a group's prompt
        assert batch["rewards"][i].item() == pytest.approx(example.reward(response, VOCAB))
        with torch.no_grad():  # the log-prob of each token at the temperature, 0 first
            logits = model(tokens[None]).logits[0, :-1].float() / 0.7
        expected = torch.log_softmax(logits, -1).gather(-1, tokens[1:, None])[:, 0]
        torch.testing.assert_close(lp, torch.cat([torch.zeros(1), expected]))
    micro_batches = example.rollout_micro_batches(batch, row_positions=16)
    assert len(micro_batches) > 1
    lay_out_all(micro_batches, 16)  # as the policy checks them
    # Per micro-batch values (here the tokens themselves) back to their sequences.
    back = example.by_sequence(micro_batches, [mb.tokens for mb in micro_batches])
    assert sorted(back) == list(range(6))
    assert all(torch.equal(back[i], batch["tokens"][i]) for i in range(6))
    same = example.by_sequence(micro_batches, [torch.cat([batch["logprobs"][i]
                                                          for i in mb.indices])
                                               for mb in micro_batches])
    assert example.mismatch(same, batch["logprobs"], batch["masks"]) == (0.0, 0.0)


def _flags_folder(tmp_path):
    folder = tmp_path / "flags"
    folder.mkdir()
    (folder / "megatron_flags.txt").write_text("--num-layers=2\n")
    return folder


def test_a_phase_line_lines_up_with_the_header(example):
    header = example.phase_line(example.COLUMNS)
    line = example.phase_line((3, "policy log-probs", "0.125", 1234, 2048, 130000, "note"))
    assert header.startswith("iter  phase ") and line.endswith("  note")
    assert line.index("0.125") + len("0.125") == header.index("seconds") + len("seconds")
    assert line.index("130000") + 6 == header.index("free MiB") + len("free MiB")
