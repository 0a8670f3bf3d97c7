"""TII's Falcon-H1 (`FalconH1ForCausalLM`): every layer a Mamba-2 mixer and attention side by side on one normed input,
their outputs summed into the residual, then the MLP; Bamba's module names. Read as a hybrid model whose Mamba layers
are all its layers, each beside attention (`MambaConfig.parallel`); the mixer's output ungated-normed (`gate_norm`
"none": y * silu(z)) unless `mamba_rms_norm`, then normed per group before or after its gate.

Its µP multipliers (`FalconScales`: the keys', the attention's and the mixer's inputs and outputs, each part of the
mixer's input projection, the MLP's gate and output) are folded into the weights at load (`loader.falcon_keys`) and
out again when written; the embedding's and the LM head's are `ModelConfig.embedding_multiplier` and
`logits_scaling`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jaxserve.errors import UnsupportedModelError

FAMILY = "falcon_h1"


@dataclass(frozen=True)
class FalconScales:
    """Falcon-H1's multipliers, as its config gives them."""

    key: float = 1.0
    attention_in: float = 1.0
    attention_out: float = 1.0
    ssm_in: float = 1.0
    ssm_out: float = 1.0
    ssm: tuple[float, float, float, float, float] = (1.0, 1.0, 1.0, 1.0, 1.0)  # z, x, B, C, dt of the input projection
    mlp: tuple[float, float] = (1.0, 1.0)  # the gate's (before its activation), the output's
    embedding: float = 1.0
    lm_head: float = 1.0

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> FalconScales:
        f = lambda key: float(1.0 if d.get(key) is None else d[key])  # noqa: E731
        ssm, mlp = tuple(d.get("ssm_multipliers") or (1.0,) * 5), tuple(d.get("mlp_multipliers") or (1.0, 1.0))
        if len(ssm) != 5 or len(mlp) != 2:
            raise UnsupportedModelError(f"falcon_h1 ssm_multipliers {list(ssm)} / mlp_multipliers {list(mlp)} must "
                                        "have 5 and 2 values")
        return cls(key=f("key_multiplier"), attention_in=f("attention_in_multiplier"),
                   attention_out=f("attention_out_multiplier"), ssm_in=f("ssm_in_multiplier"),
                   ssm_out=f("ssm_out_multiplier"), ssm=tuple(map(float, ssm)), mlp=tuple(map(float, mlp)),
                   embedding=f("embedding_multiplier"), lm_head=f("lm_head_multiplier"))

    def to_hf(self) -> dict[str, Any]:
        return {"key_multiplier": self.key, "attention_in_multiplier": self.attention_in,
                "attention_out_multiplier": self.attention_out, "ssm_in_multiplier": self.ssm_in,
                "ssm_out_multiplier": self.ssm_out, "ssm_multipliers": list(self.ssm),
                "mlp_multipliers": list(self.mlp),
                "embedding_multiplier": self.embedding, "lm_head_multiplier": self.lm_head}


def falcon_h1(d: dict[str, Any]) -> dict[str, Any]:
    """A Falcon-H1 config in Granite 4.0-H's keys (every layer "mamba", `mamba_parallel`; its mixer's norm as
    `mamba_gate_norm`), with transformers' defaults; any other config as it is."""
    if d.get("model_type") != FAMILY and "FalconH1ForCausalLM" not in (d.get("architectures") or []):
        return d
    if d.get("quantization_config"):
        raise UnsupportedModelError("falcon_h1 checkpoints stored quantized are not supported (their multipliers are "
                                    "folded into float weights at load; --quantization quantizes after)")
    if d.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"falcon_h1 with hidden_act {d['hidden_act']!r} is not supported (silu)")
    for key in ("attention_bias", "mlp_bias"):
        if d.get(key):
            raise UnsupportedModelError(f"falcon_h1 with {key} is not supported")
    if bool(d.get("mamba_proj_bias")) != bool(d.get("projectors_bias")):
        raise UnsupportedModelError("falcon_h1 with mamba_proj_bias and projectors_bias differing is not supported")
    n, hidden = int(d["num_hidden_layers"]), int(d["hidden_size"])
    heads = int(d.get("mamba_n_heads") or 128)
    inner = int(d.get("mamba_d_ssm") or int(d.get("mamba_expand", 2)) * hidden)
    if inner % heads:
        raise UnsupportedModelError(f"falcon_h1 mamba_n_heads ({heads}) must divide the mixer's width ({inner})")
    head_dim = d.get("mamba_d_head", "auto")
    head_dim = inner // heads if head_dim in (None, "auto") else int(head_dim)
    if head_dim * heads != inner:
        raise UnsupportedModelError(f"falcon_h1 mamba_d_head ({head_dim}) x mamba_n_heads ({heads}) must be the "
                                    f"mixer's width ({inner})")
    norm = "none" if not d.get("mamba_rms_norm", False) else "before" if d.get("mamba_norm_before_gate", True) \
        else "gated"
    return {**d, "architectures": ["FalconH1ForCausalLM"], "model_type": FAMILY,
            "num_key_value_heads": d.get("num_key_value_heads") or d["num_attention_heads"],
            "layer_types": ["mamba"] * n, "mamba_parallel": True, "mamba_gate_norm": norm,
            "mamba_n_heads": heads, "mamba_d_head": head_dim, "mamba_d_state": int(d.get("mamba_d_state") or 256),
            "mamba_n_groups": int(d.get("mamba_n_groups") or 1), "mamba_d_conv": int(d.get("mamba_d_conv") or 4),
            "mamba_conv_bias": bool(d.get("mamba_conv_bias", True)), "mamba_proj_bias": bool(d.get("mamba_proj_bias")),
            "rms_norm_eps": d.get("rms_norm_eps", 1e-5)}


def falcon_fields(d: dict[str, Any]) -> dict[str, Any]:
    """Falcon-H1's `ModelConfig` fields of its multipliers (`d` as `falcon_h1` gives it)."""
    scales = FalconScales.from_hf(d)
    return {"falcon": scales, "embedding_multiplier": scales.embedding, "logits_scaling": 1.0 / scales.lm_head}


def falcon_hf(cfg: Any) -> dict[str, Any]:
    """A Falcon-H1 model's own HF config keys (the inverse of `falcon_h1` and `falcon_fields`)."""
    m = cfg.mamba
    return {**cfg.falcon.to_hf(), "mamba_n_heads": m.num_heads, "mamba_d_head": m.head_dim, "mamba_d_ssm": m.inner,
            "mamba_d_state": m.state_size, "mamba_n_groups": m.n_groups, "mamba_d_conv": m.conv_kernel,
            "mamba_conv_bias": m.conv_bias, "mamba_proj_bias": m.proj_bias, "projectors_bias": m.proj_bias,
            "mamba_rms_norm": m.gate_norm != "none", "mamba_norm_before_gate": m.gate_norm == "before",
            "time_step_limit": [m.time_step_min, m.time_step_max]}
