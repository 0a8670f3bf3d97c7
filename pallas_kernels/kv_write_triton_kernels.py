"""The Triton source of the KV write (`kv_write_triton.py` builds the call). Importing this module needs
`triton`; it is imported only when the kernel is first built.
"""

import triton
import triton.language as tl


@triton.jit
def write_kv_rows(slots_ptr, k_new_ptr, v_new_ptr, k_out_ptr, v_out_ptr, ROW: tl.constexpr, BLOCK: tl.constexpr):
    """One program copies one token's K and V rows (`ROW` elements, padded to `BLOCK`) to its slot."""
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    in_row = cols < ROW
    src = token.to(tl.int64) * ROW + cols
    dst = slot * ROW + cols
    tl.store(k_out_ptr + dst, tl.load(k_new_ptr + src, mask=in_row), mask=in_row)
    tl.store(v_out_ptr + dst, tl.load(v_new_ptr + src, mask=in_row), mask=in_row)


@triton.jit
def write_kv_rows_into(
    slots_ptr, k_new_ptr, v_new_ptr, k_in_ptr, v_in_ptr, k_out_ptr, v_out_ptr, ROW: tl.constexpr, BLOCK: tl.constexpr
):
    """The same, for jax-triton up to 0.3, which passes an aliased output as its own parameter: the pages in
    and out are one buffer, written through the output's pointer."""
    write_kv_rows(slots_ptr, k_new_ptr, v_new_ptr, k_out_ptr, v_out_ptr, ROW, BLOCK)
