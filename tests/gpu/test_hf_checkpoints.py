"""Hugging Face checkpoints on GPUs: the half of tests/unit/test_hf_convert.py that needs
CUDA, Transformer Engine or mamba-ssm (docs/hf-checkpoints.md).

* The converted checkpoint holds exactly what the fork's own model shards, on every backend
  it builds (TE and TE-free): MLA in TE's layout, Mamba's split in_proj / conv1d.
* Logits against transformers on packed rows (several documents per row, each document run
  alone through the Hugging Face model): fp32 gates (last-position argmax, cosine >= 0.999;
  Nemotron-H's Mamba layers run only here), and a bf16 report of max |dlogit| (printed, and
  written to ``hf_logits_report.json`` in the test's folder).
* Training from the converted checkpoint (pretrain_gpt.py / pretrain_mamba.py,
  --pretrained-checkpoint): local layer graphs and full-iteration graphs follow eager.
* 2 GPUs: TP = 2, PP = 2 and EP = 2 load the TP = 1 checkpoint (the vocabulary re-padded for
  TP 2) and start from the TP = 1 loss; a TP = 2 / PP = 2 save exports back to the Hugging
  Face weights.
* The SFT example (examples/hf/sft_from_hugging_face.py): chat data under graphs, the first
  logged loss is the Hugging Face model's on the same micro-batches, the export reloads in
  transformers and its greedy tokens are the trained fork model's.

Run: ``python -m pytest -q -s tests/gpu/test_hf_checkpoints.py`` (``-s`` shows the report).
"""

import json
import math
import os

import pytest
import torch

from megatron.packed_training.extra_args import is_importable
from megatron.packed_training.hf import export_hf, import_hf
from megatron.packed_training.metrics import read_metrics
from tests.gpu.launch import losses, run_training
from tests.unit.hf_tiny import (
    VOCAB,
    agreement,
    build_fork_model,
    first_micro_batches,
    flags_of,
    greedy,
    hf_document_logits,
    hf_loss_sum,
    load_release,
    packed_documents,
    packed_logits,
    parse_fork_args,
    tiny_deepseek_v3,
    tiny_llama,
    tiny_moonlight,
    tiny_nemotron_h,
    tiny_qwen3,
    tiny_qwen3_moe,
    write_chat_data,
)
from tests.unit.test_hf_convert import (
    DOCUMENTS,
    _weights,
    assert_checkpoint_fits,
    load_example,
)

TE = is_importable("transformer_engine")
MAMBA = is_importable("mamba_ssm") and is_importable("causal_conv1d")
# family -> (tiny model builder, model kind)
FAMILIES = {
    "llama": (tiny_llama, "gpt"),
    "qwen3": (tiny_qwen3, "gpt"),
    "qwen3_moe": (tiny_qwen3_moe, "gpt"),
    "deepseek_v3": (tiny_deepseek_v3, "gpt"),
    # no q-LoRA (Moonlight's shape): the fork's MLA builds a plain query projection
    "deepseek_v3_no_q_lora": (tiny_moonlight, "gpt"),
    "nemotron_h": (tiny_nemotron_h, "hybrid"),
    # without MoE layers: full-iteration graphs refuse MoE
    "nemotron_h_dense": (lambda folder: tiny_nemotron_h(
        folder, layers=["linear_attention", "full_attention", "mlp", "linear_attention",
                        "mlp"]), "hybrid"),
    # a convolution of width 3 (--mamba-conv-kernel-size 3; causal-conv1d's kernel)
    "nemotron_h_conv3": (lambda folder: tiny_nemotron_h(folder, conv_kernel=3), "hybrid"),
}
MLA = ("deepseek_v3", "deepseek_v3_no_q_lora")
SCRIPT = {"gpt": "pretrain_gpt.py", "hybrid": "pretrain_mamba.py"}
BACKENDS = {"local": "--attention-backend=local", "te": "--attention-backend=auto"}
REPORT = {}


