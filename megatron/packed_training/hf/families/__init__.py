"""The model families the converter knows: one module per family, each with one mapping
table (`mapping.LayerKind` rules) and the launch flags that build the same model.

`describe(config)` dispatches on ``config.json``'s ``model_type``.
"""

from typing import Callable

from megatron.packed_training.hf.config import ConversionError, HFConfig
# A family's answer; it lives in mapping.py so the family modules need not import this
# package, which imports them.
from megatron.packed_training.hf.mapping import Converted

__all__ = ["Converted", "describe", "supported_model_types"]


def _registry() -> dict[str, Callable[[HFConfig], Converted]]:
    from megatron.packed_training.hf.families import (
        deepseek_v3,
        llama,
        nemotron_h,
        qwen3,
        qwen3_moe,
    )

    return {model_type: module.describe
            for module in (llama, qwen3, qwen3_moe, deepseek_v3, nemotron_h)
            for model_type in module.MODEL_TYPES}


def supported_model_types() -> list[str]:
    return sorted(_registry())


def describe(config: HFConfig) -> Converted:
    """The family's reading of ``config``; a `ConversionError` for another model_type or a
    field the fork cannot build."""
    registry = _registry()
    if config.model_type not in registry:
        raise ConversionError(
            f"config.json model_type is {config.model_type!r}: the converter supports "
            f"{', '.join(sorted(registry))}. For another family, convert with Megatron-Bridge "
            f"(docs/hf-checkpoints.md, 'Other families')")
    return registry[config.model_type](config)
