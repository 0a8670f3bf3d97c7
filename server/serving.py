"""The generation endpoints: `/v1/chat/completions` and `/v1/completions`, streaming and not.

Each request goes: admission (ready, not draining) -> JSON checked (protocol.py) -> model name ->
prompt rendered and tokenized, lengths checked against the context -> queue limit (429) -> engine.
The first engine output is awaited before the response starts, so a request the engine refuses still
gets a JSON 400; after that, errors travel inside the SSE stream.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve.beam_search import BeamSearchParams
from jaxserve.engine.memory import EngineSleepingError
from jaxserve.engine.prompt_embeds import is_embeds
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams
from server.beam import beam_params
from server.chat_replies import ChatReplies
from server.errors import ApiError, sse_error
from server.fields import with_server_defaults
from server.generation import ClientDisconnected, Generation, Job, race_disconnect, wait_disconnect
from server.prompts import (
    check_request_template,
    echoed_text,
    fit_to_context,
    fitted_chat_prompt,
    read_images,
    truncated_ids,
)
from server.protocol import ChatRequest, CompletionRequest, parse_chat, parse_completion
from server.reasoning import constrained_throughout, reasoning_params, request_parser
from server.responses import (
    SSE_DONE,
    ChoiceCursor,
    TokenText,
    chat_logprobs,
    completion_logprobs,
    echo_logprobs,
    prompt_logprobs_json,
    sse,
)
from server.state import ServerState

logger = logging.getLogger("jaxserve.server")
# Rendering and tokenizing prompts longer than this many characters moves off the event loop.
_OFFLOAD_CHARS = 20_000


async def read_json(request: Request, max_bytes: int) -> Any:
    """The request body as JSON; 413 past `max_bytes`, 400 if it is not JSON."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise ApiError(413, f"the request body is {length} bytes; the limit is {max_bytes}",
                       code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise ApiError(413, f"the request body exceeds the limit of {max_bytes} bytes",
                           code="request_too_large")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise ApiError(400, "the request body is empty; send a JSON object", code="invalid_json")
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from e


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _log(request: Request) -> dict[str, Any]:
    return request.scope.setdefault("state", {}).setdefault("access", {})


def _request_id(request: Request) -> str:
    return request.scope["state"]["request_id"]


async def _offload(fn: Any, *args: Any, big: bool) -> Any:
    return await asyncio.to_thread(fn, *args) if big else fn(*args)


async def _chat_jobs(state: ServerState, req: ChatRequest, request_id: str, encode: bool = True) -> list[Job]:
    engine, tok = state.engine, state.tokenizer_for("a chat (its template renders text)")
    check_request_template(req, state.config.trust_request_chat_template)
    size = sum(len(str(m.get("content") or "")) for m in req.messages)
    spec = getattr(engine, "images", None)
    req, text, ids, images = await _offload(fitted_chat_prompt, tok, req, state.config.chat_template,
                                            engine.max_model_len, spec, big=size > _OFFLOAD_CHARS or req.drop_turns_to_fit)
    if images:
        ids, images = await read_images(spec, ids, images, encode)  # (not encoded ahead over imported KV)
    params = req.common.params
    if req.tool_choice is not None and req.tool_choice.mode == "auto":
        parser = state.tool_parser
        if parser is None:
            raise ApiError(400, "tool_choice 'auto' (the default with tools) needs the server started with "
                                "--enable-auto-tool-choice and --tool-call-parser; send 'required', a named "
                                "function, or 'none'", param="tool_choice", code="unsupported_parameter")
        if parser.keeps_special_tokens:  # the format's markers are special tokens the parser must see
            params = dataclasses.replace(params, skip_special_tokens=False)
    params = reasoning_params(request_parser(state.reasoning_parser, req), params)
    ids = truncated_ids(ids, params, engine.max_model_len)
    params = fit_to_context(engine.max_model_len, ids, params, max_tokens_given=req.common.max_tokens_given,
                            prompt_param="messages", cap=_defaults(state).get("max_tokens"))
    return [Job(state.engine_id(request_id), ids, text, params, _beam(req, params), images or None)]


