"""The Starlette application: routes, error handlers, and the middleware around them."""

from __future__ import annotations

import json
import logging
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from server.classify import classify
from server.config import ServerConfig
from server.conversations import conversation_routes, list_page
from server.embeddings import embeddings
from server.errors import ApiError
from server.fields import with_server_defaults
from server.kv_feed import KVEventFeed, kv_events
from server.lora_admin import load_lora_adapter, unload_lora_adapter
from server.middleware import ApiMiddleware
from server.openai_responses import responses_api
from server.pd import PDWorker, pd_ack_kv, pd_info, pd_prefill, pd_send_kv
from server.prompts import chat_prompt, check_request_template, read_images
from server.protocol import get_bool, get_str, parse_chat
from server.scores import rerank, score
from server.serving import handle_generate, read_json
from server.sleep_admin import (
    is_sleeping,
    reset_mm_cache,
    reset_prefix_cache,
    sleep,
    update_weights_from_disk,
    wake_up,
)
from server.state import ServerState
from server.trace import TraceStore, attach_tracer, request_trace, summarize_request

logger = logging.getLogger("jaxserve.server")
VERSION = "0.1.0"


def _state(request: Request) -> ServerState:
    return request.app.state.server


async def health(request: Request) -> Response:
    """Alive: the process answers HTTP."""
    return Response(status_code=200)


async def ready(request: Request) -> Response:
    """200 once weights are loaded and warmup is done, 503 before that and while draining."""
    state = _state(request)
    if state.draining:
        status = "draining"
    elif not state.engine.is_ready:
        status = "loading"
    else:
        return JSONResponse({"status": "ready"})
    return JSONResponse({"status": status}, status_code=503,
                        headers={"Retry-After": str(state.config.retry_after_s)})


async def metrics(request: Request) -> Response:
    """Prometheus text exposition."""
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def version(request: Request) -> Response:
    """The server's version."""
    return JSONResponse({"version": VERSION})


async def models(request: Request) -> Response:
    """`GET /v1/models`: every served name of the one loaded model."""
    state = _state(request)
    cards = [_model_card(state, n) for n in state.served_names]
    cards += [_model_card(state, n, lora=p) for n, p in state.lora_modules.items()]
    return JSONResponse({"object": "list", "data": cards})


async def model(request: Request) -> Response:
    """`GET /v1/models/{model}`."""
    state = _state(request)
    name = request.path_params["model"]
    lora = state.check_model(name)
    return JSONResponse(_model_card(state, name, lora=state.lora_modules[lora] if lora else None))


def _model_card(state: ServerState, name: str, lora: str | None = None) -> dict[str, Any]:
    """A served name's card; a LoRA adapter's (`lora`: its path) has the base model as its parent. A LongRoPE
    model served past its original context names that context (`long_rope_context`), past which prompts are
    cached in a namespace of their own (`jaxserve.rope.prompt_cache_salt`): a prefix-aware router hashes them so."""
    card = {"id": name, "object": "model", "created": state.created, "owned_by": "jaxserve",
            "root": lora or state.engine.model_name, "parent": state.model_name if lora else None,
            "max_model_len": state.engine.max_model_len}
    long_rope = getattr(state.engine, "long_rope_context", None)
    return card | {"long_rope_context": long_rope} if long_rope else card


async def _traced_generate(request: Request, kind: str, **api: Any) -> Response:
    """Record the request's L1 view in its trace, then serve it (`api`: another API's translation into chat)."""
    state = _state(request)
    state.check_serving()
    # Read (and size-check) the body once here; handle_generate reads the cached copy.
    body = await read_json(request, state.config.max_request_body_bytes)
    request._body = json.dumps(body).encode()
    store: TraceStore = request.app.state.trace
    attach_tracer(store, state.engine)
    request_id = request.scope["state"]["request_id"]
    store.record(request_id, "L1", "received", summarize_request(kind, body))
    pd: PDWorker = request.app.state.pd
    imported = await pd.import_for(request, request_id)  # a disaggregated request's prompt KV
    request.scope["state"]["kv_imported"] = imported is not None  # its images' tokens need no encoding
    try:
        return await handle_generate(request, "chat" if kind == "responses" else kind, **api)
    finally:
        if imported is not None:
            await pd.release_import(imported)


