"""What the Mosaic GPU kernels (`paged_decode_mosaic.py`, `ragged_attention_mosaic.py`) share beyond their
bodies: the `plgpu` module, register-layout hints that the CPU interpreter lacks, WGMMA operand tiling, the
logit transform and key mask (soft-cap, sliding window), and the compile and interpreter options."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def plgpu_module():
    """The Mosaic GPU Pallas module, imported when a kernel is built (it pulls in the CUDA lowering)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu


def register_layouts(interpret: bool):
    """`layout_cast` and `broadcasted_iota` with register layouts: hints for the GPU lowering, which the
    interpreter has no rule for (there they are the identity and the plain iota)."""
    if not interpret:
        plgpu = plgpu_module()
        return plgpu.layout_cast, plgpu.broadcasted_iota

    def layout_cast(x, layout):
        return x

    def iota(dtype, shape, dim, layout):
        return lax.broadcasted_iota(dtype, shape, dim)

    return layout_cast, iota


def logits(s, sm_scale: float, soft_cap: float | None, log_base: float = 1.0):
    """The scores `s` scaled, soft-capped (`cap * tanh(x / cap)`) when `soft_cap` is set, times `log_base`
    (log2(e) for a softmax in base 2)."""
    if soft_cap is None:
        return s * (sm_scale * log_base)
    return jnp.tanh(s * (sm_scale / soft_cap)) * (soft_cap * log_base)


def mask_keys(s, key_pos, row_pos, window: int | None):
    """`s` with -inf where a row does not see a key: keys past its position (causal) or, with a sliding window,
    `window` or more positions before it."""
    s = jnp.where(key_pos <= row_pos, s, -jnp.inf)
    if window is not None:
        s = jnp.where(key_pos > row_pos - window, s, -jnp.inf)
    return s


def window_start(pos, window: int | None, block_kv: int):
    """The first KV block holding a key that position `pos` sees."""
    if window is None:
        return jnp.zeros_like(pos)
    return lax.div(jnp.maximum(pos - window + 1, 0), block_kv)


def swizzled(dtype, head_dim: int):
    """SMEM transforms that make a `[rows, head_dim]` tile a WGMMA operand."""
    plgpu = plgpu_module()
    bits = jnp.finfo(dtype).bits
    swizzle = plgpu.find_swizzle(head_dim * bits)
    return (plgpu.TilingTransform((8, 8 * swizzle // bits)), plgpu.SwizzleTransform(swizzle))


def compiler_params():
    """Mosaic GPU compile options of both kernels: approximate exp2/exp (`ex2.approx`, a few ulp in float32,
    far below the bfloat16 rounding of the probabilities that the PV product reads)."""
    return plgpu_module().CompilerParams(approx_math=True)


def interpret_params():
    """Mosaic GPU's CPU interpreter (simulated SMEM, TMA and barriers); a private path in JAX 0.10."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams(uninitialized_memory="zero")
