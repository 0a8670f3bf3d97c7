"""The sampler's noise: Exp(1) per (row, token) from a counter hash of the row's key and the token id.

A counter hash rather than threefry: threefry over a 49152-token vocabulary costs ~440 ms per call at 256
rows on a 2-core CPU (the hash: ~80 ms); the hash maps distinct token ids to distinct 32-bit values under a
key (`jaxserve.engine.sampler` draws with the exponential race, argmax(p / E)).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def exponential_noise(keys: jax.Array, vocab_size: int) -> jax.Array:
    """Exp(1) noise [S, V] from a counter hash of (row key, token id); bijective in the id."""
    ids = lax.broadcasted_iota(jnp.uint32, (1, vocab_size), 1)
    x = fmix32(ids * jnp.uint32(0x9E3779B9) ^ keys[:, :1])
    x = fmix32(x ^ keys[:, 1:])
    return -jnp.log(open_unit(x))


def open_unit(x: jax.Array) -> jax.Array:
    """uint32 bits to a float32 strictly inside (0, 1): the top 23 bits, centred in their step. With
    24 bits the top value's +0.5 rounds up to 2**24, u to 1.0 and the noise to 0, which made a token
    win the race whatever its probability (~0.3% of draws over a 49152-token vocabulary)."""
    return ((x >> 9).astype(jnp.float32) + 0.5) * (1.0 / (1 << 23))


def fmix32(x: jax.Array) -> jax.Array:
    # MurmurHash3's finalizer: a bijection on uint32 with full avalanche.
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)
