"""What the vision towers of variable-size images share (`models.vision_qwen2`, `models.vision_pixtral`): their
activations, the rotation of q and k by each patch's rotary angles, and attention within segments (each image, or
each window of one) over a padded bucket of patches, a block of queries at a time."""

from __future__ import annotations

import jax
import jax.numpy as jnp

ACTIVATIONS = {"quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x), "silu": jax.nn.silu,
               "gelu": lambda x: jax.nn.gelu(x, approximate=False),
               "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True)}
QUERY_BLOCK = 1024  # patches whose attention is computed at once


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [N, H, D] rotated (in float32) by cos, sin [N, D]: each dimension paired with the one half a head away."""
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    turned = jnp.concatenate([-x2, x1], axis=-1)
    return (xf * cos[:, None] + turned * sin[:, None]).astype(x.dtype)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array) -> jax.Array:
    """Attention of patches q, k, v [N, H, D] within their segments (seg [N]), QUERY_BLOCK queries at a time, so
    the scores held at once are [H, QUERY_BLOCK, N], not [H, N, N]."""
    (N, H, D), Q = q.shape, min(q.shape[0], QUERY_BLOCK)

    def block(i: jax.Array) -> jax.Array:
        qb, sb = jax.lax.dynamic_slice_in_dim(q, i * Q, Q), jax.lax.dynamic_slice_in_dim(seg, i * Q, Q)
        scores = jnp.einsum("qhd,khd->hqk", qb, k, preferred_element_type=jnp.float32) * D**-0.5
        scores = jnp.where(sb[:, None] == seg[None, :], scores, jnp.finfo(jnp.float32).min)  # [H, Q, N]
        return jnp.einsum("hqk,khd->qhd", jax.nn.softmax(scores, axis=-1).astype(v.dtype), v)

    return jax.lax.map(block, jnp.arange(N // Q)).reshape(N, H, D)


def pixel_shuffle(x: jax.Array, s: int) -> jax.Array:
    """Features [B, g * g, E] of a g x g grid folded s x s into [B, (g / s)**2, E * s * s] (InternVL's and Idefics3's
    pixel shuffle): tokens row by row, each one's channels over (row in its square, column in it, channel)."""
    B, N, E = x.shape
    g = round(N**0.5)
    x = x.reshape(B, g // s, s, g // s, s, E).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(B, (g // s) ** 2, s * s * E)
