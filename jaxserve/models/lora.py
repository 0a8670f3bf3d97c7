"""LoRA adapters in the model step: every adapter's low-rank deltas, applied per token in one batch.

An engine with LoRA holds `max_loras` adapter slots in each layer (`LoraLayer`, on `LayerParams.lora`):
for each projection, A [slots, in, rank] and B [slots, rank, out], the adapter's scale folded into B,
ranks below `max_lora_rank` padded with zeros, projections an adapter leaves alone all zeros. A step's
tokens carry their request's slot (`ModelInputs.lora_slots`, -1 for none); a projection's output gains
(x A_s) B_s for the token's slot s, computed for all slots at once as two matmuls of width
slots x rank, the other slots' columns masked to zero. Base weights are never changed, so requests of
different adapters (and none) share one batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig

# The HF module names a LoRA adapter may target, to our field suffixes.
TARGETS = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "gate_proj": "gate", "up_proj": "up",
           "down_proj": "down"}


@jax.tree_util.register_dataclass
@dataclass
class LoraLayer:
    """The adapter slots of one layer (stacked on a leading layers axis in stacked params)."""

    a_q: Any
    b_q: Any
    a_k: Any
    b_k: Any
    a_v: Any
    b_v: Any
    a_o: Any
    b_o: Any
    a_gate: Any
    b_gate: Any
    a_up: Any
    b_up: Any
    a_down: Any
    b_down: Any


def target_dims(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each target projection, by HF module name."""
    E, F, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * D, cfg.num_kv_heads * D
    return {"q_proj": (E, q), "k_proj": (E, kv), "v_proj": (E, kv), "o_proj": (q, E), "gate_proj": (E, F),
            "up_proj": (E, F), "down_proj": (F, E)}


def empty_lora(cfg: ModelConfig, num_slots: int, rank: int, dtype: Any) -> LoraLayer:
    """Zeroed adapter slots for every layer: [L, slots, in, rank] and [L, slots, rank, out]."""
    L, arrays = cfg.num_layers, {}
    for module, (k, n) in target_dims(cfg).items():
        t = TARGETS[module]
        arrays[f"a_{t}"] = jnp.zeros((L, num_slots, k, rank), dtype)
        arrays[f"b_{t}"] = jnp.zeros((L, num_slots, rank, n), dtype)
    return LoraLayer(**arrays)


def lora_deltas(x: jax.Array, pairs: list[tuple[jax.Array, jax.Array]], slots: jax.Array) -> list[jax.Array]:
    """`lora_delta` of x through each (a, b) pair, computed only when some token has a slot (a step of the
    base model alone skips them: zeros)."""
    def some() -> list[jax.Array]:
        return [lora_delta(x, a, b, slots) for a, b in pairs]

    def none() -> list[jax.Array]:
        return [jnp.zeros((x.shape[0], b.shape[-1]), x.dtype) for _, b in pairs]

    return jax.lax.cond(jnp.any(slots >= 0), some, none)


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, slots: jax.Array) -> jax.Array:
    """x [T, in] through each token's adapter slot (a [S, in, r], b [S, r, out], slots [T], -1 none): [T, out]."""
    S, _, r = a.shape
    xa = jnp.einsum("tk,skr->tsr", x, a, preferred_element_type=jnp.float32)  # every slot's down projection
    mine = (slots[:, None] == jnp.arange(S, dtype=slots.dtype))[:, :, None]  # [T, S, 1]
    xa = jnp.where(mine, xa, 0.0).astype(x.dtype).reshape(x.shape[0], S * r)
    return jnp.dot(xa, b.reshape(S * r, -1), preferred_element_type=jnp.float32).astype(x.dtype)
