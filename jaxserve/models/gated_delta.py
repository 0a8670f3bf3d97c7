"""A hybrid model's Gated DeltaNet layers (Qwen3-Next, Qwen3.5; `config_mamba.MambaConfig` kind "gated_delta") over a
ragged batch, each sequence's convolution state and its heads' delta-rule states kept in a slot of the state pools
(`KVCache.conv`, `KVCache.ssm`), as for the Mamba layers (`models.mamba`).

Per value head, with q and k L2-normed (q also scaled by key dim ** -1/2) and shared by the value heads of their key
head, each token t decays the state S [value dim, key dim] by exp(g_t) (g_t = -exp(A_log) softplus(a_t + dt_bias)),
then writes its value where its key reads: S += beta_t (v_t - S k_t) k_t^T (beta_t = sigmoid(b_t)); its output is
S q_t, normed per head and gated by silu(z_t)."""

from __future__ import annotations

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
    steps' tokens one at a time (`mamba.ragged_scan`), on every backend (`chunked` is not read: the delta rule's
    chunked form is not written)."""
    del chunked
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
        y, ssm = ragged_scan(_delta_step, (g, beta, q, k, v), own, jnp.where(real, slots[seq], 0),
                             fresh[seq] | ~real, (tok == qsl[seq + 1] - 1) | ~real, ssm)

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
