"""A hybrid model's Gated DeltaNet layers (Qwen3-Next, Qwen3.5; `config_mamba.MambaConfig` kind "gated_delta") over a
ragged batch, each sequence's convolution state and its heads' delta-rule states kept in a slot of the state pools
(`KVCache.conv`, `KVCache.ssm`), as for the Mamba layers (`models.mamba`).

Per value head, with q and k L2-normed (q also scaled by key dim ** -1/2) and shared by the value heads of their key
head, each token t decays the state S [value dim, key dim] by exp(g_t) (g_t = -exp(A_log) softplus(a_t + dt_bias)),
then writes its value where its key reads: S += beta_t (v_t - S k_t) k_t^T (beta_t = sigmoid(b_t)); its output is
S q_t, normed per head and gated by silu(z_t)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxserve.config_mamba import MambaConfig
from jaxserve.models.inputs import ModelInputs
from jaxserve.models.mamba import _causal_conv, ragged_scan
from jaxserve.models.params import LayerParams


def gated_delta_mixer(m: MambaConfig, lp: LayerParams, h: jax.Array, inputs: ModelInputs, conv: jax.Array,
                      ssm: jax.Array, chunked: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One Gated DeltaNet layer over normed inputs h [T, E]: its output [T, E] and the layer's state pools (conv
    [slots, conv_dim, kernel - 1], ssm [slots, value heads, value dim, key dim]) with each sequence's slot holding
    its states after this step (arguments as `mamba.mamba_mixer`'s). A decode step's states step at once; other
    steps' tokens by `chunked_delta_scan` (`chunked`: the Pallas backends', for a GPU) or `token_delta_scan` (the
    CPU's XLA backend)."""
    T, S = h.shape[0], inputs.seq_lens.shape[0]
    qsl, slots = inputs.query_start_loc, inputs.state_slots
    if slots is None or conv is None:
        raise ValueError("a hybrid model's step needs each sequence's state slot (ModelInputs.state_slots) and the "
                         "state pools (KVCache.allocate with state_slots)")
    q_len = qsl[1:] - qsl[:-1]
    fresh = inputs.seq_lens - q_len == 0  # [S]: the sequence starts here (position 0)
    tok = jnp.arange(T, dtype=jnp.int32)
    real = tok < qsl[S]
    seq = jnp.minimum(jnp.sum(tok[:, None] >= qsl[None, 1:], axis=1), S - 1)  # each token's sequence
    i = tok - qsl[seq]  # each token's place in its sequence's chunk

    H, P, N, G = m.num_heads, m.head_dim, m.state_size, m.n_groups
    proj = jnp.dot(h, lp.m_in, preferred_element_type=jnp.float32)  # q, k, v | z | b | a
    qkv, z = proj[:, :m.conv_dim], proj[:, m.conv_dim:m.conv_dim + m.inner]
    b, a = proj[:, m.conv_dim + m.inner:m.conv_dim + m.inner + H], proj[:, m.conv_dim + m.inner + H:]
    acc, conv = _causal_conv(m, lp, qkv, conv, slots, fresh, q_len, qsl, seq, i, tok)
    qkv = jax.nn.silu(acc)
    q, k = (jnp.repeat(_l2norm(qkv[:, j * G * N:(j + 1) * G * N].reshape(T, G, N)), H // G, axis=1) for j in (0, 1))
    q = q * N**-0.5
    v = qkv[:, 2 * G * N:].reshape(T, H, P)
    beta = jax.nn.sigmoid(b)  # [T, H]
    g = -jnp.exp(lp.m_a_log) * jax.nn.softplus(a + lp.m_dt_bias)  # [T, H]: each head's log decay

    if inputs.decode:  # one token per sequence, token t of sequence t: every state steps at once
        start = jnp.where(fresh[:, None, None, None], 0.0, ssm[slots].astype(jnp.float32))
        states, y = jax.vmap(_delta_step)(start, g, beta, q, k, v)
        ssm = ssm.at[slots].set(states.astype(ssm.dtype))
    else:  # each sequence from its slot's state, its last one written back
        own = jnp.where(real, seq, S + tok)  # (each padding token a sequence of its own, in slot 0)
        y, ssm = (chunked_delta_scan if chunked else token_delta_scan)(
            g, beta, q, k, v, own, jnp.where(real, slots[seq], 0), fresh[seq] | ~real,
            (tok == qsl[seq + 1] - 1) | ~real, ssm)

    # Each head's output normed over its channels (weights shared by the heads), gated by silu(z); the output
    # projection.
    y = y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + m.norm_eps)
    y = (y.astype(h.dtype) * lp.m_norm).astype(jnp.float32) * jax.nn.silu(z.reshape(T, H, P))
    out = jnp.dot(y.reshape(T, m.inner).astype(h.dtype), lp.m_out, preferred_element_type=jnp.float32)
    return out.astype(h.dtype), conv, ssm


def _l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _delta_step(state: jax.Array, g: jax.Array, beta: jax.Array, q: jax.Array, k: jax.Array,
                v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One token of the gated delta rule: the state [H, P, N] after it and its output [H, P] (g, beta [H]; q, k [H, N];
    v [H, P])."""
    state = state * jnp.exp(g)[:, None, None]
    delta = (v - jnp.einsum("hpn,hn->hp", state, k)) * beta[:, None]
    state = state + delta[:, :, None] * k[:, None, :]
    return state, jnp.einsum("hpn,hn->hp", state, q)


def token_delta_scan(g: jax.Array, beta: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, seq: jax.Array,
                     slot: jax.Array, fresh: jax.Array, last: jax.Array, pool: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule over a ragged batch one token a step (arguments and outputs as `chunked_delta_scan`'s)."""
    return ragged_scan(_delta_step, (g, beta, q, k, v), seq, slot, fresh, last, pool)


CHUNK = 64  # tokens whose states one step of `chunked_delta_scan` computes at once


def chunked_delta_scan(g: jax.Array, beta: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, seq: jax.Array,
                       slot: jax.Array, fresh: jax.Array, last: jax.Array, pool: jax.Array,
                       chunk: int = CHUNK) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule over a ragged batch, `chunk` tokens a step: the outputs [T, H, P] and the pool with each
    sequence's state after its last token (`last`) in its slot. Token t: its log decay g and beta [H], q and k
    [H, N], v [H, P]; its sequence (`seq`, contiguous), that sequence's slot and whether it starts from zero
    (`fresh`).

    Within a chunk, per head and per run (a sequence's tokens in the chunk) from its starting state S0 (the previous
    chunk's last state where its sequence goes on, else zero or its slot's), with G_t the sum of g over the run up to
    t: S_t = exp(G_t) S0 + sum over s <= t of exp(G_t - G_s) u_s k_s^T, where the new values u solve the lower
    unitriangular system u_s + beta_s sum over r < s of exp(G_s - G_r) (k_s . k_r) u_r = beta_s (v_s - exp(G_s) S0 k_s)
    (masked to the run: one [chunk, chunk] system per head). Then o_t = exp(G_t) S0 q_t + sum over s <= t of
    exp(G_t - G_s) (q_t . k_s) u_s, and a run's last state is S_t at its last token; no other token's state is
    formed."""
    T, H, P = v.shape
    Q = math.gcd(T, chunk)
    idx = jnp.arange(Q)
    eye = jnp.eye(Q, dtype=jnp.float32)
    starts_before = jnp.concatenate([jnp.zeros(1, bool), seq[1:] == seq[:-1]]) & (jnp.arange(T) % Q == 0)

    def step(carry, xs):
        h_in, pool = carry  # the state after the previous chunk's last token [H, P, N]
        gc, bt, qc, kc, vc, sq, sl, fr, la, before = xs
        acum = jnp.cumsum(gc, axis=0)  # [Q, H]
        start, end = (idx == 0) | (sq != jnp.roll(sq, 1)), (idx == Q - 1) | (sq != jnp.roll(sq, -1))
        run = jnp.cumsum(start) - 1  # [Q]: each token's run
        first = jax.lax.cummax(jnp.where(start, idx, 0), axis=0)
        final = jax.lax.cummin(jnp.where(end, idx, Q - 1), axis=0, reverse=True)
        cont = before[0] & (run == 0)  # the run that goes on from the previous chunk
        base = jnp.where(cont[:, None], 0.0, acum[first] - gc[first])  # [Q, H]: the sum of g before its run
        init = jnp.where(cont[:, None, None, None], h_in[None],
                         jnp.where(fr[:, None, None, None], 0.0, pool[sl].astype(jnp.float32)))  # [Q, H, P, N]
        same = sq[:, None] == sq[None, :]
        decay = jnp.exp(jnp.where((same & (idx[:, None] >= idx[None, :]))[:, :, None],
                                  acum[:, None, :] - acum[None, :, :], -jnp.inf))  # [t, s, H]
        strict = jnp.where((idx[:, None] > idx[None, :])[:, :, None], decay, 0.0)
        system = eye[None] + jnp.einsum("th,tsh,thn,shn->hts", bt, strict, kc, kc)  # [H, Q, Q]
        lead = jnp.exp(acum - base)  # [Q, H]: exp(G_t)
        rhs = bt[:, :, None] * (vc - lead[:, :, None] * jnp.einsum("thpn,thn->thp", init, kc))
        u = jax.scipy.linalg.solve_triangular(system, jnp.swapaxes(rhs, 0, 1), lower=True, unit_diagonal=True)
        u = jnp.swapaxes(u, 0, 1)  # [Q, H, P]
        y = (lead[:, :, None] * jnp.einsum("thpn,thn->thp", init, qc)
             + jnp.einsum("tsh,shp->thp", decay * jnp.einsum("thn,shn->tsh", qc, kc), u))
        # Each run's state after its last token in the chunk, on each of its tokens' rows.
        own = jnp.exp(acum[final] - acum)[:, :, None, None] * u[..., None] * kc[:, :, None, :]
        ends = (jnp.exp(acum[final] - base)[:, :, None, None] * init
                + jax.ops.segment_sum(own, run, num_segments=Q)[run])
        pool = pool.at[jnp.where(la, sl, pool.shape[0])].set(ends.astype(pool.dtype), mode="drop")
        return (ends[-1], pool), y

    chunks = [x.reshape(T // Q, Q, *x.shape[1:]) for x in (g, beta, q, k, v, seq, slot, fresh, last, starts_before)]
    (_, pool), y = jax.lax.scan(step, (jnp.zeros(pool.shape[1:], jnp.float32), pool), chunks)
    return y.reshape(T, H, P), pool
