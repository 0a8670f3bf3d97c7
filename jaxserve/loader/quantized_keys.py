"""Which of a checkpoint's projections a model of `cfg` holds quantized (`ModelConfig.weight_quant`)."""

from __future__ import annotations

from jaxserve.config import ModelConfig
from jaxserve.errors import CheckpointError
from jaxserve.loader.keymap import canonical_name, hf_names, hf_target, layer_field
from jaxserve.models.quantized import INPUT_AXES, METHODS


def projection_modules(cfg: ModelConfig) -> dict[str, str]:
    """Every quantizable projection of a checkpoint of `cfg`: HF module name -> our layer field ("wq", ...)."""
    out = {}
    for name in hf_names(cfg):
        target = hf_target(name, cfg)
        field = layer_field(target.path) if target is not None else ""
        if field in INPUT_AXES and name.endswith(".weight"):
            out[name.removesuffix(".weight")] = field
    return out


def kept_module(module: str, cfg: ModelConfig) -> bool:
    """Whether checkpoint module `module`'s weight is held quantized by `cfg` (`cfg.weight_quant`); a fused
    projection (Phi-3's `qkv_proj`, `gate_up_proj`) as the projections it packs."""
    if not cfg.weight_quant:
        return False
    name = canonical_name(f"{module}.weight", cfg)
    name = name.replace(".qkv_proj.", ".q_proj.").replace(".gate_up_proj.", ".gate_proj.")
    try:
        target = hf_target(name, cfg)
    except CheckpointError:
        return False
    return target is not None and layer_field(target.path) in METHODS[cfg.weight_quant].fields
