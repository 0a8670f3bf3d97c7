"""The device-side inputs of one model step and the paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.models.kv_pages import kv_storage_bits


@jax.tree_util.register_dataclass
@dataclass
class KVCache:
    """The page pool of every layer.

    `k` and `v` are `[num_layers, num_pages, page_size, num_kv_heads, head_dim]` (an MLA model's latent entries
    in `k`, `v` zero wide: `ModelConfig.kv_cache_dims`). Page 0 is
    reserved: padding tokens write there and no sequence reads it. Inside the forward pass the
    layer and page axes are merged (`[num_layers * num_pages, ...]`, a free reshape), so one
    layer's pages are addressed as `layer * num_pages + page` and no layer is ever copied out.

    With `dtype_name` (static), `k` and `v` hold the raw bits of pages of that dtype, as unsigned
    integers of its width: how the CPU attention keeps bfloat16 and float8 pages (see
    `attention.kv_storage_bits`).
    """

    k: jax.Array
    v: jax.Array
    dtype_name: str | None = field(default=None, metadata=dict(static=True))
    # A hybrid model's (`ModelConfig.mamba`): its Mamba layers' states, a slot per running sequence
    # (`ModelInputs.state_slots`; slot 0 takes the padding's writes). `k` and `v` then hold the attention layers' pages.
    conv: jax.Array | None = None  # [mamba layers, slots, conv_dim, conv_kernel - 1] (`--mamba-cache-dtype`)
    ssm: jax.Array | None = None  # [mamba layers, slots, heads, head_dim, state_size] (`--mamba-ssm-cache-dtype`)

    @property
    def dtype(self) -> np.dtype:
        """The dtype the pages hold."""
        return jnp.dtype(self.dtype_name) if self.dtype_name else self.k.dtype

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]

    @property
    def page_size(self) -> int:
        return self.k.shape[2]

    @classmethod
    def allocate(cls, cfg: ModelConfig, num_pages: int, page_size: int, dtype: Any, as_bits: bool = False,
                 state_slots: int = 0, state_dtypes: tuple[Any, Any] = (jnp.float32, jnp.float32)) -> KVCache:
        """A zeroed pool; `as_bits` keeps pages narrower than float32 as their raw bits (the CPU attention's
        storage); a hybrid model's states for `state_slots` slots (`state_shapes`), its convolution's and its SSM's
        in `state_dtypes`."""
        k_dim, v_dim = cfg.kv_cache_dims
        shape = (len(cfg.attention_layers), num_pages, page_size, cfg.kv_pool_heads)
        dtype = jnp.dtype(dtype)
        bits = kv_storage_bits(dtype) if as_bits else None
        shapes = cls.state_shapes(cfg, state_slots)  # ({} without states)
        states = {name: jnp.zeros(shapes[name], t) for name, t in zip(("conv", "ssm"), state_dtypes, strict=True)
                  if name in shapes}
        if bits is not None:
            return cls(k=jnp.zeros((*shape, k_dim), bits), v=jnp.zeros((*shape, v_dim), bits), dtype_name=dtype.name,
                       **states)
        return cls(k=jnp.zeros((*shape, k_dim), dtype), v=jnp.zeros((*shape, v_dim), dtype), **states)

    @staticmethod
    def state_shapes(cfg: ModelConfig, slots: int) -> dict[str, tuple[int, ...]]:
        """A hybrid model's state pools of `slots` slots, by field ({} for other models)."""
        m = cfg.mamba
        if m is None:
            return {}
        Lm = len(m.layers)
        return {"conv": (Lm, slots, m.conv_dim, m.conv_kernel - 1),
                "ssm": (Lm, slots, m.num_heads, m.head_dim, m.state_size)}

    @staticmethod
    def bytes_per_page(cfg: ModelConfig, page_size: int, dtype: Any) -> int:
        return (len(cfg.attention_layers) * page_size * cfg.kv_pool_heads * sum(cfg.kv_cache_dims)
                * np.dtype(dtype).itemsize)


