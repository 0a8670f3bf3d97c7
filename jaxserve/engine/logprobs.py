"""Logprobs beyond the sampled token's: the top logprobs of each sampled row, and prompt logprobs
(each prompt token's logprob given the tokens before it), computed inside the jitted steps."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.models.llama import lm_head
from jaxserve.models.params import Params

PROMPT_LOGPROB_BLOCK = 256  # prompt tokens projected onto the vocabulary at once (prompt logprobs)


@jax.tree_util.register_dataclass
@dataclass
class PromptLogprobInputs:
    """Per packed token of a mixed step, the prompt token that follows it, whose logprob is wanted
    (-1: none; all -1 when no request asks for prompt logprobs)."""

    next_ids: jax.Array  # [T] int32


@jax.tree_util.register_dataclass
@dataclass
class PromptLogprobs:
    """Per packed token of a mixed step: the logprob and rank of the prompt token that follows it, and
    the top logprobs of the distribution there (zeros where none was wanted)."""

    logprobs: jax.Array  # [T] f32
    ranks: jax.Array  # [T] int32
    top_ids: jax.Array  # [T, K] int32
    top_logprobs: jax.Array  # [T, K] f32


def top_logprobs(logits: jax.Array, want: jax.Array, k: int, normalize: bool = True):
    """The `k` largest of each row of `logits` [S, V] and their ids, as logprobs (`normalize`) or as they are
    (scores a sampler already reports: `SamplerOutput.scores`); zeros unless `want`."""
    def compute(x):
        vals, ids = jax.lax.top_k(x, k)
        return ids.astype(jnp.int32), vals - jax.nn.logsumexp(x, axis=-1, keepdims=True) if normalize else vals

    def skip(x):
        return jnp.zeros((x.shape[0], k), jnp.int32), jnp.zeros((x.shape[0], k), jnp.float32)

    return jax.lax.cond(want, compute, skip, logits)


def prompt_logprobs(params: Params, cfg: ModelConfig, hidden: jax.Array, next_ids: jax.Array,
                     top_k: int) -> PromptLogprobs:
    """Logprobs of the prompt tokens that follow each packed token (hidden: [T, E]), computed only
    when some token wants one: the vocabulary projection of every token costs T x E x V. Tokens go
    `PROMPT_LOGPROB_BLOCK` at a time, so the logits held at once stay [block, V]."""
    T, E = hidden.shape
    block = min(T, PROMPT_LOGPROB_BLOCK)
    pad = -T % block

    def one_block(args):
        h, nxt = args  # [block, E], [block]
        logits = lm_head(params, cfg, h)  # [block, V]
        lse = jax.nn.logsumexp(logits, axis=-1)
        chosen = jnp.take_along_axis(logits, jnp.maximum(nxt, 0)[:, None], axis=-1)[:, 0]
        ranks = 1 + jnp.sum(logits > chosen[:, None], axis=-1, dtype=jnp.int32)
        vals, ids = jax.lax.top_k(logits, top_k)
        return PromptLogprobs(chosen - lse, ranks, ids.astype(jnp.int32), vals - lse[:, None])

    def compute(h):
        h = jnp.pad(h, ((0, pad), (0, 0))).reshape(-1, block, E)
        nxt = jnp.pad(next_ids, (0, pad)).reshape(-1, block)
        out = jax.lax.map(one_block, (h, nxt))
        return jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:])[:T], out)

    def skip(h):
        return PromptLogprobs(jnp.zeros((T,), jnp.float32), jnp.zeros((T,), jnp.int32),
                              jnp.zeros((T, top_k), jnp.int32), jnp.zeros((T, top_k), jnp.float32))

    return jax.lax.cond(jnp.any(next_ids >= 0), compute, skip, hidden)
