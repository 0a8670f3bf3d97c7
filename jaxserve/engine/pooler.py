"""Embeddings on the device and the host: one pooled row per sequence of a step, then the vector.

`pool_step` is the pooling runner's one jitted function: a forward over a ragged batch of prompt
chunks (written into the paged KV cache like any prefill, so long prompts are chunked and LAST
pooling reuses cached prefixes), then per sequence row the final-normed hidden state of its last
token (LAST), of its first (CLS, meaningful in a chunk that starts the prompt), or the sum over its
tokens in this chunk (MEAN, summed across chunks on the host). `PooledSequence` gathers a request's
rows across chunks and finishes the vector: Matryoshka truncation, then the L2 norm.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.models.attention import AttentionBackend
from jaxserve.models.inputs import KVCache, ModelInputs
from jaxserve.models.llama import forward
from jaxserve.models.ops import model_norm
from jaxserve.models.params import Params
from jaxserve.pooling_params import PoolingParams, PoolingType


def pool_step(params: Params, kv: KVCache, inputs: ModelInputs, cfg: ModelConfig, backend: AttentionBackend,
              pooling_type: PoolingType, model_fn=forward) -> tuple[jax.Array, KVCache]:
    """Forward over a ragged batch; [S, E] float32 pooled rows (see the module) and the KV cache."""
    _, kv, h = model_fn(params, kv, inputs, cfg, backend, return_hidden=True)  # h [T, E], before the final norm
    S = inputs.query_start_loc.shape[0] - 1
    T = h.shape[0]
    if pooling_type == "LAST":
        rows = h[inputs.logits_indices]
    elif pooling_type == "CLS":
        rows = h[jnp.minimum(inputs.query_start_loc[:S], T - 1)]
    else:  # MEAN: each token's row by the query offsets; padding tokens fall past the last row and drop out
        seg = jnp.searchsorted(inputs.query_start_loc, jnp.arange(T, dtype=jnp.int32), side="right") - 1
        normed = model_norm(cfg, h, params.final_norm, params.final_norm_b).astype(jnp.float32)
        return jax.ops.segment_sum(normed, seg, num_segments=S), kv
    return model_norm(cfg, rows, params.final_norm, params.final_norm_b).astype(jnp.float32), kv


@dataclass
class PooledSequence:
    """One embedding request's pooling across its prompt chunks."""

    params: PoolingParams
    pooling_type: PoolingType
    normalize: bool
    total: np.ndarray | None = None  # LAST/CLS: the row; MEAN: the sum so far
    count: int = 0  # MEAN: tokens summed

    def take(self, row: np.ndarray, start: int, num_tokens: int, last_chunk: bool) -> None:
        """A step's row for a chunk of `num_tokens` prompt tokens starting at position `start`."""
        if self.pooling_type == "MEAN":
            if start == 0:  # a recompute after preemption starts over
                self.total, self.count = None, 0
            self.total = row.astype(np.float64) if self.total is None else self.total + row
            self.count += num_tokens
        elif (self.pooling_type == "CLS" and start == 0) or (self.pooling_type == "LAST" and last_chunk):
            self.total = row.astype(np.float64)

    def embedding(self) -> list[float]:
        """The finished vector: pooled, cut to `dimensions`, normalized if asked."""
        assert self.total is not None, "embedding() before the prompt's last chunk"
        vec = self.total / self.count if self.pooling_type == "MEAN" else self.total
        if self.params.dimensions is not None:
            vec = vec[: self.params.dimensions]
        normalize = self.params.normalize if self.params.normalize is not None else self.normalize
        if normalize:
            vec = vec / max(float(np.linalg.norm(vec)), 1e-12)
        return vec.astype(np.float32).tolist()
