"""`POST /v1/embeddings`: OpenAI's embeddings API, with vLLM's extras, for a model run with `--runner pooling`.

`input` is a string, a list of strings, a list of token ids or a list of such lists (one embedding
each, in order), or, as vLLM also takes, `messages` rendered with the chat template. Extras:
`truncate_prompt_tokens` (keep the last N tokens), `add_special_tokens` (default true for `input`,
false for `messages`), `normalize`, `priority`. `encoding_format` "base64" sends each vector as
little-endian float32 bytes, as OpenAI's clients decode it.
"""

from __future__ import annotations

import base64
import dataclasses
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve.pooling_params import PoolingParams
from server.constraints import tools_and_choice
from server.errors import ApiError, bad_field
from server.generation import ClientDisconnected, Generation, Job, race_disconnect
from server.protocol import check_messages, check_prompts, get_bool, get_int, get_str
from server.serving import read_json
from server.trace import attach_tracer, summarize_request

_KNOWN = {"input", "messages", "model", "encoding_format", "dimensions", "user", "truncate_prompt_tokens",
          "add_special_tokens", "normalize", "priority", "chat_template_kwargs", "add_generation_prompt", "tools"}


def request_prompts(state: Any, body: Mapping[str, Any]) -> list[list[int]]:
    """Each input's token ids (a chat's rendered prompt for `messages`); 400 for any that cannot be embedded."""
    vocab = state.vocab_size()
    if ("input" in body) == ("messages" in body):
        raise bad_field("input", "send exactly one of 'input' and 'messages'", "missing_required_parameter")
    if "messages" in body:
        tools, _ = tools_and_choice({"tools": body.get("tools"), "tool_choice": "none"})
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, Mapping):
            raise bad_field("chat_template_kwargs", "'chat_template_kwargs' must be an object", "invalid_type")
        kwargs = {**state.config.default_chat_template_kwargs, **kwargs}
        tok = state.tokenizer_for("'messages'")
        try:
            text = tok.apply_chat_template(check_messages(body["messages"]), tools=tools,
                                           add_generation_prompt=get_bool(body, "add_generation_prompt", False),
                                           chat_template=state.config.chat_template, **kwargs)
        except (TypeError, ValueError) as e:
            raise ApiError(400, str(e), param="messages", code="invalid_messages") from e
        return [tok.encode(text, add_special_tokens=get_bool(body, "add_special_tokens", False))]
    special = get_bool(body, "add_special_tokens", True)
    out = []
    for i, item in enumerate(check_prompts(body["input"], "input")):
        ids = state.tokenizer_for("a text input").encode(item, add_special_tokens=special) if isinstance(item, str) \
            else list(item)
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise bad_field("input", f"input[{i}] has token id {bad[0]}, outside the vocabulary (size {vocab})")
        out.append(ids)
    return out


def request_pooling_params(body: Mapping[str, Any], max_model_len: int) -> PoolingParams:
    normalize = body.get("normalize")
    if normalize is not None and not isinstance(normalize, bool):
        raise bad_field("normalize", f"'normalize' must be a boolean, got {normalize!r}", "invalid_type")
    truncate = get_int(body, "truncate_prompt_tokens", None, -1)
    if truncate == 0:
        raise bad_field("truncate_prompt_tokens", "'truncate_prompt_tokens' must be -1 (the model's length) or >= 1")
    return PoolingParams(dimensions=get_int(body, "dimensions", None, 1), normalize=normalize,
                         truncate_prompt_tokens=max_model_len if truncate == -1 else truncate)


def fit_prompt(ids: list[int], params: PoolingParams, max_model_len: int, i: int, param: str = "input") -> list[int]:
    keep = params.truncate_prompt_tokens
    if keep is not None:
        if keep > max_model_len:
            raise bad_field("truncate_prompt_tokens", f"'truncate_prompt_tokens' {keep} exceeds the model's maximum "
                                                      f"context length {max_model_len}")
        ids = ids[-keep:]
    if len(ids) > max_model_len:
        raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens. However, {param}[{i}] has "
                            f"{len(ids)} tokens. Shorten it, or set truncate_prompt_tokens.", param=param,
                       code="context_length_exceeded")
    return ids


