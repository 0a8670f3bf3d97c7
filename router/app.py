"""The router's HTTP front: the OpenAI endpoints proxied to a picked worker, plus worker management.

Per generation request: the body is read once; the prompt's token ids are asked of a worker
(`POST /tokenize`) when the policy needs them and hashed into pages; a worker is picked; the body
goes to it unchanged with the same `X-Request-Id`; its answer comes back as is: a streamed answer
chunk by chunk, an error with its status and JSON. A worker that cannot be reached, or answers
429/503 before anything was sent to the client, is skipped and the next pick is tried (an
unreachable one is also marked unhealthy), so a worker dying fails no request not yet started on it.
KV data never flows through the router (DESIGN.md, L2).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from jaxserve.engine.kv_events import hash_token_pages
from router.config import RouterConfig
from router.pd import Disaggregator
from router.policy import Decision, Picker, RouteRequest
from router.prefix_index import PrefixIndex
from router.workers import Worker, WorkerPool
from server.errors import ApiError, sse_error
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
        self.pool = WorkerPool(self.index, config.probe_interval_s)
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
        if not self.needs_tokens():
            return RouteRequest(session=session), None
        ids = await self.tokenize(kind, body, headers)
        if ids is None:
            return RouteRequest(session=session), None
        page_size = next((w.page_size for w in self.pool.healthy() if w.page_size), self.config.page_size)
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        # The engine caches prompt[:-1] (the last token is always computed), so hash that.
        hashes = tuple(hash_token_pages(ids[:-1], page_size, salt))
        return RouteRequest(hashes, len(ids), session), ids

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
        info, ids = await self.route_request(kind, body, headers, request.headers)
        path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        stream = bool(body.get("stream"))
        if self.pd.enabled:
            return await self.pd.generate(request_id, path, raw, body, headers, stream, info, ids)
        return await self.forward(request_id, path, raw, headers, stream, info)

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


def _router(request: Request) -> Router:
    return request.app.state.router


async def chat_completions(request: Request) -> Response:
    """`POST /v1/chat/completions` through a picked worker."""
    return await _router(request).generate(request, "chat")


async def completions(request: Request) -> Response:
    """`POST /v1/completions` through a picked worker."""
    return await _router(request).generate(request, "completion")


async def models(request: Request) -> Response:
    """`GET /v1/models` as a worker answers it."""
    return await _router(request).passthrough(request, "GET", request.url.path)


async def tokenize(request: Request) -> Response:
    """`POST /tokenize` / `/detokenize` as a worker answers it."""
    return await _router(request).passthrough(request, "POST", request.url.path)


async def health(request: Request) -> Response:
    """The router process answers."""
    return Response(status_code=200)


async def ready(request: Request) -> Response:
    """200 while at least one worker is healthy."""
    n = len(_router(request).pool.healthy())
    if n:
        return JSONResponse({"status": "ready", "healthy_workers": n})
    return JSONResponse({"status": "no_healthy_worker", "healthy_workers": 0}, status_code=503,
                        headers={"Retry-After": "1"})


async def metrics(request: Request) -> Response:
    """The router's Prometheus metrics."""
    return Response(generate_latest(_router(request).registry), media_type=CONTENT_TYPE_LATEST)


async def workers(request: Request) -> Response:
    """`GET /workers` lists; `POST {"url", "role"}` registers; `DELETE {"url"}` (or `?url=`) deregisters."""
    router = _router(request)
    if request.method == "GET":
        return JSONResponse({"workers": [w.to_json() for w in router.pool.workers.values()]})
    body: dict[str, Any] = {}
    raw = await request.body()
    if raw.strip():
        try:
            body = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ApiError(400, f"not JSON: {e}", code="invalid_json") from e
    url = body.get("url") or request.query_params.get("url")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ApiError(400, "'url' must be the worker's http(s) URL", param="url")
    if request.method == "DELETE":
        if not router.pool.deregister(url):
            raise ApiError(404, f"no worker {url}", code="not_found")
        return JSONResponse({"deregistered": url.rstrip("/")})
    role = body.get("role", "both")
    if role not in ("both", "prefill", "decode"):
        raise ApiError(400, "'role' must be both, prefill or decode", param="role")
    w = router.pool.register(url, role)
    await router.pool.probe(w)
    return JSONResponse({"registered": w.to_json()})


async def request_trace(request: Request) -> Response:
    """`GET /v1/requests/{id}/trace`: the router's records joined with the workers'."""
    request_id = request.path_params["request_id"]
    records = await _router(request).joined_trace(request_id)
    if records is None:
        raise ApiError(404, f"no trace of request {request_id!r} (unknown, or too old)", code="not_found")
    return JSONResponse({"request_id": request_id, "records": records})


class _RequestId:
    """Assigns `X-Request-Id` (the client's, if printable and short) and echoes it."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or []).get(b"x-request-id", b"").decode("latin-1")
        request_id = given if given and len(given) <= 256 and given.isprintable() else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        start = time.perf_counter()

        async def send_with_id(message: Any) -> None:
            if message["type"] == "http.response.start":
                names = {k.lower() for k, _ in message.get("headers", [])}
                if b"x-request-id" not in names:
                    message = {**message, "headers": [*message.get("headers", []),
                                                       (b"x-request-id", request_id.encode("latin-1"))]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            logger.debug("%s %s %s %.4fs", request_id, scope.get("method"), scope.get("path"),
                         time.perf_counter() - start)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return exc.response()


def build_router_app(config: RouterConfig) -> Starlette:
    """The router's ASGI app; the worker probes run for the app's lifespan."""
    router = Router(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/workers", workers, methods=["GET", "POST", "DELETE"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", models, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", tokenize, methods=["POST"]),
        Route("/v1/requests/{request_id:path}/trace", request_trace, methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={ApiError: _api_error}, lifespan=lifespan)
    app.state.router = router
    app.add_middleware(_RequestId)
    return app
