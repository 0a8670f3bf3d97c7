"""Plain `jax.numpy` ragged paged attention: the oracle of the kernels.

It computes what `ragged_paged_attention` computes (see that module for the semantics) by gathering each
sequence's pages whole, with no blocking and no online softmax.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_attention_args import check_attention_args, clamp_last_key, token_metadata

# Masked logits are finite so that a padding token, which sees no position at all, gets a uniform softmax
# instead of NaN (its output is zeroed afterwards).
_MASKED = -1e30


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "sliding_window", "attention_chunk"))
def ragged_paged_attention_reference(
    q,
    k_pages,
    v_pages,
    block_tables,
    seq_lens,
    query_start_loc,
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    last_key: jax.Array | None = None,
    sinks: jax.Array | None = None,
    attention_chunk: int | None = None,
    alibi: jax.Array | None = None,
) -> jax.Array:
    """Plain `jax.numpy` ragged paged attention, the kernels' oracle (the engine's `xla` backend computes
    the same in blocks of pages; a test holds the two equal). `sinks` [QH]: each head's attention-sink logit
    (gpt-oss), one more column of the softmax whose probability is dropped. `attention_chunk`: Llama 4's chunked
    attention (a token sees no key before its chunk of positions). `alibi` [QH]: ALiBi's slope per query head (each
    score plus its slope times the key's distance back from the token: `alibi_bias`)."""
    check_attention_args(
        q, k_pages, v_pages, block_tables, seq_lens, query_start_loc, sm_scale, soft_cap, sliding_window, last_key,
        sinks, attention_chunk, alibi=alibi,
    )
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    num_seqs, pages_per_seq = block_tables.shape
    group = num_q_heads // num_kv_heads
    kv_len = pages_per_seq * page_size

    tok_seq, pos, valid = token_metadata(seq_lens, query_start_loc, num_tokens)
    # Pages stored narrower than q (bfloat16, float8) are read back in q's dtype.
    seq_shape = (num_seqs, kv_len, num_kv_heads, head_dim)
    k_seq = k_pages[block_tables].reshape(seq_shape).astype(q.dtype)  # [S, L, KVH, D]
    v_seq = v_pages[block_tables].reshape(seq_shape).astype(q.dtype)
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)  # [T, KVH, G, D]

    kv_pos = jnp.arange(kv_len, dtype=jnp.int32)
    # Rows past a sequence's length may come from stale or scratch pages; zero V there so that
    # 0 * garbage cannot reach the output.
    v_seq = jnp.where(
        (kv_pos[None, :] < seq_lens[:, None])[..., None, None], v_seq, jnp.zeros((), v_seq.dtype)
    )
    last = pos if last_key is None else clamp_last_key(last_key, seq_lens, query_start_loc, num_tokens)
    mask = valid[:, None] & (kv_pos[None, :] <= last[:, None])  # [T, L]
    if sliding_window is not None:
        mask &= kv_pos[None, :] > pos[:, None] - sliding_window
    if attention_chunk is not None:
        mask &= kv_pos[None, :] >= (pos - pos % attention_chunk)[:, None]

    def finish(logits):  # [T, KVH, G, (S,) L]
        logits = logits * sm_scale
        if soft_cap is not None:
            logits = soft_cap * jnp.tanh(logits / soft_cap)
        if alibi is not None:
            dist = (kv_pos[None, :] - pos[:, None]).astype(jnp.float32)  # [T, L]
            dist = dist.reshape(num_tokens, 1, 1, *(1,) * (logits.ndim - 4), kv_len)
            slopes = alibi.astype(jnp.float32).reshape(1, num_kv_heads, group, *(1,) * (logits.ndim - 3))
            logits = logits + slopes * dist
        return logits

    # Two equivalent formulations; take the one with the smaller intermediate. Gathering each token's own
    # sequence costs T*L*KVH*D; scoring every token against every sequence and masking costs T*QH*S*L.
    if num_seqs * group < head_dim:
        logits = jnp.einsum("tkgd,slkd->tkgsl", qg, k_seq, preferred_element_type=jnp.float32)
        logits = finish(logits)
        full_mask = (tok_seq[:, None] == jnp.arange(num_seqs)[None, :])[:, :, None] & mask[
            :, None, :
        ]  # [T,S,L]
        logits = jnp.where(full_mask[:, None, None], logits, _MASKED)
        shape = logits.shape
        probs = _softmax(logits.reshape(*shape[:3], -1), sinks).reshape(shape)
        out = jnp.einsum("tkgsl,slkd->tkgd", probs, v_seq.astype(jnp.float32))
    else:
        k_tok = k_seq[tok_seq]  # [T, L, KVH, D]
        v_tok = v_seq[tok_seq]
        logits = jnp.einsum("tkgd,tlkd->tkgl", qg, k_tok, preferred_element_type=jnp.float32)
        logits = finish(logits)
        logits = jnp.where(mask[:, None, None, :], logits, _MASKED)
        probs = _softmax(logits, sinks)
        out = jnp.einsum("tkgl,tlkd->tkgd", probs, v_tok.astype(jnp.float32))
    out = jnp.where(valid[:, None, None, None], out, 0.0)
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)


def _softmax(logits: jax.Array, sinks: jax.Array | None) -> jax.Array:
    """The softmax over the last axis of [T, KVH, G, N] logits; with `sinks` [KVH * G], over one more column
    holding each head's sink, which is then dropped."""
    if sinks is None:
        return jax.nn.softmax(logits, axis=-1)
    T, kvh, g, _ = logits.shape
    column = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, kvh, g, 1), (T, kvh, g, 1))
    return jax.nn.softmax(jnp.concatenate([logits, column], axis=-1), axis=-1)[..., :-1]