def _encode(vector: list[float], fmt: str) -> list[float] | str:
    return base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode() if fmt == "base64" else vector


class _Gone(Exception):
    """The client left before its vectors were ready."""


async def open_request(request: Request, known: set[str], kind: str) -> tuple[Any, dict[str, Any], float]:
    """(server state, checked JSON body, arrival time) of a pooling endpoint's request, recorded at L1."""
    state = request.app.state.server
    state.check_serving()
    arrival = time.time()
    body = await read_json(request, state.config.max_request_body_bytes)
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_type")
    unknown = sorted(set(body) - known)
    if unknown:
        raise bad_field(unknown[0], f"unknown field {unknown[0]!r} for {request.url.path}", "unknown_parameter")
    state.check_model(get_str(body, "model"))
    store = request.app.state.trace
    attach_tracer(store, state.engine)
    store.record(request.scope["state"]["request_id"], "L1", "received", summarize_request(kind, body))
    return state, body, arrival


async def embed_prompts(request: Request, state: Any, prompts: list[list[int]], params: PoolingParams,
                        priority: int, arrival: float) -> list[list[float]]:
    """The engine's vector for each prompt, in order; raises `_Gone` if the client disconnects."""
    outs = await pool_prompts(request, state, prompts, dataclasses.replace(params, task="embed"), priority, arrival)
    return [out.outputs.embedding for out in outs]


async def pool_prompts(request: Request, state: Any, prompts: list[list[int]], params: PoolingParams,
                       priority: int, arrival: float) -> list[Any]:
    """The engine's finished output for each prompt, in order; raises `_Gone` if the client disconnects."""
    request_id = request.scope["state"]["request_id"]
    jobs = [Job(state.engine_id(request_id if len(prompts) == 1 else f"{request_id}-{i}"), ids, None, params)
            for i, ids in enumerate(prompts)]
    state.admit(len(jobs))
    log = request.scope.setdefault("state", {}).setdefault("access", {})
    gen = Generation(state, jobs, priority=priority, cache_salt=None, arrival=arrival, log=log)
    try:
        outs = await race_disconnect(request.receive, gen.collect())
    except ValueError as e:  # the engine refused an input (or serves no embeddings)
        raise ApiError(400, str(e), code="invalid_request") from e
    except ClientDisconnected as e:
        log["disconnected"] = True
        raise _Gone() from e
    finally:
        await gen.close()
    return outs


def pooling_endpoint(handler: Any) -> Any:
    """`handler` with a client that left answered by a 499."""
    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request)
        except _Gone:
            return Response(status_code=499)
    endpoint.__doc__ = handler.__doc__
    return endpoint


@pooling_endpoint
async def embeddings(request: Request) -> Response:
    """`POST /v1/embeddings`."""
    state, body, arrival = await open_request(request, _KNOWN, "embedding")
    fmt = get_str(body, "encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise bad_field("encoding_format", f"'encoding_format' must be 'float' or 'base64', got {fmt!r}")
    max_len = state.engine.max_model_len
    params = request_pooling_params(body, max_len)
    prompts = [fit_prompt(ids, params, max_len, i) for i, ids in enumerate(request_prompts(state, body))]
    params = PoolingParams(params.dimensions, params.normalize)  # truncated here, where the token counts are known
    vectors = await embed_prompts(request, state, prompts, params, get_int(body, "priority", 0), arrival)
    n = sum(len(ids) for ids in prompts)
    return JSONResponse({
        "id": f"embd-{request.scope['state']['request_id']}", "object": "list", "created": int(arrival),
        "model": state.model_name,
        "data": [{"index": i, "object": "embedding", "embedding": _encode(v, fmt)} for i, v in enumerate(vectors)],
        "usage": {"prompt_tokens": n, "total_tokens": n},
    })