def needs(family: str, backend: str = "local"):
    """Skip what the machine cannot build: MLA runs on TE attention only, Mamba layers need
    mamba-ssm and causal-conv1d."""
    if backend == "te" and not TE:
        pytest.skip("needs Transformer Engine (pip install -e .[te])")
    if family in MLA and backend != "te":
        pytest.skip("packed multi-latent attention runs on Transformer Engine attention only")
    if family.startswith("nemotron_h") and not MAMBA:
        pytest.skip("needs mamba-ssm and causal-conv1d (pip install -e .[mamba])")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    cache = {}

    def get(family, tensor_parallel_size=1):
        if (family, tensor_parallel_size) not in cache:
            root = tmp_path_factory.mktemp(family)
            hf = FAMILIES[family][0](root / "hf")
            import_hf(hf, root / "megatron", tensor_parallel_size=tensor_parallel_size)
            cache[family, tensor_parallel_size] = (hf, str(root / "megatron"))
        return cache[family, tensor_parallel_size]
    return get


@pytest.fixture(scope="module", autouse=True)
def bf16_report(tmp_path_factory):
    yield
    if REPORT:
        path = tmp_path_factory.mktemp("report") / "hf_logits_report.json"
        path.write_text(json.dumps(REPORT, indent=2))
        print(f"\nbf16 logits against transformers ({path}):")
        for name, row in sorted(REPORT.items()):
            print(f"  {name}: max |dlogit| {row['max_abs']:.3e}, mean |dlogit| "
                  f"{row['mean_abs']:.3e}, last-token argmax agree {row['argmax_agree']}, "
                  f"min cosine {row['min_cosine']:.5f}")


def _gpu_model(family, megatron, backend, bf16=False):
    from megatron.core.transformer.module import Float16Module

    from megatron.packed_training.config import transformer_config_from_args

    kind = FAMILIES[family][1]
    args = parse_fork_args(flags_of(megatron), kind,
                           extra=[BACKENDS[backend], *(["--bf16"] if bf16 else [])])
    torch.manual_seed(1234)
    model = build_fork_model(args, kind).cuda()
    load_release(model, megatron)
    if bf16:
        model = Float16Module(transformer_config_from_args(args), model)
    return model.eval()


# ----------------------------------------------------------------------- layout on every backend

@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe", *MLA, "nemotron_h"])
def test_checkpoint_holds_what_the_fork_model_shards(dist, converted, family, backend):
    needs(family, backend)
    _, megatron = converted(family)
    kind = FAMILIES[family][1]
    args = parse_fork_args(flags_of(megatron), kind, extra=[BACKENDS[backend]])
    model = build_fork_model(args, kind).cuda()
    assert_checkpoint_fits(megatron, model)


# -------------------------------------------------------------------- logits against transformers

@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe", "nemotron_h",
                                    "nemotron_h_conv3"])
def test_fp32_logits_equal_hugging_face(dist, converted, family):
    """fp32 on the TE-free path (TE's fused attention runs bf16 / fp16 only; DeepSeek's fp32
    gate runs on CPU over megatron-core's MLA: tests/unit/test_hf_convert.py)."""
    from transformers import AutoModelForCausalLM

    needs(family)
    hf, megatron = converted(family)
    model = _gpu_model(family, megatron, "local")
    documents, tokens, positions, params = packed_documents(DOCUMENTS, device="cuda")
    logits = packed_logits(model, tokens, positions, params)
    reference = hf_document_logits(AutoModelForCausalLM.from_pretrained(hf).cuda().eval(),
                                   documents)
    for same_token, cosine, largest in agreement(logits, documents, reference, VOCAB):
        assert same_token and cosine >= 0.999, (cosine, largest)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe", *MLA, "nemotron_h"])
