"""A hybrid model's Mamba-2 layers (Granite 4.0-H, Bamba, Nemotron-H) or short convolutions (LFM2;
`config_mamba.MambaConfig`) over a ragged batch, each sequence's convolution and SSM states kept in a slot of the
state pools (`KVCache.conv`, `KVCache.ssm`; `ModelInputs.state_slots`).

A sequence whose step starts at position 0 starts from zero states; any other continues from its slot's, which the
step leaves holding the states after its last token (a prefix cache hit's slot holds a copy of the states kept there:
`engine.state_cache`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.config_mamba import MambaConfig, apart_mlp_layers
from jaxserve.models.inputs import ModelInputs
from jaxserve.models.params import ATTENTION_FIELDS, MLP_FIELDS, LayerParams, ParamInfo, Params

NO_MIXER = "no mixer"  # a layer's mixer where it has none: an MLP alone (`MambaConfig.no_mixer`)


class Beside(NamedTuple):
    """A layer's Mamba mixer beside its attention (`MambaConfig.parallel`): `run(h)` its output of the attention's
    normed input h, added to attention's (the layer's state pools updated as it runs)."""

    run: Callable[[jax.Array], jax.Array]


def declare_hybrid(cfg: ModelConfig, declare_layers: Callable[[ModelConfig, int, bool], LayerParams]) -> Params:
    """A hybrid model's parameters: every layer's norms and MLP in `layers`, the attention layers' projections in
    `attn_layers`, the Mamba layers' in `mamba_layers` (`Params`); where some layers have no MLP, or the first
    layers' are dense and the others' experts, the MLPs apart: the dense first layers' in `dense_layers`, the others'
    in `mlp_layers`."""
    m, E, V = cfg.mamba, cfg.hidden_size, cfg.vocab_size
    La, Lm = len(cfg.attention_layers), len(cfg.mamba.layers)
    none = {f.name: None for f in dataclasses.fields(LayerParams)}
    attn = declare_layers(cfg, La, bool(cfg.num_experts))
    layers = dataclasses.replace(declare_layers(cfg, cfg.num_layers, bool(cfg.num_experts)),
                                 **{f: None for f in ATTENTION_FIELDS})
    mlps = dense = None
    k = cfg.num_dense_layers  # (dense first layers, or dense layers between the experts: Jamba's)
    if m.no_mlp or k:
        mlps = declare_layers(cfg, len(apart_mlp_layers(cfg)), bool(cfg.num_experts))
        mlps = LayerParams(**none | {f: getattr(mlps, f) for f in MLP_FIELDS})
        dense = LayerParams(**none | {f: getattr(declare_layers(cfg, k, False), f) for f in MLP_FIELDS}) if k else None
        layers = dataclasses.replace(layers, **{f: None for f in MLP_FIELDS})
    if len(m.no_mlp) == cfg.num_layers:  # (no MLP, nor its norm: Mamba's)
        layers, mlps = dataclasses.replace(layers, mlp_norm=None), None

    def p(shape, axes, init="normal", dtype=None) -> ParamInfo:
        return ParamInfo((Lm, *shape), ("layers", *axes), init, dtype)

    scan = m.kind != "short_conv"  # (a short convolution has no scan: no dt, A, D or gated norm; a DeltaNet no D)
    one = m.kind == "mamba1"  # (Jamba's, Mamba's: A per channel and state dim; dt, B, C from x; no gated norm)
    R, N = m.dt_rank, m.state_size
    mamba = LayerParams(**none | dict(
        m_in=p((E, m.proj_dim), ("embed", None)), m_in_b=p((m.proj_dim,), (None,), "zeros") if m.proj_bias else None,
        m_conv=p((m.conv_dim, m.conv_kernel), (None, None)),
        m_conv_b=p((m.conv_dim,), (None,), "zeros") if m.conv_bias else None,
        m_dt_bias=p((m.num_heads,), (None,), "ones", jnp.float32) if scan else None,
        m_a_log=p((m.num_heads, N) if one else (m.num_heads,), (None,) * (1 + one), "zeros", jnp.float32)
        if scan else None,
        m_d=p((m.num_heads,), (None,), "ones", jnp.float32) if m.kind in ("mamba2", "mamba1") else None,
        m_norm=p((m.head_dim if m.kind == "gated_delta" else m.inner,), (None,), "ones")
        if scan and m.gate_norm != "none" and not one else None,
        m_x=p((m.inner, R + 2 * N), (None, None)) if one else None, m_dt=p((R, m.inner), (None, None)) if one else None,
        **({name: p((size,), (None,), "ones") for name, size in (("m_dt_norm", R), ("m_b_norm", N), ("m_c_norm", N))}
           if one and m.step_norms == "weighted" else {}),
        m_out=p((m.inner, E), (None, "embed")), m_out_b=p((E,), ("embed",), "zeros") if m.proj_bias else None))
    return Params(embed=ParamInfo((V, E), ("vocab", "embed")),
                  layers=layers,
                  final_norm=ParamInfo((E,), ("embed",), "ones"),
                  lm_head=None if cfg.tie_word_embeddings else ParamInfo((E, V), ("embed", "vocab")),
                  attn_layers=LayerParams(**none | {f: getattr(attn, f) for f in ATTENTION_FIELDS}) if La else None,
                  mamba_layers=mamba, mlp_layers=mlps, dense_layers=dense)


def hybrid_layers(cfg: ModelConfig, params: Params, carry: tuple, conv: jax.Array, ssm: jax.Array,
                  inputs: ModelInputs, layer: Callable, chunked: bool,
                  keep: Callable = lambda carry, i: carry) -> tuple[tuple, jax.Array, jax.Array]:
    """Every layer of a hybrid model in order, unrolled: `layer(i, lp, carry, index, mixer)` runs layer i (its
    `LayerParams` lp) over `carry` (x, k, v), or with `mixer` over (x, conv, ssm), `index` its place among the
    attention layers (its pages) or the Mamba layers (its states). Returns the carry and the state pools. `chunked`:
    the prompt tokens' scan by `chunked_scan`, else `token_scan`. A layer of an MLP alone runs with `NO_MIXER`; a
    layer without an MLP gets no MLP weights; a layer whose mixer is beside its attention (Falcon-H1's) runs over
    (x, k, v) with `Beside`. `carry` may hold a fourth part, the states entering some layers, which
    `keep(carry, i)` (`KeptLayers.keep`) writes before layer i (an EAGLE-3 draft's inputs)."""
    from jaxserve.models.gated_delta import gated_delta_mixer
    from jaxserve.models.mamba1 import mamba1_mixer

    mix = {"gated_delta": gated_delta_mixer, "mamba1": mamba1_mixer}.get(cfg.mamba.kind, mamba_mixer)
    x, k, v, *kept = carry
    a = j = f = 0
    for i in range(cfg.num_layers):
        x, k, v, *kept = keep((x, k, v, *kept), i)
        lp = jax.tree.map(lambda w, i=i: w[i], params.layers)
        if params.dense_layers is not None and cfg.dense_layer(i):  # (a dense layer's MLP: a first one, Jamba's)
            fp = jax.tree.map(lambda w, s=cfg.stack_index(i, True): w[s], params.dense_layers)
            lp = dataclasses.replace(lp, **{name: getattr(fp, name) for name in MLP_FIELDS})
        elif params.mlp_layers is not None and i not in cfg.mamba.no_mlp:
            fp = jax.tree.map(lambda w, f=f: w[f], params.mlp_layers)
            lp = dataclasses.replace(lp, **{name: getattr(fp, name) for name in MLP_FIELDS})
            f += 1
        if i in cfg.mamba.no_mixer:
            x, k, v = layer(i, lp, (x, k, v), 0, NO_MIXER)
        elif cfg.mamba.parallel:  # (Falcon-H1: the mixer beside attention, on its normed input)
            mp = jax.tree.map(lambda w, j=j: w[j], params.mamba_layers)
            ap = jax.tree.map(lambda w, a=a: w[a], params.attn_layers)
            lp = dataclasses.replace(lp, **{name: getattr(ap, name) for name in ATTENTION_FIELDS})
            states = []

            def beside(h, mp=mp, j=j, conv=conv, ssm=ssm, states=states):
                out, c, s = mix(cfg.mamba, mp, h, inputs, conv[j], ssm[j], chunked)
                states.extend([conv.at[j].set(c), ssm.at[j].set(s)])
                return out

            x, k, v = layer(i, lp, (x, k, v), a, Beside(beside))
            conv, ssm = states
            a, j = a + 1, j + 1
        elif i in cfg.mamba.layers:
            mp = jax.tree.map(lambda w, j=j: w[j], params.mamba_layers)

            def mixer(h, conv, ssm, mp=mp, j=j):
                out, c, s = mix(cfg.mamba, mp, h, inputs, conv[j], ssm[j], chunked)
                return out, conv.at[j].set(c), ssm.at[j].set(s)

            x, conv, ssm = layer(i, _kind_norms(cfg, lp, False), (x, conv, ssm), j, mixer)
            j += 1
        else:
            ap = jax.tree.map(lambda w, a=a: w[a], params.attn_layers)
            lp = dataclasses.replace(lp, **{name: getattr(ap, name) for name in ATTENTION_FIELDS})
            x, k, v = layer(i, _kind_norms(cfg, lp, True), (x, k, v), a, None)
            a += 1
    return (x, k, v, *kept), conv, ssm


def _kind_norms(cfg: ModelConfig, lp: LayerParams, attention: bool) -> LayerParams:
    """Layer `lp` with only its kind's norms: OLMo Hybrid's attention layers norm after attention and the MLP, its
    DeltaNet layers before them (`Params.layers` holds all four norms for every layer)."""
    if cfg.family != "olmo_hybrid":
        return lp
    drop = ("attn_norm", "mlp_norm") if attention else ("post_attn_norm", "post_mlp_norm")
    return dataclasses.replace(lp, **dict.fromkeys(drop))


def mamba_mixer(m: MambaConfig, lp: LayerParams, h: jax.Array, inputs: ModelInputs, conv: jax.Array,
                ssm: jax.Array, chunked: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One Mamba-2 mixer (or LFM2's short convolution: `MambaConfig.kind`) over normed inputs h [T, E]: its output
    [T, E] and the layer's state pools (conv [slots, conv_dim, kernel - 1], ssm [slots, heads, head_dim, state])
    with each sequence's slot holding its states after this step. A decode step's states step at once; other steps' tokens are scanned by
    `chunked_scan` (`chunked`: the Pallas backends', for a GPU) or `token_scan` (the CPU's XLA backend: on 2 cores
    5x faster at Granite-4.0-H-Tiny's shapes, bench/hybrid_scan.py)."""
    T = h.shape[0]
    r = ragged_tokens(inputs, T, conv)
    qsl = inputs.query_start_loc

    proj = jnp.dot(h, lp.m_in, preferred_element_type=jnp.float32)
    if lp.m_in_b is not None:
        proj = proj + lp.m_in_b.astype(jnp.float32)
    if m.kind == "short_conv":  # LFM2's: C * conv(B * x), no scan
        b, c, x = proj[:, :m.inner], proj[:, m.inner:2 * m.inner], proj[:, 2 * m.inner:]
        acc, conv = _causal_conv(m, lp, b * x, conv, r, qsl)
        out = jnp.dot((c * acc).astype(h.dtype), lp.m_out, preferred_element_type=jnp.float32)
        if lp.m_out_b is not None:
            out = out + lp.m_out_b.astype(jnp.float32)
        return out.astype(h.dtype), conv, ssm
    z, xbc, dt = proj[:, :m.inner], proj[:, m.inner:m.inner + m.conv_dim], proj[:, m.inner + m.conv_dim:]
    acc, conv = _causal_conv(m, lp, xbc, conv, r, qsl)
    xbc_out = jax.nn.silu(acc)

    H, P, N, G = m.num_heads, m.head_dim, m.state_size, m.n_groups
    x = xbc_out[:, :m.inner].reshape(T, H, P)
    B = jnp.repeat(xbc_out[:, m.inner:m.inner + G * N].reshape(T, G, N), H // G, axis=1)  # [T, H, N]
    C = jnp.repeat(xbc_out[:, m.inner + G * N:].reshape(T, G, N), H // G, axis=1)
    dt = jnp.clip(jax.nn.softplus(dt + lp.m_dt_bias), m.time_step_min, m.time_step_max)  # [T, H]
    log_decay = dt * -jnp.exp(lp.m_a_log)  # [T, H]
    dx = dt[:, :, None] * x  # [T, H, P]

    if inputs.decode:  # one token per sequence, token t of sequence t: every state steps at once
        start = jnp.where(r.fresh[:, None, None, None], 0.0, ssm[r.slots].astype(jnp.float32))
        states = start * jnp.exp(log_decay)[:, :, None, None] + dx[..., None] * B[:, :, None, :]
        y = jnp.einsum("thpn,thn->thp", states, C)
        ssm = ssm.at[r.slots].set(states.astype(ssm.dtype))
    else:  # each sequence from its slot's state, its last one written back
        y, ssm = (chunked_scan if chunked else token_scan)(log_decay, dx, B, C, *r.scan, ssm)
    y = (y + lp.m_d[:, None] * x).reshape(T, m.inner)

    # y gated by z and normed over each group's channels (after the gate, before it, or not: `gate_norm`), then the
    # output projection.
    g = y if m.gate_norm == "before" else y * jax.nn.silu(z)
    if m.gate_norm != "none":
        g = g.reshape(T, G, m.inner // G)
        g = g * jax.lax.rsqrt(jnp.mean(g * g, axis=-1, keepdims=True) + m.norm_eps)
        g = (g.reshape(T, m.inner).astype(h.dtype) * lp.m_norm).astype(h.dtype)
    if m.gate_norm == "before":
        g = g.astype(jnp.float32) * jax.nn.silu(z)
    out = jnp.dot(g.astype(h.dtype), lp.m_out, preferred_element_type=jnp.float32)
    if lp.m_out_b is not None:
        out = out + lp.m_out_b.astype(jnp.float32)
    return out.astype(h.dtype), conv, ssm


class RaggedTokens(NamedTuple):
    """Where the tokens of a hybrid model's step sit: per sequence its state slot, query length and whether it starts
    at position 0 (`fresh`); per token its index, its sequence and its place in that sequence's chunk; and `scan`,
    per token (its sequence, contiguous, each padding token one of its own; its slot, 0 for padding; whether it
    starts from zero; whether its state is written back, after its sequence's last token) as the scans take them."""

    slots: jax.Array
    q_len: jax.Array
    fresh: jax.Array
    tok: jax.Array
    seq: jax.Array
    i: jax.Array
    scan: tuple[jax.Array, jax.Array, jax.Array, jax.Array]


def ragged_tokens(inputs: ModelInputs, T: int, conv: jax.Array | None) -> RaggedTokens:
    """`RaggedTokens` of a step of T tokens; ValueError without the state slots or pools (`conv`)."""
    S, qsl, slots = inputs.seq_lens.shape[0], inputs.query_start_loc, inputs.state_slots
    if slots is None or conv is None:
        raise ValueError("a hybrid model's step needs each sequence's state slot (ModelInputs.state_slots) and the "
                         "state pools (KVCache.allocate with state_slots)")
    q_len = qsl[1:] - qsl[:-1]
    fresh = inputs.seq_lens - q_len == 0  # [S]: the sequence starts here (position 0)
    tok = jnp.arange(T, dtype=jnp.int32)
    real = tok < qsl[S]
    seq = jnp.minimum(jnp.sum(tok[:, None] >= qsl[None, 1:], axis=1), S - 1)  # each token's sequence
    scan = (jnp.where(real, seq, S + tok), jnp.where(real, slots[seq], 0), fresh[seq] | ~real,
            (tok == qsl[seq + 1] - 1) | ~real)
    return RaggedTokens(slots, q_len, fresh, tok, seq, tok - qsl[seq], scan)


def _causal_conv(m: MambaConfig, lp: LayerParams, xbc: jax.Array, conv: jax.Array, r: RaggedTokens,
                 qsl: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The causal depthwise convolution of `xbc` [T, channels] over a ragged batch (before any activation), and the
    pool `conv` with each sequence's slot holding its last K - 1 inputs. Tap j reads the input K - 1 - j tokens
    back, from the chunk or from the slot's state, both gathered at once from the step's inputs followed by every
    sequence's state."""
    slots, fresh, q_len, seq, i, tok = r.slots, r.fresh, r.q_len, r.seq, r.i, r.tok
    T, S, K = xbc.shape[0], slots.shape[0], m.conv_kernel
    prev = jnp.where(fresh[:, None, None], 0.0, conv[slots].astype(jnp.float32))  # [S, C, K - 1]
    inputs_then_states = jnp.concatenate([xbc, jnp.swapaxes(prev, 1, 2).reshape(S * (K - 1), -1)])
    back = K - 1 - jnp.arange(K)  # [K]
    taps = jnp.where(i[:, None] >= back, tok[:, None] - back, T + seq[:, None] * (K - 1) + K - 1 - back + i[:, None])
    acc = jnp.einsum("tkc,ck->tc", inputs_then_states[taps], lp.m_conv.astype(jnp.float32))
    if lp.m_conv_b is not None:
        acc = acc + lp.m_conv_b.astype(jnp.float32)
    # The new state: each sequence's last K - 1 inputs (from before the chunk where it is shorter).
    at = q_len[:, None] - (K - 1) + jnp.arange(K - 1)  # [S, K - 1]: the chunk index each column takes
    rows = jnp.where(at >= 0, qsl[:-1, None] + at, T + jnp.arange(S)[:, None] * (K - 1) + at + K - 1)
    new_conv = jnp.swapaxes(inputs_then_states[rows], 1, 2)  # [S, C, K - 1]
    return acc, conv.at[slots].set(new_conv.astype(conv.dtype))


def copy_state_slots(kv, copies: jax.Array, count: jax.Array):
    """The pool `kv` (`KVCache`) with its state slots copied, in order: the first `count` (a traced scalar: one
    executable for any number) of `copies` [K, 2] int32, (from, to) each."""
    def one(i, pools):
        return tuple(jax.lax.dynamic_update_index_in_dim(
            p, jax.lax.dynamic_index_in_dim(p, copies[i, 0], 1), copies[i, 1], 1) for p in pools)

    conv, ssm = jax.lax.fori_loop(0, count, one, (kv.conv, kv.ssm))
    return dataclasses.replace(kv, conv=conv, ssm=ssm)


def token_scan(log_decay: jax.Array, dx: jax.Array, B: jax.Array, C: jax.Array, seq: jax.Array, slot: jax.Array,
               fresh: jax.Array, last: jax.Array, pool: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The selective scan over a ragged batch one token a step (arguments and outputs as `chunked_scan`'s)."""
    def update(state, a, u, b, c):
        state = state * jnp.exp(a)[:, None, None] + u[:, :, None] * b[:, None, :]
        return state, jnp.einsum("hpn,hn->hp", state, c)

    return ragged_scan(update, (log_decay, dx, B, C), seq, slot, fresh, last, pool)


def ragged_scan(update: Callable, xs: tuple, seq: jax.Array, slot: jax.Array, fresh: jax.Array, last: jax.Array,
                pool: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A recurrence over a ragged batch one token a step: `update(state, *x_t)` -> (state, y_t) with token t's
    inputs `x_t` (`xs` [T, ...] each) from the state before it, a float32 [H, P, N] as the pool's slots; each
    sequence's first token (`seq`, contiguous) from zero (`fresh`) or its slot's state, its last token's (`last`)
    state written to its slot. Returns y [T, ...] and the pool."""
    first = jnp.concatenate([jnp.ones(1, bool), seq[1:] != seq[:-1]])

    def step(carry, x):
        state, pool = carry
        is_first, is_last, sl, is_fresh, *rest = x
        begin = jnp.where(is_fresh, 0.0, pool[sl].astype(jnp.float32))
        state, y = update(jnp.where(is_first, begin, state), *rest)
        pool = jax.lax.dynamic_update_index_in_dim(pool, jnp.where(is_last, state.astype(pool.dtype), pool[sl]), sl, 0)
        return (state, pool), y

    (_, pool), y = jax.lax.scan(step, (jnp.zeros(pool.shape[1:], jnp.float32), pool), (first, last, slot, fresh, *xs))
    return y, pool


CHUNK = 64  # tokens whose states one step of `chunked_scan` computes at once


def chunked_scan(log_decay: jax.Array, dx: jax.Array, B: jax.Array, C: jax.Array, seq: jax.Array, slot: jax.Array,
                 fresh: jax.Array, last: jax.Array, pool: jax.Array, chunk: int = CHUNK) -> tuple[jax.Array, jax.Array]:
    """The selective scan over a ragged batch, `chunk` tokens a step: the outputs y [T, H, P] and the pool with each
    sequence's state after its last token (`last`) in its slot. Token t: its log decay [H], dt x [H, P], B and C [H, N];
    its sequence (`seq`, contiguous), that sequence's slot and whether it starts from zero (`fresh`).

    Per head, a token t's state is h_t = exp(a_t) h_(t-1) + dx_t B_t, from the state before its sequence's first
    token (zero where `fresh`, else its slot's), and y_t = h_t C_t. Within a chunk, as state space duality has it:
    y_t is its run's starting state (its sequence's tokens in the chunk) decayed by the sum of a since and read by
    C_t, plus the run's tokens s <= t, each dx_s weighted by (C_t . B_s) and by the decay over (s, t] (a masked
    [chunk, chunk] matrix per head); a run's state after its last token in the chunk is its starting state decayed,
    plus each of its tokens' dx_s B_s decayed to that token (a sum by run), and no token's state is formed
    otherwise. That state of the chunk's last run passes to the next chunk, where its sequence goes on."""
    def body(w, lead, init, u, b, c):
        y = (jnp.einsum("tsh,shp->thp", w * jnp.einsum("thn,shn->tsh", c, b), u)
             + lead[:, :, None] * jnp.einsum("thn,thpn->thp", c, init))
        return y, u, b

    return chunk_scan(body, log_decay, (dx, B, C), seq, slot, fresh, last, pool, chunk)


def chunk_scan(body: Callable, log_decay: jax.Array, xs: tuple, seq: jax.Array, slot: jax.Array, fresh: jax.Array,
               last: jax.Array, pool: jax.Array, chunk: int = CHUNK) -> tuple[jax.Array, jax.Array]:
    """A linear recurrence over a ragged batch, `chunk` tokens a step (`chunked_scan`'s, the gated delta rule's):
    the outputs [T, H, P] and the pool with each sequence's state after its last token (`last`) in its slot. Per
    chunk it finds each token's run (its sequence's tokens in the chunk), the run's start state (the previous
    chunk's last where the sequence goes on, else zero (`fresh`) or its slot's) and calls `body(w, lead, init, *x)`
    with w [t, s, H] the decay from token s to t within a run (exp of the sum of `log_decay` over (s, t]; 0 across
    runs and for s > t), lead [Q, H] each token's decay since its run's start, init [Q, H, P, N] its run's start
    state and x the chunk's `xs`: it returns the outputs [Q, H, P] and what each token writes to the state, u [Q, H,
    P] and k [Q, H, N] (u k^T); a run's state after its last token is its start state decayed plus those writes,
    each decayed from its token. No other token's state is formed."""
    T, H = log_decay.shape
    P, N = pool.shape[2], pool.shape[3]
    Q = math.gcd(T, chunk)
    idx = jnp.arange(Q)
    causal = idx[:, None] >= idx[None, :]
    starts_before = jnp.concatenate([jnp.zeros(1, bool), seq[1:] == seq[:-1]]) & (jnp.arange(T) % Q == 0)

    def step(carry, x):
        h_in, pool = carry  # the state after the previous chunk's last token [H, P, N]
        a, sq, sl, fr, la, before, *rest = x
        acum = jnp.cumsum(a, axis=0)  # [Q, H]
        start, end = (idx == 0) | (sq != jnp.roll(sq, 1)), (idx == Q - 1) | (sq != jnp.roll(sq, -1))
        run = jnp.cumsum(start) - 1  # [Q]: each token's run
        first = jax.lax.cummax(jnp.where(start, idx, 0), axis=0)
        final = jax.lax.cummin(jnp.where(end, idx, Q - 1), axis=0, reverse=True)
        cont = before[0] & (run == 0)  # the run that goes on from the previous chunk
        base = jnp.where(cont[:, None], 0.0, acum[first] - a[first])  # [Q, H]: the sum of a before its run
        init = jnp.where(cont[:, None, None, None], h_in[None],
                         jnp.where(fr[:, None, None, None], 0.0, pool[sl].astype(jnp.float32)))  # [Q, H, P, N]
        same = causal & (sq[:, None] == sq[None, :])
        w = jnp.exp(jnp.where(same[:, :, None], acum[:, None, :] - acum[None, :, :], -jnp.inf))  # [t, s, H]
        y, u, k = body(w, jnp.exp(acum - base), init, *rest)
        # Each run's state after its last token in the chunk, on each of its tokens' rows.
        own = jnp.exp(acum[final] - acum)[:, :, None, None] * u[..., None] * k[:, :, None, :]
        ends = (jnp.exp(acum[final] - base)[:, :, None, None] * init
                + jax.ops.segment_sum(own, run, num_segments=Q)[run])
        pool = pool.at[jnp.where(la, sl, pool.shape[0])].set(ends.astype(pool.dtype), mode="drop")
        return (ends[-1], pool), y

    chunks = [x.reshape(T // Q, Q, *x.shape[1:]) for x in (log_decay, seq, slot, fresh, last, starts_before, *xs)]
    (_, pool), y = jax.lax.scan(step, (jnp.zeros((H, P, N), jnp.float32), pool), chunks)
    return y.reshape(T, H, P), pool
