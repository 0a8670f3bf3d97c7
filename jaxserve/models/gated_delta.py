"""A hybrid model's Gated DeltaNet layers (Qwen3-Next, Qwen3.5, OLMo Hybrid; `config_mamba.MambaConfig` kind
"gated_delta") over a ragged batch, each sequence's convolution state and its heads' delta-rule states kept in a slot
of the state pools (`KVCache.conv`, `KVCache.ssm`), as for the Mamba layers (`models.mamba`).

Per value head, with q and k L2-normed (q also scaled by key dim ** -1/2) and shared by the value heads of their key
head, each token t decays the state S [value dim, key dim] by exp(g_t) (g_t = -exp(A_log) softplus(a_t + dt_bias)),
then writes its value where its key reads: S += beta_t (v_t - S k_t) k_t^T (beta_t = sigmoid(b_t), times
`MambaConfig.beta_scale`); its output is S q_t, normed per head and gated by silu(z_t)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.config_mamba import MambaConfig
from jaxserve.models.inputs import ModelInputs
from jaxserve.models.mamba import CHUNK, _causal_conv, chunk_scan, ragged_scan, ragged_tokens
from jaxserve.models.params import LayerParams


def gated_delta_mixer(m: MambaConfig, lp: LayerParams, h: jax.Array, inputs: ModelInputs, conv: jax.Array,
                      ssm: jax.Array, chunked: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One Gated DeltaNet layer over normed inputs h [T, E]: its output [T, E] and the layer's state pools (conv
    [slots, conv_dim, kernel - 1], ssm [slots, value heads, value dim, key dim]) with each sequence's slot holding
    its states after this step (arguments as `mamba.mamba_mixer`'s). A decode step's states step at once; other
    steps' tokens by `chunked_delta_scan` (`chunked`: the Pallas backends', for a GPU) or `token_delta_scan` (the
    CPU's XLA backend)."""
    T = h.shape[0]
    r = ragged_tokens(inputs, T, conv)

    H, P, N, G = m.num_heads, m.head_dim, m.state_size, m.n_groups
    proj = jnp.dot(h, lp.m_in, preferred_element_type=jnp.float32)  # q, k, v | z | b | a
    qkv, z = proj[:, :m.conv_dim], proj[:, m.conv_dim:m.conv_dim + m.inner]
    b, a = proj[:, m.conv_dim + m.inner:m.conv_dim + m.inner + H], proj[:, m.conv_dim + m.inner + H:]
    acc, conv = _causal_conv(m, lp, qkv, conv, r, inputs.query_start_loc)
    qkv = jax.nn.silu(acc)
    q, k = (jnp.repeat(_l2norm(qkv[:, j * G * N:(j + 1) * G * N].reshape(T, G, N)), H // G, axis=1) for j in (0, 1))
    q = q * N**-0.5
    v = qkv[:, 2 * G * N:].reshape(T, H, P)
    beta = jax.nn.sigmoid(b) * m.beta_scale  # [T, H]
    g = -jnp.exp(lp.m_a_log) * jax.nn.softplus(a + lp.m_dt_bias)  # [T, H]: each head's log decay

    if inputs.decode:  # one token per sequence, token t of sequence t: every state steps at once
        start = jnp.where(r.fresh[:, None, None, None], 0.0, ssm[r.slots].astype(jnp.float32))
        states, y = jax.vmap(_delta_step)(start, g, beta, q, k, v)
        ssm = ssm.at[r.slots].set(states.astype(ssm.dtype))
    else:  # each sequence from its slot's state, its last one written back
        y, ssm = (chunked_delta_scan if chunked else token_delta_scan)(g, beta, q, k, v, *r.scan, ssm)

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
    def body(w, lead, init, bt, qc, kc, vc):
        Q = w.shape[0]
        strict = w * (1.0 - jnp.eye(Q, dtype=w.dtype))[:, :, None]  # (w's diagonal: 1)
        system = jnp.eye(Q, dtype=jnp.float32)[None] + jnp.einsum("th,tsh,thn,shn->hts", bt, strict, kc, kc)
        rhs = bt[:, :, None] * (vc - lead[:, :, None] * jnp.einsum("thpn,thn->thp", init, kc))
        u = jax.scipy.linalg.solve_triangular(system, jnp.swapaxes(rhs, 0, 1), lower=True, unit_diagonal=True)
        u = jnp.swapaxes(u, 0, 1)  # [Q, H, P]: the new values
        y = (lead[:, :, None] * jnp.einsum("thpn,thn->thp", init, qc)
             + jnp.einsum("tsh,shp->thp", w * jnp.einsum("thn,shn->tsh", qc, kc), u))
        return y, u, kc

    return chunk_scan(body, g, (beta, q, k, v), seq, slot, fresh, last, pool, chunk)
