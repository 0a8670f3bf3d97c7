"""Tencent's Hunyuan models (`HunYuanDenseV1ForCausalLM`: Hunyuan 0.5B-7B, Hunyuan-MT; `HunYuanMoEV1ForCausalLM`:
Hunyuan-A13B): their `ModelConfig` fields from an HF config, and back (`ModelConfig.from_hf`, `config_hf.config_to_hf`).

Llama's layers with q and k normed per head after the rotation (`query_layernorm`, `key_layernorm`: read as q/k norms,
`ModelConfig.rope_qk_norm`), and a rotary base stretched by NTK-alpha (`rope_scaling` "dynamic" with an `alpha`: the
base times alpha^(d / (d - 2)), fixed, so read into `rope_theta`). A13B's layers: the softmax's top-k experts,
renormalized, beside an ungated shared MLP; transformers gives the experts and the shared MLP the config's
`intermediate_size`. The checkpoints' per-layer lists (`num_experts`, `moe_topk`, ...) must hold one value.
"""

from __future__ import annotations

from typing import Any

from jaxserve.errors import UnsupportedModelError

HUNYUAN_FAMILIES: tuple[str, ...] = ("hunyuan_v1_dense", "hunyuan_v1_moe")
_ARCHITECTURES = ("HunYuanDenseV1ForCausalLM", "HunYuanMoEV1ForCausalLM")
_PER_LAYER = ("num_experts", "moe_topk", "num_shared_expert", "moe_intermediate_size")


def hunyuan_config(d: dict[str, Any]) -> dict[str, Any]:
    """A Hunyuan config with its per-layer lists as single values and its NTK-alpha base in `rope_theta`; any other
    config as it is."""
    if d.get("model_type") not in HUNYUAN_FAMILIES and not set(_ARCHITECTURES) & set(d.get("architectures") or []):
        return d
    d = dict(d)
    for key in _PER_LAYER:
        value = d.get(key)
        if isinstance(value, list):
            if len(set(value)) != 1:
                raise UnsupportedModelError(f"Hunyuan with {key} differing by layer ({value}) is not supported")
            d[key] = value[0]
    for key in ("rope_scaling", "rope_parameters"):
        rope = d.get(key)
        if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) == "dynamic" and rope.get("alpha"):
            head_dim = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
            theta = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
            d["rope_theta"] = theta * float(rope["alpha"]) ** (head_dim / (head_dim - 2))
            d[key] = None
    return d


def hunyuan_moe_fields(d: dict[str, Any]) -> dict[str, Any]:
    """Hunyuan-A13B's experts (see the module doc; a GGUF file's top-k as `num_experts_per_tok`)."""
    width = d.get("moe_intermediate_size")
    if width is not None and int(width) != int(d["intermediate_size"]):
        raise UnsupportedModelError(f"Hunyuan with experts {width} wide beside an MLP {d['intermediate_size']} wide is "
                                    "not supported (transformers gives its experts the MLP's width)")
    return dict(num_experts=int(d.get("num_experts") or 1),
                num_experts_per_tok=int(d.get("moe_topk") or d.get("num_experts_per_tok") or 1),
                moe_intermediate_size=int(d["intermediate_size"]), norm_topk_prob=True,
                shared_expert_intermediate_size=int(d["intermediate_size"]))


def hunyuan_hf(cfg: Any) -> dict[str, Any]:
    """Hunyuan's own config keys (the inverse of `hunyuan_moe_fields`); the rotary base as read (alpha folded in)."""
    if cfg.family != "hunyuan_v1_moe":
        return {}
    return dict(num_experts=cfg.num_experts, moe_topk=cfg.num_experts_per_tok)