def test_bf16_logits_report(dist, converted, family, backend):
    """bf16 on both sides (the fork's model as training wraps it): the report's figures, and
    a loose gate (bf16 rounding, not a wrong weight)."""
    from transformers import AutoModelForCausalLM

    needs(family, backend)
    hf, megatron = converted(family)
    model = _gpu_model(family, megatron, backend, bf16=True)
    documents, tokens, positions, params = packed_documents(DOCUMENTS, device="cuda")
    logits = packed_logits(model, tokens, positions, params).float()
    reference_model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.bfloat16)
    reference = hf_document_logits(reference_model.cuda().eval(), documents)
    rows = agreement(logits, documents, reference, VOCAB)
    start, deltas = 0, []
    for document, ref in zip(documents, reference):
        deltas.append((logits[start:start + len(document), :VOCAB] - ref.float()).abs())
        start += len(document)
    deltas = torch.cat(deltas)
    REPORT[f"{family}/{backend}"] = {
        "max_abs": deltas.max().item(), "mean_abs": deltas.mean().item(),
        "argmax_agree": f"{sum(row[0] for row in rows)}/{len(rows)}",
        "min_cosine": min(row[1] for row in rows)}
    assert min(row[1] for row in rows) >= 0.99


# ----------------------------------------------------------- graphs from the converted checkpoint

TRAINING = ["--mock-data", "--mock-doc-length-median", "48", "--seq-length", "256",
            "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "12",
            "--lr", "1e-4", "--min-lr", "1e-5", "--lr-decay-style", "cosine", "--bf16",
            "--calculate-per-token-loss", "--log-interval", "1", "--eval-iters", "0",
            "--seed", "1234", "--no-check-for-nan-in-loss-and-grad",
            *(["--te-rng-tracker"] if TE else [])]
LAYER_GRAPHS = ["--cuda-graph-impl", "local", "--cuda-graph-max-packed-seqs", "16",
                "--cuda-graph-warmup-steps", "2"]
FULL_ITERATION = ["--cuda-graph-impl", "full_iteration", "--cuda-graph-max-packed-seqs", "16",
                  "--cuda-graph-warmup-steps", "2"]
DROP_AND_PAD = ["--moe-expert-capacity-factor", "2", "--moe-pad-expert-input-to-capacity"]


def _launch(converted_folder, family):
    """The converted launch line with the checkpoint to start from."""
    return [*flags_of(converted_folder), f"--pretrained-checkpoint={converted_folder}",
            *(DROP_AND_PAD if family in ("qwen3_moe", *MLA, "nemotron_h", "nemotron_h_conv3")
              else [])]


@pytest.mark.parametrize("family, graphs", [
    ("llama", "layer"), ("llama", "full_iteration"), ("qwen3", "full_iteration"),
    ("qwen3_moe", "layer"), ("deepseek_v3", "layer"), ("deepseek_v3_no_q_lora", "layer"),
    ("nemotron_h", "layer"), ("nemotron_h_dense", "full_iteration"),
    ("nemotron_h_conv3", "layer"),
])
def test_graphs_train_like_eager_from_the_converted_checkpoint(converted, tmp_path, family,
                                                               graphs):
    needs(family, "te" if family in MLA else "local")
    _, megatron = converted(family)
    script = SCRIPT[FAMILIES[family][1]]
    common = _launch(megatron, family) + TRAINING
    eager = run_training(script, common, tmp_path, name="eager")
    graphed = run_training(script, common + (LAYER_GRAPHS if graphs == "layer"
                                             else FULL_ITERATION), tmp_path, name=graphs)
    dloss = max(abs(a - b) for a, b in zip(losses(eager), losses(graphed)))
    print(f"{family} {graphs}: first loss {losses(eager)[0]:.4f}, max |dloss| {dloss:.2e}")
    assert len(graphed) == len(eager) == 12
    # bitwise for GPT in this fork's runs; Mamba's kernels are not bitwise run to run
    assert dloss < 5e-3, (losses(eager), losses(graphed))
    assert all(math.isfinite(loss) for loss in losses(graphed))


# ------------------------------------------------------------------------------ TP / PP / EP

