"""The Pallas grouped matmul (pallas_kernels/grouped_matmul.py) compiled for sm_90 without a GPU, at a Qwen3-30B-A3B
MoE layer's shapes (128 experts, 2048 wide, 768 per expert): a prefill step's 4096 routed rows and a decode step's
512, bfloat16, int8 and float8 weights. XLA:GPU's own ragged dot expands x to [rows, experts, K] there; the kernel's
temporaries stay a few rows' worth."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.grouped_matmul import grouped_matmul


def _temp_bytes(fn, spec, x, w, g) -> tuple[int, str]:
    compiled = jax.jit(fn).trace(spec(x.shape, x.dtype), spec(w.shape, w.dtype), spec(g.shape, g.dtype)).lower().compile()
    return compiled.memory_analysis().temp_size_in_bytes, compiled.as_text()


@pytest.mark.gpu_compile
@pytest.mark.parametrize("M,K,N,w_dtype", [(4096, 2048, 768, jnp.bfloat16), (4096, 768, 2048, jnp.bfloat16),
                                           (512, 2048, 768, jnp.int8), (512, 768, 2048, jnp.float8_e4m3fn)])
def test_grouped_matmul_compiles_for_sm90_without_expanding_rows(spec, M, K, N, w_dtype):
    G = 128
    x, w, g = (jax.ShapeDtypeStruct(s, d) for s, d in (((M, K), jnp.bfloat16), ((G, K, N), w_dtype), ((G,), jnp.int32)))
    ours, text = _temp_bytes(lambda x, w, g: grouped_matmul(x, w, g), spec, x, w, g)
    assert "triton" in text.lower(), "no Pallas Triton kernel in the compiled program"
    theirs, _ = _temp_bytes(lambda x, w, g: jax.lax.ragged_dot(x, w.astype(x.dtype), g), spec, x, w, g)
    print(f"grouped matmul M={M} K={K} N={N} G={G} {jnp.dtype(w_dtype).name}: temporaries {ours / 2**20:.1f} MiB "
          f"(XLA's ragged dot: {theirs / 2**20:.1f} MiB)")
    assert ours * 8 < theirs and ours < (M + G * 64) * (K + N) * 4 + (64 << 20)
