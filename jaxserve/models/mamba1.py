"""A hybrid model's Mamba layers of the first, selective-scan form (Jamba's; `config_mamba.MambaConfig` kind
"mamba1") over a ragged batch, each sequence's convolution state and its channels' SSM states kept in a slot of the
state pools (`KVCache.conv`, `KVCache.ssm` [slots, channels, 1, state]), as for the Mamba-2 layers (`models.mamba`).

Per channel c, each token t decays the state h [state] by exp(dt_c A_c) (A_c = -exp(A_log_c), a rate per state dim)
and adds dt_c x_c B_t; its output is C_t . h + D_c x_c, gated by silu(z_c). dt, B and C come from x (after the
convolution) through `m_x`: a low-rank step, RMSNormed and projected up per channel (`m_dt`, its bias, a softplus),
and B and C, each RMSNormed (Jamba's norms). The prompt tokens are scanned one at a time on every backend (this form
has no chunked scan here)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.config_mamba import MambaConfig
from jaxserve.models.inputs import ModelInputs
from jaxserve.models.mamba import _causal_conv, ragged_scan, ragged_tokens
from jaxserve.models.ops import rms_norm
from jaxserve.models.params import LayerParams


def mamba1_mixer(m: MambaConfig, lp: LayerParams, h: jax.Array, inputs: ModelInputs, conv: jax.Array,
                 ssm: jax.Array, chunked: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One Mamba layer over normed inputs h [T, E]: its output [T, E] and the layer's state pools with each sequence's
    slot holding its states after this step (arguments as `mamba.mamba_mixer`'s; `chunked` has no effect)."""
    T, C, N, R = h.shape[0], m.inner, m.state_size, m.dt_rank
    r = ragged_tokens(inputs, T, conv)
    proj = jnp.dot(h, lp.m_in, preferred_element_type=jnp.float32)
    if lp.m_in_b is not None:
        proj = proj + lp.m_in_b.astype(jnp.float32)
    x, z = proj[:, :C], proj[:, C:]
    acc, conv = _causal_conv(m, lp, x, conv, r, inputs.query_start_loc)
    x = jax.nn.silu(acc)  # [T, C]
    dbc = jnp.dot(x.astype(h.dtype), lp.m_x, preferred_element_type=jnp.float32)
    eps = m.norm_eps
    dt = rms_norm(dbc[:, :R], lp.m_dt_norm.astype(jnp.float32), eps)
    B, Cm = (rms_norm(dbc[:, R + i * N:R + (i + 1) * N], w.astype(jnp.float32), eps)
             for i, w in enumerate((lp.m_b_norm, lp.m_c_norm)))
    dt = jax.nn.softplus(jnp.dot(dt, lp.m_dt.astype(jnp.float32)) + lp.m_dt_bias)  # [T, C]
    log_decay = dt[:, :, None] * -jnp.exp(lp.m_a_log)  # [T, C, N]
    dx = dt * x  # [T, C]

    def update(state, a, u, b, c):  # state [C, 1, N]
        state = state * jnp.exp(a)[:, None, :] + u[:, None, None] * b[None, None, :]
        return state, jnp.einsum("cpn,n->cp", state, c)[:, 0]

    if inputs.decode:  # one token per sequence, token t of sequence t: every state steps at once
        start = jnp.where(r.fresh[:, None, None, None], 0.0, ssm[r.slots].astype(jnp.float32))
        states, y = jax.vmap(update)(start, log_decay, dx, B, Cm)
        ssm = ssm.at[r.slots].set(states.astype(ssm.dtype))
    else:  # each sequence from its slot's state, its last one written back
        y, ssm = ragged_scan(update, (log_decay, dx, B, Cm), *r.scan, ssm)
    y = (y + lp.m_d * x) * jax.nn.silu(z)
    out = jnp.dot(y.astype(h.dtype), lp.m_out, preferred_element_type=jnp.float32)
    if lp.m_out_b is not None:
        out = out + lp.m_out_b.astype(jnp.float32)
    return out.astype(h.dtype), conv, ssm
