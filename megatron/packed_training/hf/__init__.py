"""Hugging Face checkpoints in and out: start training from a pretrained model, give it back.

    from megatron.packed_training.hf import import_hf, export_hf

    result = import_hf("Llama-3.2-1B", "llama-converted")   # HF folder -> torch_dist release
    print(result.launch_text())                             # flags that build the model
    export_hf("runs/sft", "llama-sft-hf", hf_config="llama-converted")  # and back

`import_hf` writes a Megatron-LM torch_dist checkpoint (``release``) that
``--pretrained-checkpoint`` (or ``--load ... --finetune``) loads at any TP / PP / EP, copies
the tokenizer and config.json beside it (``--tokenizer-model <folder>``) and returns the
launch flags of the matching model. `export_hf` turns any Megatron-LM torch_dist checkpoint of
that model (a training run's ``--save`` folder) back into a folder
``transformers.AutoModelForCausalLM.from_pretrained`` loads. Both stream: peak host memory
is about one safetensors shard plus one layer, never the model.

Families (``model_type``): llama (Llama 3.x), qwen3, qwen3_moe, deepseek_v3 (DeepSeek-V3,
Moonlight), nemotron_h. Each has one mapping table in ``families/``. Command line:
``tools/convert_hf.py``; user guide: docs/hf-checkpoints.md.
"""

from megatron.packed_training.hf.config import ConversionError
from megatron.packed_training.hf.convert import (
    ConversionResult,
    export_hf,
    import_hf,
    padded_vocab_size,
)
from megatron.packed_training.hf.families import supported_model_types

__all__ = ["ConversionError", "ConversionResult", "export_hf", "import_hf",
           "padded_vocab_size", "supported_model_types"]
