"""LoRA adapters in the model step: every adapter's low-rank deltas, applied per token in one batch.

An engine with LoRA holds `max_loras` adapter slots in each layer (`LoraLayer`, on `LayerParams.lora`):
for each projection an A [slots, in, rank] (the A's of projections of one input side by side: q/k/v,
gate/up) and a B [slots, rank, out], the adapter's scale folded into B, ranks below `max_lora_rank`
padded with zeros, projections an adapter leaves alone all zeros. A step's tokens carry their
request's slot (`ModelInputs.lora_slots`, -1 for none); a projection's output gains (x A_s) B_s for
the token's slot s, computed for all slots at once (one A matmul per input, one B matmul per
projection, of width slots x rank), the other slots' columns masked to zero. Base weights are never changed, so requests of
different adapters (and none) share one batch.

A MoE model's experts hold slots too, per expert, the slot axis beside the rank (`SLOT_AXIS`): `ae_gate_up`
[X, E, slots, 2 x rank] (the gate's and the up projection's A side by side), `be_gate`, `be_up` [X, slots, rank, Fe],
`ae_down` [X, Fe, slots, rank], `be_down` [X, slots, rank, E]; the (token, expert) pairs, sorted by expert, go through
their expert's A of every slot and their slot's B (`expert_lora_deltas`, grouped matmuls as the experts' own, each
reading the slots where they lie). Its layers' other targets
(`moe_targets`): the router and the shared expert, whose projections of the MLP's input share `a_moe`, and the shared
expert's down projection; its dense first layers' MLP takes the dense model's fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig

# The HF module names a LoRA adapter may target: the A field holding its down projection (projections of
# one input share it, their ranks side by side), its place there, and its B field.
TARGETS = {"q_proj": ("a_qkv", 0, "b_q"), "k_proj": ("a_qkv", 1, "b_k"), "v_proj": ("a_qkv", 2, "b_v"),
           "o_proj": ("a_o", 0, "b_o"), "gate_proj": ("a_gate_up", 0, "b_gate"), "up_proj": ("a_gate_up", 1, "b_up"),
           "down_proj": ("a_down", 0, "b_down")}


ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
# Latent attention's targets (DeepSeek-V2 / -V3): the projections of the layer's input (the queries, or their
# bottleneck, and the latent with the rotary key) share `a_qkv`; the query bottleneck's up projection, `kv_b_proj`
# (applied where its weights are absorbed: `latent_lora`) and the output projection have their own.
LATENT = {"q_proj": ("a_qkv", 0, "b_q"), "q_a_proj": ("a_qkv", 0, "b_q"), "kv_a_proj_with_mqa": ("a_qkv", 1, "b_kva"),
          "q_b_proj": ("a_qb", 0, "b_qb"), "kv_b_proj": ("a_kvb", 0, "b_kvb"), "o_proj": ("a_o", 0, "b_o")}


def attention_targets(cfg: ModelConfig) -> dict[str, tuple[str, int, str]]:
    """The attention's targets, as `TARGETS`: q/k/v/o, or latent attention's (`LATENT`: q_proj without a query
    bottleneck, q_a_proj and q_b_proj with one)."""
    if not cfg.kv_lora_rank:
        return {t: TARGETS[t] for t in ATTENTION}
    skip = ("q_proj",) if cfg.q_lora_rank else ("q_a_proj", "q_b_proj")
    return {t: v for t, v in LATENT.items() if t not in skip}


def dense_targets(cfg: ModelConfig) -> dict[str, tuple[str, int, str]]:
    """A dense layer's targets: the attention's and the MLP's."""
    return attention_targets(cfg) | {t: TARGETS[t] for t in MLP}
# The B fields of a MoE layer's projections of its MLP's input (A's side by side in `a_moe`), in their order there.
MOE_IN = {"shared.gate_proj": "bs_gate", "shared.up_proj": "bs_up", "gate": "b_route", "shared_expert_gate": "b_mix"}


def moe_targets(cfg: ModelConfig) -> dict[str, tuple[str, int, str]]:
    """A MoE model's targets in its MoE layers besides the attention and the experts, as `TARGETS`: the router
    ("gate"), the shared expert's projections ("shared.gate_proj" ...) and Qwen2-MoE's shared-expert gate."""
    if not cfg.num_experts or not cfg.gated_mlp:  # (Nemotron 3's ungated experts: its attention's targets only)
        return {}
    shared = cfg.shared_expert_intermediate_size > 0
    # (the sigmoid gate on the shared expert is Qwen's alone)
    reading = [m for m in MOE_IN if (shared or not m.startswith("shared"))
               and (m != "shared_expert_gate" or cfg.shared_expert_gated)]
    targets = {m: ("a_moe", i, MOE_IN[m]) for i, m in enumerate(reading)}
    return targets | ({"shared.down_proj": ("as_down", 0, "bs_down")} if shared else {})