@jax.tree_util.register_dataclass
@dataclass
class ModelInputs:
    """A ragged batch: `T` token slots packed by sequence, `S` sequence slots, `P` pages each.

    Sequence `s` owns tokens `query_start_loc[s]:query_start_loc[s + 1]`; those are its newest
    tokens, so token `i` of it sits at position `seq_lens[s] - q_len[s] + i`. Token slots past
    `query_start_loc[S]` are padding: they write to page 0 and their outputs are ignored.
    """

    token_ids: jax.Array  # [T] int32
    positions: jax.Array  # [T] int32
    slot_mapping: jax.Array  # [T] int32, page * page_size + offset
    block_tables: jax.Array  # [S, P] int32
    seq_lens: jax.Array  # [S] int32, KV length including this step's tokens
    query_start_loc: jax.Array  # [S + 1] int32
    logits_indices: jax.Array  # [R] int32, the token slots whose logits are returned
    decode: bool = field(default=False, metadata=dict(static=True))
    """Static: every sequence has at most one query token (the decode loop's batches)."""
    lora_slots: jax.Array | None = None  # [T] int32: each token's LoRA adapter slot (-1: none); LoRA engines only
    state_slots: jax.Array | None = None  # [S] int32: each sequence's state slot (0: padding); hybrid models only
    long_prompt: jax.Array | None = None
    """[T] bool: the token's sequence has a prompt longer than a LongRoPE model's original context, so all its
    positions take the long factors (`rotary.rope_tables`); only in engines serving past that context."""
    image_embeds: jax.Array | None = None
    """[T, E]: the embeddings the decoder takes for image tokens, in place of their tokens'; image-text engines
    only (`engine.multimodal`)."""
    image_mask: jax.Array | None = None  # [T] bool: the tokens that take `image_embeds`
    last_key: jax.Array | None = None
    """[T] int32: the last key position each token attends to, past its own for the tokens of an image attended
    both ways (Gemma 3; a value at or below the token's position: causal); None: all causal."""
    rope_offsets: jax.Array | None = None
    """[3, T] int32: what each token's temporal, height and width rotary positions add to its position (M-RoPE,
    `ModelConfig.mrope_section`: an image's tokens by their place in it, the text after an image drawn back by
    the positions its tokens did not take); M-RoPE engines with images only."""
    per_layer: jax.Array | None = None  # [T, L, P]: Gemma 4 E2B/E4B's input of each layer (made in `llama.forward`)

    @classmethod
    def build(
        cls,
        seqs: list[tuple[list[int], int, list[int]]],
        page_size: int,
        num_tokens: int | None = None,
        num_seqs: int | None = None,
        pages_per_seq: int | None = None,
        all_logits: bool = False,
        lora_slots: list[int] | None = None,
        logit_rows: list[int] | None = None,
        long_prompts: list[bool] | None = None,
        mrope: bool = False,
        state_slots: list[int] | None = None,
    ) -> ModelInputs:
        """Host-side builder from `(new_token_ids, start_position, page_table)` per sequence.

        Pads to the given bucket sizes; returns the last token's logits per sequence, or every
        token's with `all_logits`, or with `logit_rows` the logits of each sequence's last
        `logit_rows[s]` tokens, in order (a sequence verifying drafts: one row per position), padded to
        `num_seqs` rows. `lora_slots` (a LoRA engine's): each sequence's adapter slot, -1 none. `long_prompts`
        (an engine's serving a LongRoPE model past its original context): whether each sequence's prompt is
        longer than that context. `mrope`: with `rope_offsets`, all 0 (an M-RoPE engine's text). `state_slots` (a hybrid
        model's): each sequence's state slot.
        """
        real_tokens = sum(len(t) for t, _, _ in seqs)
        T = num_tokens or real_tokens
        S = num_seqs or len(seqs)
        P = pages_per_seq or max(1, max(len(p) for _, _, p in seqs))
        if real_tokens > T or len(seqs) > S:
            raise ValueError(f"batch of {len(seqs)} seqs / {real_tokens} tokens exceeds bucket {S} / {T}")
        token_ids = np.zeros(T, np.int32)
        positions = np.zeros(T, np.int32)
        slots = np.zeros(T, np.int32)
        tables = np.zeros((S, P), np.int32)
        seq_lens = np.zeros(S, np.int32)
        qsl = np.zeros(S + 1, np.int32)
        last = np.zeros(S, np.int32)
        t = 0
        for s, (toks, start, pages) in enumerate(seqs):
            n = len(toks)
            end = start + n
            if -(-end // page_size) > len(pages):
                raise ValueError(f"sequence {s} needs {-(-end // page_size)} pages, has {len(pages)}")
            if len(pages) > P:
                raise ValueError(f"sequence {s} has {len(pages)} pages, bucket allows {P}")
            pos = np.arange(start, end)
            token_ids[t:t + n] = toks
            positions[t:t + n] = pos
            slots[t:t + n] = np.asarray(pages, np.int64)[pos // page_size] * page_size + pos % page_size
            tables[s, : len(pages)] = pages
            seq_lens[s] = end
            qsl[s + 1] = t + n
            last[s] = t + n - 1
            t += n
        qsl[len(seqs) + 1:] = t
        logits_indices = np.arange(T, dtype=np.int32) if all_logits else last

        def per_token(values: list, pad: object, dtype: type) -> np.ndarray:  # each sequence's value, token by token
            return np.concatenate([np.full(len(t), v, dtype) for (t, _, _), v in zip(seqs, values, strict=True)]
                                  + [np.full(T - real_tokens, pad, dtype)])

        if logit_rows is not None:
            if len(logit_rows) != len(seqs) or any(
                    not 1 <= r <= len(t) for r, (t, _, _) in zip(logit_rows, seqs, strict=True)):
                raise ValueError(f"logit_rows {logit_rows} must give 1 to len(tokens) rows for each of {len(seqs)} "
                                 "sequences")
            picked = np.concatenate([np.arange(last[s] + 1 - r, last[s] + 1) for s, r in enumerate(logit_rows)])
            if len(picked) > S:
                raise ValueError(f"{len(picked)} logit rows exceed the bucket's {S}")
            logits_indices = np.zeros(S, np.int32)
            logits_indices[:len(picked)] = picked
        return cls(
            token_ids=jnp.asarray(token_ids),
            positions=jnp.asarray(positions),
            slot_mapping=jnp.asarray(slots),
            block_tables=jnp.asarray(tables),
            seq_lens=jnp.asarray(seq_lens),
            query_start_loc=jnp.asarray(qsl),
            logits_indices=jnp.asarray(logits_indices),
            lora_slots=None if lora_slots is None else jnp.asarray(per_token(lora_slots, -1, np.int32)),
            long_prompt=None if long_prompts is None else jnp.asarray(per_token(long_prompts, False, np.bool_)),
            rope_offsets=jnp.zeros((3, T), jnp.int32) if mrope else None,
            state_slots=None if state_slots is None else jnp.asarray(
                np.pad(np.asarray(state_slots, np.int32), (0, S - len(seqs)))),
        )
