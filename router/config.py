"""The router's configuration: one frozen dataclass, checked when built."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

Policy = Literal["round-robin", "least-load", "prefix", "session"]
POLICIES: tuple[str, ...] = ("round-robin", "least-load", "prefix", "session")


@dataclass(frozen=True)
class CostWeights:
    """Weights of the `prefix` policy's score (see `router.policy` for the formula)."""

    prefix: float = 1.0
    """Weight of the fraction of the prompt already cached on the worker."""
    load: float = 0.5
    """Weight of the worker's queue (in flight + waiting), relative to the busiest candidate."""
    kv: float = 0.2
    """Weight of the worker's KV cache usage (0..1)."""
    hotspot_threshold: int = 4
    """A worker whose queue exceeds the shortest one by more than this loses its prefix advantage."""
    lora: float = 1.0
    """Weight of a LoRA request's adapter cost on the worker: 0 where it runs, 1 where it would wait."""

    def __post_init__(self) -> None:
        for name in ("prefix", "load", "kv", "lora"):
            if getattr(self, name) < 0:
                raise ValueError(f"weight {name} must be >= 0, got {getattr(self, name)}")
        if self.hotspot_threshold < 0:
            raise ValueError(f"hotspot_threshold must be >= 0, got {self.hotspot_threshold}")


@dataclass(frozen=True)
class RouterConfig:
    """How the router listens, probes its workers and picks one per request.

    Attributes:
      host, port: where the router listens (port 0 picks a free one).
      workers: URLs of aggregated workers (`jaxserve serve`), e.g. `http://127.0.0.1:8001`.
      prefill_workers, decode_workers: URLs of `--role prefill` / `--role decode` workers; with both
        given, requests whose uncached prompt is long are disaggregated (see `router.pd`).
      policy: how a worker is picked: round-robin, least-load, prefix or session.
      weights: the prefix policy's cost function.
      session_header: the header whose value keeps a session on one worker (policy `session`).
      probe_interval_s: how often each worker's /ready, /metrics and KV events are read.
      probe_timeout_s: how long one probe request may take.
      probe_failure_threshold: probes in a row that time out (or break off) before a worker stops
        receiving traffic; an error answer or a refused connection stops it at once.
      approx_ttl_s: how long a routing-time guess of a worker's cached prefix counts (bridges the
        delay before the worker's own KV events arrive, and stands in when it publishes none).
      page_size: the page size assumed for hashing until a worker's /metrics reports its own.
      request_timeout_s: total time allowed for one proxied request.
      max_attempts: workers tried for one request when a worker is unreachable or refuses (429/503).
      pd_min_uncached_tokens: disaggregate a request only when at least this many prompt tokens are
        not already cached on the chosen decode worker.
      pd_transfer_timeout_s: how long a decode worker waits for a KV transfer before recomputing.
      log_level: level of the router's logs.
    """

    host: str = "127.0.0.1"
    port: int = 8080
    workers: tuple[str, ...] = ()
    prefill_workers: tuple[str, ...] = ()
    decode_workers: tuple[str, ...] = ()
    policy: Policy = "prefix"
    weights: CostWeights = CostWeights()
    session_header: str = "x-session-id"
    probe_interval_s: float = 0.5
    probe_timeout_s: float = 2.0
    probe_failure_threshold: int = 3
    approx_ttl_s: float = 30.0
    page_size: int = 16
    request_timeout_s: float = 600.0
    max_attempts: int = 3
    pd_min_uncached_tokens: int = 64
    pd_transfer_timeout_s: float = 10.0
    log_level: str = "info"

    def __post_init__(self) -> None:
        for name in ("workers", "prefill_workers", "decode_workers"):
            urls = tuple(u.rstrip("/") for u in getattr(self, name))
            bad = [u for u in urls if not u.startswith(("http://", "https://"))]
            if bad:
                raise ValueError(f"{name}: {bad[0]!r} is not an http(s) URL")
            object.__setattr__(self, name, urls)
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if bool(self.prefill_workers) != bool(self.decode_workers):
            raise ValueError("give both prefill and decode workers, or neither")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        for name in ("probe_interval_s", "probe_timeout_s", "approx_ttl_s", "request_timeout_s",
                     "pd_transfer_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.page_size < 1 or self.max_attempts < 1 or self.pd_min_uncached_tokens < 0:
            raise ValueError("page_size and max_attempts must be >= 1, pd_min_uncached_tokens >= 0")
        if self.probe_failure_threshold < 1:
            raise ValueError(f"probe_failure_threshold must be >= 1, got {self.probe_failure_threshold}")
        object.__setattr__(self, "session_header", self.session_header.lower())

    def replace(self, **changes) -> RouterConfig:
        """A copy with `changes` applied (and checked)."""
        return dataclasses.replace(self, **changes)
