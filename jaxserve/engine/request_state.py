"""Host-side state of the engine's requests (each completion and each user request) and its stats."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from jaxserve.detokenizer import IncrementalDetokenizer, NoText, StopChecker
from jaxserve.engine.request import RequestStatus
from jaxserve.engine.speculative import DraftBackoff
from jaxserve.outputs import CompletionOutput, RequestMetrics, RequestOutput, token_logprobs
from jaxserve.sampling_params import SamplingParams

__all__ = ["EngineStats", "RequestGroup", "SeqState", "accept_step"]

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    """A snapshot of the engine for metrics and health."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_pages: int
    page_size: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    compilations_after_warmup: int
    step_time_s: float
    num_steps: int
    spec_num_drafts: int = 0  # speculative decoding: requests drafted (summed over steps)
    spec_num_draft_tokens: int = 0  # draft tokens proposed
    spec_num_accepted_tokens: int = 0  # draft tokens the model's own samples confirmed
    spec_num_accepted_tokens_per_pos: tuple[int, ...] = ()  # ... by their place among their request's drafts
    kv_cache_dtype: str = "auto"  # as configured (`--kv-cache-dtype`), vLLM's `cache_dtype`
    calculate_kv_scales: bool = False  # float8 KV scales measured at start-up (`--calculate-kv-scales`)
    max_lora: int = 0  # LoRA adapter slots (0: no LoRA)
    running_lora_adapters: tuple[str, ...] = ()  # adapters of running requests, and of waiting ones
    waiting_lora_adapters: tuple[str, ...] = ()
    mm_cache_queries: int = 0  # images looked up in the embeddings cache (an image-text engine's)
    mm_cache_hits: int = 0  # images found there