async def chat_completions(request: Request) -> Response:
    """`POST /v1/chat/completions`."""
    return await _traced_generate(request, "chat")


async def completions(request: Request) -> Response:
    """`POST /v1/completions`."""
    return await _traced_generate(request, "completion")


async def responses(request: Request) -> Response:
    """`POST /v1/responses` (OpenAI's Responses API)."""
    state = _state(request)
    return await _traced_generate(request, "responses", **responses_api(state.responses, state.conversations))


def _stored_response_id(request: Request) -> str:
    """The id of a stored response named by the path; 404 when none is stored under it."""
    response_id = request.path_params["response_id"]
    if _state(request).responses.get(response_id) is None:
        raise ApiError(404, f"no stored response with id {response_id!r}", param="response_id", code="not_found")
    return response_id


async def stored_response(request: Request) -> Response:
    """`GET /v1/responses/{id}`: a stored response, as it was returned."""
    return JSONResponse(_state(request).responses.get(_stored_response_id(request)).response)


async def response_input_items(request: Request) -> Response:
    """`GET /v1/responses/{id}/input_items`: a stored response's input items, a page at a time as OpenAI lists
    them (`limit` 1-100, default 20; `order` desc by default; `after` an item id)."""
    stored = _state(request).responses.get(_stored_response_id(request))
    return JSONResponse(list_page(stored.input_items, request, "desc"))


async def cancel_response(request: Request) -> Response:
    """`POST /v1/responses/{id}/cancel`: stop a background response in progress; the response, cancelled."""
    response_id = _stored_response_id(request)
    store = _state(request).responses
    if not await store.stop(response_id):
        status = store.get(response_id).response["status"]
        raise ApiError(400, f"response {response_id!r} is {status}: only a background response in progress can be "
                            "cancelled", param="response_id", code="invalid_value")
    return JSONResponse(store.get(response_id).response)


