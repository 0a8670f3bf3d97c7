"""A hybrid model's Mamba layers of the first, selective-scan form (Jamba's; `config_mamba.MambaConfig` kind
"mamba1") over a ragged batch, each sequence's convolution state and its channels' SSM states kept in a slot of the
state pools (`KVCache.conv`, `KVCache.ssm` [slots, channels, 1, state]), as for the Mamba-2 layers (`models.mamba`).

Per channel c, each token t decays the state h [state] by exp(dt_c A_c) (A_c = -exp(A_log_c), a rate per state dim)
and adds dt_c x_c B_t; its output is C_t . h + D_c x_c, gated by silu(z_c). dt, B and C come from x (after the
convolution) through `m_x`: a low-rank step, RMSNormed and projected up per channel (`m_dt`, its bias, a softplus),
and B and C, each RMSNormed (Jamba's norms; Falcon Mamba's have no weights, Mamba has none). The prompt tokens are
scanned one at a time on the CPU's XLA backend (`token_mamba1_scan`), chunk by chunk on the Pallas ones
(`chunked_mamba1_scan`: an associative scan within each chunk, for a GPU)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxserve.config_mamba import MambaConfig
from jaxserve.models.inputs import ModelInputs
from jaxserve.models.mamba import CHUNK, _causal_conv, ragged_scan, ragged_tokens
from jaxserve.models.ops import rms_norm
from jaxserve.models.params import LayerParams


def mamba1_mixer(m: MambaConfig, lp: LayerParams, h: jax.Array, inputs: ModelInputs, conv: jax.Array,
                 ssm: jax.Array, chunked: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One Mamba layer over normed inputs h [T, E]: its output [T, E] and the layer's state pools with each sequence's
    slot holding its states after this step (arguments as `mamba.mamba_mixer`'s)."""
    T, C, N, R = h.shape[0], m.inner, m.state_size, m.dt_rank
    r = ragged_tokens(inputs, T, conv)
    proj = jnp.dot(h, lp.m_in, preferred_element_type=jnp.float32)
    if lp.m_in_b is not None:
        proj = proj + lp.m_in_b.astype(jnp.float32)
    x, z = proj[:, :C], proj[:, C:]
    acc, conv = _causal_conv(m, lp, x, conv, r, inputs.query_start_loc)
    x = jax.nn.silu(acc)  # [T, C]
    dbc = jnp.dot(x.astype(h.dtype), lp.m_x, preferred_element_type=jnp.float32)
    dt, B, Cm = dbc[:, :R], dbc[:, R:R + N], dbc[:, R + N:]
    if m.step_norms != "none":  # (Jamba's norms weighted, Falcon Mamba's not)
        weights = (lp.m_dt_norm, lp.m_b_norm, lp.m_c_norm) if m.step_norms == "weighted" else (None,) * 3
        dt, B, Cm = (rms_norm(v, 1.0 if w is None else w.astype(jnp.float32), m.norm_eps)
                     for v, w in zip((dt, B, Cm), weights, strict=True))
    dt = jax.nn.softplus(jnp.dot(dt, lp.m_dt.astype(jnp.float32)) + lp.m_dt_bias)  # [T, C]
    log_decay = dt[:, :, None] * -jnp.exp(lp.m_a_log)  # [T, C, N]
    dx = dt * x  # [T, C]

    if inputs.decode:  # one token per sequence, token t of sequence t: every state steps at once
        start = jnp.where(r.fresh[:, None, None, None], 0.0, ssm[r.slots].astype(jnp.float32))
        states, y = jax.vmap(_update)(start, log_decay, dx, B, Cm)
        ssm = ssm.at[r.slots].set(states.astype(ssm.dtype))
    else:  # each sequence from its slot's state, its last one written back
        y, ssm = (chunked_mamba1_scan if chunked else token_mamba1_scan)(log_decay, dx, B, Cm, *r.scan, ssm)
    y = (y + lp.m_d * x) * jax.nn.silu(z)
    out = jnp.dot(y.astype(h.dtype), lp.m_out, preferred_element_type=jnp.float32)
    if lp.m_out_b is not None:
        out = out + lp.m_out_b.astype(jnp.float32)
    return out.astype(h.dtype), conv, ssm


