"""The synchronous engine core: requests in, one scheduler iteration per `step()`, outputs out.

`LLMEngine` is the thin imperative shell of DESIGN.md: it runs the scheduler, the device step and
sampling, then detokenizes and checks stops on the host. `AsyncEngine` runs it in a thread; `LLM`
drives it to completion for offline batches.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import jax

from jaxserve.engine import hybrid
from jaxserve.engine.admission import bad_words_token_ids, check_request, prompt_token_ids
from jaxserve.engine.draft_model import draft_fields, draft_memory, load_draft
from jaxserve.engine.image_prompt import encode_step_images, step_embeds, step_rope_offsets
from jaxserve.engine.kv_budget import kv_cache_pages, max_model_length
from jaxserve.engine.lora_manager import LoraManager, lora_fields
from jaxserve.engine.memory import EngineMemory, prepare_model
from jaxserve.engine.model_loading import (
    LoadedModel,
    enable_compile_cache,
    load_model,
    params_bytes,
    resolve_attention_backend,
)
from jaxserve.engine.multimodal import request_fields
from jaxserve.engine.prompt_embeds import admit_prompt
from jaxserve.engine.request import Request
from jaxserve.engine.request_state import EngineStats, RequestGroup, SeqState, accept_step, engine_stats
from jaxserve.engine.runner import InFlightStep, ModelRunner, RunnerConfig, default_layer_loop
from jaxserve.engine.sampler import SamplingTensors
from jaxserve.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from jaxserve.engine.speculative import Drafter, SpecStep, row_outputs
from jaxserve.engine.step_batch import (
    PromptChunk,
    decode_state,
    long_prompts,
    mixed_inputs,
    prompt_logprob_chunks,
    prompt_next_ids,
    sampled_rows,
    sampling_inputs,
    take_prompt_logprobs,
    trace_plan,
)
from jaxserve.engine.step_costs import step_costs
from jaxserve.engine_args import EngineArgs
from jaxserve.lora_request import LoRARequest
from jaxserve.models.inputs import KVCache
from jaxserve.outputs import RequestMetrics, RequestOutput
from jaxserve.rope import prompt_cache_salt
from jaxserve.sampling_params import SamplingParams
from jaxserve.structured_outputs import GrammarCompiler

logger = logging.getLogger(__name__)
# A dispatched step: its plan, the device work, its prompt-logprob chunks, and the drafts it verifies.
Launched = tuple[SchedulerOutput, InFlightStep, list[PromptChunk], SpecStep | None]


class LLMEngine:
    """Continuous batching over the paged KV cache of one model."""

    def __new__(cls, args: EngineArgs | None = None, *rest, **kw):
        if cls is LLMEngine and args is not None and args.is_pooling:  # an embedding model's engine
            from jaxserve.engine.pooling_engine import PoolingEngine

            return super().__new__(PoolingEngine)
        return super().__new__(cls)

    def __init__(self, args: EngineArgs | None = None, loaded: LoadedModel | None = None, progress: bool = True):
        enable_compile_cache((args := args or EngineArgs()).compile_cache_dir)
        # Over several devices with its sharding plan, its KV dtype (scales), its LoRA slots.
        loaded = loaded or load_model(args, progress=progress)
        self.args = args = hybrid.hybrid_args(args, loaded.config)  # (what a hybrid model cannot serve refused)
        self.model, self.kv_dtype = prepare_model(loaded, args)
        kv_dtype, plan, cfg = self.kv_dtype, self.model.plan, self.model.config
        self.tokenizer = self.model.tokenizer
        # An embedding model's pooling (`PoolingEngine`), or None: this engine generates.
        self.pooler_config = args.pooler_config_for(self.model.path)
        self.draft = load_draft(args, self.model, progress)  # speculative decoding's draft model (None: none)
        states = hybrid.state_layout(cfg, args, self.model.dtype)  # (a hybrid model's Mamba states)
        num_pages = kv_cache_pages(args, cfg, kv_dtype, params_bytes(self.model.params), plan.kv_shards if plan else 1,
                                   beside=draft_memory(self.draft, args.page_size, plan), states=states.bytes)
        self.max_model_len = max_model_len = max_model_length(args, cfg, num_pages)
        # A LongRoPE model served past its original context: steps say whose prompts are longer than it.
        self.long_rope_context = lr if (lr := cfg.long_rope_context) is not None and max_model_len > lr else None
        max_seqs = args.max_num_seqs
        batched = max(args.max_num_batched_tokens, max_seqs)
        self.scheduler = Scheduler(args.scheduler_config(max_model_len, states), num_pages)
        backend, spec = resolve_attention_backend(args, None if cfg.kv_lora_rank else cfg.head_dim), args.speculative_config
        chunked = spec is not None and spec.chunked  # drafts verified as chunks, in mixed steps
        as_bits = backend == "xla"  # narrow pages as their bits: see attention.kv_storage_bits
        kv = (plan.allocate_kv if plan else functools.partial(KVCache.allocate, cfg))(
            num_pages, args.page_size, kv_dtype, as_bits, states.slots, states.dtypes)
        self.runner = ModelRunner(
            cfg, self.model.params, kv,
            RunnerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=batched, max_model_len=max_model_len,
                         page_size=args.page_size, num_pages=num_pages,
                         num_scheduler_steps=args.num_scheduler_steps, backend=backend,
                         max_logprobs=args.max_logprobs, logprobs_mode=args.logprobs_mode,
                         layer_loop=default_layer_loop(backend, cfg.weight_quant) if args.layer_loop == "auto" else args.layer_loop,
                         pooling_type=self.pooler_config.pooling_type if self.pooler_config else None,
                         lora=args.enable_lora, min_token_bucket=4 if chunked else 16,
                         long_rope=self.long_rope_context is not None, images=self.model.vision is not None or args.enable_prompt_embeds,
                         image_spans=self.model.vision is not None and self.model.vision.cfg.bidirectional,
                         mrope=self.model.vision is not None and cfg.mrope_section is not None,
                         **draft_fields(self.draft)),
            model_fn=self.model.forward_fn, shardings=plan.step_shardings(kv) if plan else None,
        )
        # The runner may hold the weights in another layout (per layer); keep one copy.
        self.model = dataclasses.replace(self.model, params=self.runner.params)
        if self.draft:  # its pool, of the target's pages, and its steps at the runner's shapes
            self.draft.start(self.runner.cfg, strict=args.strict_compile, mesh=plan.mesh if plan else None)
        self.loras = (LoraManager(self, args.max_loras, args.max_lora_rank, args.lora_modules, args.max_cpu_loras)
                      if args.enable_lora else None)
        self.warmup_seconds = 0.0
        if args.warmup:
            self.warmup_seconds = (self.runner.warmup(progress=progress) + (self.images.warmup() if self.images else 0)
                                   + (self.draft.warmup() if self.draft else 0))
        self.runner.strict = args.strict_compile
        self._groups: dict[str, RequestGroup] = {}
        self._seq_group: dict[str, RequestGroup] = {}
        self._seq: dict[str, SeqState] = {}
        self._counter = 0
        self._inflight: Launched | None = None  # dispatched, outputs not fetched
        self._launch_error: Exception | None = None
        self.failures: dict[str, Exception] = {}  # see take_failures
        self.num_preemptions = self.prompt_tokens = self.generation_tokens = 0
        self.eos_ids = tuple(self.tokenizer.eos_token_ids) if self.tokenizer else self.model.eos_ids
        self.grammars = GrammarCompiler(self.tokenizer, cfg.vocab_size)
        # Speculative decoding's drafts. Hosts in lockstep must draft alike: their measured costs would differ.
        warm = spec and args.warmup and jax.process_count() == 1
        costs = step_costs(self.runner, chunked, model=self.draft) if warm else None
        self.drafter = Drafter(spec, costs, self.draft) if spec else None
        self.memory = EngineMemory(self)  # sleep mode and weight updates
        self.trace: Callable[[str, str, str, dict[str, Any]], None] | None = None
        """When set, called as `trace(request_id, layer, event, data)` at each layer a request crosses."""

    @property
    def images(self) -> Any:  # an image-text model's `multimodal.ImageEncoder` (None: the engine takes no images)
        return self.model.vision

    def _trace(self, engine_id: str, layer: str, event: str, **data: Any) -> None:
        group = self._seq_group.get(engine_id)
        if self.trace is not None:
            self.trace(group.request_id if group is not None else engine_id, layer, event, data)

    # -- requests ----------------------------------------------------------------------------------

    def tokenize_prompt(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        """A text prompt's ids (with the tokenizer's BOS and the like, as vLLM adds them), or token ids checked."""
        return prompt_token_ids(self.tokenizer, prompt, self.model.config.vocab_size, add_special_tokens,
                                self.images.placeholder_ids if self.images else ())

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | str | None = None,
        multi_modal_data: dict[str, Any] | None = None,
    ) -> None:
        """Queue a request of text, token ids or embeddings [N, E] (`engine.prompt_embeds`), with a LoRA adapter
        (`lora_request`, or its name), images (vLLM's `multi_modal_data`); ValueError naming what can never run."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"this engine generates; {type(params).__name__} needs an embedding model "
                             "(runner 'pooling', --runner pooling)")
        self.memory.check_serving()
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_ids, images = admit_prompt(self, prompt, params, multi_modal_data)
        max_tokens, stop_ids = check_request(
            prompt_ids, params, max_model_len=self.max_model_len, max_logprobs=self.args.max_logprobs,
            vocab_size=self.model.config.vocab_size, eos_ids=self.eos_ids, has_tokenizer=self.tokenizer is not None,
            supports_prompt_logprobs=self.runner.supports_prompt_logprobs)
        # Its adapter and the cache namespace of its adapter and of its prompt's rotary factors.
        salt = prompt_cache_salt(self.long_rope_context, len(prompt_ids), cache_salt)
        lora = lora_fields(self.loras, lora_request, salt)
        matcher = self.grammars.matcher_after(params.structured_outputs, prompt_ids) if params.structured_outputs \
            else None
        bad_words = bad_words_token_ids(self.tokenizer, params.bad_words or [])
        now = arrival_time if arrival_time is not None else time.time()
        group = RequestGroup(request_id, prompt if isinstance(prompt, str) else None, prompt_ids, [], RequestMetrics(now),
                             prompt_logprobs={} if params.prompt_logprobs is not None else None, images=images)
        group.add_completions(params, self.tokenizer, stop_ids, bad_words, matcher)
        for seq in group.seqs:
            self.scheduler.add_request(Request(
                request_id=seq.engine_id, max_tokens=max_tokens,
                **request_fields(prompt_ids, images),
                sampling_params=seq.params, priority=priority, arrival_time=now, **lora,
                # The first completion computes every prompt position for the prompt logprobs.
                read_prefix_cache=group.prompt_logprobs is None or seq.index > 0,
            ))
            self._seq[seq.engine_id] = seq
            self._seq_group[seq.engine_id] = group
            seq.counter = self._counter
            self._counter += 1
        self._groups[request_id] = group
        self.prompt_tokens += len(prompt_ids) * params.n
        if self.trace is not None:
            self.trace(request_id, "L4", "queued", {"prompt_tokens": len(prompt_ids), "max_tokens": max_tokens,
                                                     "n": params.n, "priority": priority,
                                                     "waiting": self.scheduler.num_waiting})

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a request wherever it is, freeing its pages; returns its final output if it was live."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return None
        for seq in group.seqs:
            if self.drafter is not None and (req := self.scheduler.get_request(seq.engine_id)) is not None:
                self.drafter.finished(req)  # (suffix decoding caches its response as far as it got)
            self.scheduler.abort(seq.engine_id)
            self._forget(seq)
            if seq.finish_reason is None:
                seq.finish_reason = "abort"
        group.metrics.finished_time = time.time()
        return group.output()

    def _forget(self, seq: SeqState) -> None:
        self._seq.pop(seq.engine_id, None)
        self._seq_group.pop(seq.engine_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups) or self._launch_error is not None

    @property
    def num_requests(self) -> int:
        return len(self._groups)

    # -- one iteration -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduler iteration; returns the outputs of requests that progressed.

        With `async_scheduling`, a step ends with the next one already on the device: it waits for the
        step in flight, applies its tokens (what the scheduler needs), schedules and dispatches the next,
        and detokenizes while the device works."""
        if self._launch_error is not None:  # the last step's outputs went out; its dispatch of this one failed
            error, self._launch_error = self._launch_error, None
            raise error
        try:
            launched = self._inflight or self._launch()
            self._inflight = None
            if launched is None:
                return []
            plan, pending, chunks, spec = launched
            out = self.runner.fetch(pending)
            if chunks:
                take_prompt_logprobs(chunks, out.prompt, self.tokenizer)
            touched = accept_step(self, plan, spec.verify(out) if spec else sampled_rows(plan, pending.kind, out))
            hybrid.roll_back_rejected(self, spec)  # (a hybrid model's states)
        except BaseException:
            self._inflight = None
            raise
        if self.args.async_scheduling:
            try:
                self._inflight = self._launch()
            except Exception as e:  # noqa: BLE001 - raised by the next step(), once these outputs are out
                self._launch_error = e
        return self._emit(touched)

    def _launch(self) -> Launched | None:
        """Schedule a step and dispatch it to the device (None when there is nothing to run), with the
        prompt chunks whose prompt logprobs it computes and the drafts it verifies."""
        plan = self._plan()
        if self.scheduler.states is not None and (copies := self.scheduler.take_state_copies()):
            self.runner.copy_states(copies)  # a hybrid model's states kept in, or taken from, the prefix cache
        if plan.is_empty:
            return None
        now = time.time()
        step_id = self.runner.num_steps
        for s in plan.scheduled:
            group = self._seq_group.get(s.request_id)
            if group is not None and group.metrics.first_scheduled_time is None:
                group.metrics.first_scheduled_time = now
        scheduled = list(plan.scheduled)
        spec = self._drafts(plan) if self.drafter is not None else None
        hybrid.back_up_drafted(self, spec)
        rows = spec.rows if spec else scheduled  # a drafted decode: a row per position it verifies
        loras = [self.loras.slot_for(self.scheduler.get_request(s.request_id)) for s in rows] if self.loras else None
        longs = long_prompts(rows, self.scheduler.get_request, self.long_rope_context)
        states = [self.scheduler.get_request(s.request_id).state_slot for s in rows] if self.scheduler.states else None
        if self.trace is not None:
            trace_plan(plan, step_id, self.runner.cfg, self.model.config, self.scheduler.get_request, self._trace,
                       spec)
        # Named by step id, so a device profile lines up with the request traces.
        with jax.profiler.TraceAnnotation(f"jaxserve_step_{step_id}"):
            if (spec is None or not spec.drafter.chunked) and all(s.is_decode for s in scheduled):
                seqs = [self._seq[s.request_id] for s in rows]
                # A grammar's or bad words' next mask needs the token before it; drafts are checked on the host; a
                # draft model follows each token: such a batch steps one token (per row) at a time.
                one = spec is not None or self.draft is not None or any(q.stepwise for q in seqs)
                st = decode_state(rows, seqs, self.runner.cfg, self.scheduler.reserve_decode_pages,
                                  lambda rid: self.scheduler.get_request(rid).pages, num_steps=1 if one else None,
                                  lora_slots=loras, long_prompts=longs, rope_deltas=self._rope_deltas(rows),
                                  state_slots=states)
                tensors, want_top, penalties = self._sampling(rows, st.tokens.shape[0], spec)
                pending = self.runner.dispatch_decode(st, tensors, penalties, want_top)
                if self.draft:  # the draft model's KV of the same tokens
                    self.draft.follow_decode(st, pending.outputs, rows)
                return plan, pending, [], spec
            inputs, S = mixed_inputs(rows, self.runner.cfg, loras, spec is not None and spec.drafter.chunked, longs,
                                     self._step_images if self.runner.cfg.images else None,
                                     self._step_rope if self.runner.cfg.mrope else None, states)
            tensors, want_top, penalties = self._sampling(rows, S, spec)
            chunks = prompt_logprob_chunks(rows, [self._seq.get(s.request_id) for s in rows],
                                           [self._seq_group.get(s.request_id) for s in rows])
            next_ids = prompt_next_ids(chunks, inputs.token_ids.shape[0])
            pending = self.runner.dispatch_mixed(inputs, tensors, penalties, want_top, next_ids)
            if self.draft:
                self.draft.follow(inputs, pending.outputs, rows, self.scheduler.get_request)
            return plan, pending, chunks, spec

    def _plan(self) -> SchedulerOutput:
        """The next step's plan, with the images its prefill chunks reach encoded: a request whose image fails to
        encode fails alone (`_fail_images`) and the step is planned again without it."""
        while True:
            plan = self.scheduler.schedule()
            self.num_preemptions += len(plan.preempted_ids)
            if self.images is None or not (failed := encode_step_images(plan.scheduled, self._seq_group)):
                return plan
            self._fail_images(failed)

    def _fail_images(self, failed: dict[str, Exception]) -> None:
        """Abort the requests whose images failed to encode; their errors wait for `take_failures`."""
        for request_id, error in failed.items():
            self.abort_request(request_id)
            self.failures[request_id] = error

    def take_failures(self) -> dict[str, Exception]:
        """The requests that failed alone since the last call (aborted, no output of theirs follows), by id."""
        failures, self.failures = self.failures, {}
        return failures

    def _step_images(self, rows: list[ScheduledRequest], T: int):
        return step_embeds(rows, lambda rid: self._seq_group[rid].images, T, self.model.config.image_width,
                           self.model.dtype, self.runner.cfg.image_spans)

    def _step_rope(self, rows: list[ScheduledRequest], T: int):
        return step_rope_offsets(rows, lambda rid: self._seq_group[rid].images, T)

    def _rope_deltas(self, rows: list[ScheduledRequest]) -> list[int] | None:
        return [0 if (p := self._seq_group[s.request_id].images) is None else p.rope_delta
                for s in rows] if self.runner.cfg.mrope else None

    def _drafts(self, plan: SchedulerOutput) -> SpecStep | None:
        """Drafts for the plan's decodes (cut where a grammar refuses one), within the rows its step can add."""
        sched, seq = self.scheduler, self._seq
        return self.drafter.plan(
            plan.scheduled, plan.num_batched_tokens, self.runner.cfg, request_of=sched.get_request,
            reserve=sched.reserve_decode_pages, pace_of=lambda rid: seq[rid].draft_pace,
            valid=lambda rid, d: seq[rid].valid_drafts(d), pages_of=lambda rid: sched.get_request(rid).pages)

    def _sampling(self, rows: list[ScheduledRequest], S: int,
                  spec: SpecStep | None = None) -> tuple[SamplingTensors, bool, object]:
        seqs = [self._seq[s.request_id] for s in rows]
        prompts = [self._seq_group[s.request_id].prompt_ids for s in rows]
        outputs = row_outputs(spec, {s.request_id: self._seq[s.request_id].token_ids for s in rows}) if spec else None
        return sampling_inputs(rows, seqs, prompts, S, self.model.config.vocab_size, self.eos_ids,
                               self.args.seed, self.runner.penalty_inputs, outputs)

    # -- host side of a step -----------------------------------------------------------------------

    def _emit(self, touched: dict[str, RequestGroup]) -> list[RequestOutput]:
        """Detokenize what `accept_step` took and build the outputs of the requests that progressed."""
        outputs = []
        for group in touched.values():
            for seq in group.seqs:
                seq.decode(self.tokenizer)
            if group.finished and self.trace is not None:
                self.trace(group.request_id, "L4", "finished",
                           {"finish_reasons": [q.finish_reason for q in group.seqs],
                            "output_tokens": sum(len(q.token_ids) for q in group.seqs)})
            outputs.append(group.output())
        return outputs

    # -- introspection -----------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        return engine_stats(self)

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.cache.reset() if self.scheduler.cache else True