@jax.tree_util.register_dataclass
@dataclass
class LoraLayer:
    """The adapter slots of one layer (stacked on a leading layers axis in stacked params): A [slots, in,
    n x rank] for the n projections of one input, B [slots, rank, out] for each projection."""

    a_qkv: Any
    b_q: Any
    a_o: Any
    b_o: Any
    a_gate_up: Any
    b_gate: Any
    b_up: Any
    a_down: Any
    b_down: Any
    ae_gate_up: Any = None  # a MoE model's experts (None: a dense model)
    be_gate: Any = None
    be_up: Any = None
    ae_down: Any = None
    be_down: Any = None
    a_moe: Any = None  # a MoE layer's projections of the MLP's input (`moe_targets`): [slots, E, n x rank]
    bs_gate: Any = None  # the shared expert's (None: no shared expert)
    bs_up: Any = None
    as_down: Any = None
    bs_down: Any = None
    b_route: Any = None  # the router's [slots, rank, X]
    b_mix: Any = None  # Qwen2-MoE's shared-expert gate's [slots, rank, 1]
    b_k: Any = None  # (None: latent attention)
    b_v: Any = None
    b_kva: Any = None  # latent attention's (`LATENT`; None: another attention)
    a_qb: Any = None
    b_qb: Any = None
    a_kvb: Any = None
    b_kvb: Any = None


def target_dims(cfg: ModelConfig, layer: int | None = None) -> dict[str, tuple[int, int]]:
    """(in, out) features of each target projection, by HF module name (`TARGETS`, `moe_targets`); of Gemma 4 (whose
    layers differ), those of `layer`, or (None) the widest of any layer's, which its slots hold (`gemma4.kind_lora`)."""
    if cfg.gemma4 is not None and not cfg.gemma4.full_layers:
        from jaxserve.models.gemma4 import lora_dims

        return lora_dims(cfg, layer, target_dims)
    E, F, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * D, cfg.num_kv_heads * D
    Fs = cfg.shared_expert_intermediate_size
    moe = {"gate": (E, cfg.num_experts), "shared.gate_proj": (E, Fs), "shared.up_proj": (E, Fs),
           "shared.down_proj": (Fs, E), "shared_expert_gate": (E, 1)}
    mlp = {"gate_proj": (E, F), "up_proj": (E, F), "down_proj": (F, E)} | {m: moe[m] for m in moe_targets(cfg)}
    if cfg.kv_lora_rank:
        R, Rq, Dv, Dr = cfg.kv_lora_rank, cfg.q_lora_rank, cfg.v_head_dim, cfg.rotary_dims
        latent = {"q_proj": (E, q), "q_a_proj": (E, Rq), "q_b_proj": (Rq, q), "kv_a_proj_with_mqa": (E, R + Dr),
                  "kv_b_proj": (R, cfg.num_heads * (D - Dr + Dv)), "o_proj": (cfg.num_heads * Dv, E)}
        return {t: latent[t] for t in attention_targets(cfg)} | mlp
    # (a gated attention's q_proj also projects each head's gate: `ModelConfig.q_head_dim`)
    return {"q_proj": (E, cfg.num_heads * cfg.q_head_dim), "k_proj": (E, kv), "v_proj": (E, kv), "o_proj": (q, E)} | mlp


def lora_shapes(cfg: ModelConfig, rank: int) -> dict[str, tuple[int, ...]]:
    """Each `LoraLayer` field's shape for one slot of one layer (a MoE model's experts' too)."""
    dims, shapes, targets = target_dims(cfg), {}, dense_targets(cfg) | moe_targets(cfg)
    for module, (a, _, b) in targets.items():
        k, n = dims[module]
        shapes[a] = (k, rank * sum(1 for x, _, _ in targets.values() if x == a))
        shapes[b] = (rank, n)
    if cfg.num_experts:
        X, E, F = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        shapes |= {"ae_gate_up": (X, E, 2 * rank), "be_gate": (X, rank, F), "be_up": (X, rank, F),
                   "ae_down": (X, F, rank), "be_down": (X, rank, E)}
    return shapes


# Where a field's slot axis lies in one layer's array (0 where not named): the experts' next to their rank, so their
# grouped matmuls read every slot of an expert as one matrix without moving them.
SLOT_AXIS = {"ae_gate_up": 2, "ae_down": 2, "be_gate": 1, "be_up": 1, "be_down": 1}


def empty_lora(cfg: ModelConfig, num_slots: int, rank: int, dtype: Any) -> LoraLayer:
    """Zeroed adapter slots for every layer: [L, ...] of `lora_shapes` with the slots at `SLOT_AXIS`."""
    def shape(f: str, one: tuple[int, ...]) -> tuple[int, ...]:
        at = SLOT_AXIS.get(f, 0)
        return (cfg.num_layers, *one[:at], num_slots, *one[at:])

    return LoraLayer(**{f: jnp.zeros(shape(f, one), dtype) for f, one in lora_shapes(cfg, rank).items()})