TP2 = ["--tensor-model-parallel-size", "2"]
TP2_MOE = TP2 + ["--sequence-parallel"]  # Megatron-LM requires it for MoE with TP
LAYOUTS = {
    "llama": {"tp2": TP2, "pp2": ["--pipeline-model-parallel-size", "2"]},
    "qwen3_moe": {"tp2": TP2_MOE, "ep2": ["--expert-model-parallel-size", "2"]},
    "deepseek_v3": {"tp2": TP2_MOE, "ep2": ["--expert-model-parallel-size", "2"],
                    "pp2": ["--pipeline-model-parallel-size", "2"]},
    # TP shards the plain query projection by heads, as it does the up projections
    "deepseek_v3_no_q_lora": {"tp2": TP2_MOE},
    "nemotron_h": {"tp2": TP2_MOE, "pp2": ["--pipeline-model-parallel-size", "2"]},
}


@pytest.mark.gpus(2)
@pytest.mark.parametrize("family, layout", [(family, name) for family in sorted(LAYOUTS)
                                            for name in LAYOUTS[family]])
def test_parallel_layouts_load_the_converted_checkpoint(converted, tmp_path, family, layout):
    """One checkpoint loads at TP = 2, PP = 2 or EP = 2 and trains from the same loss as on
    one GPU (same micro-batches). It is converted for TP 2 (--tensor-parallel-size 2): its
    vocabulary divisor pads TP 1 and TP 2 alike, with trained rows only; zero rows would
    add exp(0) to every softmax denominator at one of them (docs/hf-checkpoints.md). One
    layout per test, so that a family's layouts run side by side under xdist."""
    needs(family, "te" if family in MLA else "local")
    _, megatron = converted(family, tensor_parallel_size=2)
    script = SCRIPT[FAMILIES[family][1]]
    common = _launch(megatron, family) + TRAINING + ["--train-iters", "6"]
    reference = losses(run_training(script, common, tmp_path, name="one_gpu"))
    curve = losses(run_training(script, common + LAYOUTS[family][layout], tmp_path, nproc=2,
                                name=layout))
    print(f"{family} {layout}: first loss {curve[0]:.4f} (one GPU {reference[0]:.4f})")
    assert abs(curve[0] - reference[0]) < 5e-3, (layout, curve, reference)
    assert max(abs(a - b) for a, b in zip(curve, reference)) < 0.05, layout


@pytest.mark.gpus(2)
@pytest.mark.parametrize("family, layout", [
    ("llama", ["--tensor-model-parallel-size", "2"]),
    ("llama", ["--pipeline-model-parallel-size", "2"]),
    ("qwen3_moe", ["--expert-model-parallel-size", "2"]),
    ("nemotron_h", TP2_MOE),
])
def test_a_sharded_training_checkpoint_exports_to_hugging_face(converted, tmp_path, family,
                                                              layout):
    """Saved by a TP = 2 / PP = 2 / EP = 2 run that does not move the weights (a learning rate
    of 1e-30 and no weight decay), the checkpoint exports to the Hugging Face weights in bf16
    (--bf16 keeps bf16 model weights), at the Hugging Face vocabulary; the expert bias (a
    float32 buffer) as it was."""
    from transformers import AutoModelForCausalLM

    needs(family)
    hf, megatron = converted(family)
    script = SCRIPT[FAMILIES[family][1]]
    save = str(tmp_path / "save")
    run_training(script, _launch(megatron, family) + TRAINING + layout + [
        "--train-iters", "1", "--lr", "1e-30", "--min-lr", "1e-30", "--weight-decay", "0",
        "--moe-router-bias-update-rate", "0",  # the expert bias moves with the routing
        "--save", save, "--save-interval", "1"], tmp_path, nproc=2, name="sharded")
    export_hf(save, tmp_path / "back", hf_config=megatron)
    original, back = _weights(hf), _weights(tmp_path / "back")
    assert sorted(back) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(back[name].float(), tensor.to(back[name].dtype).float()), name
    AutoModelForCausalLM.from_pretrained(tmp_path / "back")


# ------------------------------------------------------------------------- the SFT example

