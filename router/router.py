"""The router's core: per generation request, tokenize when the policy needs it, pick a worker,
forward the body unchanged and relay the answer; retries on a worker that cannot take the request.

A worker that cannot be reached, or answers 429/503 before anything was sent to the client, is
skipped and the next pick is tried (an unreachable one is also marked unhealthy), so a worker dying
fails no request not yet started on it. KV data never flows through the router (DESIGN.md, L2).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from jaxserve.engine.kv_events import hash_token_pages
from jaxserve.lora_request import lora_cache_salt
from jaxserve.rope import prompt_cache_salt
from router.config import RouterConfig
from router.pd import Disaggregator
from router.policy import Decision, Picker, RouteRequest
from router.prefix_index import PrefixIndex
from router.workers import Worker, WorkerPool
from server.errors import ApiError, sse_error
from server.responses_input import chat_body
from server.trace import TraceStore, summarize_request

logger = logging.getLogger("jaxserve.router")
_FORWARD_HEADERS = ("authorization", "content-type", "accept")


class _PoolCollector(Collector):
    def __init__(self, pool: WorkerPool):
        self._pool = pool

    def collect(self):
        healthy = GaugeMetricFamily("jaxserve_router:worker_healthy", "1 if the worker passes its probe.",
                                    labels=["worker", "role"])
        in_flight = GaugeMetricFamily("jaxserve_router:worker_in_flight", "Requests in flight on the worker.",
                                      labels=["worker"])
        for w in list(self._pool.workers.values()):
            healthy.add_metric([w.url, w.role], 1.0 if w.healthy else 0.0)
            in_flight.add_metric([w.url], w.in_flight)
        yield healthy
        yield in_flight


class Router:
    """The router's state: workers, prefix index, policy, traces and the outgoing HTTP client."""

    def __init__(self, config: RouterConfig):
        self.config = config
        self.index = PrefixIndex(ttl_s=config.approx_ttl_s)
        self.pool = WorkerPool(self.index, config.probe_interval_s, config.probe_timeout_s,
                               config.probe_failure_threshold)
        for url in config.workers:
            self.pool.register(url, "both")
        for url in config.prefill_workers:
            self.pool.register(url, "prefill")
        for url in config.decode_workers:
            self.pool.register(url, "decode")
        self.picker = Picker(config, self.index)
        self.trace = TraceStore("router")
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(config.request_timeout_s, connect=2.0))
        self.pd = Disaggregator(self)
        self._tokenize_rr = 0
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_PoolCollector(self.pool))
        self.routed = Counter("jaxserve_router:requests_routed", "Requests sent to each worker.",
                              ["worker", "policy"], registry=self.registry)
        self.retries = Counter("jaxserve_router:retries", "Requests moved to another worker.", ["reason"],
                               registry=self.registry)

    async def start(self) -> None:
        """Probe the workers once, then keep probing."""
        await self.pool.start()

    async def stop(self) -> None:
        """Stop probing and close connections."""
        await self.pool.stop()
        await self.client.aclose()

    # -- what the policies need ------------------------------------------------------------------

    def needs_tokens(self) -> bool:
        """Whether picking needs the prompt's token ids (prefix policy, or P/D decisions)."""
        return self.config.policy == "prefix" or bool(self.config.prefill_workers)

    async def tokenize(self, kind: str, body: dict[str, Any], headers: dict[str, str]) -> list[int] | None:
        """The prompt's token ids as a worker tokenizes them, or None if that is not possible."""
        if kind == "completion":
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
                prompt = prompt[0]
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
                prompt = prompt[0]
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                return list(prompt)
            if not isinstance(prompt, str):
                return None
            query = {"prompt": prompt, "add_special_tokens": body.get("add_special_tokens", True)}
        else:
            if not isinstance(body.get("messages"), list):
                return None
            query = {"messages": body["messages"], "add_special_tokens": body.get("add_special_tokens", False),
                     "add_generation_prompt": body.get("add_generation_prompt", True)}
        workers = self.pool.healthy()
        if not workers:
            return None
        self._tokenize_rr += 1
        w = workers[self._tokenize_rr % len(workers)]
        try:
            r = await self.client.post(w.url + "/tokenize", json=query, headers=headers, timeout=5.0)
        except httpx.HTTPError:
            return None
        return r.json().get("tokens") if r.status_code == 200 else None

    async def route_request(self, kind: str, body: dict[str, Any], headers: dict[str, str],
                            request_headers: Any) -> tuple[RouteRequest, list[int] | None]:
        """The policies' view of a request (token ids only when a policy uses them)."""
        session = request_headers.get(self.config.session_header)
        adapter = self.adapter_of(body)
        if not self.needs_tokens():
            return RouteRequest(session=session, adapter=adapter), None
        ids = await self.tokenize(kind, body, headers)
        if ids is None:
            return RouteRequest(session=session, adapter=adapter), None
        page_size = next((w.page_size for w in self.pool.healthy() if w.page_size), self.config.page_size)
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        long_rope = next((w.long_rope_context for w in self.pool.healthy() if w.long_rope_context), None)
        try:  # a prompt past a LongRoPE model's original context: its own cache namespace, as the worker's
            salt = prompt_cache_salt(long_rope, len(ids), salt)
        except ValueError:
            pass  # a salt the worker refuses: it answers the request with the reason
        if adapter is not None:  # a LoRA adapter: its own cache namespace
            salt = lora_cache_salt(adapter, salt)
        # The engine caches prompt[:-1] (the last token is always computed), so hash that.
        hashes = tuple(hash_token_pages(ids[:-1], page_size, salt))
        return RouteRequest(hashes, len(ids), session, adapter), ids

    def adapter_of(self, body: dict[str, Any]) -> str | None:
        """The LoRA adapter a request's `model` names: a name the workers' `/v1/models` lists with a parent,
        or one they do not list as a base model's (an adapter loaded since)."""
        model = body.get("model")
        bases = next((w.base_models for w in self.pool.healthy() if w.base_models), None)
        return model if isinstance(model, str) and bases and model not in bases else None

    def pick(self, request_id: str, candidates: list[Worker], info: RouteRequest) -> Decision:
        """Pick among `candidates`, record it in the trace and the metrics, and count the request in flight."""
        decision = self.picker.pick(candidates, info)
        w = decision.worker
        self.trace.record(request_id, "L2", "picked", decision.to_json())
        self.index.note_routed(w.url, info.hashes)
        self.routed.labels(w.url, decision.policy).inc()
        w.routed += 1
        return decision

    # -- proxying --------------------------------------------------------------------------------

    async def forward(self, request_id: str, path: str, raw: bytes, headers: dict[str, str], stream: bool,
                      info: RouteRequest, role: str | None = None,
                      extra_headers: dict[str, str] | None = None, first: Worker | None = None) -> Response:
        """Send the request to a picked worker (another one if it is unreachable or refuses) and relay the answer.

        `role` limits the candidates to workers of that role (None: aggregated workers, or any if
        there are none); `first` is tried first without a new pick.
        """
        tried: set[str] = set()
        last: Response | None = None
        for attempt in range(self.config.max_attempts):
            candidates = [w for w in self.pool.healthy(role) if w.url not in tried]
            if role is None:
                candidates = [w for w in candidates if w.role == "both"] or candidates
            if first is not None and first.healthy and first.url not in tried:
                w = first
            elif not candidates:
                break
            else:
                w = self.pick(request_id, candidates, info).worker
            first = None
            tried.add(w.url)
            w.in_flight += 1
            sent = {**headers, **(extra_headers or {}), "x-request-id": request_id}
            try:
                resp = await self.client.send(self.client.build_request("POST", w.url + path, content=raw,
                                                                        headers=sent), stream=True)
            except httpx.TransportError as e:
                w.in_flight -= 1
                self.pool.mark_failed(w, f"{path}: {type(e).__name__}")
                self.retries.labels("unreachable").inc()
                self.trace.record(request_id, "L2", "retry", {"worker": w.url, "error": type(e).__name__})
                continue
            if resp.status_code in (429, 503) and attempt + 1 < self.config.max_attempts:
                body = await resp.aread()
                await resp.aclose()
                w.in_flight -= 1
                self.retries.labels(str(resp.status_code)).inc()
                self.trace.record(request_id, "L2", "retry", {"worker": w.url, "status": resp.status_code})
                last = Response(body, resp.status_code, media_type=resp.headers.get("content-type"),
                                headers={"x-request-id": request_id})
                continue
            self.trace.record(request_id, "L2", "forwarded", {"worker": w.url, "status": resp.status_code})
            return await self._relay(request_id, w, resp, stream)
        if last is not None:
            return last
        raise ApiError(503, "no healthy worker can take the request", code="no_healthy_worker",
                       headers={"Retry-After": "1"})

    async def _relay(self, request_id: str, w: Worker, resp: httpx.Response, stream: bool) -> Response:
        headers = {"x-request-id": request_id, "x-jaxserve-worker": w.url}
        media = resp.headers.get("content-type", "application/json")
        if not (stream and resp.status_code == 200):
            try:
                body = await resp.aread()
            finally:
                await resp.aclose()
                w.in_flight -= 1
            self.trace.record(request_id, "L2", "done", {"worker": w.url, "status": resp.status_code})
            return Response(body, resp.status_code, media_type=media, headers=headers)

        closed = False

        async def close() -> None:
            # From the stream's end, or as the response's background task when the client left
            # before the stream started (then the generator's `finally` never runs).
            nonlocal closed
            if not closed:
                closed = True
                await resp.aclose()
                w.in_flight -= 1
                self.trace.record(request_id, "L2", "done", {"worker": w.url, "status": resp.status_code})

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            except httpx.HTTPError as e:
                self.pool.mark_failed(w, f"stream broke: {type(e).__name__}")
                yield sse_error(502, f"the worker failed mid-stream: {type(e).__name__}", "worker_failed")
                yield b"data: [DONE]\n\n"
            finally:
                await close()

        headers.update({"cache-control": "no-cache", "x-accel-buffering": "no"})
        return StreamingResponse(chunks(), status_code=200, media_type=media, headers=headers,
                                 background=BackgroundTask(close))

    async def generate(self, request: Request, kind: str) -> Response:
        """A generation request: pick (or disaggregate) and proxy."""
        request_id = request.state.request_id
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from e
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object", code="invalid_type")
        headers = {k: v for k, v in request.headers.items() if k in _FORWARD_HEADERS}
        self.trace.record(request_id, "L2", "received", summarize_request(kind, body))
        path = {"chat": "/v1/chat/completions", "completion": "/v1/completions", "responses": "/v1/responses"}[kind]
        previous = body.get("previous_response_id") if kind == "responses" else None
        conversation = body.get("conversation") if kind == "responses" else None
        if isinstance(conversation, dict):
            conversation = conversation.get("id")
        if isinstance(previous, str) or isinstance(conversation, str):
            # A continuation runs on the worker that keeps the response or the conversation it continues.
            kept = f"/v1/responses/{previous}" if isinstance(previous, str) else f"/v1/conversations/{conversation}"
            owner = await self.owner(kept, headers)
            self.trace.record(request_id, "L2", "continues", {"of": kept, "worker": owner.url if owner else None})
            return await self.forward(request_id, path, raw, headers, bool(body.get("stream")),
                                      RouteRequest(session=request.headers.get(self.config.session_header)),
                                      first=owner)
        if kind == "responses":  # routed (and prefilled) as the chat request a worker turns it into
            try:
                body, kind = chat_body(body), "chat"
            except ApiError:
                pass  # the worker answers the 400
        info, ids = await self.route_request(kind, body, headers, request.headers)
        stream = bool(body.get("stream"))
        if self.pd.enabled:
            return await self.pd.generate(request_id, path, raw, body, headers, stream, info, ids)
        return await self.forward(request_id, path, raw, headers, stream, info)

    async def owner(self, path: str, headers: dict[str, str]) -> Worker | None:
        """The healthy worker that keeps the response or conversation at `path` (each keeps its own), asked in
        turn."""
        for w in self.pool.healthy():
            try:
                r = await self.client.get(f"{w.url}{path}", headers=headers)
            except httpx.TransportError:
                continue
            if r.status_code == 200:
                return w
        return None

    async def kept(self, request: Request, kind: str, kept_id: str, suffix: str = "") -> Response:
        """A call on a stored response (`GET`, `DELETE`, `POST .../cancel`, `GET .../input_items`) or a
        conversation (and its items), on the worker that keeps it; 404 when none does. `kind`: "responses" or
        "conversations"; `suffix`: the path after the id."""
        headers = {k: v for k, v in request.headers.items() if k in _FORWARD_HEADERS}
        owner = await self.owner(f"/v1/{kind}/{kept_id}", headers)
        if owner is None:
            what = "response" if kind == "responses" else "conversation"
            raise ApiError(404, f"no worker keeps a {what} with id {kept_id!r}", param=f"{what}_id", code="not_found")
        query = f"?{request.url.query}" if request.url.query else ""
        r = await self.client.request(request.method, f"{owner.url}/v1/{kind}/{kept_id}{suffix}{query}",
                                      content=await request.body() or None, headers=headers)
        return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))

    async def pooling(self, request: Request) -> Response:
        """An embedding model's request (embeddings, score, rerank) to the least-loaded worker, at its own path."""
        headers = {k: v for k, v in request.headers.items() if k in _FORWARD_HEADERS}
        info = RouteRequest(session=request.headers.get(self.config.session_header))
        return await self.forward(request.state.request_id, request.url.path, await request.body(), headers, False,
                                  info)

    async def passthrough(self, request: Request, method: str, path: str) -> Response:
        """A non-generation API call (models, tokenize) answered by any healthy worker."""
        workers = self.pool.healthy()
        if not workers:
            raise ApiError(503, "no healthy worker", code="no_healthy_worker", headers={"Retry-After": "1"})
        headers = {k: v for k, v in request.headers.items() if k in _FORWARD_HEADERS}
        raw = await request.body()
        for w in workers[: self.config.max_attempts]:
            try:
                r = await self.client.request(method, w.url + path, content=raw or None, headers=headers)
            except httpx.TransportError as e:
                self.pool.mark_failed(w, f"{path}: {type(e).__name__}")
                continue
            return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))
        raise ApiError(503, "no healthy worker answered", code="no_healthy_worker")

    async def joined_trace(self, request_id: str) -> list[dict[str, Any]] | None:
        """The router's records of a request joined with those of every worker it used, in time order."""
        mine = self.trace.get(request_id)
        if mine is None:
            return None
        urls = []
        for rec in mine:
            for key in ("picked", "worker", "prefill", "decode"):
                url = rec["data"].get(key)
                if isinstance(url, str) and url not in urls:
                    urls.append(url)
        records = list(mine)
        for url in urls:
            try:
                r = await self.client.get(f"{url}/v1/requests/{request_id}/trace", timeout=5.0)
            except httpx.HTTPError:
                continue
            if r.status_code == 200:
                for rec in r.json()["records"]:
                    records.append({**rec, "where": url})
        records.sort(key=lambda rec: rec["t"])
        return records
