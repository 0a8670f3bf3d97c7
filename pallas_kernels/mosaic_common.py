"""What the Mosaic GPU kernels (`paged_decode_mosaic.py`, `ragged_attention_mosaic.py`) share beyond their
bodies: the `plgpu` module, register-layout hints that the CPU interpreter lacks, WGMMA operand tiling, and
the compile and interpreter options."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl


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


def copy_kv_block(pages_ref, dst, bar, block_tables_ref, seq, j, last_page, kv_head) -> None:
    """Start the TMA copies of KV block j of sequence `seq` (its `dst.shape[0] // page_size` pages of one KV
    head) into the SMEM tile `dst`, one copy and one arrival on `bar` per page; pages past `last_page`
    re-read it."""
    plgpu = plgpu_module()
    num_pages, page_size = pages_ref.shape[:2]
    pages_per_block = dst.shape[0] // page_size
    for i in range(pages_per_block):
        idx = jnp.minimum(j * pages_per_block + i, last_page)
        page = jnp.clip(block_tables_ref[seq, idx], 0, num_pages - 1)
        plgpu.copy_gmem_to_smem(pages_ref.at[page, :, kv_head, :], dst.at[pl.ds(i * page_size, page_size)], bar)
