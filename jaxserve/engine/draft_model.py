"""A draft model for speculative decoding: a smaller model of the target's vocabulary writes the drafts.

`--speculative-config '{"model": <draft>, "num_speculative_tokens": k}'` (vLLM's method "draft_model").
Before a step, the draft model decodes k tokens greedily for each decode it drafts, from the request's
last token, in one call on the device (`_draft_loop`); the target verifies them as it verifies n-gram
drafts (`speculative.SpecStep`), so outputs are the target's own, greedy or sampled. The loop is paid before
its drafts are seen: a decode step drafts only when the drafts it could verify pay for it, at the acceptance
so far and the loop's cost measured at warmup (`speculative.Drafter.plan`).

The draft keeps its own KV pool with the target's page ids: a page of a request holds the target's keys
and values in the target's pool and the draft's in the draft's, allocated, shared through the prefix cache,
preempted and freed together by the one scheduler. The draft's pages are written in lockstep: every step the
target runs, prefill chunks, decodes and draft rows alike, the draft runs too on the same inputs, keeping
only its KV (`follow`, `follow_decode`; the logits are compiled away). Wherever the target's pages hold a
position, the draft's do too, so a prefix cache hit, a recomputed preemption or a chunked prefill needs
nothing more. Drafting writes the draft's KV at the drafted positions past the request's computed tokens;
the step verifying them rewrites those it keeps with the same values and the rest lie past the request's
length until later steps overwrite them, as the target's rejected rows do.

Decode steps go one token at a time with a draft model (the draft follows each token). The draft's KV
holds the draft model's dtype. Drafts past the draft model's own context are merely worse guesses.
Over several devices (tensor or expert parallel), every device of the target's holds the whole draft model and
its pool (it is small) and runs it alike, across the hosts of a cluster too. Sleep mode frees, keeps or drops its
weights and frees its pool with the target's (`memory.EngineMemory`). A prefill/decode worker with one recomputes an
imported prompt (`kv_transfer.import_pages`).

An image-text target's draft is a text model (an image-text checkpoint's language model, its images off): it reads
an image's tokens as token 0 and every token at its plain position (the target's M-RoPE offsets are its own), so its
drafts after an image are guesses from the text around it; what is taken is the target's, as always.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxserve.config import ModelConfig
from jaxserve.engine.runner import DecodeState, RunnerConfig
from jaxserve.engine.warmup import compile_all
from jaxserve.engine_args import EngineArgs
from jaxserve.models.inputs import KVCache, ModelInputs
from jaxserve.models.unstack import unstack_layers

logger = logging.getLogger(__name__)


def load_draft(args: EngineArgs, target: Any, progress: bool = True) -> DraftModel | None:
    """The draft model `args.speculative_config` names, loaded beside the `target` (a `LoadedModel`) and checked
    against it; None when the config drafts otherwise (or there is none)."""
    spec = args.speculative_config
    if spec is not None and spec.method == "mtp":  # the model's own multi-token prediction layer
        from jaxserve.engine.mtp import load_mtp

        return load_mtp(args, target)
    if spec is None or spec.method not in ("draft_model", "eagle", "eagle3"):
        return None
    from jaxserve.engine.eagle import eagle_method, load_eagle

    method = spec.method if spec.method != "draft_model" else eagle_method(spec.model)
    if method is not None:  # an EAGLE head (a config naming only the model of one: as vLLM reads speculators')
        return load_eagle(args, target, method)
    from jaxserve.engine.model_loading import load_model

    draft_args = EngineArgs(model=spec.model, dtype=args.dtype, quantization=spec.quantization,
                            load_format=args.load_format, seed=args.seed, limit_mm_per_prompt={"image": 0})
    draft = load_model(draft_args, progress=progress)
    if target.tokenizer is not None:  # (without one, `skip_tokenizer_init`: ids are taken as they come)
        check_same_vocabulary(target.tokenizer, draft.tokenizer, target.name, draft.name)
    logger.info("draft model %s: %d layers, %d of hidden width, drafting %d tokens", draft.name,
                draft.config.num_layers, draft.config.hidden_size, spec.num_speculative_tokens)
    return DraftModel(draft, target.config.vocab_size, spec.num_speculative_tokens, draft_args)


def check_same_vocabulary(target: Any, draft: Any, target_name: str, draft_name: str) -> None:
    """Raises ValueError unless every token id both tokenizers know is the same token in each (drafts are token
    ids of the target's vocabulary)."""
    t = {i: s for s, i in target.backend.get_vocab(with_added_tokens=True).items()}
    d = {i: s for s, i in draft.backend.get_vocab(with_added_tokens=True).items()}
    shared = sorted(t.keys() & d.keys())
    differ = [i for i in shared if t[i] != d[i]]
    if differ or len(shared) < min(len(t), len(d)) // 2:
        example = ", ".join(f"{i}: {t[i]!r} / {d[i]!r}" for i in differ[:3])
        raise ValueError(f"the draft model {draft_name} does not share the vocabulary of {target_name}: "
                         f"{len(differ)} of the {len(shared)} ids both have are other tokens"
                         + (f" ({example})" if example else "") + "; a draft model must use the same tokenizer")


def _follow(params: Any, kv: KVCache, inputs: ModelInputs, cfg: ModelConfig, backend: str,
            model_fn: Callable) -> KVCache:
    """The draft's forward over a target step's inputs, kept for its KV writes."""
    inputs = dataclasses.replace(inputs, token_ids=jnp.clip(inputs.token_ids, 0, cfg.vocab_size - 1))  # (images: < 0)
    return model_fn(params, kv, inputs, cfg, backend)[1]


def _draft_loop(params: Any, kv: KVCache, tokens: jax.Array, positions: jax.Array, tables: jax.Array,
                counts: jax.Array, cfg: ModelConfig, backend: str, model_fn: Callable, vocab: int,
                n_max: int) -> tuple[jax.Array, KVCache]:
    """Greedy decoding of `counts[i]` (<= n_max) tokens for each row from its last token `tokens[i]` at
    `positions[i]` (not yet in the KV): [n_max, S] drafts (-1 past a row's count) and the pool."""
    S, P = tables.shape
    page_size = kv.k.shape[2]
    rows = jnp.arange(S, dtype=jnp.int32)
    qsl = jnp.arange(S + 1, dtype=jnp.int32)

    def body(j, c):
        kv, tok, out = c
        pos = positions + j
        live = j < counts
        page = tables[rows, jnp.clip(pos // page_size, 0, P - 1)]
        inputs = ModelInputs(
            token_ids=jnp.minimum(tok, cfg.vocab_size - 1), positions=pos,
            slot_mapping=jnp.where(live, page * page_size + pos % page_size, 0),
            block_tables=jnp.where(live[:, None], tables, 0), seq_lens=jnp.where(live, pos + 1, 1),
            query_start_loc=qsl, logits_indices=rows, decode=True)
        logits, kv = model_fn(params, kv, inputs, cfg, backend)
        new = jnp.argmax(logits[:, :vocab], axis=-1).astype(jnp.int32)
        return kv, jnp.where(live, new, tok), out.at[j].set(jnp.where(live, new, -1))

    out = jnp.full((n_max, S), -1, jnp.int32)
    kv, _, out = jax.lax.fori_loop(0, jnp.max(counts), body, (kv, tokens, out))
    return out, kv


@functools.lru_cache(maxsize=4)
def _steps(cfg: ModelConfig, backend: str, model_fn: Callable, vocab: int, n_max: int,
           replicated: Any = None) -> tuple[Callable, Callable]:
    """The jitted lockstep forward and drafting loop, shared by the draft models of one process alike in these
    (their executables, keyed by the arguments' shapes too, compile once: `compiled_steps` says why); with
    `replicated` (a sharding over a mesh), their outputs are laid out as it says."""
    common = dict(cfg=cfg, backend=backend, model_fn=model_fn)
    out = {} if replicated is None else dict(in_shardings=replicated, out_shardings=replicated)
    return (jax.jit(functools.partial(_follow, **common), donate_argnums=(1,), **out),
            jax.jit(functools.partial(_draft_loop, vocab=vocab, n_max=n_max, **common), donate_argnums=(1,), **out))


def draft_memory(draft: DraftModel | None, page_size: int, plan: Any) -> tuple[int, int]:
    """(bytes of the draft's weights, bytes of one page of its pool) a device holds, the page counted as the
    target's are (over all `plan.kv_shards` devices a page is split over: the draft is whole on each); (0, 0)
    without a draft model."""
    if draft is None:
        return 0, 0
    from jaxserve.engine.model_loading import params_bytes

    page = KVCache.bytes_per_page(draft.cfg, page_size, draft.loaded.dtype)
    return params_bytes(draft.loaded.params), page * (plan.kv_shards if plan is not None else 1)


def draft_fields(draft: DraftModel | None) -> dict[str, Any]:
    """The `RunnerConfig` fields the target's steps take for the `draft`: what hidden states they keep."""
    needs = draft is not None and draft.needs_hidden
    return {"keep_hidden": needs, "hidden_layers": draft.hidden_layers if needs else ()}


class DraftModel:
    """A loaded draft model, then (`start`) on the device with its KV pool (the target's pages) and its jitted
    steps."""

    needs_hidden = False  # whether it drafts from the target's hidden states (`RunnerConfig.keep_hidden`)
    hidden_layers: tuple[int, ...] = ()  # the target's layers whose entering hidden states (`RunnerConfig`)

    def __init__(self, loaded: Any, target_vocab: int, num_speculative_tokens: int, args: EngineArgs | None = None):
        """`args`: how it was loaded (`reload` reads it again so)."""
        self.loaded, self.name, self.cfg, self.args = loaded, loaded.name, loaded.config, args
        self.vocab = min(self.cfg.vocab_size, target_vocab)  # drafts are ids of both vocabularies
        self.num_speculative_tokens = num_speculative_tokens
        self._baseline_compiles: int | None = None

    def start(self, rcfg: RunnerConfig, strict: bool = False, mesh: Any = None) -> None:
        """Lay out the weights, allocate the pool of the target runner's pages and build the steps at its shapes,
        over the target's `mesh` (None: one device) whole on every device; `strict`: a compile after warmup raises
        (`EngineArgs.strict_compile`)."""
        self.rcfg, self.strict, loaded = rcfg, strict, self.loaded
        self._rep = rep = None if mesh is None else NamedSharding(mesh, PartitionSpec())
        self.params = self.lay_out(loaded.params)

        def pool() -> KVCache:
            return KVCache.allocate(self.cfg, rcfg.num_pages, rcfg.page_size, loaded.dtype,
                                    as_bits=rcfg.backend == "xla")

        self.kv = pool() if rep is None else jax.jit(pool, out_shardings=rep)()
        self._follow, self._draft = self.build_steps(rep)
        self.loaded = dataclasses.replace(loaded, params=self.params)  # one copy of the weights

    def build_steps(self, rep: Any) -> tuple[Callable, Callable | None]:
        """The jitted lockstep forward and drafting loop (outputs laid out by `rep`, a sharding, or None)."""
        return _steps(self.cfg, self.rcfg.backend, self.loaded.forward_fn, self.vocab, self.num_speculative_tokens,
                      rep)

    def replicated(self, params: Any) -> Any:
        """`params` whole on each device of the mesh (as they are on one device)."""
        if self._rep is not None:  # (each host of a cluster places its own copy: they read the same checkpoint)
            from sharding.plan import replicated_array

            params = jax.tree.map(lambda x: replicated_array(self._rep.mesh, x), params) if jax.process_count() > 1 \
                else jax.device_put(params, self._rep)
        return params

    def lay_out(self, params: Any) -> Any:
        """Loaded weights as the steps take them: whole on each device of the mesh, per layer or stacked."""
        params = self.replicated(params)
        return unstack_layers(params, fuse=True) if self.rcfg.layer_loop == "unroll" else params

    def reload(self, target_params: Any = None) -> None:
        """Read the weights again from the draft's checkpoint (after sleep mode dropped them; `target_params`: the
        target's, read again before)."""
        from jaxserve.engine.model_loading import load_model

        self.params = self.lay_out(load_model(self.args, progress=False).params)
        self.loaded = dataclasses.replace(self.loaded, params=self.params)

    # -- lockstep with the target ------------------------------------------------------------------

    def follow(self, inputs: ModelInputs, out: Any = None, rows: Any = None, request_of: Any = None) -> None:
        """Write the draft's KV of a target mixed step's tokens (what only the target reads is left out); `out`, the
        step's outputs (on the device), its `rows` (`ScheduledRequest`s) and `request_of` are for drafters that
        read them (`mtp.MtpDraft`)."""
        self.kv = self._follow(self.params, self.kv, _own(inputs))

    def follow_decode(self, st: DecodeState, out: Any = None, rows: Any = None) -> None:
        """Write the draft's KV of a target decode step's tokens (its first step: the engine steps one token at a
        time with a draft model); `out` and `rows` as for `follow`."""
        tokens, positions, tables = np.asarray(st.tokens), np.asarray(st.positions), np.asarray(st.block_tables)
        live = np.asarray(st.max_steps) > 0
        self.kv = self._follow(self.params, self.kv, self._decode_inputs(tokens, positions, tables, live))

    def _decode_inputs(self, tokens: np.ndarray, positions: np.ndarray, tables: np.ndarray,
                       live: np.ndarray) -> ModelInputs:
        S, P = tables.shape
        ps = self.rcfg.page_size
        page = tables[np.arange(S), np.clip(positions // ps, 0, P - 1)]
        return ModelInputs(
            token_ids=jnp.asarray(tokens, jnp.int32), positions=jnp.asarray(positions, jnp.int32),
            slot_mapping=jnp.asarray(np.where(live, page * ps + positions % ps, 0), jnp.int32),
            block_tables=jnp.asarray(np.where(live[:, None], tables, 0), jnp.int32),
            seq_lens=jnp.asarray(np.where(live, positions + 1, 1), jnp.int32),
            query_start_loc=jnp.arange(S + 1, dtype=jnp.int32), logits_indices=jnp.arange(S, dtype=jnp.int32),
            decode=True)

    # -- drafting ----------------------------------------------------------------------------------

    def propose(self, rows: Sequence[tuple[str, int, int, Sequence[int], int]]) -> dict[str, np.ndarray]:
        """Drafts for decoding requests, each `(request_id, last token, its position, page table, how many)`,
        the pages of those positions already reserved: the draft model's greedy continuation of each."""
        rows = [r for r in rows if r[4] > 0]
        if not rows:
            return {}
        S, P = self.rcfg.seq_bucket(len(rows)), self.rcfg.pages_per_seq
        tokens, positions, counts = (np.zeros(S, np.int32) for _ in range(3))
        tables = np.zeros((S, P), np.int32)
        for i, (_, token, position, pages, k) in enumerate(rows):
            tokens[i], positions[i], counts[i] = token, position, min(k, self.num_speculative_tokens)
            tables[i, :len(pages)] = pages
        out, self.kv = self._draft(self.params, self.kv, tokens, positions, tables, counts)
        out = host_copy(out)
        self._check_compiles()
        return {rid: out[:counts[i], i] for i, (rid, *_) in enumerate(rows)}

    def time_draft(self, S: int) -> None:
        """A drafting loop of S rows, each writing `num_speculative_tokens` drafts into the reserved page 0, waited
        for (what `speculative.step_costs` times)."""
        zeros, tables = np.zeros(S, np.int32), np.zeros((S, self.rcfg.pages_per_seq), np.int32)
        counts = np.full(S, self.num_speculative_tokens, np.int32)
        out, self.kv = self._draft(self.params, self.kv, zeros, zeros, tables, counts)
        jax.block_until_ready(out)

    # -- compiles ----------------------------------------------------------------------------------

    def warmup(self) -> float:
        """Compile the lockstep forward at every token and sequence bucket and the drafting loop at every
        sequence bucket (into the reserved page 0), side by side, then run each once; returns the seconds it took."""
        t0 = time.perf_counter()
        calls = self.warm_calls()
        compile_all(calls)
        for fn, args in calls:
            got = fn(*args())
            self.kv = next(x for x in (got if isinstance(got, tuple) else (got,)) if isinstance(x, KVCache))
        jax.block_until_ready(self.kv)
        self._baseline_compiles = self.num_compilations()
        return time.perf_counter() - t0

    def warm_inputs(self) -> tuple[list[ModelInputs], list[ModelInputs]]:
        """Inert inputs of the lockstep forward: a mixed step's at each token bucket, a decode step's at each
        sequence bucket."""
        rc = self.rcfg
        mixed = [_own(ModelInputs.build([([0], 0, [0])], rc.page_size, num_tokens=T, num_seqs=min(T, rc.max_num_seqs),
                                        pages_per_seq=rc.pages_per_seq)) for T in rc.token_buckets]
        zeros = [np.zeros(S, np.int32) for S in rc.seq_buckets]
        return mixed, [self._decode_inputs(z, z, np.zeros((len(z), rc.pages_per_seq), np.int32), z > 0) for z in zeros]

    def warm_calls(self) -> list[tuple[Callable, Callable[[], tuple]]]:
        """Each compiled step with its inert arguments (`warmup`)."""
        mixed, decode = self.warm_inputs()
        calls = [(self._follow, lambda i=i: (self.params, self.kv, i)) for i in mixed + decode]
        for S in self.rcfg.seq_buckets:
            z, t = np.zeros(S, np.int32), np.zeros((S, self.rcfg.pages_per_seq), np.int32)
            calls.append((self._draft, lambda z=z, t=t: (self.params, self.kv, z, z, t, z)))
        return calls

    def num_compilations(self) -> int:
        return sum(f._cache_size() for f in (self._follow, self._draft) if f is not None)

    @property
    def compilations_after_warmup(self) -> int:
        return 0 if self._baseline_compiles is None else self.num_compilations() - self._baseline_compiles

    def _check_compiles(self) -> None:
        if self.strict and self.compilations_after_warmup > 0:
            from jaxserve.engine.runner import CompileAfterWarmupError

            raise CompileAfterWarmupError(f"{self.compilations_after_warmup} draft model compilation(s) after "
                                          "warmup (strict mode)")


def host_copy(x: jax.Array) -> np.ndarray:
    """A replicated array on the host (every host of a cluster holds it whole)."""
    return np.asarray(x.addressable_data(0))


def _own(inputs: ModelInputs) -> ModelInputs:
    """A target mixed step's inputs as the draft model's forward takes them: without what only the target reads (a
    hybrid target's state slots among them)."""
    return dataclasses.replace(inputs, lora_slots=None, long_prompt=None, image_embeds=None, image_mask=None,
                               last_key=None, rope_offsets=None, state_slots=None)
