"""Speculative decoding with the model's own multi-token prediction layer: `--speculative-config '{"method": "mtp",
"num_speculative_tokens": k}'` (vLLM's method; "deepseek_mtp" and "glm4_moe_mtp" name it too). `models.mtp`
describes the layer, read from an HF directory or from a GGUF file's `nextn` block (GLM-4.5's, as llama.cpp writes
it); the drafts are verified as any others (`speculative.SpecStep`), so outputs are the target's own.

The layer keeps a one-layer KV pool of the target's pages, allocated, shared, preempted and freed with the target's
as a draft model's is (`draft_model.DraftModel`), and written in lockstep from the target's steps themselves: every
step keeps its tokens' last hidden states on the device (`RunnerConfig.keep_hidden`), and the layer runs over the
step's rows with, at each row, the token after it: the next token of its chunk, the prompt's next token for a
chunk that does not end the prompt, else the token the target sampled at that row, read from the step's outputs on
the device (nothing waits for the host). A row whose sampled token is not taken (a rejected draft's) lies past the
request's length, as the target's own does, and is written again when the target computes that position again.

The layer's logits at a sampling row are a first draft for the row's request, free with the step: the engine
takes it when the row's sampled token is the request's last token (the row then sits just before the request's
next position). Further drafts run the layer again from its own output, one token an iteration of a loop on the
device (`_draft_loop`), as a draft model's loop does. So one draft a step (the usual `num_speculative_tokens` 1)
costs the layer's forward over each step and no drafting loop.

A prefix cache hit reads the layer's KV of the cached positions; a cached page's last position holds what the layer
computed with the next token of the request that wrote it, which may differ from a later request's (its drafts
there are then a little worse; outputs never change)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.config_qwen3_next import GATED_DELTA_FAMILIES
from jaxserve.engine.draft_model import DraftModel, _own, host_copy
from jaxserve.engine_args import EngineArgs
from jaxserve.models.inputs import KVCache, ModelInputs
from jaxserve.models.mtp import MtpParams, load_mtp_params, mtp_config, mtp_forward, unstacked
from jaxserve.models.unstack import unstack_layers


def load_mtp(args: EngineArgs, target: Any) -> MtpDraft:
    """The first multi-token prediction layer of the `target`'s checkpoint (a `LoadedModel`), ready to `start`."""
    if target.vision is not None:
        raise ValueError("speculative method 'mtp' is not supported with an image-text model; use method 'ngram', "
                         "or no speculative config")
    layers, tensors = _mtp_tensors(target.path, args.hf_overrides, target.config)
    cfg = mtp_config(target.config, layers)
    params = load_mtp_params(tensors(cfg), cfg, target.params, target.config.num_layers, target.dtype)
    loaded = dataclasses.replace(target, params=params, config=cfg, name=f"{target.name} (MTP layer)", vision=None,
                                 plan=None)
    draft = MtpDraft(loaded, target.config.vocab_size, args.speculative_config.num_speculative_tokens, args)
    draft.target_cfg = target.config
    return draft


def _mtp_tensors(path: str, overrides: Any, target: ModelConfig) -> tuple[int, Callable[[ModelConfig], Any]]:
    """How many MTP layers the checkpoint at `path` has (an HF directory's `num_nextn_predict_layers`, a GGUF file's
    `nextn` blocks: GLM-4.5's as llama.cpp writes them) and its tensors that may be theirs, by the layer's config."""
    from jaxserve.loader import HFDirectory, open_checkpoint
    from jaxserve.loader.gguf_file import prediction_blocks

    ckpt = open_checkpoint(path, overrides=overrides)
    if isinstance(ckpt, HFDirectory):
        first = f"model.layers.{target.num_layers}."
        if target.family in GATED_DELTA_FAMILIES:  # (Qwen3-Next's, Qwen3.5's: `mtp.*`)
            first = "mtp."
        hf = ckpt.hf_config.get("text_config") or ckpt.hf_config
        return (int(hf.get("num_nextn_predict_layers") or hf.get("mtp_num_hidden_layers") or 0),
                lambda cfg: ckpt.tensors(cfg, select=lambda n: n.startswith(first)))
    return len(prediction_blocks(t.name for t in ckpt.reader.tensors)), lambda _: ckpt.tensors(target, prediction=True)