@dataclass
class SeqState:
    """Host state of one completion (one of a request's n)."""

    engine_id: str
    index: int
    params: SamplingParams
    detok: IncrementalDetokenizer | NoText  # (NoText: its output is not turned into text)
    stops: StopChecker
    stop_ids: tuple[int, ...]
    counter: int = 0  # the engine's request counter: a distinct random stream for unseeded sampling
    matcher: Any = None  # structured outputs: a `GrammarMatcher` following the tokens taken so far
    bad_words: list[list[int]] = field(default_factory=list)  # `SamplingParams.bad_words` as token sequences
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Accepted tokens not yet detokenized: (token, step output row, index in it, how it ends the
    # completion: "" (it does not), "id" (a stop id: its text is left out) or "grammar" (the last token
    # its grammar takes: its text is kept)).
    undecoded: list[tuple[int, Any, int, str]] = field(default_factory=list)
    flushed: bool = False  # the held-back text went out at the length limit
    draft_pace: DraftBackoff = field(default_factory=DraftBackoff)  # speculative decoding's pace
    prediction_accepted: int = 0  # drafts from its predicted output accepted (`Request.prediction_accepted`)

    @property
    def has_text(self) -> bool:
        return not isinstance(self.detok, NoText)

    @property
    def masked(self) -> bool:
        """Whether its samples are masked (a grammar, allowed token ids or bad words)."""
        return self.matcher is not None or bool(self.bad_words) or self.params.allowed_token_ids is not None

    @property
    def stepwise(self) -> bool:
        """Whether its mask changes with each token (a grammar, or bad words of several tokens): it steps one
        token per device call."""
        return self.matcher is not None or any(len(w) > 1 for w in self.bad_words)

    def valid_drafts(self, drafts: list[int]) -> int:
        """How many of these drafts (in order) the completion's grammar takes; all without one."""
        return len(drafts) if self.matcher is None else self.matcher.valid_prefix(drafts)

    def accept(self, tok: int, out: Any, j: int, tokenizer: Any) -> bool:
        """Take a sampled token (index j of a step output row); True if it ends the completion.

        What the scheduler needs, decided at once: a stop id ends it (as vLLM: the id stays in
        token_ids, its text is left out). Its text and logprobs wait for `decode`, unless a stop string
        could end the completion, which only its text tells: such a completion is decoded now.
        Under structured outputs, the matcher takes the token; a completed grammar ends the completion
        ("stop"); a token the grammar refuses (possible only when the matcher failed to compute its
        mask, e.g. over a parser limit) aborts it, with the token's text left out.
        """
        self.token_ids.append(tok)
        end = ""
        if tok in self.stop_ids and len(self.token_ids) > self.params.min_tokens - 1:
            end = "id"
            self.finish_reason = "stop"
            self.stop_reason = tok if tok in (self.params.stop_token_ids or ()) else None
        elif self.matcher is not None:
            if not self.matcher.consume(tok):
                logger.error("request %s: token %d is outside its structured output grammar (%s); aborting it",
                             self.engine_id, tok, self.matcher.error)
                end = "id"  # its text is left out, as a stop id's is
                self.finish_reason = "abort"
            elif self.matcher.stopped:
                end = "grammar"
                self.finish_reason = "stop"
        self.undecoded.append((tok, out, j, end))
        if self.stops.stop:
            self.decode(tokenizer)
        return self.finish_reason is not None

    def decode(self, tokenizer: Any) -> None:
        """Detokenize the accepted tokens (text, stop strings, logprob entries); once the completion has
        reached its length limit, flush the held-back text."""
        for tok, out, j, end in self.undecoded:
            if self.logprobs is not None:
                lp = float(out.logprobs[j])
                self.cumulative_logprob += lp
                k = self.params.logprobs or 0
                entry = token_logprobs(tok, lp, int(out.ranks[j]), out.top_ids[j][:k].tolist(),
                                       out.top_logprobs[j][:k].tolist())
                for tid, item in entry.items():
                    item.decoded_token = tokenizer.decode([tid], skip_special_tokens=False) if self.has_text else None
                self.logprobs.append(entry)
            if end == "id":
                self.text += self.stops.add(self.detok.flush()).text + self.stops.flush()
                break
            delta = self.stops.add(self.detok.add(tok))
            self.text += delta.text
            if delta.stop_str is not None:
                self.finish_reason = "stop"
                self.stop_reason = delta.stop_str
                break
            if end == "grammar":
                self.text += self.stops.add(self.detok.flush()).text + self.stops.flush()
                break
        self.undecoded.clear()
        if self.finish_reason == "length" and not self.flushed:
            self.text += self.detok.flush()
            self.text += self.stops.flush()
            self.flushed = True


@dataclass
class RequestGroup:
    """A user request: its prompt and its n completions."""

    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    seqs: list[SeqState]
    metrics: RequestMetrics
    prompt_logprobs: dict[int, Any] | None = None
    """With `prompt_logprobs` asked: each prompt position's entry (position >= 1), as computed."""
    images: Any = None
    """Its prompt's images (`image_prompt.ImagePrompt`), or None."""

    def __post_init__(self) -> None:
        if self.images is not None and self.images.prompt_embeds:  # (`engine.prompt_embeds`: no token ids)
            self.prompt_ids = []

    def add_completions(self, params: SamplingParams, tokenizer: Any, stop_ids: tuple[int, ...],
                        bad_words: list[list[int]], matcher: Any) -> None:
        """Its `params.n` completions, each with its own seed (the request's + its index), detokenizer, stop
        checker and grammar matcher (copies of `matcher`)."""
        stop_strs = [params.stop] if isinstance(params.stop, str) else list(params.stop or [])
        text = params.detokenize and tokenizer is not None
        for i in range(params.n):
            seed = params.seed + i if params.seed is not None else None
            child = dataclasses.replace(params, n=1, seed=seed, prediction=params.prediction if not isinstance(
                params.prediction, str) else tokenizer.encode(params.prediction))
            engine_id = self.request_id if params.n == 1 else f"{self.request_id}-{i}"
            self.seqs.append(SeqState(
                engine_id, i, child, IncrementalDetokenizer(tokenizer, self.prompt_ids, params.skip_special_tokens)
                if text else NoText(),
                StopChecker(stop_strs, params.include_stop_str_in_output), stop_ids,
                logprobs=[] if params.logprobs is not None else None, bad_words=bad_words,
                matcher=None if matcher is None else matcher if i == 0 else matcher.copy()))

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)

    def prompt_logprob_list(self) -> list | None:
        """vLLM's form: None for the first prompt token, then one entry per token; None until the whole
        prompt is computed."""
        got = self.prompt_logprobs
        if got is None or len(got) < len(self.prompt_ids) - 1:
            return None
        return [None] + [got[p] for p in range(1, len(self.prompt_ids))]

    def output(self) -> RequestOutput:
        outs = [
            CompletionOutput(
                index=s.index, text=s.text, token_ids=list(s.token_ids),
                cumulative_logprob=s.cumulative_logprob if s.params.logprobs is not None else None,
                logprobs=list(s.logprobs) if s.logprobs is not None else None,
                finish_reason=s.finish_reason, stop_reason=s.stop_reason,
                **prediction_counts(s.params.prediction, s.prediction_accepted),
            )
            for s in self.seqs
        ]
        return RequestOutput(self.request_id, self.prompt, list(self.prompt_ids), outs, self.finished,
                             dataclasses.replace(self.metrics), prompt_logprobs=self.prompt_logprob_list())