@pytest.mark.parametrize("family", ["qwen3", "nemotron_h_dense"])
def test_sft_from_hugging_face_under_graphs(dist, converted, tmp_path, family):
    """examples/hf/sft_from_hugging_face.py on a tiny model: 300 iterations of chat SFT under
    local layer graphs from the converted checkpoint; the first logged loss is the Hugging Face model's on
    the run's first micro-batches; the trained checkpoint exports, reloads in transformers,
    and its greedy tokens are the trained fork model's."""
    from megatron.core import dist_checkpointing
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron.packed_training.hf.torch_dist import checkpoint_folder

    needs(family)
    example = load_example()
    kind = FAMILIES[family][1]
    hf = FAMILIES[family][0](tmp_path / "hf")
    data = write_chat_data(tmp_path / "chat.jsonl", conversations=4096)
    work = str(tmp_path / "work")
    conversion = example.convert(hf, work)
    command = example.training_command(conversion, data, work, train_iters=300, seq_length=256,
                                        global_batch_size=2, lr=1e-3, capacity=16)
    example.train(command, os.path.join(work, "train.log"))
    records = read_metrics(os.path.join(work, "metrics.jsonl"))
    first = records[0]["lm_loss"]

    # The loss of the run's first iteration (two micro-batches, per-token) under transformers.
    script = command.index(os.path.join(example.REPO, conversion.script))
    args = parse_fork_args(command[script + 1:], kind, training=())
    reference_model = AutoModelForCausalLM.from_pretrained(hf).cuda().eval()
    sums = [hf_loss_sum(reference_model, batch, "cuda") for batch in first_micro_batches(args, 2)]
    pretrained = sum(s for s, _ in sums) / sum(n for _, n in sums)
    print(f"{family}: first logged loss {first:.4f}, transformers {pretrained:.4f}, "
          f"last {records[-1]['lm_loss']:.4f}")
    assert abs(first - pretrained) < 2e-2  # bf16 training against fp32 transformers
    assert records[-1]["lm_loss"] < first

    exported = example.export(work)
    hf_model = AutoModelForCausalLM.from_pretrained(exported.destination,
                                                    dtype=torch.float32).cuda().eval()
    trained = _gpu_model_from(conversion.destination, kind)
    state = dist_checkpointing.load(trained.sharded_state_dict(),
                                    checkpoint_folder(os.path.join(work, "sft")))
    missing, _ = trained.load_state_dict({k: v for k, v in state.items()
                                          if k in trained.state_dict()}, strict=False)
    assert all(key.endswith("_extra_state") for key in missing), missing
    tokenizer = AutoTokenizer.from_pretrained(exported.destination)
    text = tokenizer.apply_chat_template(example.first_prompt(data), add_generation_prompt=True,
                                         tokenize=False)
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]

    def fork_next(ids):
        _, tokens, positions, params = _one_document(ids)
        return packed_logits(trained, tokens, positions, params)[-1, :VOCAB]

    def hf_next(ids):
        with torch.no_grad():
            return hf_model(torch.tensor([ids], device="cuda")).logits[0, -1]

    ours, gaps = greedy(fork_next, prompt, 16)
    theirs, _ = greedy(hf_next, prompt, 16)
    for step, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:  # only a near tie may flip between two fp32 implementations
            assert gaps[step] < 1e-3, (step, ours, theirs, gaps)
            break
    print(f"{family}: greedy tokens {ours} (transformers {theirs})")


def _gpu_model_from(converted_folder, kind):
    args = parse_fork_args(flags_of(converted_folder), kind, extra=[BACKENDS["local"]])
    return build_fork_model(args, kind).cuda().eval()


def _one_document(ids):
    from megatron.packed_graphs.packed_seq import build_packed_batch_params

    tokens = torch.tensor([ids], device="cuda")
    positions = torch.arange(len(ids), device="cuda")[None]
    cu = torch.tensor([0, len(ids)], dtype=torch.int32, device="cuda")
    return [tokens[0]], tokens, positions, build_packed_batch_params(cu, positions, len(ids))
