"""Paged attention over the KV page pool, dispatched by backend.

All backends share one contract (`pallas_kernels.ragged_attention_args`, see also `ModelInputs`):
queries packed by sequence, KV read through each sequence's page table, causal within the sequence.
The `xla` backend here is plain `jax.numpy` and is what the CPU serves with: it walks blocks of pages
with an online softmax, so its memory stays bounded by a block whatever the context. The kernels'
oracle (`pallas_kernels.ragged_paged_attention_reference`) gathers whole sequences instead; a test
holds the two equal.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

AttentionBackend = Literal["xla", "pallas", "pallas_interpret", "pallas_mosaic"]
# pallas_mosaic: the pallas kernels, with decode-only batches on the Mosaic GPU decode kernel (Hopper).
ATTENTION_BACKENDS: tuple[str, ...] = ("xla", "pallas", "pallas_interpret", "pallas_mosaic")


def xla_ragged_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    query_start_loc: jax.Array,
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    pages_per_block: int = 8,
) -> jax.Array:
    """Ragged paged attention in plain JAX, with an online softmax over blocks of pages.

    q: [T, Hq, D]; k_pages, v_pages: [N, page_size, Hkv, D]; block_tables: [S, P];
    seq_lens: [S]; query_start_loc: [S + 1]. Returns [T, Hq, D] in q's dtype. The loop over
    KV blocks runs only as far as the longest sequence in the batch.
    """
    T, Hq, D = q.shape
    _, page_size, Hkv, _ = k_pages.shape
    S, P = block_tables.shape
    G = Hq // Hkv
    B = min(pages_per_block, P)
    num_blocks_max = -(-P // B)
    if num_blocks_max * B != P:
        block_tables = jnp.pad(block_tables, ((0, 0), (0, num_blocks_max * B - P)))
    J = B * page_size

    from pallas_kernels.ragged_attention_args import token_metadata  # the contract shared with the kernels

    seq, pos, valid = token_metadata(seq_lens, query_start_loc, T)
    pos = jnp.where(valid, pos, -1)  # a padding token sees no key, so its output is zero
    tables = block_tables[seq]  # [T, num_blocks_max * B]
    qf = q.astype(jnp.float32).reshape(T, Hkv, G, D) * sm_scale
    max_len = jnp.max(jnp.where(valid, pos + 1, 0))
    num_blocks = jnp.minimum((max_len + J - 1) // J, num_blocks_max)

    def body(j, carry):
        m, denom, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(tables, j * B, B, axis=1)  # [T, B]
        k = k_pages[pages].reshape(T, J, Hkv, D).astype(jnp.float32)
        v = v_pages[pages].reshape(T, J, Hkv, D).astype(jnp.float32)
        s = jnp.einsum("tkgd,tjkd->tkgj", qf, k)  # [T, Hkv, G, J]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        kpos = j * J + jnp.arange(J, dtype=jnp.int32)
        mask = kpos[None, :] <= pos[:, None]  # [T, J]
        if sliding_window is not None:
            mask &= kpos[None, :] > pos[:, None] - sliding_window
        s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - m_safe[..., None])
        alpha = jnp.exp(m - m_safe)
        denom = denom * alpha + p.sum(axis=-1)
        # A masked key may sit in a stale or scratch page: zero its V so 0 * garbage cannot reach the output.
        v = jnp.where(mask[:, :, None, None], v, 0.0)
        acc = acc * alpha[..., None] + jnp.einsum("tkgj,tjkd->tkgd", p, v)
        return m_new, denom, acc

    init = (
        jnp.full((T, Hkv, G), -jnp.inf, jnp.float32),
        jnp.zeros((T, Hkv, G), jnp.float32),
        jnp.zeros((T, Hkv, G, D), jnp.float32),
    )
    _, denom, acc = jax.lax.fori_loop(0, num_blocks, body, init)
    out = acc / jnp.where(denom > 0, denom, 1.0)[..., None]
    return out.reshape(T, Hq, D).astype(q.dtype)


def write_kv(
    k_pages: jax.Array, v_pages: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Scatter new K/V ([T, Hkv, D]) into their slots (page * page_size + offset)."""
    n, page_size, hkv, d = k_pages.shape
    if k.shape[0] == 1:
        # XLA turns a one-row scatter into a dynamic-update-slice, which XLA:CPU does not always do
        # in place in an unrolled layer loop (it copied the whole pool per layer); a second row
        # aimed at slot 0 of the reserved padding page keeps it a scatter.
        k, v = jnp.pad(k, ((0, 1), (0, 0), (0, 0))), jnp.pad(v, ((0, 1), (0, 0), (0, 0)))
        slot_mapping = jnp.pad(slot_mapping, (0, 1))
    k_flat = k_pages.reshape(n * page_size, hkv, d).at[slot_mapping].set(k.astype(k_pages.dtype))
    v_flat = v_pages.reshape(n * page_size, hkv, d).at[slot_mapping].set(v.astype(v_pages.dtype))
    return k_flat.reshape(k_pages.shape), v_flat.reshape(v_pages.shape)


def paged_attention(
    backend: AttentionBackend,
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    query_start_loc: jax.Array,
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
) -> jax.Array:
    """Dispatch to the chosen attention backend (all share the xla backend's contract)."""
    kwargs = dict(sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window)
    if backend == "xla":
        return xla_ragged_paged_attention(q, k_pages, v_pages, block_tables, seq_lens, query_start_loc, **kwargs)
    if backend in ("pallas", "pallas_interpret", "pallas_mosaic"):
        from pallas_kernels import AttentionTuning, ragged_paged_attention

        tuning = AttentionTuning(decode_lowering="mosaic" if backend == "pallas_mosaic" else "triton")
        return ragged_paged_attention(
            q, k_pages, v_pages, block_tables, seq_lens, query_start_loc,
            interpret=backend == "pallas_interpret", tuning=tuning, **kwargs,
        )
    raise ValueError(f"unknown attention backend {backend!r} (choose from {', '.join(ATTENTION_BACKENDS)})")
