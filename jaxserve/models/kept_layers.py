"""The hidden states entering chosen layers of a forward pass, kept as the layer loops pass them (`llama.forward`'s
`aux_layers`: an EAGLE-3 draft's inputs, `models.eagle`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


class KeptLayers:
    """The states entering `layers` (of `num_layers`; layer 0's are the embeddings, layer L's the last): each kept
    once, in a slot of a buffer carried through the loops beside (x, k, v) and written in place; the last slot takes
    the other layers' writes. With no layers, nothing is carried and nothing written."""

    def __init__(self, layers: tuple[int, ...], num_layers: int):
        self.layers = layers
        distinct = sorted(set(layers))
        self.slot_of = np.full(num_layers + 1, len(distinct), np.int32)
        self.slot_of[distinct] = np.arange(len(distinct))
        self.num_slots = len(distinct) + 1

    def start(self, x: jax.Array) -> tuple:
        """What the loops' carry gains: the buffer, or nothing."""
        return (jnp.zeros((self.num_slots, *x.shape), x.dtype),) if self.layers else ()

    def keep(self, carry: tuple, layer) -> tuple:
        """`carry` (x, ...[, buffer]) with x kept as the state entering `layer` (traced or static)."""
        if not self.layers:
            return carry
        *head, kept = carry
        return (*head, jax.lax.dynamic_update_index_in_dim(kept, head[0], jnp.asarray(self.slot_of)[layer], 0))

    def states(self, kept: jax.Array) -> jax.Array:
        """The kept states side by side in the order asked: [T, len(layers) * E]."""
        return jnp.concatenate([kept[self.slot_of[j]] for j in self.layers], axis=-1)