def lora_deltas(x: jax.Array, a: jax.Array, bs: list[jax.Array], slots: jax.Array) -> list[jax.Array]:
    """x [T, in] through each token's adapter slot (slots [T], -1 none): one [T, out] per B in `bs`, whose
    down projections sit side by side in a [S, in, len(bs) x r]. Computed only when some token has a slot
    (a step of the base model alone gets zeros)."""
    S, r = a.shape[0], a.shape[-1] // len(bs)

    def some() -> list[jax.Array]:
        xa = jnp.einsum("tk,skr->tsr", x, a, preferred_element_type=jnp.float32)  # every slot's down projections
        mine = (slots[:, None] == jnp.arange(S, dtype=slots.dtype))[:, :, None]  # [T, S, 1]
        xa = jnp.where(mine, xa, 0.0).astype(x.dtype)
        return [jnp.dot(xa[:, :, i * r:(i + 1) * r].reshape(x.shape[0], S * r), b.reshape(S * r, -1),
                        preferred_element_type=jnp.float32).astype(x.dtype) for i, b in enumerate(bs)]

    def none() -> list[jax.Array]:
        return [jnp.zeros((x.shape[0], b.shape[-1]), x.dtype) for b in bs]

    return jax.lax.cond(jnp.any(slots >= 0), some, none)


def expert_lora_deltas(xs: jax.Array, a: jax.Array, bs: list[jax.Array], group_sizes: jax.Array,
                       row_expert: jax.Array, row_slot: jax.Array, matmul: Any = None) -> list[jax.Array]:
    """A MoE layer's (token, expert) pairs `xs` [R, in], sorted by expert (`group_sizes`, `row_expert` [R]), through
    their slot's (`row_slot` [R], -1 none) adapter of their expert: one [R, out] per B in `bs` ([X, S, r, out]),
    whose A's sit side by side in `a` [X, in, S, len(bs) x r]. Zeros when no pair has a slot. `matmul`: the grouped
    matmul kernel (`models.quantized.grouped`)."""
    from jaxserve.models.quantized import grouped

    X, k, S, nr = a.shape
    r, R = nr // len(bs), xs.shape[0]

    def some() -> list[jax.Array]:
        every = a.reshape(X, k, S * nr)  # each expert's A of every slot, side by side
        xa = grouped(xs, every, group_sizes, row_expert, matmul).reshape(R, S, nr)
        xa = jnp.where((row_slot[:, None] == jnp.arange(S, dtype=row_slot.dtype))[:, :, None], xa, 0)
        return [grouped(xa[:, :, i * r:(i + 1) * r].reshape(R, S * r), b.reshape(X, S * r, -1),
                        group_sizes, row_expert, matmul) for i, b in enumerate(bs)]

    def none() -> list[jax.Array]:
        return [jnp.zeros((R, b.shape[-1]), xs.dtype) for b in bs]

    return jax.lax.cond(jnp.any(row_slot >= 0), some, none)


def latent_lora(x: jax.Array, a: jax.Array, b: jax.Array, slots: jax.Array, nope: int, value: bool = False
                ) -> jax.Array:
    """`kv_b_proj`'s adapter where latent attention absorbs its weights (`models.mla`): its A [S, R, r] and B
    [S, r, Hq * (Dn + Dv)] (each head's `nope` key rows, then its value rows), per token's slot (zeros when no token
    has one). x: the queries' unrotated dims [T, Hq, Dn], carried into the latent space: (B_k A)ᵀ x -> [T, Hq, R];
    with `value`, the attention's output in the latent space [T, Hq, R], through the values' delta: B_v A x ->
    [T, Hq, Dv]."""
    S, _, r = a.shape
    T, H = x.shape[:2]
    heads = b.reshape(S, r, H, -1)
    bk, bv = heads[..., :nope], heads[..., nope:]
    mine = (slots[:, None] == jnp.arange(S, dtype=slots.dtype))[:, :, None, None]  # [T, S, 1, 1]

    def some() -> jax.Array:
        f32 = jnp.float32
        if value:
            xa = jnp.einsum("thk,skr->tshr", x, a, preferred_element_type=f32)
            xa = jnp.where(mine, xa, 0.0).astype(x.dtype)
            return jnp.einsum("tshr,srhv->thv", xa, bv, preferred_element_type=f32).astype(x.dtype)
        xb = jnp.einsum("thn,srhn->tshr", x, bk, preferred_element_type=f32)
        xb = jnp.where(mine, xb, 0.0).astype(x.dtype)
        return jnp.einsum("tshr,skr->thk", xb, a, preferred_element_type=f32).astype(x.dtype)

    def none() -> jax.Array:
        return jnp.zeros((T, H, bv.shape[-1] if value else a.shape[1]), x.dtype)

    return jax.lax.cond(jnp.any(slots >= 0), some, none)
