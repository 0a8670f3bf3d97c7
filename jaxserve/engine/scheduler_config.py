"""The scheduler's limits and policy (`SchedulerConfig`), shared by the pure planner and its shell."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Policy = Literal["fcfs", "priority"]


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits and policy of the scheduler."""

    max_num_seqs: int = 256
    """Most requests running at once (each running request is scheduled every step)."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step: decode tokens plus prefill chunk tokens."""
    max_model_len: int = 8192
    """Most tokens (prompt plus output) a request may reach."""
    page_size: int = 16
    """Tokens per KV page, a power of two."""
    long_prefill_token_threshold: int | None = None
    """Largest prefill chunk one request gets per step (None: only the token budget limits it)."""
    policy: Policy = "fcfs"
    """``"fcfs"``: arrival order; ``"priority"``: lower ``Request.priority`` first, arrival order within one."""
    enable_prefix_caching: bool = True
    max_loras: int | None = None
    """Most LoRA adapters among the running requests (None: no limit), as an engine holds that many slots."""
    num_state_slots: int = 0
    """A hybrid model's state slots (`hybrid.StateSlots`), one per running request besides slot 0; 0: none."""
    num_state_snapshots: int = 0
    """... and its prefix cache's snapshot slots (`state_cache.StateSnapshots`), from `first_snapshot_slot` on
    (0: right after those); 0: none."""
    first_snapshot_slot: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "page_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # Otherwise a full batch of decodes would not fit in one step's budget.
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs ({self.max_num_seqs})"
            )
        if self.long_prefill_token_threshold is not None and self.long_prefill_token_threshold < 1:
            raise ValueError(
                f"long_prefill_token_threshold must be >= 1, got {self.long_prefill_token_threshold}"
            )
        if self.max_loras is not None and (not isinstance(self.max_loras, int) or self.max_loras < 1):
            raise ValueError(f"max_loras must be a positive int or None, got {self.max_loras!r}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")

    @property
    def prefill_chunk_size(self) -> int:
        """The most prefill tokens one request is given in one step."""
        return self.long_prefill_token_threshold or self.max_num_batched_tokens

    def order_key(self, priority: int, arrival_index: int) -> tuple[int, int]:
        """Policy order: smaller runs first and is preempted last."""
        return (priority if self.policy == "priority" else 0, arrival_index)
