"""Grouped matmul for a mixture-of-experts layer: rows sorted by group (expert), each group's rows times its own matrix.

`grouped_matmul(x [M, K], w [G, K, N], group_sizes [G])` equals `jax.lax.ragged_dot(x, w, group_sizes)`: rows
`sum(group_sizes[:g])` .. `+ group_sizes[g]` of x are multiplied by `w[g]`; rows past the groups give zeros. XLA:GPU
lowers `ragged_dot` on Hopper by expanding x to [M, G, K] (each row masked to its group) for one dense matmul: G times
the work and an [M, G, K] temporary (a Qwen3-30B-A3B layer's 4096 routed rows over 128 experts: 2.1 GB, compiled for
sm_90 here). The kernel does each group's rows alone.

Each group's rows are cut into blocks of `block_m` (its last block partly empty); one program computes one block's
[block_m, block_n] tile of the output from the rows it gathers out of x and its group's matrix, over K in steps of
`block_k` (float32 accumulation; a narrower weight, int8 or float8, converted to x's dtype tile by tile). The
blocks' tiles are gathered back into row order. The grid has room for every block any split of M rows into G groups
can need (M / block_m + G); unused programs write zeros and return. Generic Pallas: interpret mode on the CPU, the
Triton lowering on a GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl


def check_grouped_matmul_args(x, w, group_sizes) -> None:
    """Raise ValueError/TypeError with a specific message when the arguments break the contract."""
    if x.ndim != 2:
        raise ValueError(f"x must be [rows, K], got shape {x.shape}")
    if w.ndim != 3 or w.shape[1] != x.shape[1]:
        raise ValueError(f"w must be [groups, {x.shape[1]}, N] (K matching x), got shape {w.shape}")
    if group_sizes.shape != (w.shape[0],):
        raise ValueError(f"group_sizes must be [{w.shape[0]}] (one size per group of w), got {group_sizes.shape}")
    if group_sizes.dtype != jnp.int32:
        raise TypeError(f"group_sizes must be int32, got {group_sizes.dtype}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"x must be floating point, got {x.dtype}")


def grouped_matmul_reference(x, w, group_sizes):
    """`jax.lax.ragged_dot` with w converted to x's dtype: [M, N] in x's dtype."""
    check_grouped_matmul_args(x, w, group_sizes)
    return lax.ragged_dot(x, w.astype(x.dtype), group_sizes)


def kernel_fits(k: int, n: int) -> bool:
    """Whether the kernel takes a [K, N] matrix per group: K and N multiples of 16 (the smallest tensor-core tile)."""
    return k % 16 == 0 and n % 16 == 0


def _largest_block(dim: int, most: int) -> int:
    block = most
    while dim % block:
        block //= 2
    return block


def _kernel(meta_ref, x_ref, w_ref, out_ref, *, block_m: int, block_n: int, block_k: int):
    """Program (b, j): block b's rows (group, first row, rows used) times its group's columns j * block_n..."""
    b, j = pl.program_id(0), pl.program_id(1)
    group, first, used = meta_ref[b, 0], meta_ref[b, 1], meta_ref[b, 2]
    local = lax.broadcasted_iota(jnp.int32, (block_m,), 0)
    # A partly used block's other rows read row 0: their outputs are never gathered back.
    rows = jnp.where(local < used, first + local, 0)
    k_steps = x_ref.shape[1] // block_k

    def body(step, acc):
        xt = x_ref[rows, pl.ds(step * block_k, block_k)]  # [block_m, block_k] gathered rows
        wt = w_ref[group, pl.ds(step * block_k, block_k), pl.ds(j * block_n, block_n)].astype(xt.dtype)
        return acc + jnp.dot(xt, wt, preferred_element_type=jnp.float32)

    steps = jnp.minimum(used, 1) * k_steps
    acc = lax.fori_loop(0, steps, body, jnp.zeros((block_m, block_n), jnp.float32))
    out_ref[...] = acc.astype(out_ref.dtype)


def _block_meta(group_sizes, num_rows: int, num_blocks: int, block_m: int):
    """[num_blocks, 3] int32: each block's group, first row and rows used (0: unused); and each row's position among
    the blocks' rows (rows past the groups: -1)."""
    sizes = jnp.maximum(group_sizes, 0)
    G = sizes.shape[0]
    blocks = (sizes + block_m - 1) // block_m
    block_end = jnp.cumsum(blocks)
    block_start, row_start = block_end - blocks, jnp.cumsum(sizes) - sizes
    b = jnp.arange(num_blocks, dtype=jnp.int32)
    g = jnp.searchsorted(block_end, b, side="right").astype(jnp.int32)  # G: past every group's blocks
    gc = jnp.minimum(g, G - 1)
    local = (b - block_start[gc]) * block_m
    used = jnp.where(g < G, jnp.clip(sizes[gc] - local, 0, block_m), 0)
    meta = jnp.stack([gc, row_start[gc] + local, used], axis=1).astype(jnp.int32)
    row = jnp.arange(num_rows, dtype=jnp.int32)
    rg = jnp.minimum(jnp.searchsorted(jnp.cumsum(sizes), row, side="right"), G - 1)
    position = block_start[rg] * block_m + row - row_start[rg]
    return meta, jnp.where(row < jnp.sum(sizes), position, -1)


@functools.partial(jax.jit, static_argnames=("interpret", "block_m", "num_warps", "num_stages"))
def grouped_matmul(x, w, group_sizes, *, interpret: bool = False, block_m: int | None = None, num_warps: int = 4,
                   num_stages: int = 2):
    """The Pallas grouped matmul: [M, N] in x's dtype, equal to `grouped_matmul_reference`. `block_m` (a power of two
    >= 16): rows per program; by default about the mean rows per group, 16 to 64."""
    check_grouped_matmul_args(x, w, group_sizes)
    (M, K), (G, _, N) = x.shape, w.shape
    if not kernel_fits(K, N):
        raise ValueError(f"the grouped matmul kernel needs K and N multiples of 16, got K={K}, N={N}")
    if block_m is None:
        block_m = min(64, max(16, 1 << max(0, -(-M // G) - 1).bit_length()))
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two >= 16, got {block_m}")
    if M == 0:
        return jnp.zeros((0, N), x.dtype)
    block_n, block_k = _largest_block(N, 128), _largest_block(K, 64)
    num_blocks = pl.cdiv(M, block_m) + G  # any split of M rows into G groups fits
    meta, position = _block_meta(group_sizes, M, num_blocks, block_m)
    compiler_params = None
    if not interpret:
        from jax.experimental.pallas import triton as pl_triton

        compiler_params = pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    tiles = pl.pallas_call(
        functools.partial(_kernel, block_m=block_m, block_n=block_n, block_k=block_k),
        grid=(num_blocks, N // block_n),
        in_specs=[pl.BlockSpec(meta.shape, lambda b, j: (0, 0)), pl.BlockSpec(x.shape, lambda b, j: (0, 0)),
                  pl.BlockSpec(w.shape, lambda b, j: (0, 0, 0))],
        out_specs=pl.BlockSpec((None, block_m, block_n), lambda b, j: (b, 0, j)),
        out_shape=jax.ShapeDtypeStruct((num_blocks, block_m, N), x.dtype),
        interpret=interpret,
        compiler_params=compiler_params,
        name=f"grouped_matmul_bm{block_m}_bn{block_n}_bk{block_k}",
    )(meta, x, w)
    out = tiles.reshape(num_blocks * block_m, N)[jnp.maximum(position, 0)]
    return jnp.where((position >= 0)[:, None], out, jnp.zeros_like(out))
