"""What one scheduler step hands the runner: each request's tokens, positions and page table."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step: feed ``token_ids`` at positions ``start_position`` onwards."""

    request_id: str
    num_new_tokens: int
    start_position: int
    """Tokens already computed (their KV is in the pages): the position of ``token_ids[0]``."""
    token_ids: tuple[int, ...]
    page_table: tuple[int, ...]
    """The request's KV pages, covering at least ``start_position + num_new_tokens`` positions."""
    sample: bool
    """True when the step feeds the request's last known token, so the logits of that token are
    sampled: every decode, and the chunk that completes a prefill."""
    is_decode: bool
    """True for a running request's one-token decode step (these come first in the step)."""


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's plan; ``scheduled`` lists decodes first, then prefill chunks."""

    step: int
    scheduled: tuple[ScheduledRequest, ...]
    preempted_ids: tuple[str, ...]
    """Requests preempted in this step (their pages are freed; they will recompute)."""
    finished_ids: tuple[str, ...]
    """Requests finished or aborted since the previous step (a runner drops their state)."""

    @property
    def num_batched_tokens(self) -> int:
        """Tokens fed in this step."""
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        """Whether nothing runs in this step."""
        return not self.scheduled
