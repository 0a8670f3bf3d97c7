"""The small numerical pieces decoder layers share: RMSNorm, LayerNorm, each family's norm, q and k norms, the MLP's
activation and the rotary embedding's rotation."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.config import COHERE_FAMILIES, OLMO_FAMILIES, UNIT_NORM_FAMILIES, ModelConfig
from jaxserve.config_families import (
    BIASED_NORM_FAMILIES,
    UNBIASED_LAYER_NORM_FAMILIES,
    WEIGHTLESS_NORM_FAMILIES,
)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32, returned in x's dtype (as HF does)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def layer_norm(x: jax.Array, w: jax.Array, b: jax.Array, eps: float) -> jax.Array:
    """LayerNorm (weight and bias) computed in float32, returned in x's dtype."""
    xf = x.astype(jnp.float32)
    mean = xf.mean(-1, keepdims=True)
    var = jnp.square(xf - mean).mean(-1, keepdims=True)
    return ((xf - mean) * jax.lax.rsqrt(var + eps) * w.astype(jnp.float32) + b.astype(jnp.float32)).astype(x.dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate x ([T, H, D]) by position, its leading cos.shape[-1] dims (all, but for a partial rotary
    embedding; the others pass through); computed in float32."""
    rot = cos.shape[-1]
    xf = x.astype(jnp.float32)
    turned, kept = xf[..., :rot], xf[..., rot:]
    half = rot // 2
    rotated = jnp.concatenate([-turned[..., half:], turned[..., :half]], axis=-1)
    out = turned * cos[:, None, :] + rotated * sin[:, None, :]
    return (jnp.concatenate([out, kept], axis=-1) if rot < x.shape[-1] else out).astype(x.dtype)


def model_norm(cfg: ModelConfig, x: jax.Array, weight: jax.Array, bias: jax.Array | None = None) -> jax.Array:
    """The model's RMSNorm: Gemma's and Qwen3-Next's scale by (1 + weight), in float32, OLMo 2's, gpt-oss's and
    Helium's by its weight in float32 (as HF does); Cohere's and MPT's LayerNorm (centered, no bias) likewise, OLMo's
    (its weights ones), Jais 2's, StarCoder2's and the rest of `BIASED_NORM_FAMILIES` with its `bias`."""
    layer_norm = (*COHERE_FAMILIES, *UNBIASED_LAYER_NORM_FAMILIES, *BIASED_NORM_FAMILIES, *WEIGHTLESS_NORM_FAMILIES)
    if cfg.family not in (*UNIT_NORM_FAMILIES, *OLMO_FAMILIES, *layer_norm, "gpt_oss", "gemma4", "helium"):
        return rms_norm(x, weight, cfg.rms_norm_eps)
    xf = x.astype(jnp.float32)
    if cfg.family in layer_norm:
        xf = xf - jnp.mean(xf, axis=-1, keepdims=True)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + cfg.rms_norm_eps)
    scale = weight.astype(jnp.float32) + (1.0 if cfg.family in UNIT_NORM_FAMILIES else 0.0)
    out = xf * scale if bias is None else xf * scale + bias.astype(jnp.float32)  # (no add without a bias)
    return out.astype(x.dtype)


def mlp_activation(cfg: ModelConfig, gate: jax.Array | None, up: jax.Array, xielu: jax.Array | None) -> jax.Array:
    """act(gate) * up, or an ungated MLP's act(up): Arcee's squared ReLU, StarCoder2's tanh GELU, Apertus' xIELU (its
    learned alpha_p, alpha_n and its beta, eps per layer: `xielu` [4])."""
    if gate is not None:
        return (jax.nn.silu(gate) if cfg.hidden_act == "silu" else jax.nn.gelu(gate, approximate=True)) * up
    if cfg.hidden_act == "relu2":
        return jnp.square(jax.nn.relu(up))
    if cfg.hidden_act in ("gelu_pytorch_tanh", "gelu"):  # (GPT-NeoX's: exact)
        return jax.nn.gelu(up, approximate=cfg.hidden_act != "gelu")
    alpha_p, beta, eps = jax.nn.softplus(xielu[0]), xielu[2], xielu[3]
    alpha_n = beta + jax.nn.softplus(xielu[1])
    x = up.astype(jnp.float32)
    out = jnp.where(x > 0, alpha_p * x * x + beta * x, (jnp.expm1(jnp.minimum(x, eps)) - x) * alpha_n + beta * x)
    return out.astype(up.dtype)


def qk_norm(cfg: ModelConfig, x: jax.Array, weight: jax.Array, bias: jax.Array | None = None) -> jax.Array:
    """q or k ([T, H, D]) normed per head by a [D] weight (or Cohere's [H, D]: each head's own; Phi's with a [D]
    bias), or (OLMo) over all heads at once by an [H, D] one."""
    if not cfg.qk_norm_heads:
        return model_norm(cfg, x, weight, bias)
    return model_norm(cfg, x.reshape(x.shape[0], -1), weight.reshape(-1)).reshape(x.shape)


def clip_qkv(cfg: ModelConfig, q: jax.Array, k: jax.Array, v: jax.Array, normed: bool) -> tuple[jax.Array, ...]:
    """q, k and v clamped to [-clip_qkv, clip_qkv] where the model clamps them: OLMo's after their projections, OLMoE's
    after its q and k norms (`normed`)."""
    if cfg.clip_qkv is None or normed != (cfg.family == "olmoe"):
        return q, k, v
    return tuple(jnp.clip(x, -cfg.clip_qkv, cfg.clip_qkv) for x in (q, k, v))


def mlp_input(cfg: ModelConfig, lp, x: jax.Array, x_in: jax.Array, h_attn: jax.Array) -> jax.Array:
    """What a layer's MLP reads: the attention's normed input beside it (Cohere's, Phi's parallel blocks), the layer's
    input normed by its own norm beside it (GPT-NeoX's), or the residual after attention, normed (none without a norm:
    OLMo 2's)."""
    if cfg.parallel_block:
        return h_attn if lp.mlp_norm is None else model_norm(cfg, x_in, lp.mlp_norm, lp.mlp_norm_b)
    return x if lp.mlp_norm is None else model_norm(cfg, x, lp.mlp_norm, lp.mlp_norm_b)