def _update(state: jax.Array, a: jax.Array, u: jax.Array, b: jax.Array, c: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One token: the state [C, 1, N] after it (log decay a [C, N], dt x u [C], B b [N]) and its output [C] (C c)."""
    state = state * jnp.exp(a)[:, None, :] + u[:, None, None] * b[None, None, :]
    return state, jnp.einsum("cpn,n->cp", state, c)[:, 0]


def token_mamba1_scan(log_decay: jax.Array, dx: jax.Array, B: jax.Array, C: jax.Array, seq: jax.Array,
                      slot: jax.Array, fresh: jax.Array, last: jax.Array,
                      pool: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The selective scan over a ragged batch one token a step (arguments and outputs as `chunked_mamba1_scan`'s)."""
    return ragged_scan(_update, (log_decay, dx, B, C), seq, slot, fresh, last, pool)


def chunked_mamba1_scan(log_decay: jax.Array, dx: jax.Array, B: jax.Array, C: jax.Array, seq: jax.Array,
                        slot: jax.Array, fresh: jax.Array, last: jax.Array, pool: jax.Array,
                        chunk: int = CHUNK) -> tuple[jax.Array, jax.Array]:
    """The selective scan over a ragged batch, `chunk` tokens a step: the outputs y [T, C] and the pool [slots, C, 1,
    N] with each sequence's state after its last token (`last`) in its slot. Token t: its log decay [C, N], dt x [C],
    B and C [N]; its sequence (`seq`, contiguous), that sequence's slot and whether it starts from zero (`fresh`).

    h_t = exp(a_t) h_(t-1) + dx_t B_t is a linear recurrence whose pairs (exp(a_t), dx_t B_t) compose associatively:
    within a chunk, one associative scan of those pairs, where a run (its sequence's tokens in the chunk) begins with
    its start state folded in (the previous chunk's last state where its sequence goes on, else zero or its slot's)
    and a decay of 0, so that nothing passes from one run to the next. Each token's state [C, N] is formed (the
    chunk's at once: `chunk` x C x N floats)."""
    T = log_decay.shape[0]
    S, Cn, N = pool.shape[0], pool.shape[1], pool.shape[3]
    Q = math.gcd(T, chunk)
    idx = jnp.arange(Q)
    goes_on = jnp.concatenate([jnp.zeros(1, bool), seq[1:] == seq[:-1]]).reshape(-1, Q)

    def step(carry, x):
        h_in, pool = carry  # the state after the previous chunk's last token [C, N]
        a, u, b, c, sq, sl, fr, la, on = x
        start = (idx == 0) | (sq != jnp.roll(sq, 1))
        init = jnp.where((on & (idx == 0))[:, None, None], h_in[None],
                         jnp.where(fr[:, None, None], 0.0, pool[sl, :, 0].astype(jnp.float32)))  # [Q, C, N]
        decay = jnp.exp(a)  # [Q, C, N]
        write = u[:, :, None] * b[:, None, :] + jnp.where(start[:, None, None], decay * init, 0.0)
        decay = jnp.where(start[:, None, None], 0.0, decay)
        _, h = jax.lax.associative_scan(lambda p, q: (p[0] * q[0], q[0] * p[1] + q[1]), (decay, write))
        pool = pool.at[jnp.where(la, sl, S), :, 0].set(h.astype(pool.dtype), mode="drop")
        return (h[-1], pool), jnp.einsum("tcn,tn->tc", h, c)

    xs = (log_decay, dx, B, C, seq, slot, fresh, last)
    xs = tuple(v.reshape(-1, Q, *v.shape[1:]) for v in xs) + (goes_on,)
    (_, pool), y = jax.lax.scan(step, (jnp.zeros((Cn, N), jnp.float32), pool), xs)
    return y.reshape(T, Cn), pool
