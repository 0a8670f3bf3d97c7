"""Repetition, presence and frequency penalties: the token history they read, and how they change logits.

The runner passes each step a `PenaltyInputs` (prompt then output ids per row); `penalty_arrays` turns
it into output-token counts and a prompt-token mask on the device, only when some row uses a penalty,
and `apply_penalties` applies them as vLLM does. The decode loop keeps the counts current with
`update_counts`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:
    from jaxserve.engine.sampler import SamplingTensors


@jax.tree_util.register_dataclass
@dataclass
class PenaltyInputs:
    """Token history for repetition/presence/frequency penalties (all -1 when no row uses them)."""

    history: jax.Array  # [S, H] int32: prompt then output ids, -1 padded
    num_prompt: jax.Array  # [S] int32


def penalty_arrays(pen: PenaltyInputs, t: SamplingTensors, vocab: int):
    """counts [S, V] of output ids and mask [S, V] of prompt ids, built only when a row needs them."""
    S, H = pen.history.shape
    wants = jnp.any((t.repetition_penalty != 1) | (t.presence_penalty != 0) | (t.frequency_penalty != 0))

    def build(_):
        idx = jnp.arange(H)[None, :]
        ids = jnp.where(pen.history < 0, vocab, pen.history)
        is_prompt = idx < pen.num_prompt[:, None]
        rows = jnp.broadcast_to(jnp.arange(S)[:, None], (S, H))
        counts = jnp.zeros((S, vocab), jnp.int32).at[rows, jnp.where(is_prompt, vocab, ids)].add(1, mode="drop")
        mask = jnp.zeros((S, vocab), bool).at[rows, jnp.where(is_prompt, ids, vocab)].set(True, mode="drop")
        return counts, mask

    def empty(_):
        return jnp.zeros((S, vocab), jnp.int32), jnp.zeros((S, vocab), bool)

    return jax.lax.cond(wants, build, empty, None)


def update_counts(counts: jax.Array, token_ids: jax.Array) -> jax.Array:
    """Add one to counts [S, V] at each row's new token [S]; negative ids (padding) add nothing."""
    S, V = counts.shape
    ids = jnp.where(token_ids < 0, V, token_ids)
    return counts.at[jnp.arange(S), ids].add(1, mode="drop")


def token_counts(rows: Sequence[Sequence[int]], padded_size: int, vocab_size: int) -> np.ndarray:
    """Host [padded_size, vocab_size] int32 counts of each row's token ids."""
    counts = np.zeros((padded_size, vocab_size), np.int32)
    for i, ids in enumerate(rows):
        np.add.at(counts[i], np.asarray(ids, np.int64), 1)
    return counts


def token_mask(rows: Sequence[Sequence[int]], padded_size: int, vocab_size: int) -> np.ndarray:
    """Host [padded_size, vocab_size] bool mask of the token ids present in each row."""
    mask = np.zeros((padded_size, vocab_size), bool)
    for i, ids in enumerate(rows):
        mask[i, np.asarray(ids, np.int64)] = True
    return mask


def apply_penalties(
    logits: jax.Array, t: SamplingTensors, counts: jax.Array | None, prompt_mask: jax.Array | None
) -> jax.Array:
    seen = jnp.zeros(logits.shape, bool)  # [S, V] in the prompt or the output so far
    if counts is not None:
        seen = counts > 0
    if prompt_mask is not None:
        seen = seen | prompt_mask
    rep = t.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    if counts is not None:
        logits = logits - t.frequency_penalty[:, None] * counts.astype(jnp.float32)
        logits = logits - t.presence_penalty[:, None] * (counts > 0)
    return logits