async def _completion_jobs(state: ServerState, req: CompletionRequest, request_id: str) -> list[Job]:
    engine, tok, vocab, jobs = state.engine, state.engine.tokenizer, state.vocab_size(), []
    for i, prompt in enumerate(req.prompts):
        if isinstance(prompt, str):
            ids = await _offload(state.tokenizer_for("a text prompt").encode, prompt, req.common.add_special_tokens,
                                 big=len(prompt) > _OFFLOAD_CHARS)
            text = prompt
        elif is_embeds(prompt):  # (`prompt_embeds`, checked by the engine)
            ids, text = prompt, None
        else:
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise ApiError(400, f"token id {bad[0]} is outside the vocabulary (size {vocab})",
                               param="prompt", code="invalid_value")
            ids, text = list(prompt), None
        kept = truncated_ids(ids, req.common.params, engine.max_model_len)
        if len(kept) < len(ids):  # what is echoed is what the model reads
            ids, text = kept, None if text is None else tok.decode(kept, skip_special_tokens=False)
        params = fit_to_context(engine.max_model_len, ids, req.common.params, max_tokens_given=req.common.max_tokens_given,
                                prompt_param="prompt", cap=_defaults(state).get("max_tokens"))
        engine_id = request_id if len(req.prompts) == 1 else f"{request_id}-{i}"
        jobs.append(Job(state.engine_id(engine_id), ids, text, params, _beam(req, params)))
    return jobs


def _defaults(state: ServerState) -> dict[str, Any]:  # the model's sampling defaults (jaxserve.generation_config)
    return getattr(state.engine, "sampling_defaults", None) or {}


def _beam(req: ChatRequest | CompletionRequest, params: SamplingParams) -> BeamSearchParams | None:
    return beam_params(params, req.common.length_penalty) if req.common.use_beam_search else None


