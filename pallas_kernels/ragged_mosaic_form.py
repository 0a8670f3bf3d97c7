"""The form of the ragged Mosaic GPU kernel (`ragged_attention_mosaic.py`) for given shapes: warp-specialized or
one warpgroup, its KV block, and the shared memory it takes; and whether the kernel takes the shapes at all."""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.paged_decode_mosaic import ROWS, SMEM_BYTES, mosaic_decode_supported

COMPUTE_WGS = 2
STAGES = 2  # the K/V ring: one stage multiplied while the next lands


def ws_smem_bytes(itemsize: int, head_dim: int, block_kv: int, kv_itemsize: int | None = None) -> int:
    """Shared memory of one warp-specialized program: the q/output tiles of both compute warpgroups, the K/V
    ring, and the ring the float8 pages land in when the pages are narrower than q."""
    kv_itemsize = kv_itemsize or itemsize
    landing = 2 * STAGES * block_kv * head_dim * kv_itemsize if kv_itemsize != itemsize else 0
    return COMPUTE_WGS * ROWS * head_dim * itemsize + 2 * STAGES * block_kv * head_dim * itemsize + landing + 1024


def ws_block_kv(itemsize: int, head_dim: int, page_size: int, kv_itemsize: int | None = None) -> int | None:
    """The default KV block of the warp-specialized kernel: 128 keys where they fit, else 64 or 256."""
    for block_kv in (128, 64, 256):
        if block_kv % page_size == 0 and ws_smem_bytes(itemsize, head_dim, block_kv, kv_itemsize) <= SMEM_BYTES:
            return block_kv
    return None


def kernel_form(dtype, kv_dtype, head_dim: int, page_size: int, interpret: bool, compute_wgs: int | None = None,
          block_kv: int | None = None) -> tuple[int, int, int | None]:
    """(compute_wgs, block_kv, SMEM bytes of the program or None for the one-warpgroup kernel's own sum), the
    defaults filled in: the warp-specialized form when compiled, 128-key blocks where they fit. In the
    interpreter the three warpgroups are three threads blocking on each other inside host callbacks, which can
    exhaust the CPU thread pool of a host with few cores (tests/mosaic_ws_worker.py)."""
    itemsize, kv_itemsize = jnp.dtype(dtype).itemsize, jnp.dtype(kv_dtype).itemsize
    if compute_wgs is None:  # one warpgroup where no warp-specialized block fits (256-wide float8 heads)
        fits = block_kv is not None or ws_block_kv(itemsize, head_dim, page_size, kv_itemsize) is not None
        compute_wgs = 1 if interpret or not fits else COMPUTE_WGS
    if compute_wgs == 1:
        return 1, block_kv or 64, None
    block_kv = block_kv or ws_block_kv(itemsize, head_dim, page_size, kv_itemsize) or 64
    return compute_wgs, block_kv, ws_smem_bytes(itemsize, head_dim, block_kv, kv_itemsize)


def ragged_mosaic_supported(dtype, head_dim: int, page_size: int, group: int, kv_dtype=None,
                            interpret: bool = False) -> str | None:
    """None when the kernel in its default form takes these shapes, else the reason it does not."""
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    _, block_kv, smem = kernel_form(dtype, kv_dtype, head_dim, page_size, interpret)
    return mosaic_decode_supported(dtype, head_dim, page_size, group, block_kv, kv_dtype=kv_dtype, smem=smem)
