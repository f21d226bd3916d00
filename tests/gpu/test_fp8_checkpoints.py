"""Checkpoints of FP8 runs (Megatron-LM's format, docs/fp8.md): they hold the bf16 weights
and fp32 optimizer state as a BF16 run's do, plus Transformer Engine's FP8 state
(``_extra_state``: delayed scaling's amax history and scales).

* Resume: an FP8 run (tensorwise, delayed) saved at iteration 4 and resumed to 8 gives the
  uninterrupted run's losses (delayed scaling's history travels with the checkpoint), as a
  BF16 run does (test_training.py's tolerance).
* Export: an FP8 run started from a converted Llama and saved after a step of learning rate
  1e-30 exports (`export_hf`, what ``tools/convert_hf.py export`` runs) back to the Hugging
  Face weights bit for bit: the export reads the bf16 weights, never FP8 copies. After real
  steps the export is finite, moved off the start, and loads in transformers.

Run: ``python -m pytest -q tests/gpu/test_fp8_checkpoints.py`` (one GPU, TE).
"""

import math

import pytest
import torch

from megatron.packed_training.extra_args import is_importable
from megatron.packed_training.hf import export_hf, import_hf
from tests.gpu.launch import TE, TINY_GPT, TRAIN, losses, run_training, train_then_resume
from tests.unit.hf_tiny import flags_of, tiny_llama
from tests.unit.test_hf_convert import _weights

pytestmark = pytest.mark.skipif(not is_importable("transformer_engine"),
                                reason="FP8 needs Transformer Engine (pip install -e .[te])")


def fp8(recipe: str) -> list:
    return ["--fp8-format", "e4m3", "--fp8-recipe", recipe]


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_an_fp8_run_resumes_where_it_stopped(tmp_path, monkeypatch, recipe):
    if recipe == "delayed":  # TE loads delayed scaling's pickled state only when told to
        monkeypatch.setenv("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE", "1")
    common = TINY_GPT + TRAIN + TE + fp8(recipe) + ["--global-batch-size", "4",
                                                    "--train-iters", "8"]
    full = run_training("pretrain_gpt.py", common, tmp_path, name="full")
    first, second = train_then_resume("pretrain_gpt.py", common, tmp_path, save_interval=4,
                                      exit_interval=4)
    assert [r["iteration"] for r in second] == list(range(5, 9))
    print(f"{recipe}: resumed {losses(second)} against {losses(full)[4:]}")
    for resumed, reference in zip(second, full[4:]):
        assert abs(resumed["lm_loss"] - reference["lm_loss"]) < 2e-3, (resumed, reference)
    assert all(math.isfinite(loss) for loss in losses(full))


LLAMA_TRAINING = ["--mock-data", "--mock-doc-length-median", "48", "--seq-length", "256",
                  "--micro-batch-size", "1", "--global-batch-size", "4", "--bf16",
                  "--calculate-per-token-loss", "--log-interval", "1", "--eval-iters", "0",
                  "--seed", "1234", "--attention-backend", "auto", "--te-rng-tracker",
                  *fp8("tensorwise")]


def test_an_fp8_checkpoint_exports_its_bf16_weights(tmp_path):
    from transformers import AutoModelForCausalLM

    hf = tiny_llama(tmp_path / "hf")
    megatron = str(tmp_path / "megatron")
    import_hf(hf, megatron)
    start = [*flags_of(megatron), f"--pretrained-checkpoint={megatron}", *LLAMA_TRAINING]
    still = str(tmp_path / "still")
    run_training("pretrain_gpt.py", start + [
        "--train-iters", "1", "--lr", "1e-30", "--min-lr", "1e-30", "--weight-decay", "0",
        "--save", still, "--save-interval", "1"], tmp_path, name="still")
    export_hf(still, tmp_path / "still_hf", hf_config=megatron)
    original, back = _weights(hf), _weights(tmp_path / "still_hf")
    assert sorted(back) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(back[name].float(), tensor.to(back[name].dtype).float()), name

    trained = str(tmp_path / "trained")
    records = run_training("pretrain_gpt.py", start + [
        "--train-iters", "4", "--lr", "1e-3", "--min-lr", "1e-4", "--save", trained,
        "--save-interval", "4"], tmp_path, name="trained")
    assert all(math.isfinite(loss) for loss in losses(records))
    export_hf(trained, tmp_path / "trained_hf", hf_config=megatron)
    moved = _weights(tmp_path / "trained_hf")
    assert sorted(moved) == sorted(original)
    assert all(torch.isfinite(t.float()).all() for t in moved.values())
    assert any(not torch.equal(moved[name].float(), original[name].to(moved[name].dtype).float())
               for name in original)
    AutoModelForCausalLM.from_pretrained(tmp_path / "trained_hf")