def mtp_layer(p: MtpParams, kv: KVCache, inputs: ModelInputs, prev: jax.Array, from_target: bool, cfg: ModelConfig,
              backend: str, vocab: int) -> tuple[jax.Array, KVCache, jax.Array]:
    """The layer as the drafting steps run it (`mtp_forward`): its greedy drafts at `inputs.logits_indices` [R], the
    pool and its outputs [T, E]."""
    logits, kv, h = mtp_forward(p, kv, inputs, prev, cfg, backend, from_target)
    return jnp.argmax(logits[:, :vocab], axis=-1).astype(jnp.int32), kv, h


def _follow(p: Any, kv: KVCache, inputs: ModelInputs, hidden: jax.Array, sampled: jax.Array,
            next_ids: jax.Array, next_from: jax.Array, layer: Callable, num_ids: int, rows: int):
    """The `layer` (as `mtp_layer`) over a target step's rows (`hidden` the hidden states it keeps), each row's next
    token `next_ids` where known (else -1: the step's sampled token `sampled.ravel()[next_from]`). Returns the pool,
    and at each sampling row (`inputs.logits_indices`), padded to `rows`: the first draft and the token read ([2,
    rows], one transfer to the host), and the layer's output."""
    ids = jnp.where(next_ids >= 0, next_ids, sampled.reshape(-1)[next_from])
    ids = jnp.clip(ids, 0, num_ids - 1)  # (padding rows sample -1)
    first, kv, h = layer(p, kv, dataclasses.replace(inputs, token_ids=ids), hidden, True)
    at = inputs.logits_indices
    pad = rows - at.shape[0]
    tokens = jnp.stack([jnp.pad(first, (0, pad)), jnp.pad(ids[at], (0, pad), constant_values=-1)])
    return kv, tokens, jnp.pad(h[at], ((0, pad), (0, 0)))


