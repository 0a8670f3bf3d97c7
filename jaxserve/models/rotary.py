"""Rotary embedding tables of a step's tokens (`rope_tables`), by position, LongRoPE factor set or M-RoPE section."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig, rope_inv_freq_and_scale


def rope_tables(cfg: ModelConfig, positions: jax.Array, local: bool = False, long_prompt: jax.Array | None = None,
                offsets: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """cos and sin, [T, rotary dims], for the half-split (rotate_half) rotary layout; `local`: the sliding
    layers' (see `rope_inv_freq_and_scale`). A LongRoPE model's tokens take the long factors at positions at or
    past its original context, and all of them in a sequence whose prompt is longer (`long_prompt` [T] bool, None:
    no such sequence). That is transformers' choice: it picks one set per forward call, the long one when the
    call's highest position is at or past the original context, so the prompt's call (all its tokens) when the
    prompt is longer, and each generated token's call from the token at the original context on. A token's set
    is thus fixed by its position and its prompt's length, whatever chunks or batches compute it.

    With M-RoPE (`cfg.mrope_section`), each section of rotary pairs turns by one of the token's three positions
    (temporal, height, width): its position plus its `offsets` ([3, T] int32, `ModelInputs.rope_offsets`)."""
    inv_freq, attention_factor = rope_inv_freq_and_scale(cfg, local)
    inv = jnp.asarray(np.asarray(inv_freq, np.float32))[None, :]  # [1, D/2]
    if cfg.long_rope_context is not None and not local:
        long = positions >= cfg.long_rope_context
        if long_prompt is not None:
            long = long | long_prompt
        inv_long = jnp.asarray(np.asarray(rope_inv_freq_and_scale(cfg, local, long=True)[0], np.float32))
        inv = jnp.where(long[:, None], inv_long[None, :], inv)  # [T, D/2]
    if cfg.mrope_section is not None and offsets is not None:  # (without offsets every axis is the position)
        axis = mrope_axes(cfg)
        angles = (positions[None, :] + offsets)[axis].T.astype(jnp.float32) * inv  # [T, D/2]
    else:
        angles = positions.astype(jnp.float32)[:, None] * inv  # [T, D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)  # [T, D]
    return jnp.cos(angles) * attention_factor, jnp.sin(angles) * attention_factor


def mrope_axes(cfg: ModelConfig) -> np.ndarray:
    """Each rotary pair's M-RoPE axis (0 temporal, 1 height, 2 width): `mrope_section[i]` pairs of axis i in turn,
    or, interleaved (Qwen3-VL), pair j of axis j % 3 while that axis has pairs left (then temporal), for each of
    the head's rotary pairs (Qwen3.5's sections may count more)."""
    section = cfg.mrope_section
    if not cfg.mrope_interleaved:
        return np.repeat(np.arange(len(section)), section)
    j = np.arange(cfg.rotary_dims // 2)
    return np.where((j % 3 == 1) & (j < 3 * section[1]), 1, np.where((j % 3 == 2) & (j < 3 * section[2]), 2, 0))


def query_scale(cfg: ModelConfig, positions: jax.Array) -> jax.Array:
    """[T]: Llama 4's scaling of queries by position (Ministral 3's and Mistral 4's on every layer; Llama 4's on its
    unrotated layers, positions counted from 1): 1 + beta * log(1 + floor(position / length))."""
    pos = positions + (cfg.family == "llama4")
    return 1.0 + cfg.query_scale_beta * jnp.log1p(jnp.floor(pos / cfg.query_scale_length))
