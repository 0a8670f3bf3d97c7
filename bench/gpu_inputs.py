"""The input sets of `bench/gpu_kernels.py`: paged attention batches whose pages are scattered over a pool
larger than the GPU's L2, several sets per row (fresh queries and page tables), and the bytes and FLOPs each
row's attention needs."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

PAGE_SIZE = 16
DTYPE = jnp.bfloat16
MIN_POOL_BYTES = 512 << 20  # pages scattered over a pool well past the 60 MiB L2
NUM_SETS = 3
IMAGE_TOKENS = 256  # the images row: Gemma 3's tokens an image, one every 512 positions


@dataclasses.dataclass(frozen=True)
class Heads:
    """Attention head shape of a model."""

    name: str
    q: int
    kv: int
    dim: int



def decode_case(
    rng,
    heads: Heads,
    batch: int,
    ctx: int,
    num_tokens: int | None = None,
    min_pool_bytes: int = MIN_POOL_BYTES,
    kv_dtype=DTYPE,
):
    """Input sets for `batch` sequences of KV length `ctx` with `num_tokens // batch` new tokens each, the
    pages in `kv_dtype` (float8 for `--kv-cache-dtype fp8`)."""
    q_len = 1 if num_tokens is None else num_tokens // batch
    pages_per_seq = -(-ctx // PAGE_SIZE)
    needed = batch * pages_per_seq
    kv_item = jnp.dtype(kv_dtype).itemsize
    page_bytes = PAGE_SIZE * heads.kv * heads.dim * kv_item
    num_pages = max(needed + 1, min_pool_bytes // (2 * page_bytes))
    shape = (num_pages, PAGE_SIZE, heads.kv, heads.dim)
    key = jax.random.key(int(rng.integers(1 << 30)))
    kk, kv, kq = jax.random.split(key, 3)
    k_pages = jax.random.normal(kk, shape, DTYPE).astype(kv_dtype)
    v_pages = jax.random.normal(kv, shape, DTYPE).astype(kv_dtype)
    sets = []
    for i, (tables, seq_lens, qsl) in enumerate(table_sets(rng, num_pages, batch, ctx, q_len)):
        q = jax.random.normal(jax.random.fold_in(kq, i), (batch * q_len, heads.q, heads.dim), DTYPE)
        sets.append((q, k_pages, v_pages, tables, seq_lens, qsl))
    return (sets, *work(heads, batch, ctx, q_len, kv_item))


def table_sets(rng, num_pages: int, batch: int, ctx: int, q_len: int) -> list[tuple[jax.Array, jax.Array, jax.Array]]:
    """`NUM_SETS` (page tables, sequence lengths, query starts) of `batch` sequences of `ctx` keys and `q_len` new
    tokens each, their pages drawn anew from pages 1 to `num_pages` - 1 for each set."""
    pages_per_seq = -(-ctx // PAGE_SIZE)
    needed = batch * pages_per_seq
    seq_lens = jnp.full((batch,), ctx, jnp.int32)
    qsl = jnp.arange(batch + 1, dtype=jnp.int32) * q_len
    return [(jnp.asarray(rng.choice(np.arange(1, num_pages), needed, replace=needed > num_pages - 1).reshape(
        batch, pages_per_seq), jnp.int32), seq_lens, qsl) for _ in range(NUM_SETS)]


def as_rows(sets, q_len: int):
    """The same queries as one-token rows (drafts verified as rows): each sequence's `q_len` tokens become rows
    of its page table, at KV lengths ctx - q_len + 1 ... ctx."""
    out = []
    for q, k_pages, v_pages, tables, seq_lens, _ in sets:
        offsets = jnp.tile(jnp.arange(1 - q_len, 1, dtype=jnp.int32), seq_lens.shape[0])
        rows = q.shape[0]
        out.append((q, k_pages, v_pages, jnp.repeat(tables, q_len, axis=0), jnp.repeat(seq_lens, q_len) + offsets,
                    jnp.arange(rows + 1, dtype=jnp.int32)))
    return out


def mixed_case(rng, heads: Heads, decodes: int, ctx: int, chunk: int, min_pool_bytes: int = MIN_POOL_BYTES):
    """Input sets for a mixed step: `decodes` decode tokens over `ctx` keys each, then one `chunk`-token prefill
    chunk ending at its own `ctx` keys."""
    sets, _, _ = decode_case(rng, heads, decodes + 1, ctx, min_pool_bytes=min_pool_bytes)
    qsl = jnp.asarray([*range(decodes + 1), decodes + chunk], jnp.int32)
    key = jax.random.key(int(rng.integers(1 << 30)))
    sets = [(jax.random.normal(jax.random.fold_in(key, i), (decodes + chunk, heads.q, heads.dim), DTYPE), *rest[1:5],
             qsl) for i, rest in enumerate(sets)]
    decode_bytes, decode_flops = work(heads, decodes, ctx, 1, jnp.dtype(DTYPE).itemsize)
    chunk_bytes, chunk_flops = work(heads, 1, ctx, chunk, jnp.dtype(DTYPE).itemsize)
    return sets, decode_bytes + chunk_bytes, decode_flops + chunk_flops


def span_sets(sets, ctx: int):
    """The sets of a one-sequence prefill with each set's `last_key` appended: an image of `IMAGE_TOKENS` tokens
    (each seeing up to the image's last) after every `IMAGE_TOKENS` of text."""
    last = np.arange(ctx, dtype=np.int32)
    for start in range(IMAGE_TOKENS, ctx - IMAGE_TOKENS + 1, 2 * IMAGE_TOKENS):
        last[start:start + IMAGE_TOKENS] = start + IMAGE_TOKENS - 1
    return [(*s, jnp.asarray(last)) for s in sets]


def work(heads: Heads, batch: int, ctx: int, q_len: int, kv_item: int) -> tuple[int, float]:
    """(bytes, FLOPs) of attention for `batch` sequences of `q_len` new tokens over `ctx` keys each: K and V
    read once, q read and the output written, QK^T and PV over the causal part."""
    kv_bytes = 2 * batch * ctx * heads.kv * heads.dim * kv_item
    io_bytes = 2 * batch * q_len * heads.q * heads.dim * 2
    flops = 4 * batch * heads.q * heads.dim * (q_len * ctx - q_len * (q_len - 1) / 2)
    return kv_bytes + io_bytes, flops


def dense_sets(sets, heads: Heads, batch: int, ctx: int):
    """The same attention with dense KV `[B, L, KVH, D]` for cuDNN (gathered once, outside the timing)."""
    out = []
    for q, k_pages, v_pages, tables, _, _ in sets:
        k = k_pages[tables].reshape(batch, -1, heads.kv, heads.dim)[:, :ctx]
        v = v_pages[tables].reshape(batch, -1, heads.kv, heads.dim)[:, :ctx]
        out.append((q.reshape(batch, -1, heads.q, heads.dim), k, v))
    return out
