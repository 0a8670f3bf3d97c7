"""What the engine hands back for a request, shaped as vLLM's `RequestOutput`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]


@dataclasses.dataclass
class Logprob:
    """The log probability of one token, its rank (1 = most likely) and its text once decoded."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


TokenLogprobs = dict[int, Logprob]
"""The logprobs reported for one generated position: the sampled token and the top ones."""

SampleLogprobs = list[TokenLogprobs]
"""One `TokenLogprobs` per generated token."""


def token_logprobs(
    token_id: int,
    logprob: float,
    rank: int,
    top_ids: Sequence[int],
    top_logprobs: Sequence[float],
) -> TokenLogprobs:
    """Build one position's logprobs: the sampled token first, then the top tokens by rank."""
    entries: TokenLogprobs = {int(token_id): Logprob(float(logprob), int(rank))}
    for i, (tid, lp) in enumerate(zip(top_ids, top_logprobs, strict=True)):
        entries.setdefault(int(tid), Logprob(float(lp), i + 1))
    return entries


@dataclasses.dataclass
class CompletionOutput:
    """One completion of a request (one of its n), as generated so far."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: FinishReason | None = None
    # The stop string or stop token id that ended the completion; None for EOS or length.
    stop_reason: int | str | None = None
    # With a predicted output (`SamplingParams.prediction`): drafts from it accepted, and its other tokens.
    accepted_prediction_tokens: int | None = None
    rejected_prediction_tokens: int | None = None

    def finished(self) -> bool:
        """Whether this completion has ended."""
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestMetrics:
    """Wall-clock times (seconds, `time.time()`) of a request's milestones."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0


@dataclasses.dataclass
class RequestOutput:
    """A request's state as reported to the caller: its prompt and its completions so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    """With `SamplingParams.prompt_logprobs`: None for the first prompt token, then each prompt
    token's entry (its own logprob first, then the top ones), once the prompt is computed."""


@dataclasses.dataclass
class EmbeddingOutput:
    """A prompt's embedding (vLLM's `EmbeddingOutput`)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclasses.dataclass
class EmbeddingRequestOutput:
    """An embedding request's result (vLLM's `EmbeddingRequestOutput`): `outputs` is None until `finished`,
    and stays None for an aborted request."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput | None
    finished: bool
    metrics: RequestMetrics | None = None


@dataclasses.dataclass
class ClassificationOutput:
    """A prompt's class probabilities (vLLM's `ClassificationOutput`), in label order."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclasses.dataclass
class ClassificationRequestOutput:
    """A classification request's result (vLLM's `ClassificationRequestOutput`): `outputs` is None until
    `finished`, and stays None for an aborted request."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: ClassificationOutput | None
    finished: bool
    metrics: RequestMetrics | None = None


@dataclasses.dataclass
class ScoringOutput:
    """A text pair's score (vLLM's `ScoringOutput`)."""

    score: float


@dataclasses.dataclass
class ScoringRequestOutput:
    """One pair's result from `LLM.score`: `prompt_token_ids` holds both texts' ids, the first's then the second's
    (a cross-encoder's: the pair's encoding as one input)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True
