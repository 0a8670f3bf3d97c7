"""`jaxserve bench serve`: an asyncio load generator for OpenAI-compatible servers on this machine.

Requests arrive as a gamma process at `request_rate` (burstiness 1 is Poisson; an infinite rate sends
all at once), wait for one of `max_concurrency` slots, and stream their reply; every chunk is timed.
A run stops issuing requests after `num_prompts` or `max_duration_s`, and gives requests in flight
`drain_timeout_s` more before it cancels them (they count as failed). Multi-turn conversations send
each turn when the previous reply is complete, with the history and the actual replies.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.client import first_model, make_client, request_body, send_streaming
from bench.metrics import DEFAULT_PERCENTILES, RequestRecord, compute_metrics
from bench.workloads import BenchRequest, Conversation, Workload, turn_messages


@dataclass(frozen=True)
class LoadConfig:
    """How one run sends its requests."""

    request_rate: float = math.inf  # requests (or conversations) per second
    burstiness: float = 1.0  # gamma shape: 1 = Poisson, < 1 burstier, > 1 more regular
    max_concurrency: int | None = None  # requests in flight at most (None = unbounded)
    max_duration_s: float | None = None  # no new request after this many seconds
    drain_timeout_s: float = 600.0  # then requests in flight get this long before they are cancelled
    timeout_s: float = 600.0  # per HTTP request
    seed: int = 0
    extra_body: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (inf = all at once), got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times (s from the start) of n requests: gamma gaps of mean 1/rate, all 0 at an infinite rate."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    theta = 1.0 / (rate * burstiness)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, theta)
    return out


@dataclass
class LoadResult:
    records: list[RequestRecord]
    duration_s: float
    not_sent: int  # requests never issued (time bound)


async def run_load(base_url: str, workload: Workload, load: LoadConfig, *, model: str | None = None,
                   api_key: str | None = None, count_tokens: Callable[[str], int] | None = None,
                   chat_prompt_len: Callable[[list], int] | None = None) -> tuple[LoadResult, str]:
    """Send `workload` to the server at `base_url` as `load` says; returns the records and the model used."""
    conns = load.max_concurrency or max(1, len(workload))
    client = make_client(base_url, conns, load.timeout_s, api_key)
    async with client:
        model = model or await first_model(client)
        sem = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
        records: list[RequestRecord] = []
        offsets = arrival_offsets(len(workload), load.request_rate, load.burstiness, load.seed)

        async def one(body: dict, prompt_len: int, **tags: Any) -> tuple[RequestRecord, str]:
            if sem is None:
                rec, text = await send_streaming(client, body, t_zero, expected_prompt_len=prompt_len,
                                                 count_tokens=count_tokens)
            else:
                async with sem:
                    rec, text = await send_streaming(client, body, t_zero, expected_prompt_len=prompt_len,
                                                     count_tokens=count_tokens)
            for k, v in tags.items():
                setattr(rec, k, v)
            records.append(rec)
            return rec, text

        async def single(req: BenchRequest) -> None:
            body = request_body(model, req.output_len, prompt=req.prompt,
                                messages=list(req.messages) if req.messages else None, extra=load.extra_body)
            await one(body, req.prompt_len, group=req.group)

        async def conversation(i: int, conv: Conversation) -> None:
            replies: list[str] = []
            for turn in range(len(conv.user_turns)):
                if deadline is not None and time.perf_counter() > deadline:
                    return
                msgs = turn_messages(conv, turn, replies)
                body = request_body(model, conv.output_len, messages=msgs, extra=load.extra_body)
                rec, text = await one(body, chat_prompt_len(msgs) if chat_prompt_len else 0, conversation=i,
                                      turn=turn)
                if not rec.success:
                    return
                replies.append(text)

        t_zero = time.perf_counter()
        deadline = t_zero + load.max_duration_s if load.max_duration_s is not None else None
        tasks: list[asyncio.Task] = []
        not_sent = 0
        for i, (item, at) in enumerate(zip(workload, offsets, strict=True)):
            if deadline is not None and t_zero + at > deadline:
                not_sent = len(workload) - i
                break
            delay = t_zero + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            coro = conversation(i, item) if isinstance(item, Conversation) else single(item)
            tasks.append(asyncio.create_task(coro))
        if tasks:
            limit = None
            if deadline is not None:
                limit = max(0.0, deadline - time.perf_counter()) + load.drain_timeout_s
            done, pending = await asyncio.wait(tasks, timeout=limit)
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
                records.extend(RequestRecord(error="cancelled at the time bound") for _ in pending)
        # As vLLM: from the start to the moment the last request is done.
        duration = time.perf_counter() - t_zero
        return LoadResult(records, duration, not_sent), model


@dataclass(frozen=True)
class ServeBenchConfig:
    """A serving benchmark: one workload, one or more concurrency limits (a sweep), the same load otherwise."""

    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None
    api_key: str | None = None
    label: str = ""
    concurrencies: tuple[int | None, ...] = (None,)
    load: LoadConfig = LoadConfig()
    slos_ms: dict[str, float] = field(default_factory=dict)
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
    warmup_requests: int = 1
    save_requests: bool = True
    reset_caches: bool = True
    """Empty the server's prefix and image caches before each run (`/reset_prefix_cache`, `/reset_mm_cache`), so a
    run does not find the requests of the runs (or the warmup) before it cached; a server without those endpoints
    keeps its caches (each run says whether they were emptied)."""


def reset_server_caches(base_url: str, api_key: str | None = None) -> bool:
    """POST the server's cache resets; whether its prefix cache was emptied (an image cache it lacks is fine)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with httpx.Client(base_url=base_url, headers=headers, timeout=60) as client:
            prefix = client.post("/reset_prefix_cache").status_code
            images = client.post("/reset_mm_cache").status_code
    except httpx.HTTPError:
        return False
    return prefix == 200 and images in (200, 404)


