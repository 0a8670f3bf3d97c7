"""The KV write as a Triton kernel called through `jax_triton` (NVIDIA GPUs only).

Each token's K (and V) row of `num_kv_heads * head_dim` elements is contiguous both in `k_new` and at its slot
in the page pool (`[num_pages, page_size, KVH, D]` flattened to `[slots, KVH * D]`), so one program copies one
contiguous row. `triton` and `jax_triton` are imported only when the kernel is first built, so this module
imports cleanly on machines without them; `triton_available()` says whether the kernel can be used.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.kv_write import check_write_kv_args


@functools.cache
def triton_available() -> bool:
    """True when `jax_triton` imports, which needs JAX's CUDA plugin."""
    try:
        import jax_triton  # noqa: F401
        import triton  # noqa: F401
    except Exception:  # ImportError, or jax_triton refusing a JAX without GPU support
        return False
    return True


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def write_kv_rows(
        slots_ptr,
        k_new_ptr,
        v_new_ptr,
        k_in_ptr,
        v_in_ptr,
        k_out_ptr,
        v_out_ptr,
        ROW: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        token = tl.program_id(0)
        slot = tl.load(slots_ptr + token).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        in_row = cols < ROW
        src = token.to(tl.int64) * ROW + cols
        dst = slot * ROW + cols
        tl.store(k_out_ptr + dst, tl.load(k_new_ptr + src, mask=in_row), mask=in_row)
        tl.store(v_out_ptr + dst, tl.load(v_new_ptr + src, mask=in_row), mask=in_row)

    return write_kv_rows


@functools.partial(jax.jit, static_argnames=("compute_capability",), donate_argnums=(0, 1))
def write_kv_triton(k_pages, v_pages, k_new, v_new, slot_mapping, *, compute_capability: int | None = None):
    """KV write through `jax_triton`, in place on the (donated) pages; returns (k_pages, v_pages)."""
    import jax_triton

    check_write_kv_args(k_pages, v_pages, k_new, v_new, slot_mapping)
    num_tokens, num_kv_heads, head_dim = k_new.shape
    if num_tokens == 0:
        return k_pages, v_pages
    row = num_kv_heads * head_dim
    block = 1 << (row - 1).bit_length()
    # Slots past the pool would write out of bounds; send them to the scratch page instead.
    num_slots = k_pages.shape[0] * k_pages.shape[1]
    slots = jnp.where((slot_mapping >= 0) & (slot_mapping < num_slots), slot_mapping, 0)
    return jax_triton.triton_call(
        slots,
        k_new,
        v_new,
        k_pages,
        v_pages,
        kernel=_kernel(),
        out_shape=(
            jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
            jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype),
        ),
        grid=(num_tokens,),
        input_output_aliases={3: 0, 4: 1},
        num_warps=4 if block >= 512 else 1,
        num_stages=1,
        compute_capability=compute_capability,
        name="write_kv_rows",
        ROW=row,
        BLOCK=block,
    )
