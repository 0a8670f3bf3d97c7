"""The router's HTTP front: the OpenAI endpoints proxied through `router.router.Router`, plus
worker management (`/workers`), readiness, metrics and joined request traces.

Per generation request: the body is read once; the prompt's token ids are asked of a worker
(`POST /tokenize`) when the policy needs them and hashed into pages; a worker is picked; the body
goes to it unchanged with the same `X-Request-Id`; its answer comes back as is: a streamed answer
chunk by chunk, an error with its status and JSON.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from router.config import RouterConfig
from router.router import Router
from server.errors import ApiError

logger = logging.getLogger("jaxserve.router")


def _router(request: Request) -> Router:
    return request.app.state.router


async def chat_completions(request: Request) -> Response:
    """`POST /v1/chat/completions` through a picked worker."""
    return await _router(request).generate(request, "chat")


async def completions(request: Request) -> Response:
    """`POST /v1/completions` through a picked worker."""
    return await _router(request).generate(request, "completion")


async def responses(request: Request) -> Response:
    """`POST /v1/responses` through a picked worker."""
    return await _router(request).generate(request, "responses")


async def stored_response(request: Request) -> Response:
    """`GET` / `DELETE /v1/responses/{id}`, `POST /v1/responses/{id}/cancel` and `GET .../input_items` on the
    worker that stores the response."""
    response_id = request.path_params["response_id"]
    suffix = request.url.path.split(response_id, 1)[1]  # "", "/cancel" or "/input_items"
    return await _router(request).kept(request, "responses", response_id, suffix)


async def create_conversation(request: Request) -> Response:
    """`POST /v1/conversations` on a worker, which keeps the conversation."""
    return await _router(request).passthrough(request, "POST", request.url.path)


async def conversation(request: Request) -> Response:
    """A conversation's calls (read, update, delete; its items) on the worker that keeps it."""
    conversation_id = request.path_params["conversation_id"]
    suffix = request.url.path.split(conversation_id, 1)[1]  # "", "/items" or "/items/{item_id}"
    return await _router(request).kept(request, "conversations", conversation_id, suffix)


async def pooling(request: Request) -> Response:
    """`POST /v1/embeddings`, `/score`, `/rerank`, `/classify` through a picked worker."""
    return await _router(request).pooling(request)


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
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/v1/responses/{response_id}", stored_response, methods=["GET", "DELETE"]),
        Route("/v1/responses/{response_id}/cancel", stored_response, methods=["POST"]),
        Route("/v1/responses/{response_id}/input_items", stored_response, methods=["GET"]),
        Route("/v1/conversations", create_conversation, methods=["POST"]),
        Route("/v1/conversations/{conversation_id}", conversation, methods=["GET", "POST", "DELETE"]),
        Route("/v1/conversations/{conversation_id}/items", conversation, methods=["GET", "POST"]),
        Route("/v1/conversations/{conversation_id}/items/{item_id}", conversation, methods=["GET", "DELETE"]),
        *(Route(path, pooling, methods=["POST"]) for path in
          ("/v1/embeddings", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank", "/classify",
           "/v1/classify")),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", tokenize, methods=["POST"]),
        Route("/v1/requests/{request_id:path}/trace", request_trace, methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={ApiError: _api_error}, lifespan=lifespan)
    app.state.router = router
    app.add_middleware(_RequestId)
    return app
