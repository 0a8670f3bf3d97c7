"""The model runner (L5-L6): scheduler output to padded device arrays, jitted steps, warmup. Two jitted device
functions serve every step: `mixed_step`, one forward over a ragged batch of prefill chunks and decodes, then
sampling (token buckets `T`; the sequence axis is `min(T, max_num_seqs)`); `decode_loop`, up to `n` decode steps for
every running sequence in one call, on the device: sample, append, check stop ids and length, derive the next
positions and slots from the page tables, stop early when every row is done (sequence buckets `S`). All buckets
compile at warmup; `compilations_after_warmup` counts any compile after it."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.engine import compiled_steps
from jaxserve.engine.logprobs import PromptLogprobInputs, PromptLogprobs, prompt_logprobs, top_logprobs
from jaxserve.engine.penalties import PenaltyInputs, penalty_arrays, update_counts
from jaxserve.engine.pooler import pool_step
from jaxserve.engine.sampler import SamplingTensors, sample
from jaxserve.engine.warmup import bucket_call, compile_all
from jaxserve.models.attention import AttentionBackend
from jaxserve.models.inputs import KVCache, ModelInputs
from jaxserve.models.llama import forward
from jaxserve.models.mamba import copy_state_slots
from jaxserve.models.params import Params
from jaxserve.models.unstack import unstack_layers

logger = logging.getLogger(__name__)

LayerLoop = Literal["scan", "unroll"]
MAX_STOP_IDS = 8  # stop token ids checked on the device per row (EOS ids + stop_token_ids)


def default_layer_loop(backend: AttentionBackend, weight_quant: str | None = None) -> LayerLoop:
    """Unrolled on the CPU, where a scanned layer copies its weights out of the stacked arrays before every matmul
    (about twice the memory traffic of a decode step), unless its weights are kept quantized (XLA:CPU reads a
    layer's own int8 arrays 4x slower than slices of stacked ones: bench/README.md); scanned elsewhere (a model
    whose layers attend differently, as Gemma's sliding and global ones, loops over its groups of layers)."""
    unroll = backend == "xla" and jax.default_backend() == "cpu" and not weight_quant
    return "unroll" if unroll else "scan"


class CompileAfterWarmupError(RuntimeError):
    """Strict mode: a shape was compiled while serving."""


def _pow2_buckets(lo: int, hi: int, factor: int = 2) -> tuple[int, ...]:
    out, b = [hi], lo
    while b < hi:
        out, b = out + [b], b * factor
    return tuple(sorted(set(out)))


@dataclass(frozen=True)
class RunnerConfig:
    """Static shapes of the runner."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    page_size: int
    num_pages: int
    num_scheduler_steps: int
    backend: AttentionBackend
    max_logprobs: int = 20
    layer_loop: LayerLoop = "scan"  # "scan": one compiled layer on stacked weights; "unroll" (`unstack_layers`)
    pooling_type: str | None = None  # an embedding model's pooling (`pooler.pool_step` for both steps), or None
    lora: bool = False  # steps carry each token's LoRA adapter slot (the parameters hold the slots)
    long_rope: bool = False
    """Steps carry whether each token's sequence has a prompt longer than a LongRoPE model's original context
    (`ModelInputs.long_prompt`): an engine serving the model past that context."""
    logprobs_mode: str = "raw_logprobs"
    """What sampled tokens' logprobs report (`EngineArgs.logprobs_mode`, `sampler.sample`)."""
    images: bool = False
    """Mixed steps carry image embeddings and which tokens take them (`ModelInputs.image_embeds`): an image-text
    engine's."""
    image_spans: bool = False
    """Mixed steps also carry each token's last visible key (`ModelInputs.last_key`): images attended both ways."""
    mrope: bool = False  # steps carry M-RoPE offsets (`ModelInputs.rope_offsets`): an M-RoPE model's images
    min_token_bucket: int = 16
    """The smallest mixed step's tokens (4 with speculative decoding: a few requests verifying their drafts)."""
    keep_hidden: bool = False  # steps keep their last hidden states on the device (`StepOutput.hidden`; `engine.mtp`)
    hidden_layers: tuple[int, ...] = ()  # ... those entering these layers, side by side (EAGLE-3: `engine.eagle`)

    @property
    def pages_per_seq(self) -> int:
        return -(-self.max_model_len // self.page_size)

    @property
    def token_buckets(self) -> tuple[int, ...]:
        return _pow2_buckets(min(self.min_token_bucket, self.max_num_batched_tokens), self.max_num_batched_tokens)

    @property
    def seq_buckets(self) -> tuple[int, ...]:
        # 8: five to eight decoding requests step in 95-103 ms instead of 143 ms in the 16-row bucket
        # (SmolLM2 on the CPU, context 250).
        return tuple(b for b in (1, 4, 8, 16, 32, 64, 128, 256) if b < self.max_num_seqs) + (self.max_num_seqs,)

    def token_bucket(self, n: int) -> int:
        if (b := next((b for b in self.token_buckets if b >= n), None)) is not None:
            return b
        raise ValueError(f"{n} tokens exceed max_num_batched_tokens {self.max_num_batched_tokens}")

    def seq_bucket(self, n: int) -> int:
        for b in self.seq_buckets:
            if b >= n:
                return b
        raise ValueError(f"{n} sequences exceed max_num_seqs {self.max_num_seqs}")


@jax.tree_util.register_dataclass
@dataclass
class StepOutput:
    token_ids: jax.Array  # [S] or [n, S] int32
    logprobs: jax.Array  # [S] or [n, S] f32
    ranks: jax.Array  # [S] or [n, S] int32
    top_ids: jax.Array  # [S, K] or [n, S, K] int32
    top_logprobs: jax.Array  # [S, K] or [n, S, K] f32
    num_generated: jax.Array  # [S] int32 (decode loop: tokens produced per row)
    prompt: PromptLogprobs | None = None  # mixed steps of a model that returns its hidden states
    hidden: jax.Array | None = None  # [T, E] (decode loop: its last step's [S, E]), before the final norm; not fetched


def mixed_step(params: Params, kv: KVCache, inputs: ModelInputs, sampling: SamplingTensors, pen: PenaltyInputs,
               plp: PromptLogprobInputs, want_top: jax.Array, cfg: ModelConfig, backend: AttentionBackend,
               top_k: int, model_fn=forward, hidden: bool = False, logprobs_mode: str = "raw_logprobs",
               keep_hidden: bool = False, hidden_layers: tuple[int, ...] = ()):
    """Forward over a ragged batch and sample one token per sequence row; with `hidden` (a model that returns its
    hidden states), also the prompt logprobs `plp` asks for; with `keep_hidden`, the hidden states (`hidden_layers`')."""
    prompt, h = None, [None]
    if hidden:
        aux = {"aux_layers": hidden_layers} if keep_hidden and hidden_layers else {}
        logits, kv, *h = model_fn(params, kv, inputs, cfg, backend, return_hidden=True, **aux)  # [S, V], [T, E]...
        prompt = prompt_logprobs(params, cfg, h[0], plp.next_ids, top_k)
    else:
        logits, kv = model_fn(params, kv, inputs, cfg, backend)  # [S, V]
    counts, mask = penalty_arrays(pen, sampling, cfg.vocab_size)
    out = sample(logits, sampling, counts, mask, logprobs_mode=logprobs_mode)
    top_ids, top_lp = top_logprobs(logits if out.scores is None else out.scores, want_top, top_k, out.scores is None)
    return StepOutput(out.token_ids, out.logprobs, out.ranks, top_ids, top_lp,
                      jnp.ones_like(out.token_ids), prompt, h[-1] if keep_hidden else None), kv


@jax.tree_util.register_dataclass
@dataclass
class DecodeState:
    """Host-prepared state of a decode loop over S rows."""

    tokens: jax.Array  # [S] int32, each row's last token (not yet in the KV)
    positions: jax.Array  # [S] int32, that token's position
    block_tables: jax.Array  # [S, P] int32
    max_steps: jax.Array  # [S] int32, tokens the row may produce in this loop (0 = padding row)
    stop_ids: jax.Array  # [S, M] int32, ids that end the row (-1 pads)
    min_tokens_left: jax.Array  # [S] int32, stop ids do not end the row before this many tokens
    num_steps: jax.Array  # [] int32, most steps of this loop
    lora_slots: jax.Array | None = None  # [S] int32, each row's LoRA adapter slot (-1: none); LoRA engines only
    long_prompt: jax.Array | None = None  # [S] bool, `ModelInputs.long_prompt` of each row (`RunnerConfig.long_rope`)
    rope_delta: jax.Array | None = None  # [S] int32, each row's `ModelInputs.rope_offsets` (`RunnerConfig.mrope`)
    state_slots: jax.Array | None = None  # [S] int32, each row's state slot (`ModelInputs.state_slots`); hybrid only


def decode_loop(params: Params, kv: KVCache, st: DecodeState, sampling: SamplingTensors, pen: PenaltyInputs,
                want_top: jax.Array, cfg: ModelConfig, backend: AttentionBackend, top_k: int, n_max: int,
                model_fn=forward, logprobs_mode: str = "raw_logprobs", keep_hidden: bool = False, hidden_layers=()):
    """Up to `st.num_steps` (<= n_max) decode steps on the device, ending early when all rows are done; with
    `keep_hidden`, the last step's hidden states too (`StepOutput.hidden`; as `mixed_step` keeps them)."""
    S, P = st.block_tables.shape
    page_size = kv.k.shape[2]
    counts0, mask = penalty_arrays(pen, sampling, cfg.vocab_size)
    qsl = jnp.arange(S + 1, dtype=jnp.int32)
    rows = jnp.arange(S)

    def cond(c):
        i, _, _, _, _, done, _, _ = c
        return (i < st.num_steps) & ~jnp.all(done)

    def body(c):
        i, kv, tokens, pos, samp, done, counts, out = c
        page = st.block_tables[rows, jnp.clip(pos // page_size, 0, P - 1)]
        slots = jnp.where(done, 0, page * page_size + pos % page_size)
        inputs = ModelInputs(
            token_ids=tokens, positions=pos, slot_mapping=slots,
            block_tables=jnp.where(done[:, None], 0, st.block_tables),
            seq_lens=jnp.where(done, 1, pos + 1), query_start_loc=qsl, logits_indices=rows.astype(jnp.int32),
            decode=True, lora_slots=st.lora_slots, long_prompt=st.long_prompt,
            state_slots=None if st.state_slots is None else jnp.where(done, 0, st.state_slots),  # (done: padding's)
            rope_offsets=None if st.rope_delta is None else jnp.broadcast_to(st.rope_delta, (3, S)),
        )
        want = {"return_hidden": True, **({"aux_layers": hidden_layers} if hidden_layers else {})} if keep_hidden else {}
        logits, kv, *h = model_fn(params, kv, inputs, cfg, backend, **want)
        s = sample(logits, samp, counts, mask, logprobs_mode=logprobs_mode)
        top_ids, top_lp = top_logprobs(logits if s.scores is None else s.scores, want_top, top_k, s.scores is None)
        new = jnp.where(done, -1, s.token_ids)
        produced = out.num_generated + (~done)
        hit_stop = jnp.any(new[:, None] == st.stop_ids, axis=-1) & (produced >= st.min_tokens_left)
        out = StepOutput(
            out.token_ids.at[i].set(new), out.logprobs.at[i].set(s.logprobs), out.ranks.at[i].set(s.ranks),
            out.top_ids.at[i].set(top_ids), out.top_logprobs.at[i].set(top_lp), produced,
            hidden=h[-1].astype(out.hidden.dtype) if keep_hidden else None,
        )
        done = done | hit_stop | (produced >= st.max_steps)
        counts = update_counts(counts, new)
        return i + 1, kv, jnp.where(done, tokens, new), pos + 1, samp.advance(), done, counts, out

    out0 = StepOutput(
        jnp.full((n_max, S), -1, jnp.int32), jnp.zeros((n_max, S), jnp.float32), jnp.zeros((n_max, S), jnp.int32),
        jnp.zeros((n_max, S, top_k), jnp.int32), jnp.zeros((n_max, S, top_k), jnp.float32), jnp.zeros((S,), jnp.int32),
        hidden=jnp.zeros((S, cfg.hidden_size * (len(hidden_layers) or 1)), params.embed.dtype) if keep_hidden else None,
    )
    done0 = st.max_steps <= 0
    c = (jnp.int32(0), kv, st.tokens, st.positions, sampling, done0, counts0, out0)
    _, kv, _, _, _, _, _, out = jax.lax.while_loop(cond, body, c)
    return out, kv


@dataclass
class InFlightStep:
    """A step dispatched to the device whose outputs are not yet on the host."""

    kind: Literal["mixed", "decode", "pool"]
    outputs: StepOutput | jax.Array  # device arrays
    dispatched_at: float  # perf_counter
    rows: int  # sequence rows in use (decode: rows with steps to run; mixed: the bucket's rows)


def _fetch(out):
    """Step outputs on the host; on a multi-process mesh they are replicated, so the local copy serves."""
    if isinstance(out, StepOutput) and out.hidden is not None:
        out = dataclasses.replace(out, hidden=None)  # (kept on the device)
    if all(getattr(x, "is_fully_addressable", True) for x in jax.tree.leaves(out)):
        return jax.device_get(out)
    return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), out)


class ModelRunner:
    """Holds the parameters and the page pool on the device and runs the jitted steps."""

    def __init__(self, model_cfg: ModelConfig, params: Params, kv: KVCache, cfg: RunnerConfig, model_fn=forward,
                 shardings=None):
        """`shardings` (a `sharding.StepShardings`) pins the layouts of a model spread over a mesh."""
        self.model_cfg = model_cfg
        self.cfg = cfg
        self._sharded = shardings is not None
        self.params = params = self.layout(params)
        self.kv = kv
        self._copy_states = jax.jit(copy_state_slots, donate_argnums=0,  # (a hybrid model's: `copy_states`)
                                    out_shardings=jax.tree.map(lambda a: a.sharding, kv) if self._sharded else None)
        steps = compiled_steps.step_functions(mixed_step, decode_loop, pool_step, model_cfg, cfg, self.params, kv,
                                              model_fn, shardings)
        self.steps = steps  # held: shared step functions live while a runner holds them (`warmup` reads them)
        self._mixed, self._decode, self._pool = steps.mixed, steps.decode, steps.pool
        self.supports_prompt_logprobs = steps.hidden  # the model returns its hidden states (prompt logprobs)
        self._no_penalty: dict[int, PenaltyInputs] = {}
        self._no_prompt_logprobs: dict[int, PromptLogprobInputs] = {}
        self._no_images: dict[int, tuple[jax.Array, jax.Array, jax.Array | None]] = {}
        self._baseline_compiles: int | None = None
        self.strict = False
        self.num_steps = 0
        self.last_step_time = 0.0

    def layout(self, params: Params) -> Params:
        """Loaded weights in the layout the steps take: per layer with the "unroll" layer loop (fused
        projections only where no sharding would have to be split across them), else as they are."""
        return unstack_layers(params, fuse=not self._sharded, cfg=self.model_cfg) if self.cfg.layer_loop == "unroll" \
            else params

    # -- compile accounting ------------------------------------------------------------------------

    def num_compilations(self) -> int:
        return sum(f._cache_size() for f in (self._mixed, self._decode, self._pool) if f is not None)

    @property
    def compilations_after_warmup(self) -> int:
        if self._baseline_compiles is None:
            return 0
        return self.num_compilations() - self._baseline_compiles

    def _check_compiles(self) -> None:
        if self.strict and self.compilations_after_warmup > 0:
            raise CompileAfterWarmupError(f"{self.compilations_after_warmup} compilation(s) after warmup (strict mode)")

    def warmup(self, progress: bool = True) -> float:
        """Compile every bucket of both step functions, several at once (`warmup.compile_all`), then run each once;
        returns the seconds it took."""
        t0 = time.perf_counter()
        shapes = ([("pool", t) for t in self.cfg.token_buckets] if self._pool is not None else
                  [("mixed", t) for t in self.cfg.token_buckets] + [("decode", s) for s in self.cfg.seq_buckets])
        calls = [bucket_call(self, kind, size) for kind, size in shapes]
        compile_all([(fn, args) for fn, args, _ in calls], progress)
        for _, _, run in calls:
            run()
        if self.kv.conv is not None:  # (a hybrid model's state copies)
            self.copy_states([])
        self._baseline_compiles = self.num_compilations()
        compiled_steps.warn_near_mapping_limit()
        return time.perf_counter() - t0

    # -- helpers -----------------------------------------------------------------------------------

    def inert_sampling(self, S: int) -> SamplingTensors:
        return SamplingTensors.from_params([], [], S, self.model_cfg.vocab_size, [])

    def penalty_inputs(self, S: int, rows: list[tuple[list[int], list[int]]] | None) -> PenaltyInputs:
        """History arrays for rows (prompt ids, output ids); a cached inert array when None."""
        H = self.cfg.max_model_len
        if rows is None:
            if S not in self._no_penalty:
                self._no_penalty[S] = PenaltyInputs(jnp.full((S, H), -1, jnp.int32), jnp.zeros((S,), jnp.int32))
            return self._no_penalty[S]
        hist = np.full((S, H), -1, np.int32)
        num_prompt = np.zeros(S, np.int32)
        for i, (p, o) in enumerate(rows):
            ids = (list(p) + list(o))[:H]
            hist[i, : len(ids)] = ids
            num_prompt[i] = len(p)
        # Device arrays, as the inert ones are, so both hit the same compiled executable.
        return PenaltyInputs(jnp.asarray(hist), jnp.asarray(num_prompt))

    # -- steps -------------------------------------------------------------------------------------

    def prompt_logprob_inputs(self, next_ids: np.ndarray | None, T: int) -> PromptLogprobInputs:
        """`next_ids` [T] as step inputs; a cached inert (all -1) device array when None."""
        if next_ids is None:
            if T not in self._no_prompt_logprobs:
                self._no_prompt_logprobs[T] = PromptLogprobInputs(jnp.full((T,), -1, jnp.int32))
            return self._no_prompt_logprobs[T]
        return PromptLogprobInputs(jnp.asarray(next_ids, jnp.int32))

    def run_mixed(self, inputs: ModelInputs, sampling: SamplingTensors, penalties, want_top: bool) -> StepOutput:
        return self.fetch(self.dispatch_mixed(inputs, sampling, penalties, want_top))

    def run_decode(self, st: DecodeState, sampling: SamplingTensors, penalties, want_top: bool) -> StepOutput:
        return self.fetch(self.dispatch_decode(st, sampling, penalties, want_top))

    def copy_states(self, copies: list[tuple[int, int]]) -> None:
        """Copy a hybrid model's states between slots in order (`Scheduler.take_state_copies`): the pairs padded to
        2 * max_num_seqs (one compile), only the real ones copied."""
        pairs = np.zeros((max(2 * self.cfg.max_num_seqs, len(copies)), 2), np.int32)
        pairs[: len(copies)] = np.asarray(copies, np.int32).reshape(-1, 2)
        self.kv = self._copy_states(self.kv, pairs, np.int32(len(copies)))

    def dispatch_mixed(self, inputs: ModelInputs, sampling: SamplingTensors, penalties,
                       want_top: bool, prompt_next_ids: np.ndarray | None = None) -> InFlightStep:
        """Start a mixed step on the device and return at once; `fetch` waits for its outputs.
        `prompt_next_ids` ([T], -1 padded) asks for prompt logprobs (see `PromptLogprobInputs`)."""
        args = self.mixed_args(inputs, sampling, penalties, want_top, prompt_next_ids)
        t0 = time.perf_counter()
        out, self.kv = self._mixed(*args)
        return InFlightStep("mixed", out, t0, inputs.block_tables.shape[0])

    def mixed_args(self, inputs: ModelInputs, sampling: SamplingTensors, penalties, want_top: bool,
                    prompt_next_ids: np.ndarray | None = None) -> tuple:
        S = inputs.block_tables.shape[0]
        pen = penalties if penalties is not None else self.penalty_inputs(S, None)
        plp = self.prompt_logprob_inputs(prompt_next_ids, inputs.token_ids.shape[0])
        if self.cfg.images and inputs.image_embeds is None:  # one executable per bucket, with images or none
            T = inputs.token_ids.shape[0]
            if T not in self._no_images:  # (a last key of 0: causal)
                self._no_images[T] = (jnp.zeros((T, self.model_cfg.image_width), self.params.embed.dtype),
                                      jnp.zeros((T,), jnp.bool_),
                                      jnp.zeros((T,), jnp.int32) if self.cfg.image_spans else None)
            inputs = dataclasses.replace(inputs, image_embeds=self._no_images[T][0], image_mask=self._no_images[T][1],
                                         last_key=self._no_images[T][2])
        return self.params, self.kv, inputs, sampling, pen, plp, np.bool_(want_top)

    def dispatch_decode(self, st: DecodeState, sampling: SamplingTensors, penalties, want_top: bool) -> InFlightStep:
        """Start a decode loop on the device and return at once; `fetch` waits for its outputs."""
        args = self.decode_args(st, sampling, penalties, want_top)
        t0 = time.perf_counter()
        out, self.kv = self._decode(*args)
        return InFlightStep("decode", out, t0, int(np.sum(np.asarray(st.max_steps) > 0)))

    def decode_args(self, st: DecodeState, sampling: SamplingTensors, penalties, want_top: bool) -> tuple:
        pen = penalties if penalties is not None else self.penalty_inputs(st.tokens.shape[0], None)
        return self.params, self.kv, st, sampling, pen, np.bool_(want_top)

    def dispatch_pool(self, inputs: ModelInputs) -> InFlightStep:
        """Start an embedding model's step (`pooler.pool_step`); its outputs are [S, E] pooled rows."""
        t0 = time.perf_counter()
        out, self.kv = self._pool(self.params, self.kv, inputs)
        return InFlightStep("pool", out, t0, inputs.block_tables.shape[0])

    def fetch(self, step: InFlightStep) -> StepOutput:
        """The step's outputs on the host (the one device-to-host transfer of a step).

        `last_step_time` is the time from dispatch to outputs on the host: the device's share of a step."""
        out = _fetch(step.outputs)
        self.last_step_time = time.perf_counter() - step.dispatched_at
        self.num_steps += 1
        self._check_compiles()
        return out

    def replace_config(self, **changes) -> None:
        self.cfg = dataclasses.replace(self.cfg, **changes)