class EventStream(Response):
    """An SSE response that stops its producer (and so aborts the request) when the client leaves."""

    media_type = "text/event-stream"

    def __init__(self, producer: AsyncIterator[bytes]):
        # Not Response.__init__: it would announce `content-length: 0`.
        self.status_code = 200
        self.background = None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"),
                            (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
        self._producer = producer

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        pump = asyncio.ensure_future(self._pump(send))
        watcher = asyncio.ensure_future(wait_disconnect(receive))
        try:
            await asyncio.wait({pump, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not pump.done():
                pump.cancel()
            await asyncio.gather(pump, watcher, return_exceptions=True)

    async def _pump(self, send: Any) -> None:
        try:
            async for chunk in self._producer:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await self._producer.aclose()


Kind = Literal["chat", "completion"]


async def handle_generate(request: Request, kind: Kind, *, translate: Callable[[Any], Any] | None = None,
                          formatter: Callable[..., Any] | None = None,
                          prepare: Callable[[ChatRequest], ChatRequest] | None = None) -> Response:
    """The generation endpoints' shared body. Another API (server/openai_responses.py) gives `translate` (its body
    as a chat body), `prepare` (what it asks of the chat request beyond that) and `formatter` (its responses)."""
    state = _state(request)
    state.check_serving()
    arrival = time.time()
    body = await read_json(request, state.config.max_request_body_bytes)
    body = with_server_defaults(translate(body) if translate else body, state.config, _defaults(state))
    req = parse_chat(body) if kind == "chat" else parse_completion(body)
    if prepare is not None:
        req = prepare(req)
    lora = state.check_model(req.common.model)
    vocab = state.vocab_size()
    for name, ids in (("logit_bias", req.common.params.logit_bias),
                      ("allowed_token_ids", req.common.params.allowed_token_ids or ())):
        outside = sorted(t for t in ids if t >= vocab)
        if outside:
            raise ApiError(400, f"'{name}' token id {outside[0]} is outside the vocabulary (size {vocab})",
                           param=name, code="invalid_value")
    request_id = _request_id(request)
    jobs = await (_chat_jobs(state, req, request_id, not request.scope["state"].get("kv_imported")) if kind == "chat"
                  else _completion_jobs(state, req, request_id))
    state.admit(len(jobs))
    log = _log(request)
    gen = Generation(state, jobs, priority=req.common.priority, cache_salt=req.common.cache_salt,
                     arrival=arrival, log=log, lora=lora)
    fmt = (formatter or _Formatter)(state, req, kind, request_id, jobs)
    fmt.model = lora or fmt.model
    try:
        first = await race_disconnect(request.receive, gen.first())
        if getattr(fmt, "background", False):  # a background response: generates on after this returns
            response = fmt.start_background(gen)
            gen = None
            return JSONResponse(response)
        if req.common.stream:
            producer = _stream(gen, fmt, first)
            gen = None  # the stream owns it now
            return EventStream(producer)
        await race_disconnect(request.receive, gen.collect())
        return JSONResponse(fmt.full(gen))
    except ValueError as e:  # the engine refused the request before generating
        raise ApiError(400, str(e), code="invalid_request") from e
    except EngineSleepingError as e:  # it fell asleep after the request was admitted
        raise ApiError(503, str(e), code="engine_sleeping") from e
    except ClientDisconnected:
        log["disconnected"] = True
        return Response(status_code=499)
    finally:
        if gen is not None:
            await gen.close()


async def _stream(gen: Generation, fmt: _Formatter, first: tuple[int, RequestOutput]) -> AsyncIterator[bytes]:
    try:
        item: tuple[int, RequestOutput] | None = first
        while item is not None:
            for chunk in fmt.deltas(*item, gen):
                yield chunk
            try:
                item = await gen.next()
            except ValueError as e:
                yield fmt.error(400, str(e), "invalid_request")
                break
            except Exception as e:
                logger.exception("request %s failed in the engine", fmt.request_id)
                yield fmt.error(500, f"the engine failed while generating: {e}", "engine_error")
                break
        else:
            for chunk in fmt.closing(gen):
                yield chunk
        if fmt.done:
            yield fmt.done
    finally:
        await gen.close()


class _Formatter:
    """Builds the response objects of one request in the chat or completions shape."""

    done = SSE_DONE  # what ends a stream
    error = staticmethod(sse_error)  # an error inside a started stream

    def __init__(self, state: ServerState, req: ChatRequest | CompletionRequest, kind: Kind, request_id: str,
                 jobs: list[Job]):
        self.req, self.kind, self.request_id, self.jobs = req, kind, request_id, jobs
        self.model = state.model_name
        self.created = int(time.time())
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + request_id
        self.n = req.common.params.n
        self.top_n = req.common.params.logprobs or 0
        self.want_logprobs = req.common.params.logprobs is not None
        self.text_of = TokenText(state.engine.tokenizer, req.common.tokens_as_ids or state.engine.tokenizer is None)
        self.want_ids = req.common.return_token_ids
        self.cursors: dict[int, ChoiceCursor] = {}
        self.usage_field = req.common.stream_options.include_usage or req.common.stream_options.continuous_usage_stats
        self.echo = isinstance(req, CompletionRequest) and req.echo
        chat = isinstance(req, ChatRequest)
        self.echo_text = echoed_text(req) if chat else ""
        reasoning = request_parser(state.reasoning_parser, req)
        self.replies = ChatReplies(req.tool_choice if chat else None, state.tool_parser, reasoning,
                                   constrained=constrained_throughout(reasoning, req),
                                   include_reasoning=chat and req.include_reasoning,
                                   function_tools=req.tools if chat else None)

    def _envelope(self, choices: list[dict], gen: Generation | None = None) -> dict:
        obj = {"id": self.id, "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
               "created": self.created, "model": self.model, "choices": choices}
        if self.usage_field:
            opts = self.req.common.stream_options
            obj["usage"] = gen.usage() if opts.continuous_usage_stats and gen else None
        return obj

    def deltas(self, job: int, out: RequestOutput, gen: Generation) -> list[bytes]:
        """The SSE chunks for what `out` added to job `job`'s completions."""
        chunks = []
        for c in out.outputs:
            index = job * self.n + c.index
            cursor = self.cursors.setdefault(index, ChoiceCursor())
            first = not cursor.started
            if first and self.kind == "chat":
                cursor.started = True
                role = self._envelope([{"index": index, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}], gen)
                if self.want_ids and index == 0:  # the prompt's ids lead the stream, once
                    role["prompt_token_ids"] = self.jobs[job].token_ids
                chunks.append(sse(role))
                if self.echo_text:
                    chunks.append(sse(self._envelope([{"index": index, "delta": {"content": self.echo_text},
                                                       "logprobs": None, "finish_reason": None}], gen)))
            d = cursor.advance(c)
            if d is None:
                continue
            if self.kind == "chat":
                delta, finish = self.replies.delta(cursor, c, d)
                if not delta and finish is None and not self.want_logprobs and not self.want_ids:
                    continue  # a tool call, held back until it is whole (its tokens' ids and logprobs go out)
                choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
                if self.want_logprobs:
                    choice["logprobs"] = {"content": chat_logprobs(self.text_of, d.token_ids, d.logprobs,
                                                                   self.top_n)}
            else:
                text = d.text
                if first and self.echo:
                    cursor.started = True
                    text = (self.jobs[job].prompt_text or "") + text
                cursor.started = True
                choice = {"index": index, "text": text, "logprobs": None, "finish_reason": d.finish_reason}
                if self.want_ids and first:
                    choice["prompt_token_ids"] = self.jobs[job].token_ids
                if self.want_logprobs and first and self.echo:  # the prompt's logprobs lead the first chunk
                    choice["logprobs"], cursor.text_offset = echo_logprobs(
                        self.text_of, out, d.token_ids, d.logprobs, self.top_n)
                elif self.want_logprobs:
                    choice["logprobs"], cursor.text_offset = completion_logprobs(
                        self.text_of, d.token_ids, d.logprobs, self.top_n, cursor.text_offset)
            if d.finish_reason is not None:
                choice["stop_reason"] = d.stop_reason
            if self.want_ids:
                choice["token_ids"] = d.new_token_ids
            chunks.append(sse(self._envelope([choice], gen)))
        return chunks

    def closing(self, gen: Generation) -> list[bytes]:
        """What a finished stream ends with: a `choices: []` chunk with the request's usage, if asked."""
        if not self.req.common.stream_options.include_usage:
            return []
        obj = self._envelope([], gen)
        obj["usage"] = gen.usage()
        return [sse(obj)]

    def full(self, gen: Generation) -> dict:
        """The non-streaming response."""
        choices = []
        for job, out in enumerate(gen.latest):
            assert out is not None
            for c in out.outputs:
                choice: dict[str, Any] = {"index": job * self.n + c.index}
                lp = None
                finish = c.finish_reason
                if self.kind == "chat":
                    choice["message"], finish = self.replies.message(c)
                    if self.echo_text:
                        choice["message"]["content"] = self.echo_text + (choice["message"].get("content") or "")
                    if self.want_logprobs:
                        lp = {"content": chat_logprobs(self.text_of, c.token_ids, c.logprobs or [], self.top_n)}
                else:
                    choice["text"] = ((self.jobs[job].prompt_text or "") if self.echo else "") + c.text
                    if self.want_logprobs and self.echo:
                        lp, _ = echo_logprobs(self.text_of, out, c.token_ids, c.logprobs or [], self.top_n)
                    elif self.want_logprobs:
                        lp, _ = completion_logprobs(self.text_of, c.token_ids, c.logprobs or [], self.top_n, 0)
                    if self.req.common.prompt_logprobs is not None:
                        choice["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
                    if self.want_ids:
                        choice["prompt_token_ids"] = self.jobs[job].token_ids
                choice.update(logprobs=lp, finish_reason=finish, stop_reason=c.stop_reason)
                if self.want_ids:
                    choice["token_ids"] = list(c.token_ids)
                choices.append(choice)
        response = {"id": self.id, "object": "chat.completion" if self.kind == "chat" else "text_completion",
                    "created": self.created, "model": self.model, "choices": choices,
                    "usage": gen.usage()}
        if self.kind == "chat" and self.req.common.prompt_logprobs is not None:
            response["prompt_logprobs"] = prompt_logprobs_json(gen.latest[0].prompt_logprobs)
        if self.kind == "chat" and self.want_ids:
            response["prompt_token_ids"] = self.jobs[0].token_ids
        return response
