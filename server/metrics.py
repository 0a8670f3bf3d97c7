"""Prometheus metrics under the names routers scrape from vLLM (`vllm:*`), plus jaxserve's own.

Engine-side numbers (queues, KV usage, token counters, step time) are read from `engine.stats()`
when /metrics is scraped, so the token path pays nothing for them. Per-request histograms and the
finish-reason counter are recorded by the server once per request, when it ends.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from jaxserve.outputs import RequestOutput

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2, 0.3, 0.4,
                0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class _EngineCollector(Collector):
    """Reads the engine's counters at scrape time."""

    def __init__(self, engine: Any, model_name: str):
        self._engine = engine
        self._model = model_name

    def collect(self) -> Iterable[Metric]:
        s = self._engine.stats()
        label = ["model_name"]

        def gauge(name: str, doc: str, value: float) -> Metric:
            g = GaugeMetricFamily(name, doc, labels=label)
            g.add_metric([self._model], value)
            return g

        def counter(name: str, doc: str, value: float) -> Metric:
            c = CounterMetricFamily(name, doc, labels=label)
            c.add_metric([self._model], value)
            return c

        yield gauge("vllm:num_requests_running", "Requests running on the engine.", s.num_running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "Fraction of KV cache pages in use (1 = all).", s.kv_cache_usage)
        info = GaugeMetricFamily("vllm:cache_config_info", "KV cache configuration.",
                                 labels=["model_name", "block_size", "num_gpu_blocks", "cache_dtype",
                                         "calculate_kv_scales"])
        info.add_metric([self._model, str(s.page_size), str(s.num_pages), s.kv_cache_dtype,
                         str(s.calculate_kv_scales)], 1)
        yield info
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      s.prefix_cache_queries)
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits)
        yield counter("vllm:mm_cache_queries", "Images looked up in the embeddings cache.", s.mm_cache_queries)
        yield counter("vllm:mm_cache_hits", "Images found in the embeddings cache.", s.mm_cache_hits)
        yield counter("vllm:num_preemptions", "Requests preempted by the scheduler.", s.num_preemptions)
        yield counter("vllm:prompt_tokens", "Prompt tokens processed.", s.prompt_tokens)
        yield counter("vllm:generation_tokens", "Tokens generated.", s.generation_tokens)
        yield counter("vllm:spec_decode_num_drafts", "Requests given draft tokens, summed over steps.",
                      s.spec_num_drafts)
        yield counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.", s.spec_num_draft_tokens)
        yield counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", s.spec_num_accepted_tokens)
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by their place among their request's drafts.",
                                      labels=[*label, "position"])
        for position, accepted in enumerate(getattr(s, "spec_num_accepted_tokens_per_pos", ())):
            per_pos.add_metric([self._model, str(position)], accepted)
        yield per_pos
        if getattr(s, "max_lora", 0):  # vLLM's: the adapters in use, for LoRA-aware routers (its value: a time)
            lora = GaugeMetricFamily("vllm:lora_requests_info", "LoRA adapters of running and waiting requests.",
                                     labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
            lora.add_metric([str(s.max_lora), ",".join(s.running_lora_adapters), ",".join(s.waiting_lora_adapters)],
                            time.time())
            yield lora
        yield counter("jaxserve:compilations_after_warmup", "XLA compilations after warmup (should stay 0).",
                      s.compilations_after_warmup)
        yield counter("jaxserve:engine_steps", "Engine steps run.", s.num_steps)
        yield gauge("jaxserve:step_time_seconds", "Duration of the last engine step.", s.step_time_s)


class ServerMetrics:
    """The server's registry: engine gauges and counters, and per-request histograms."""

    def __init__(self, engine: Any, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineCollector(engine, model_name))
        r, m = self.registry, ["model_name"]
        self.request_success = Counter("vllm:request_success", "Finished requests by finish reason.",
                                       ["model_name", "finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", m,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between generated tokens.", m,
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to finish of a request.", m,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("vllm:request_queue_time_seconds", "Time a request waited to be scheduled.",
                                    m, buckets=_LATENCY_BUCKETS, registry=r)
        self.rejected = Counter("jaxserve:requests_rejected", "Requests refused by admission control.",
                                ["model_name", "reason"], registry=r)
        self.http_errors = Counter("jaxserve:http_errors", "Error responses by status.",
                                   ["model_name", "status"], registry=r)

    def observe_tokens(self, seconds: float, num_tokens: int) -> None:
        """`num_tokens` arrived `seconds` after the previous output: one ITL sample per token."""
        if num_tokens <= 0:
            return
        per = seconds / num_tokens
        h = self.itl.labels(self.model_name)
        for _ in range(num_tokens):
            h.observe(per)

    def observe_finished(self, out: RequestOutput, ttft_s: float | None, e2e_s: float) -> None:
        """Record one finished request (server-measured TTFT and e2e; queue time from the engine)."""
        name = self.model_name
        # An embedding's output carries no completions: it stopped with its vector, or was aborted.
        reasons = ([c.finish_reason for c in out.outputs] if isinstance(out, RequestOutput)
                   else ["stop" if out.outputs is not None else "abort"])
        for reason in reasons:
            if reason is not None:
                self.request_success.labels(name, reason).inc()
        if ttft_s is not None:
            self.ttft.labels(name).observe(ttft_s)
        self.e2e.labels(name).observe(e2e_s)
        m = out.metrics
        if m is not None and m.first_scheduled_time is not None:
            self.queue_time.labels(name).observe(max(0.0, m.first_scheduled_time - m.arrival_time))

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)
