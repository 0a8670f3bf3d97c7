"""Host-side state of the engine's requests (each completion and each user request) and its stats."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from jaxserve.detokenizer import IncrementalDetokenizer, StopChecker
from jaxserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxserve.sampling_params import SamplingParams

__all__ = ["EngineStats", "RequestGroup", "SeqState"]


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


@dataclass
class SeqState:
    """Host state of one completion (one of a request's n)."""

    engine_id: str
    index: int
    params: SamplingParams
    detok: IncrementalDetokenizer
    stops: StopChecker
    stop_ids: tuple[int, ...]
    counter: int = 0  # the engine's request counter: a distinct random stream for unseeded sampling
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestGroup:
    """A user request: its prompt and its n completions."""

    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    seqs: list[SeqState]
    metrics: RequestMetrics

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)

    def output(self) -> RequestOutput:
        outs = [
            CompletionOutput(
                index=s.index, text=s.text, token_ids=list(s.token_ids),
                cumulative_logprob=s.cumulative_logprob if s.params.logprobs is not None else None,
                logprobs=list(s.logprobs) if s.logprobs is not None else None,
                finish_reason=s.finish_reason, stop_reason=s.stop_reason,
            )
            for s in self.seqs
        ]
        return RequestOutput(self.request_id, self.prompt, list(self.prompt_ids), outs, self.finished,
                             dataclasses.replace(self.metrics))
