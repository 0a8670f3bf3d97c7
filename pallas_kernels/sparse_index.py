"""The lightning indexer's scores: DeepSeek Sparse Attention's (DeepSeek-V3.2, GLM-5) choice of keys, as a kernel.

Each query token t has `Hi` indexer heads q [Hi, Di] and head weights w [Hi]; each key j of its sequence one indexer
key k_j [Di], kept in the page pool inside the token's entry (dims `key_offset` .. `key_offset + Di`). The score of
key j for token t is sum over h of w_h * relu(scale * q_h . k_j), in float32, for the keys t sees (positions up to
its own); the rest are -inf. The caller takes each row's top-k (`lax.top_k`): the keys the token's sparse attention
reads (`sparse_latent_attention`).

Generic Pallas with a plain grid (interpret mode on the CPU; the Triton lowering for NVIDIA GPUs, where every block
dim is a power of two: heads are padded with zero weights, Di must be one). A program is one query token times a
chunk of `chunk` key positions: its heads' queries stay in registers while the chunk's keys are gathered from the
pages `block_kv` at a time and scored as one [Hi, block_kv] dot (tensor cores for 16-bit queries with 16 heads or
more: DeepSeek-V3.2's 64, GLM-5's 32), then reduced over the heads by their weights. Blocks past the token's
position are written -inf without reading a page. The scores of a row are [T, L] float32 with L the page tables'
capacity rounded up to whole chunks: the caller bounds T by memory.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.latent_attention import as_4d, is_pow2
from pallas_kernels.ragged_attention_args import MMA_MIN_ROWS, check_kv_page_dtype, next_pow2

CHUNK = 2048  # key positions a program scores (fewer when the tables hold fewer)
BLOCK_KV = 64  # keys a dot scores
STAGES = 3


def check_index_args(q, w, pages, block_tables, token_seq, token_pos, key_offset: int) -> None:
    """Raise ValueError/TypeError naming the problem when the arguments break the contract (`pages` 4-D)."""
    if q.ndim != 3:
        raise ValueError(f"q must be [num_tokens, index_heads, index_dim], got shape {q.shape}")
    num_tokens, heads, dim = q.shape
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise TypeError(f"q must be floating point, got {q.dtype}")
    if w.shape != (num_tokens, heads) or w.dtype != jnp.float32:
        raise ValueError(f"w must be float32 [{num_tokens}, {heads}] (a weight per token and head), got {w.dtype} "
                         f"{w.shape}")
    if pages.ndim != 4:
        raise ValueError(f"pages must be [num_pages, page_size, num_kv_heads, width], got {pages.shape}")
    check_kv_page_dtype(pages.dtype, q.dtype)
    if not 0 <= key_offset <= pages.shape[3] - dim:
        raise ValueError(f"the indexer keys (dims {key_offset}..{key_offset + dim}) must lie inside the entries' "
                         f"width ({pages.shape[3]})")
    if block_tables.ndim != 2 or block_tables.dtype != jnp.int32:
        raise ValueError(f"block_tables must be int32 [num_seqs, pages_per_seq], got {block_tables.dtype} "
                         f"{block_tables.shape}")
    for name, x in (("token_seq", token_seq), ("token_pos", token_pos)):
        if x.shape != (num_tokens,) or x.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32 [{num_tokens}] (one per query token), got {x.dtype} {x.shape}")


def score_chunk(block_tables: jax.Array, page_size: int, chunk: int | None = None) -> int:
    """Key positions a program scores: `chunk` (by default `CHUNK`), fewer when the tables hold fewer."""
    chunk = chunk or CHUNK
    if not is_pow2(chunk):
        raise ValueError(f"the indexer kernel's chunk must be a power of two, got {chunk}")
    return min(chunk, next_pow2(block_tables.shape[1] * page_size))


def score_capacity(block_tables: jax.Array, page_size: int, chunk: int | None = None) -> int:
    """The width L of the scores: the tables' key capacity rounded up to whole chunks."""
    chunk = score_chunk(block_tables, page_size, chunk)
    return pl.cdiv(block_tables.shape[1] * page_size, chunk) * chunk


