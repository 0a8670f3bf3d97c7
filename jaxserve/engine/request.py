"""The engine-side state of one request: its tokens, status and the KV pages it holds."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class RequestStatus(enum.Enum):
    """Where a request is in its lifecycle; the ``FINISHED_*`` states are final."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        """Whether the request will never run again."""
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI ``finish_reason`` (``"stop"``, ``"length"``, ``"abort"``), or None if unfinished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(eq=False)
class Request:
    """One request as the scheduler sees it: token counts, pages, and a few scheduling attributes.

    Token accounting: the request's tokens are ``prompt_token_ids`` followed by
    ``output_token_ids``; ``num_computed_tokens`` of them (a prefix) have their
    KV in ``pages``, page ``i`` holding positions ``[i * page_size, (i + 1) * page_size)``.
    A running request always has at least one token left to compute: its
    next step feeds ``num_tokens - num_computed_tokens`` tokens (one, when
    decoding) and samples a new token when it feeds the last one. Preemption
    by recompute resets ``num_computed_tokens`` to 0 and keeps the outputs.

    ``sampling_params`` is opaque here. Requests compare by identity.
    """

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    sampling_params: Any = None
    priority: int = 0
    """Lower runs first under the priority policy; higher is preempted first."""
    arrival_time: float = 0.0
    """Wall-clock arrival (seconds), for latency metrics; ordering uses ``arrival_index``."""
    cache_salt: str | None = None
    """Requests share cached KV pages only when their salts are equal."""
    read_prefix_cache: bool = True
    """False: compute every prompt token (prompt logprobs need each position's logits); the
    request's pages still go to the cache for others."""
    pooling: bool = False
    """An embedding request: it ends when its prompt is computed, sampling nothing (`max_tokens` unused)."""
    lora_name: str | None = None
    """The LoRA adapter its tokens run with (None: the base model); at most `max_loras` run at once."""
    whole_spans: tuple[tuple[int, int], ...] = ()
    """Prompt positions [start, end) computed in one step (no prefill chunk ends inside one): an image whose tokens
    attend to each other both ways (Gemma 3)."""
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    pages: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache at the first admission (for usage reporting)."""
    num_preemptions: int = 0
    arrival_index: int = -1
    """Order of arrival at the scheduler (set by it): FCFS order and the preemption tie-break."""
    cache_node: Any = field(default=None, repr=False)
    state_slot: int = 0  # a hybrid model's: the slot of its Mamba states while it runs (`hybrid.StateSlots`; 0: none)
    state_stop: int = 0  # ... with prefix caching: where its prompt's states are kept (`state_cache`; 0: nowhere)
    """The radix-cache node this request holds locked (scheduler-managed), or None."""
    prediction_index: Any = field(default=None, repr=False)
    """The tokens of its predicted output, indexed for drafting (`suffix_decoding.prediction_drafts`)."""
    prediction_accepted: int = 0
    """Drafts taken from its predicted output that were accepted."""
    ngram_index: Any = field(default=None, repr=False)
    """Speculative decoding's index of its tokens (`speculative.NgramIndex`, suffix decoding's store), made on first
    use."""

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r}: the prompt has no tokens")
        if self.max_tokens < 1:
            raise ValueError(f"request {self.request_id!r}: max_tokens must be >= 1, got {self.max_tokens}")
        self.prompt_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """Tokens in the prompt."""
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far."""
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose KV is not computed yet."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        """Whether the next step feeds just the last sampled token."""
        return bool(self.output_token_ids) and self.num_computed_tokens == self.num_tokens - 1

    @property
    def is_finished(self) -> bool:
        """Whether the request reached a final state."""
        return self.status.is_finished

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt and output tokens, as a new list."""
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_in(self, start: int, stop: int) -> list[int]:
        """Tokens at positions ``[start, stop)`` without copying the whole sequence."""
        n = len(self.prompt_token_ids)
        if stop <= n:
            return self.prompt_token_ids[start:stop]
        if start >= n:
            return self.output_token_ids[start - n : stop - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - n]
