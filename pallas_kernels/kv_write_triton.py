"""The KV write as a Triton kernel called through `jax_triton` (NVIDIA GPUs only).

Each token's K (and V) row of `num_kv_heads * head_dim` elements is contiguous both in `k_new` and at its slot
in the page pool (`[num_pages, page_size, KVH, D]` flattened to `[slots, KVH * D]`), so one program copies one
contiguous row. `triton` and `jax_triton` are imported only when the kernel is first built, so this module
imports cleanly on machines without them; `triton_available()` says whether the kernel can be used. Both
jax-triton calling conventions are served: up to 0.3 (an aliased output is its own kernel parameter) and from
0.4 (the aliased input's pointer is the output).
"""

from __future__ import annotations

import functools
import inspect
import warnings

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
def _aliased_outputs_are_parameters() -> bool:
    """Whether `jax_triton` passes an output aliased to an input as its own kernel parameter.

    jax-triton up to 0.3 does (its `triton_call` takes `out_shape`); from 0.4 (which takes `out_type`) the
    aliased input's pointer is the output.
    """
    import jax_triton

    return "out_type" not in inspect.signature(jax_triton.triton_call).parameters


def _kernel(aliased_outputs_are_parameters: bool):
    from pallas_kernels import kv_write_triton_kernels as kernels

    return kernels.write_kv_rows_into if aliased_outputs_are_parameters else kernels.write_kv_rows


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
    out = (jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype), jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype))
    old_api = _aliased_outputs_are_parameters()
    with warnings.catch_warnings():
        # jax-triton 0.4 deprecates `input_output_aliases` in favour of mutable refs; the alias, with the
        # pool donated, is what keeps this write in place in both versions.
        warnings.filterwarnings("ignore", "input_output_aliases is deprecated", DeprecationWarning)
        return jax_triton.triton_call(
            slots,
            k_new,
            v_new,
            k_pages,
            v_pages,
            kernel=_kernel(old_api),
            **({"out_shape": out} if old_api else {"out_type": out}),
            grid=(num_tokens,),
            input_output_aliases={3: 0, 4: 1},
            num_warps=4 if block >= 512 else 1,
            num_stages=1,
            compute_capability=compute_capability,
            name="write_kv_rows",
            ROW=row,
            BLOCK=block,
        )