def prediction_counts(prediction: Any, accepted: int) -> dict[str, int]:
    """A completion's predicted-output counts (OpenAI's usage details): drafts from the prediction accepted, and the
    prediction's other tokens; none without a prediction."""
    if prediction is None:
        return {}
    return {"accepted_prediction_tokens": accepted, "rejected_prediction_tokens": max(0, len(prediction) - accepted)}


def engine_stats(engine: Any) -> EngineStats:
    """An `LLMEngine`'s counters and gauges now."""
    from jaxserve.engine.speculative import SpecCounters

    sched, runner = engine.scheduler, engine.runner
    cache, draft = sched.cache, engine.draft  # speculative decoding's draft model, or None
    return EngineStats(
        num_running=sched.num_running, num_waiting=sched.num_waiting, kv_cache_usage=sched.kv_cache_usage,
        num_pages=sched.pool.num_pages, page_size=sched.pool.page_size,
        prefix_cache_queries=cache.query_tokens if cache else 0, prefix_cache_hits=cache.hit_tokens if cache else 0,
        num_preemptions=engine.num_preemptions, prompt_tokens=engine.prompt_tokens,
        generation_tokens=engine.generation_tokens,
        compilations_after_warmup=runner.compilations_after_warmup + (draft.compilations_after_warmup if draft else 0),
        step_time_s=runner.last_step_time, num_steps=runner.num_steps, kv_cache_dtype=engine.args.kv_cache_dtype,
        calculate_kv_scales=engine.args.calculate_kv_scales,
        **{k: tuple(v) if isinstance(v, list) else v
           for k, v in dataclasses.asdict(engine.drafter.counters if engine.drafter else SpecCounters()).items()},
        **_lora_stats(engine),
        mm_cache_queries=engine.images.cache_queries if engine.images else 0,
        mm_cache_hits=engine.images.cache_hits if engine.images else 0,
    )


def _lora_stats(engine: Any) -> dict[str, Any]:
    loras = getattr(engine, "loras", None)
    if loras is None:
        return {}

    def names(requests: Any) -> tuple[str, ...]:
        return tuple(sorted({r.lora_name for r in requests if r.lora_name is not None}))

    return {"max_lora": len(loras.slots), "running_lora_adapters": names(engine.scheduler.running),
            "waiting_lora_adapters": names(engine.scheduler.waiting)}


def accept_step(engine: Any, plan: Any, sampled: dict[str, Any]) -> dict[str, RequestGroup]:
    """A step's tokens (`StepOutput`s by row) into an `LLMEngine`'s requests and its scheduler (stops, lengths,
    finished requests, freed pages); returns the requests that progressed. Text waits for the engine's `_emit`."""
    now = time.time()
    accepted: dict[str, list[int]] = {}
    stopped: list[str] = []
    touched: dict[str, RequestGroup] = {}
    for s in plan.scheduled:
        seq = engine._seq.get(s.request_id)
        request = engine.scheduler.get_request(s.request_id)
        if not s.sample or seq is None or request is None:
            continue
        out = sampled[s.request_id]
        room = min(request.max_tokens - request.num_output_tokens, engine.max_model_len - request.num_tokens)
        toks: list[int] = []
        for j in range(min(len(out.token_ids), room)):
            toks.append(int(out.token_ids[j]))
            if seq.accept(toks[-1], out, j, engine.tokenizer):
                stopped.append(s.request_id)
                break
        accepted[s.request_id] = toks
        seq.prediction_accepted = request.prediction_accepted
        if engine.trace is not None and toks:
            engine._trace(s.request_id, "L5", "tokens", step=engine.runner.num_steps - 1, token_ids=toks)
        group = engine._seq_group[s.request_id]
        if group.metrics.first_token_time is None and toks:
            group.metrics.first_token_time = now
        touched[group.request_id] = group
    engine.generation_tokens += sum(len(t) for t in accepted.values())
    for request in engine.scheduler.update_after_step(plan, accepted, stopped):
        seq = engine._seq[request.request_id]
        group = engine._seq_group[request.request_id]
        if request.status is RequestStatus.FINISHED_LENGTH and seq.finish_reason is None:
            seq.finish_reason = "length"
        group.metrics.num_cached_tokens = max(group.metrics.num_cached_tokens, request.num_cached_tokens)
        if engine.drafter is not None:
            engine.drafter.finished(request)
        engine._forget(seq)
    for group in touched.values():
        for seq in group.seqs:
            r = engine.scheduler.get_request(seq.engine_id)
            if r is not None:
                group.metrics.num_cached_tokens = max(group.metrics.num_cached_tokens, r.num_cached_tokens)
        if group.finished:
            group.metrics.finished_time = now
            engine._groups.pop(group.request_id, None)
    return touched