def run_serve_benchmark(cfg: ServeBenchConfig, workload_spec: Any, tokenizer: Any, log=print) -> dict:
    """Build the workload, warm the server up, run once per concurrency, and return the result document."""
    from bench.machine import machine_info

    workload = workload_spec.build(tokenizer)
    count = lambda text: len(tokenizer.encode(text))  # noqa: E731
    chat_len = lambda msgs: len(tokenizer.encode_chat(msgs))  # noqa: E731
    model = cfg.model
    if cfg.warmup_requests:
        warm = _warmup_workload(workload, cfg.warmup_requests)
        _, model = asyncio.run(run_load(cfg.base_url, warm, dataclasses.replace(cfg.load, max_duration_s=None),
                                        model=model, api_key=cfg.api_key, count_tokens=count,
                                        chat_prompt_len=chat_len))
    runs = []
    for conc in cfg.concurrencies:
        load = dataclasses.replace(cfg.load, max_concurrency=conc)
        log(f"{workload_spec.name}: {len(workload)} items, max concurrency {conc or 'unbounded'}, "
            f"rate {load.request_rate} ...")
        reset = reset_server_caches(cfg.base_url, cfg.api_key) if cfg.reset_caches else False
        res, model = asyncio.run(run_load(cfg.base_url, workload, load, model=model, api_key=cfg.api_key,
                                          count_tokens=count, chat_prompt_len=chat_len))
        metrics = compute_metrics(res.records, res.duration_s, cfg.slos_ms, cfg.percentiles)
        metrics["not_sent"] = res.not_sent
        run = {"max_concurrency": conc, "request_rate": _num(load.request_rate), "burstiness": load.burstiness,
               "caches_reset": reset, "metrics": metrics}
        errors = sorted({r.error for r in res.records if r.error})
        if errors:
            run["errors"] = errors[:10]
        if cfg.save_requests:
            run["requests"] = [r.to_dict() for r in res.records]
        runs.append(run)
    load_d = dataclasses.asdict(cfg.load)
    load_d["request_rate"] = _num(load_d["request_rate"])
    return {
        "kind": "serve",
        "system": cfg.label or model,
        "base_url": cfg.base_url,
        "model": model,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_info(),
        "workload": workload_spec.to_dict(),
        "load": load_d,
        "slos_ms": cfg.slos_ms,
        "runs": runs,
    }


def _warmup_workload(workload: Workload, n: int) -> Workload:
    """The first n items, cut short (8 output tokens, conversations to one turn)."""
    out: list = []
    for item in list(workload)[:n]:
        if isinstance(item, Conversation):
            out.append(dataclasses.replace(item, user_turns=item.user_turns[:1], output_len=8))
        else:
            out.append(dataclasses.replace(item, output_len=8))
    return out


def _num(x: float) -> float | str:
    return "inf" if math.isinf(x) else x


def format_serve_report(result: dict, percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> str:
    """vLLM-style summary blocks, one per run."""
    lines = []
    for run in result["runs"]:
        m = run["metrics"]
        conc = run["max_concurrency"] or "unbounded"
        lines.append(f"{'=' * 16} {result['system']} | {result['workload']['name']} | max concurrency {conc} "
                     f"| rate {run['request_rate']} {'=' * 16}")
        rows = [("Successful requests", m["completed"], "d"), ("Failed requests", m["failed"], "d"),
                ("Benchmark duration (s)", m["duration_s"], ".2f"),
                ("Total input tokens", m["total_input_tokens"], "d"),
                ("Total generated tokens", m["total_output_tokens"], "d"),
                ("Request throughput (req/s)", m["request_throughput"], ".2f"),
                ("Output token throughput (tok/s)", m["output_throughput"], ".2f"),
                ("Total token throughput (tok/s)", m["total_token_throughput"], ".2f"),
                ("Peak concurrent requests", m["max_concurrent_requests"], "d")]
        if "goodput" in m:
            rows.append(("Request goodput (req/s)", m["goodput"], ".2f"))
        for name, value, fmt in rows:
            lines.append(f"{name:<40}{format(value, fmt) if value == value else 'nan':>12}")
        for key, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                           ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
            lines.append(f"{'-' * 12} {title} {'-' * 12}")
            lines.append(f"{'Mean ' + key.upper() + ' (ms)':<40}{m[f'mean_{key}_ms']:>12.2f}")
            lines.append(f"{'Median ' + key.upper() + ' (ms)':<40}{m[f'median_{key}_ms']:>12.2f}")
            for p in (p for p in percentiles if p != 50):  # p50 is the median above
                label = str(int(p)) if float(p).is_integer() else str(p)
                lines.append(f"{'P' + label + ' ' + key.upper() + ' (ms)':<40}{m[f'p{label}_{key}_ms']:>12.2f}")
        if run.get("errors"):
            lines.append("errors: " + "; ".join(run["errors"]))
    return "\n".join(lines)
