"""Sleep mode and weight updates over HTTP, for reinforcement-learning rollouts (jaxserve.engine.memory):
vLLM's `POST /sleep?level=1`, `POST /wake_up?tags=weights&tags=kv_cache`, `GET /is_sleeping` and
`POST /reset_prefix_cache`, and SGLang's `POST /update_weights_from_disk` {"model_path": ...} and
`/flush_cache` (the prefix cache emptied, as `/reset_prefix_cache`).

All but the prefix cache's are served only by an engine started with `--enable-sleep-mode` (404 otherwise:
anyone who can reach the server could otherwise take its memory away or load files from its disk). Each
acts on every data-parallel replica, between engine steps; one that needs an idle engine is refused with
409 while requests are in flight. While the engine sleeps, generation requests get 503.
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve.engine.errors import EngineError
from jaxserve.engine.memory import EngineBusyError
from server.errors import ApiError, bad_field
from server.serving import read_json
from server.state import ServerState


def _enabled(state: ServerState, request: Request) -> None:
    state.check_serving()
    if not getattr(state.engine, "sleep_mode", False):
        raise ApiError(404, f"sleep mode is off; start the server with --enable-sleep-mode to serve "
                            f"{request.url.path}", code="not_found")


async def _on_engines(state: ServerState, fn: Any, timeout: float, param: str | None = None) -> list[Any]:
    """`fn(engine)` on every replica's engine thread; engine errors as API errors (`param` the field a
    refusal names)."""
    try:
        out = await asyncio.to_thread(state.engine.call_on_engine, fn, timeout)
    except EngineBusyError as e:
        raise ApiError(409, str(e), code="engine_busy") from e
    except (ValueError, EngineError) as e:
        raise ApiError(400, str(e), param=param, code="invalid_request") from e
    return out if isinstance(out, list) else [out]


async def sleep(request: Request) -> Response:
    state = request.app.state.server
    _enabled(state, request)
    raw = request.query_params.get("level", "1")
    if raw not in ("1", "2"):
        raise bad_field("level", f"'level' must be 1 or 2, not {raw!r}", "invalid_value")
    state.sleeping = True  # new requests get 503 from here on; those in flight make the engine refuse
    try:
        await _on_engines(state, lambda e: e.memory.sleep(int(raw)), timeout=600)
    except ApiError:
        state.sleeping = any(await _on_engines(state, lambda e: e.memory.asleep, timeout=60))
        raise
    return Response(status_code=200)


async def wake_up(request: Request) -> Response:
    state = request.app.state.server
    _enabled(state, request)
    tags = request.query_params.getlist("tags") or None
    try:
        await _on_engines(state, lambda e: e.memory.wake_up(tags), timeout=3600)
    finally:
        state.sleeping = any(await _on_engines(state, lambda e: e.memory.asleep, timeout=60))
    return Response(status_code=200)


async def is_sleeping(request: Request) -> Response:
    state = request.app.state.server
    _enabled(state, request)
    return JSONResponse({"is_sleeping": any(await _on_engines(state, lambda e: e.memory.asleep, timeout=60))})


async def update_weights_from_disk(request: Request) -> Response:
    """`{"model_path": PATH}` (null or absent: the served checkpoint, read again)."""
    state = request.app.state.server
    _enabled(state, request)
    body = await read_json(request, state.config.max_request_body_bytes)
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_type")
    path = body.get("model_path")
    if path is not None and not (isinstance(path, str) and path):
        raise bad_field("model_path", "'model_path' must be a path (a string)", "invalid_type")
    try:
        await _on_engines(state, lambda e: e.memory.load_weights(path), timeout=3600, param="model_path")
    finally:
        state.sleeping = any(await _on_engines(state, lambda e: e.memory.asleep, timeout=60))
    return JSONResponse({"success": True, "message": f"weights loaded from {path or 'the served checkpoint'}"})


async def reset_mm_cache(request: Request) -> Response:
    """vLLM's `/reset_mm_cache`: the embeddings kept of images seen before are forgotten."""
    state = request.app.state.server
    state.check_serving()
    await _on_engines(state, lambda e: e.images.clear_cache() if getattr(e, "images", None) else None, timeout=60)
    return Response(status_code=200)


async def reset_prefix_cache(request: Request) -> Response:
    state = request.app.state.server
    state.check_serving()
    if not all(await _on_engines(state, lambda e: e.reset_prefix_cache(), timeout=60)):
        raise ApiError(409, "the prefix cache has pages in use (a KV transfer); retry when it ends",
                       code="engine_busy")
    return Response(status_code=200)
