"""The latent attention kernel compiled for sm_90 without a GPU, at DeepSeek's entry (512-dim latent + 64-dim rotary
key, 576 wide): V2-Lite's 16 heads and V3's 128 per entry (two programs of 64 heads), decode buckets, one long
decode (KV splits), a prefill chunk, float8 pages."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import AttentionTuning
from pallas_kernels.latent_attention import latent_paged_attention

pytestmark = pytest.mark.gpu_compile

CASES = [
    # T, S, pages per seq, heads, pages dtype, tuning
    (32, 32, 512, 16, jnp.bfloat16, AttentionTuning()),
    (256, 256, 512, 16, jnp.bfloat16, AttentionTuning()),
    (64, 64, 512, 128, jnp.bfloat16, AttentionTuning()),
    (1, 1, 2048, 128, jnp.bfloat16, AttentionTuning()),
    (2048, 1, 128, 16, jnp.bfloat16, AttentionTuning()),
    (512, 4, 128, 128, jnp.bfloat16, AttentionTuning()),
    (64, 64, 512, 16, jnp.float8_e4m3fn, AttentionTuning()),
    (64, 64, 512, 32, jnp.bfloat16, AttentionTuning(latent_heads=16, block_kv=64, num_stages=3)),
]


@pytest.mark.parametrize("T,S,P,heads,kv_dtype,tuning", CASES)
def test_latent_attention_compiles_for_sm90(spec, T, S, P, heads, kv_dtype, tuning):
    args = (spec((T, heads, 576), jnp.bfloat16), spec((8192, 16, 576), kv_dtype), spec((S, P), jnp.int32),
            spec((S,), jnp.int32), spec((S + 1,), jnp.int32))
    fn = functools.partial(latent_paged_attention, value_dim=512, sm_scale=192**-0.5, tuning=tuning)
    text = jax.jit(fn).trace(*args).lower().compile().as_text()
    assert "triton" in text.lower(), "the latent attention did not go through the Triton lowering"