async def delete_response(request: Request) -> Response:
    """`DELETE /v1/responses/{id}`: forget a stored response (continuing from it is refused afterwards); one
    still generating in the background is stopped first."""
    response_id = _stored_response_id(request)
    await _state(request).responses.stop(response_id)
    _state(request).responses.delete(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


async def tokenize(request: Request) -> Response:
    """`POST /tokenize`: a prompt or a chat (`messages`) to token ids, as vLLM answers it."""
    state = _state(request)
    state.check_serving()
    body = await read_json(request, state.config.max_request_body_bytes)
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_type")
    state.check_model(get_str(body, "model"))
    tok = state.tokenizer_for("/tokenize")
    if "messages" in body:  # rendered exactly as a chat request's prompt (the same fields, the same checks)
        body = with_server_defaults(body, state.config)
        req = parse_chat({**body, "tool_choice": "none"} if body.get("tools") else body)
        check_request_template(req, state.config.trust_request_chat_template)
        spec = getattr(state.engine, "images", None)
        _, ids, images = chat_prompt(tok, req, state.config.chat_template, spec)
        if images:  # as a chat's prompt: each placeholder as its image's tokens
            ids, _ = await read_images(spec, ids, images, encode=False)
    else:
        prompt = get_str(body, "prompt")
        if prompt is None:
            raise ApiError(400, "'prompt' or 'messages' is required", param="prompt",
                           code="missing_required_parameter")
        ids = tok.encode(prompt, add_special_tokens=get_bool(body, "add_special_tokens", True))
    out: dict[str, Any] = {"count": len(ids), "max_model_len": state.engine.max_model_len, "tokens": ids}
    if get_bool(body, "return_token_strs", False):
        out["token_strs"] = [tok.id_to_token(i) for i in ids]
    return JSONResponse(out)


async def detokenize(request: Request) -> Response:
    """`POST /detokenize`: token ids back to text."""
    state = _state(request)
    state.check_serving()
    body = await read_json(request, state.config.max_request_body_bytes)
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_type")
    state.check_model(get_str(body, "model"))
    ids = body.get("tokens")
    tok = state.tokenizer_for("/detokenize")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ApiError(400, "'tokens' must be a list of token ids", param="tokens", code="invalid_type")
    bad = [t for t in ids if not 0 <= t < tok.vocab_size]
    if bad:
        raise ApiError(400, f"token id {bad[0]} is outside the vocabulary (size {tok.vocab_size})",
                       param="tokens", code="invalid_value")
    return JSONResponse({"prompt": tok.decode(ids, skip_special_tokens=False)})


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    message = {404: f"no route {request.url.path}",
               405: f"method {request.method} not allowed on {request.url.path}"}.get(exc.status_code, exc.detail)
    return ApiError(exc.status_code, message, code="not_found" if exc.status_code == 404 else None,
                    headers=dict(exc.headers or {})).response()


async def _internal_error(request: Request, exc: Exception) -> Response:
    logger.error("internal error on %s", request.url.path, exc_info=exc)
    return ApiError(500, f"internal server error: {type(exc).__name__}", code="internal_error").response()


def build_app(engine: Any, config: ServerConfig | None = None, state: ServerState | None = None) -> Starlette:
    """The OpenAI-compatible app over `engine` (anything with `AsyncEngine`'s interface)."""
    config = config or ServerConfig()
    state = state or ServerState(engine, config)
    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/ping", health, methods=["GET", "POST"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        *conversation_routes(),
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/v1/responses/{response_id}", stored_response, methods=["GET"]),
        Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"]),
        Route("/v1/responses/{response_id}/cancel", cancel_response, methods=["POST"]),
        Route("/v1/responses/{response_id}/input_items", response_input_items, methods=["GET"]),
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"]),
        Route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"]),
        *(Route(path, score, methods=["POST"]) for path in ("/score", "/v1/score")),
        *(Route(path, classify, methods=["POST"]) for path in ("/classify", "/v1/classify")),
        *(Route(path, rerank, methods=["POST"]) for path in ("/rerank", "/v1/rerank", "/v2/rerank")),
        Route("/sleep", sleep, methods=["POST"]),
        Route("/wake_up", wake_up, methods=["POST"]),
        Route("/is_sleeping", is_sleeping, methods=["GET"]),
        Route("/update_weights_from_disk", update_weights_from_disk, methods=["POST"]),
        Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"]),
        Route("/flush_cache", reset_prefix_cache, methods=["GET", "POST"]),  # SGLang's name
        Route("/reset_mm_cache", reset_mm_cache, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/v1/kv_events", kv_events, methods=["GET"]),
        Route("/v1/requests/{request_id:path}/trace", request_trace, methods=["GET"]),
        Route("/v1/pd/info", pd_info, methods=["GET"]),
        Route("/v1/pd/prefill", pd_prefill, methods=["POST"]),
        Route("/v1/pd/kv/{transfer_id}", pd_send_kv, methods=["GET"]),
        Route("/v1/pd/kv/{transfer_id}", pd_ack_kv, methods=["DELETE"]),
    ]
    app = Starlette(routes=routes, exception_handlers={ApiError: _api_error, HTTPException: _http_error,
                                                       Exception: _internal_error})
    app.state.server = state
    app.state.trace = TraceStore("worker")
    app.state.kv_feed = KVEventFeed()
    app.state.pd = PDWorker(state, app.state.trace)
    app.add_middleware(ApiMiddleware, state=state)
    # CORS outermost: a browser's preflight is answered before the API key is asked for.
    app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                       allow_credentials=config.allow_credentials, allow_methods=list(config.allowed_methods),
                       allow_headers=list(config.allowed_headers))
    return app
