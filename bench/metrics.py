"""Serving metrics from per-request timings, with the definitions of `vllm bench serve`.

- TTFT: from sending the request to the first chunk that carries generated text (client side).
- ITL: every gap between consecutive text chunks, over all requests (a chunk holding several tokens is
  one gap, as the client sees it).
- TPOT: per request, (E2EL - TTFT) / (output tokens - 1); requests with one output token have none.
- E2EL: from sending the request to the last chunk.
- Throughputs divide by the benchmark's duration (first send to last completion); goodput counts
  the requests that meet every given SLO (TTFT, TPOT, E2EL, in ms).
Percentiles interpolate linearly (numpy's default); times are reported in milliseconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

SLO_KEYS = ("ttft", "tpot", "e2el")
DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)


@dataclass
class RequestRecord:
    """The client's view of one request; times in seconds."""

    success: bool = False
    prompt_len: int = 0
    output_len: int = 0
    start: float = 0.0  # send time, relative to the benchmark's start
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0  # E2EL
    error: str = ""
    conversation: int | None = None
    turn: int | None = None
    group: int | None = None
    cached_tokens: int | None = None

    @property
    def tpot(self) -> float | None:
        """(E2EL - TTFT) / (output tokens - 1), None for a single output token."""
        if self.output_len < 2:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)

    @property
    def end(self) -> float:
        return self.start + self.latency

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> RequestRecord:
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


def _stats(name: str, values_s: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    """mean/median/std/pXX of `values_s` (seconds) in ms, keyed `{stat}_{name}_ms` as vLLM names them."""
    v = np.asarray(values_s, np.float64) * 1000.0  # [n] ms
    if v.size == 0:
        v = np.zeros(1)  # vLLM reports zeros when there is nothing to measure
    out = {f"mean_{name}_ms": float(v.mean()), f"median_{name}_ms": float(np.median(v)),
           f"std_{name}_ms": float(v.std())}
    for p in percentiles:
        out[f"p{_pct_label(p)}_{name}_ms"] = float(np.percentile(v, p))
    return out


def _pct_label(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def peak_concurrency(records: Sequence[RequestRecord]) -> int:
    """The most requests in flight at one time (a request ends as its last chunk arrives)."""
    events = sorted([(r.start, 1) for r in records] + [(r.end, -1) for r in records], key=lambda e: (e[0], e[1]))
    peak = cur = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return peak


def is_good(r: RequestRecord, slos_ms: dict[str, float]) -> bool:
    """True when the request succeeded and meets every SLO given (a missing TPOT counts as 0)."""
    if not r.success:
        return False
    values = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.latency}
    return all(values[k] * 1000.0 <= limit for k, limit in slos_ms.items())


def compute_metrics(records: Sequence[RequestRecord], duration_s: float, slos_ms: dict[str, float] | None = None,
                    percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> dict[str, float]:
    """The summary metrics of a run: counts, throughputs, goodput, and TTFT/TPOT/ITL/E2EL statistics."""
    for k in slos_ms or {}:
        if k not in SLO_KEYS:
            raise ValueError(f"SLO keys are {', '.join(SLO_KEYS)}, got {k!r}")
    ok = [r for r in records if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    dur = duration_s if duration_s > 0 else float("nan")
    m: dict[str, float] = {
        "duration_s": duration_s,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / dur,
        "output_throughput": total_out / dur,
        "total_token_throughput": (total_in + total_out) / dur,
        "max_concurrent_requests": peak_concurrency(ok),
    }
    if slos_ms:
        m["goodput"] = sum(is_good(r, slos_ms) for r in ok) / dur
    m.update(_stats("ttft", [r.ttft for r in ok], percentiles))
    m.update(_stats("tpot", [t for r in ok if (t := r.tpot) is not None], percentiles))
    m.update(_stats("itl", [g for r in ok for g in r.itl], percentiles))
    m.update(_stats("e2el", [r.latency for r in ok], percentiles))
    return m


def parse_slos(items: Sequence[str] | None) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` -> {"ttft": 500.0, "tpot": 50.0} (ms), as vLLM's --goodput takes them."""
    out = {}
    for item in items or ():
        key, sep, value = item.partition(":")
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"an SLO is KEY:MS with KEY one of {', '.join(SLO_KEYS)}, got {item!r}")
        ms = float(value)
        if ms <= 0:
            raise ValueError(f"an SLO must be positive, got {item!r}")
        out[key] = ms
    return out
