"""Weight formats: the QuantConfig a model is served with, chosen once from config.json's
`quantization_config` (a checkpoint stored quantized) or --quantization (an unquantized checkpoint
quantized while it loads). Adding a format is a module here and one line in a table below.

Each entry is "module:Class", imported only when a model asks for it. A checkpoint format's class has
`from_config(quantization_config: dict, unquantized) -> QuantConfig`; an online one `(unquantized)`.
Anything not listed, or a bit width / scheme / layout a listed format does not build, is a ValueError
of one line naming it, which the worker turns into exit 2 at start-up.
"""

from __future__ import annotations

import importlib

from shard_worker.model.quant.base import LinearMethod, QuantConfig

CHECKPOINT_FORMATS = {
    "compressed-tensors": "shard_worker.model.quant.compressed_tensors:CompressedTensorsConfig",
    "awq": "shard_worker.model.quant.int4_checkpoints:AWQConfig",
    "gptq": "shard_worker.model.quant.int4_checkpoints:GPTQConfig",
    # gpt-oss's released checkpoints: experts in MXFP4, decoded at load.
    "mxfp4": "shard_worker.model.quant.mxfp4:Mxfp4Config",
    # Written by common/gguf_model.py for `--model x.gguf`: the weights are the GGUF file's.
    "gguf": "shard_worker.model.quant.gguf:GGUFConfig",
}
ONLINE_FORMATS = {
    "int8": "shard_worker.model.quant.online:OnlineInt8Config",
    "fp8": "shard_worker.model.quant.online:OnlineFp8Config",
}
# --quantization's choices ("none": the checkpoint's own format, if any).
QUANTIZATION_CHOICES = ("none", *ONLINE_FORMATS)


def _load(entry: str):
    module, _, name = entry.partition(":")
    return getattr(importlib.import_module(module), name)


def select_quant_config(
    quantization_config: dict | None, quantization: str | None, unquantized: LinearMethod
) -> QuantConfig:
    """The model's QuantConfig. quantization_config: config.json's (None when the checkpoint is not
    quantized); quantization: --quantization (None or "none": the checkpoint decides)."""
    online = quantization if quantization not in (None, "none") else None
    if quantization_config is not None:
        if not isinstance(quantization_config, dict):
            raise ValueError("quantization_config is not a JSON object")
        method = quantization_config.get("quant_method")
        if online is not None:
            raise ValueError(
                f"--quantization {online}: the checkpoint is already quantized (quant_method {method!r})"
            )
        if method not in CHECKPOINT_FORMATS:
            raise ValueError(
                f"quantization_config: quant_method {method!r} is not supported; supported: "
                f"{', '.join(CHECKPOINT_FORMATS)}"
            )
        return _load(CHECKPOINT_FORMATS[method]).from_config(quantization_config, unquantized)
    if online is None:
        return QuantConfig(unquantized)
    if online not in ONLINE_FORMATS:
        supported = ", ".join(ONLINE_FORMATS)
        raise ValueError(f"--quantization {online!r} is not supported; supported: {supported}")
    return _load(ONLINE_FORMATS[online])(unquantized)