@functools.partial(jax.jit, static_argnames=("key_offset", "scale", "chunk"))
def index_scores_reference(q, w, pages, block_tables, token_seq, token_pos, *, key_offset: int, scale: float,
                           chunk: int | None = None) -> jax.Array:
    """The kernel's oracle in plain JAX: [T, L] float32 (L as `score_capacity`), every key each token sees scored."""
    pages = as_4d(pages)
    check_index_args(q, w, pages, block_tables, token_seq, token_pos, key_offset)
    num_pages, page_size = pages.shape[:2]
    dim = q.shape[2]
    L = score_capacity(block_tables, page_size, chunk)
    keys = pages[:, :, 0, key_offset:key_offset + dim].astype(jnp.float32)  # [N, page_size, Di]
    kpos = jnp.arange(L, dtype=jnp.int32)
    page = jnp.take(block_tables, jnp.minimum(kpos // page_size, block_tables.shape[1] - 1), axis=1)  # [S, L]
    k = keys[jnp.clip(page[token_seq], 0, num_pages - 1), kpos % page_size]  # [T, L, Di]
    s = jnp.einsum("thd,tld->thl", q.astype(jnp.float32), k, precision=lax.Precision.HIGHEST)
    s = jnp.einsum("th,thl->tl", w, jax.nn.relu(s * scale), precision=lax.Precision.HIGHEST)
    return jnp.where(kpos[None, :] <= token_pos[:, None], s, -jnp.inf)


def _index_kernel(seq_ref, pos_ref, block_tables_ref, q_ref, w_ref, pages_ref, out_ref, *, key_offset: int,
                  block_kv: int, scale: float, use_mma: bool):
    """One program: one query token's scores over one chunk of key positions."""
    t, c = pl.program_id(0), pl.program_id(1)
    num_pages, page_size = pages_ref.shape[0], pages_ref.shape[1]
    pages_per_seq = block_tables_ref.shape[1]
    chunk, dim = out_ref.shape[0], q_ref.shape[1]
    seq, pos = seq_ref[t], pos_ref[t]
    start = c * chunk
    seen_blocks = jnp.clip(pl.cdiv(pos + 1 - start, block_kv), 0, chunk // block_kv)

    q = q_ref[...]  # [Hp, Di]
    w = w_ref[...]  # [Hp] float32 (zero for the padding heads)
    if not use_mma:
        q = q.astype(jnp.float32)

    def score(i, carry):
        kv_pos = start + i * block_kv + lax.broadcasted_iota(jnp.int32, (block_kv,), 0)
        page = jnp.clip(block_tables_ref[seq, jnp.minimum(kv_pos // page_size, pages_per_seq - 1)], 0, num_pages - 1)
        keys = pages_ref[page, kv_pos % page_size, 0, pl.ds(key_offset, dim)]  # [block_kv, Di]
        if use_mma:
            s = lax.dot_general(q, keys.astype(q.dtype), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        else:
            s = jnp.sum(q[:, None, :] * keys.astype(jnp.float32)[None, :, :], axis=-1)
        s = jnp.sum(w[:, None] * jnp.maximum(s * scale, 0.0), axis=0)  # [block_kv]
        out_ref[pl.ds(i * block_kv, block_kv)] = jnp.where(kv_pos <= pos, s, -jnp.inf)
        return carry

    def unseen(i, carry):
        out_ref[pl.ds(i * block_kv, block_kv)] = jnp.full((block_kv,), -jnp.inf, jnp.float32)
        return carry

    lax.fori_loop(0, seen_blocks, score, 0)
    lax.fori_loop(seen_blocks, chunk // block_kv, unseen, 0)


@functools.partial(jax.jit, static_argnames=("key_offset", "scale", "interpret", "chunk", "block_kv", "num_warps",
                                             "num_stages"))
def index_scores(q, w, pages, block_tables, token_seq, token_pos, *, key_offset: int, scale: float,
                 interpret: bool = False, chunk: int | None = None, block_kv: int | None = None,
                 num_warps: int | None = None, num_stages: int | None = None) -> jax.Array:
    """The indexer's scores [T, L] float32 (L as `score_capacity`; -inf where a token does not see the key).

    q [T, Hi, Di] (Di a power of two); w [T, Hi] float32; pages [N, page_size, KVH, W] (or [N, page_size, W]), the
    keys at dims `key_offset` .. `key_offset + Di` of KV head 0's entries; block_tables [S, P] int32; token_seq [T]
    int32 (each token's row of the tables) and token_pos [T] int32 (its position; -1 for a padding token, which sees
    nothing). `chunk` (key positions a program), `block_kv`, `num_warps`, `num_stages` override the defaults."""
    pages = as_4d(pages)
    check_index_args(q, w, pages, block_tables, token_seq, token_pos, key_offset)
    num_tokens, heads, dim = q.shape
    if not is_pow2(dim):
        raise ValueError(f"the indexer kernel needs a power-of-two key dim, got {dim}")
    chunk = score_chunk(block_tables, pages.shape[1], chunk)
    L = score_capacity(block_tables, pages.shape[1], chunk)
    if num_tokens == 0:
        return jnp.zeros((0, L), jnp.float32)
    padded = next_pow2(heads)
    use_mma = not interpret and jnp.dtype(q.dtype).itemsize == 2
    if use_mma:
        padded = max(padded, MMA_MIN_ROWS)
    q = jnp.pad(q, ((0, 0), (0, padded - heads), (0, 0)))
    w = jnp.pad(w, ((0, 0), (0, padded - heads)))
    block_kv = min(block_kv or BLOCK_KV, chunk)
    kernel = functools.partial(_index_kernel, key_offset=key_offset, block_kv=block_kv, scale=float(scale),
                               use_mma=use_mma)
    whole = lambda x: pl.BlockSpec(x.shape, lambda t, c: (0,) * x.ndim)  # noqa: E731
    in_specs = [whole(token_seq), whole(token_pos), whole(block_tables),
                pl.BlockSpec((None, padded, dim), lambda t, c: (t, 0, 0)),
                pl.BlockSpec((None, padded), lambda t, c: (t, 0)),
                whole(pages)]  # (keys are gathered inside)
    params = None
    if not interpret:
        from jax.experimental.pallas import triton as pl_triton

        params = pl_triton.CompilerParams(num_warps=num_warps or 4, num_stages=num_stages or STAGES)
    return pl.pallas_call(
        kernel, grid=(num_tokens, L // chunk), in_specs=in_specs,
        out_specs=pl.BlockSpec((None, chunk), lambda t, c: (t, c)),
        out_shape=jax.ShapeDtypeStruct((num_tokens, L), jnp.float32), interpret=interpret, compiler_params=params,
        name=f"index_scores_h{padded}_bkv{block_kv}_c{chunk}",
    )(token_seq, token_pos, block_tables, q, w, pages)