def _draft_loop(p: Any, kv: KVCache, outs: jax.Array, at: jax.Array, tokens: jax.Array, positions: jax.Array,
                tables: jax.Array, counts: jax.Array, layer: Callable, num_ids: int,
                n_max: int) -> tuple[jax.Array, KVCache]:
    """Drafts after the first: row i from the layer's output `outs[at[i]]` and its first draft `tokens[i]`, the
    layer at `positions[i]` (the request's last token's) and on, `counts[i]` (<= n_max) more greedy tokens:
    [n_max, S] (-1 past a row's count) and the pool."""
    S, P = tables.shape
    page_size = kv.k.shape[2]
    rows = jnp.arange(S, dtype=jnp.int32)

    def body(j, c):
        kv, tok, prev, out = c
        pos = positions + j
        live = j < counts
        page = tables[rows, jnp.clip(pos // page_size, 0, P - 1)]
        inputs = ModelInputs(
            token_ids=jnp.clip(tok, 0, num_ids - 1), positions=pos,
            slot_mapping=jnp.where(live, page * page_size + pos % page_size, 0),
            block_tables=jnp.where(live[:, None], tables, 0), seq_lens=jnp.where(live, pos + 1, 1),
            query_start_loc=jnp.arange(S + 1, dtype=jnp.int32), logits_indices=rows, decode=True)
        new, kv, h = layer(p, kv, inputs, prev, False)
        return kv, jnp.where(live, new, tok), jnp.where(live[:, None], h, prev), out.at[j].set(jnp.where(live, new, -1))

    out = jnp.full((n_max, S), -1, jnp.int32)
    kv, _, _, out = jax.lax.fori_loop(0, jnp.max(counts), body, (kv, tokens, outs[at], out))
    return out, kv


@functools.lru_cache(maxsize=4)
def _steps(layer: Callable, static: tuple[tuple[str, Any], ...], num_ids: int, n_max: int, rows: int,
           replicated: Any = None) -> tuple[Callable, Callable | None]:
    """The jitted lockstep forward and (for more than one draft) drafting loop of `layer` (as `mtp_layer`, its
    `static` keyword arguments given); `replicated` as in `draft_model._steps`."""
    out = {} if replicated is None else dict(in_shardings=replicated, out_shardings=replicated)
    common = dict(layer=functools.partial(layer, **dict(static)), num_ids=num_ids)
    follow = jax.jit(functools.partial(_follow, rows=rows, **common), donate_argnums=(1,), **out)
    loop = jax.jit(functools.partial(_draft_loop, n_max=n_max - 1, **common), donate_argnums=(1,), **out) \
        if n_max > 1 else None
    return follow, loop


class MtpDraft(DraftModel):
    """The model's multi-token prediction layer as the engine's drafter (`draft_model.DraftModel`'s interface)."""

    needs_hidden = True

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._last: tuple[jax.Array, jax.Array] | None = None  # the last step's ([firsts, tokens read], outputs)
        self._rows: dict[tuple[str, int], int] = {}  # (request, position) -> its sampling row of the last step
        self.target_cfg: ModelConfig | None = None  # the target's (its layer count places the layer's tensors)

    def build_steps(self, rep: Any) -> tuple[Callable, Callable | None]:
        static = (("cfg", self.cfg), ("backend", self.rcfg.backend), ("vocab", self.vocab))
        return _steps(mtp_layer, static, self.cfg.vocab_size, self.num_speculative_tokens, self.rcfg.max_num_seqs,
                      rep)

    @property
    def hidden_width(self) -> int:
        """The width of the hidden states the target's steps keep for it ([T, width])."""
        return self.target_cfg.hidden_size

    def lay_out(self, params: Any) -> Any:
        params = self.replicated(params)
        return unstacked(params, lambda m: unstack_layers(m, fuse=True)) if self.rcfg.layer_loop == "unroll" else params

    def reload(self, target_params: Any = None) -> None:
        tensors = _mtp_tensors(self.loaded.path, self.args.hf_overrides, self.target_cfg)[1](self.cfg)
        self.params = self.lay_out(load_mtp_params(tensors, self.cfg, target_params, self.target_cfg.num_layers,
                                                   self.loaded.dtype))
        self.loaded = dataclasses.replace(self.loaded, params=self.params)

    # -- lockstep with the target ------------------------------------------------------------------

    def follow(self, inputs: ModelInputs, out: Any = None, rows: Any = None, request_of: Any = None) -> None:
        """The layer over a target mixed step's `rows` (`ScheduledRequest`s, packed in order), from its outputs
        `out` (on the device)."""
        T = inputs.token_ids.shape[0]
        next_ids, next_from, t = np.full(T, -1, np.int32), np.zeros(T, np.int32), 0
        self._rows = {}
        for i, s in enumerate(rows):
            n = s.num_new_tokens
            next_ids[t:t + n - 1] = s.token_ids[1:]
            last, pos = t + n - 1, s.start_position + n
            if s.sample:  # (the row's logits are the step's output i)
                next_from[last] = i
                self._rows[(s.request_id, pos - 1)] = i
            else:  # a chunk within the prompt (or within tokens being recomputed): the next one is known
                req = request_of(s.request_id)
                k = req.num_prompt_tokens
                next_ids[last] = req.prompt_token_ids[pos] if pos < k else req.output_token_ids[pos - k]
            t += n
        self._run(_own(inputs), out, next_ids, next_from)

    def follow_decode(self, st: Any, out: Any = None, rows: Any = None) -> None:
        """The layer over a target decode step's rows (one token each), from its outputs `out`."""
        tokens, positions, tables = np.asarray(st.tokens), np.asarray(st.positions), np.asarray(st.block_tables)
        live = np.asarray(st.max_steps) > 0
        S = len(tokens)
        self._rows = {(s.request_id, int(positions[i])): i for i, s in enumerate(rows)}
        self._run(self._decode_inputs(tokens, positions, tables, live), out, np.full(S, -1, np.int32),
                  np.arange(S, dtype=np.int32))

    def _run(self, inputs: ModelInputs, out: Any, next_ids: np.ndarray, next_from: np.ndarray) -> None:
        self.kv, *last = self._follow(self.params, self.kv, inputs, out.hidden, out.token_ids, next_ids, next_from)
        self._last = tuple(last)

    # -- drafting ----------------------------------------------------------------------------------

    def propose(self, rows: Sequence[tuple[str, int, int, Sequence[int], int]]) -> dict[str, np.ndarray]:
        """Drafts for decoding requests, each `(request_id, last token, its position, page table, how many)`: the
        layer's first draft from the last step's row before that position (when that row's sampled token is the
        last token), then its own continuation."""
        if self._last is None:
            return {}
        pair, outs = self._last
        firsts, read = host_copy(pair)
        picked = []
        for rid, token, position, pages, k in rows:
            j = self._rows.get((rid, position - 1))
            if k > 0 and j is not None and read[j] == token:
                picked.append((rid, j, position, pages, min(k, self.num_speculative_tokens)))
        drafts = {rid: [int(firsts[j])] for rid, j, *_ in picked}
        deeper = [r for r in picked if r[4] > 1]
        if deeper and self._draft is not None:
            S, P = self.rcfg.seq_bucket(len(deeper)), self.rcfg.pages_per_seq
            at, tokens, positions, counts = (np.zeros(S, np.int32) for _ in range(4))
            tables = np.zeros((S, P), np.int32)
            for i, (_, j, position, pages, k) in enumerate(deeper):
                at[i], tokens[i], positions[i], counts[i] = j, firsts[j], position, k - 1
                tables[i, :len(pages)] = pages
            more, self.kv = self._draft(self.params, self.kv, outs, at, tokens, positions, tables, counts)
            more = host_copy(more)
            self._check_compiles()
            for i, (rid, *_) in enumerate(deeper):
                drafts[rid] += more[:counts[i], i].tolist()
        return {rid: np.asarray(d, np.int32) for rid, d in drafts.items()}

    def time_draft(self, S: int) -> None:
        """The drafting loop of S rows (its further drafts), into the reserved page 0, waited for; nothing for one
        draft a step (it comes with the step)."""
        if self._draft is None:
            return
        z, tables = np.zeros(S, np.int32), np.zeros((S, self.rcfg.pages_per_seq), np.int32)
        outs = self.replicated(jnp.zeros((self.rcfg.max_num_seqs, self.cfg.hidden_size), self.loaded.dtype))
        counts = np.full(S, self.num_speculative_tokens - 1, np.int32)
        out, self.kv = self._draft(self.params, self.kv, outs, z, z, z, tables, counts)
        jax.block_until_ready(out)

    # -- compiles ----------------------------------------------------------------------------------

    def warm_calls(self) -> list[tuple[Callable, Callable[[], tuple]]]:
        """The steps' executables: the step's outputs (hidden states, sampled tokens) placed as the target's steps
        place them (over a mesh, whole on each device), as they come while serving."""
        rc, E, dtype = self.rcfg, self.cfg.hidden_size, self.loaded.dtype
        mixed, decode = self.warm_inputs()
        calls = []
        for inputs, sampled in ([(i, (i.logits_indices.shape[0],)) for i in mixed]
                                + [(i, (rc.num_scheduler_steps, i.token_ids.shape[0])) for i in decode]):
            T = inputs.token_ids.shape[0]
            args = (*self.replicated((jnp.zeros((T, self.hidden_width), dtype), jnp.zeros(sampled, jnp.int32))),
                    np.full(T, -1, np.int32), np.zeros(T, np.int32))
            calls.append((self._follow, lambda i=inputs, a=args: (self.params, self.kv, i, *a)))
        if self._draft is not None:
            outs = self.replicated(jnp.zeros((rc.max_num_seqs, E), dtype))
            for S in rc.seq_buckets:
                z, t = np.zeros(S, np.int32), np.zeros((S, rc.pages_per_seq), np.int32)
                calls.append((self._draft, lambda z=z, t=t: (self.params, self.kv, outs, z, z, z, t, z)))
        return calls
