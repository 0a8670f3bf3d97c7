"""The router's view of its workers: health, load scraped from `/metrics`, and their KV events.

Each worker is probed every `probe_interval_s`: `GET /ready` (a worker that answers it with an error,
or refuses the connection, stops receiving traffic at once until it passes again; one whose probe
times out or breaks off does so after `failure_threshold` such probes in a row, as a Kubernetes
readiness probe's `failureThreshold`, so a busy worker is not dropped for one slow answer), `GET /metrics` (the `vllm:*` gauges:
running and waiting requests, KV cache usage, page size) and `GET /v1/kv_events?since=N` (fed
to the prefix index). The router also counts the requests it has in flight on each worker, which
moves at once, while the scraped numbers lag by up to one probe.
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from router.prefix_index import PrefixIndex

logger = logging.getLogger("jaxserve.router")

Role = Literal["both", "prefill", "decode"]
_EVENTS_PER_POLL = 10_000  # the worker's page size of GET /v1/kv_events


@dataclass
class Worker:
    """One worker and what the router last learned of it."""

    url: str
    role: Role = "both"
    healthy: bool = False
    num_running: float = 0.0
    num_waiting: float = 0.0
    kv_usage: float = 0.0
    page_size: int | None = None
    in_flight: int = 0
    """Requests the router has sent and not yet seen finish."""
    routed: int = 0
    """Requests routed here in total."""
    events_next: int = 0
    events_epoch: str | None = None
    last_error: str | None = None
    probe_failures: int = 0
    """Probes in a row that timed out or broke off."""
    max_lora: int = 0
    """LoRA adapters the worker runs at once (`vllm:lora_requests_info`; 0: it serves none)."""
    running_loras: frozenset[str] = frozenset()
    """LoRA adapters of its running requests, and of its waiting ones."""
    waiting_loras: frozenset[str] = frozenset()
    base_models: frozenset[str] | None = None
    """The names the worker serves its base model under (`GET /v1/models` entries without a `parent`; the
    others are LoRA adapters), read when it turns healthy; None until then."""
    long_rope_context: int | None = None
    """A LongRoPE model's original context, past which the worker caches prompts in a namespace of their own
    (its base model card's `long_rope_context`)."""

    @property
    def queue(self) -> float:
        """The load the policies compare: in flight from this router, or the worker's own count if larger."""
        return max(float(self.in_flight), self.num_running + self.num_waiting)

    def to_json(self) -> dict:
        """The worker as `GET /workers` lists it."""
        return {"url": self.url, "role": self.role, "healthy": self.healthy, "in_flight": self.in_flight,
                "num_running": self.num_running, "num_waiting": self.num_waiting, "kv_usage": self.kv_usage,
                "page_size": self.page_size, "routed": self.routed, "last_error": self.last_error,
                "probe_failures": self.probe_failures, "max_lora": self.max_lora,
                "running_loras": sorted(self.running_loras)}


_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> dict[str, Any]:
    """The few `vllm:*` numbers the router uses, from a Prometheus text exposition, and the LoRA adapters
    a worker runs (`vllm:lora_requests_info`)."""
    out: dict[str, Any] = {}
    names = {"vllm:num_requests_running": "num_running", "vllm:num_requests_waiting": "num_waiting",
             "vllm:kv_cache_usage_perc": "kv_usage"}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, rest = line.partition("{")
        if name in names:
            try:
                out[names[name]] = float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
        elif name == "vllm:lora_requests_info":
            labels = dict(_LABEL.findall(rest))
            if labels.get("max_lora", "").isdigit():
                out["max_lora"] = int(labels["max_lora"])
            for key, field in (("running_lora_adapters", "running_loras"), ("waiting_lora_adapters", "waiting_loras")):
                out[field] = frozenset(a for a in labels.get(key, "").split(",") if a)
        elif name == "vllm:cache_config_info":
            for part in rest.split(","):
                key, _, value = part.partition("=")
                if key.strip() == "block_size":
                    digits = value.strip().strip('}"').split('"')[0]
                    if digits.isdigit() and int(digits) > 0:
                        out["page_size"] = int(digits)
    return out


class WorkerPool:
    """The registered workers, their probes, and the prefix index their KV events feed."""

    def __init__(self, index: PrefixIndex, probe_interval_s: float = 0.5, timeout_s: float = 2.0,
                 failure_threshold: int = 3):
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {failure_threshold}")
        self.index = index
        self.workers: dict[str, Worker] = {}
        self._interval = probe_interval_s
        self._failure_threshold = failure_threshold
        self._client = httpx.AsyncClient(timeout=timeout_s)
        self._tasks: dict[str, asyncio.Task] = {}
        self._started = False

    def register(self, url: str, role: Role = "both") -> Worker:
        """Add a worker (or change its role); it takes traffic once its first probe passes."""
        url = url.rstrip("/")
        worker = self.workers.get(url)
        if worker is None:
            worker = self.workers[url] = Worker(url, role)
            if self._started:
                self._tasks[url] = asyncio.ensure_future(self._probe_loop(worker))
        worker.role = role
        return worker

    def deregister(self, url: str) -> bool:
        """Remove a worker: no new traffic; requests already sent to it finish there."""
        worker = self.workers.pop(url.rstrip("/"), None)
        task = self._tasks.pop(url.rstrip("/"), None)
        if task is not None:
            task.cancel()
        if worker is not None:
            self.index.forget(worker.url)
        return worker is not None

    def healthy(self, role: Role | None = None) -> list[Worker]:
        """Workers passing their probe, optionally only those of `role`, in registration order."""
        return [w for w in self.workers.values() if w.healthy and (role is None or w.role == role)]

    def mark_failed(self, worker: Worker, error: str) -> None:
        """A proxied request could not reach `worker`: stop sending to it until a probe passes."""
        if worker.healthy:
            logger.warning("worker %s marked unhealthy: %s", worker.url, error)
        worker.healthy = False
        worker.last_error = error

    async def start(self) -> None:
        """Probe every worker once (so the first request finds them), then keep probing in the background."""
        self._started = True
        await asyncio.gather(*(self.probe(w) for w in self.workers.values()))
        for url, worker in self.workers.items():
            self._tasks[url] = asyncio.ensure_future(self._probe_loop(worker))

    async def stop(self) -> None:
        """Cancel the probes and close the HTTP client."""
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        self._tasks.clear()
        await self._client.aclose()

    async def _probe_loop(self, worker: Worker) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self.probe(worker)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a probe bug must not stop probing
                logger.exception("probing %s failed", worker.url)

    def _probe_failed(self, worker: Worker, where: str, error: httpx.HTTPError) -> None:
        """A probe got no answer: a refused connection counts at once, a timeout or a broken
        connection only once `failure_threshold` probes in a row have had one."""
        message = f"{where}: {type(error).__name__}"
        worker.probe_failures += 1
        if isinstance(error, httpx.ConnectError) or worker.probe_failures >= self._failure_threshold:
            self.mark_failed(worker, message)
        else:
            logger.info("worker %s probe %d/%d failed: %s", worker.url, worker.probe_failures,
                        self._failure_threshold, message)
            worker.last_error = message

    async def probe(self, worker: Worker) -> None:
        """Read one worker's readiness, load and new KV events."""
        try:
            ready = await self._client.get(worker.url + "/ready")
        except httpx.HTTPError as e:
            self._probe_failed(worker, "/ready", e)
            return
        if ready.status_code != 200:
            worker.probe_failures = 0
            self.mark_failed(worker, f"/ready answered {ready.status_code}")
            return
        try:
            metrics = await self._client.get(worker.url + "/metrics")
            if metrics.status_code == 200:
                for key, value in parse_metrics(metrics.text).items():
                    setattr(worker, key, value)
            await self._poll_events(worker)
        except httpx.HTTPError as e:
            self._probe_failed(worker, "probe", e)
            return
        if not worker.healthy:
            logger.info("worker %s is healthy", worker.url)
            await self._read_models(worker)
        worker.healthy = True
        worker.last_error = None
        worker.probe_failures = 0

    async def _read_models(self, worker: Worker) -> None:
        try:
            r = await self._client.get(worker.url + "/v1/models")
            cards = r.json()["data"] if r.status_code == 200 else None
            worker.base_models = frozenset(c["id"] for c in cards if not c.get("parent")) if cards else None
            worker.long_rope_context = next((c.get("long_rope_context") for c in cards or () if not c.get("parent")),
                                            None)
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:  # no list: every model taken as base
            logger.info("worker %s: GET /v1/models failed (%s)", worker.url, type(e).__name__)

    async def _poll_events(self, worker: Worker) -> None:
        while True:
            r = await self._client.get(worker.url + "/v1/kv_events", params={"since": worker.events_next})
            if r.status_code != 200:
                return  # publishes none: the approximate index stands in
            feed = r.json()
            reset = bool(feed["truncated"])
            if feed["epoch"] != worker.events_epoch:
                worker.events_epoch = feed["epoch"]
                reset = True
                if worker.events_next != 0:  # a number from the worker's previous process: start over
                    logger.info("worker %s restarted; rebuilding its prefix index", worker.url)
                    worker.events_next = 0
                    self.index.apply_events(worker.url, [], reset=True)
                    continue
            self.index.apply_events(worker.url, feed["events"], reset=reset)
            worker.events_next = feed["next"]
            if len(feed["events"]) < _EVENTS_PER_POLL:
                return
