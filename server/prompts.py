"""Prompts and the context: a chat request's prompt (its conversation rendered by the chat template), the
room a prompt leaves for the completion, and the Responses API's truncation "auto", which drops a
conversation's oldest turns until its prompt fits."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from jaxserve.engine.admission import truncated_prompt
from jaxserve.sampling_params import SamplingParams
from server.errors import ApiError
from server.protocol import ChatRequest
from server.responses_input import drop_oldest_turns


def fit_to_context(max_model_len: int, ids: list[int], params: SamplingParams, *, max_tokens_given: bool,
                   prompt_param: str, cap: int | None = None) -> SamplingParams:
    """`params` with max_tokens set to fit the context, and at most `cap` (the model's generation config's
    `max_new_tokens`, as vLLM caps it); 400 with the numbers if the request cannot fit."""
    n = len(ids)
    if n >= max_model_len:
        raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens. However, your "
                            f"prompt has {n} tokens, which leaves no room for the completion.",
                       param=prompt_param, code="context_length_exceeded")
    room = max_model_len - n
    want = params.max_tokens
    if want is not None and want > room and max_tokens_given:
        raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                            f"requested {n + want} tokens ({n} in the prompt, {want} for the completion). "
                            f"Reduce the prompt or max_tokens.", param="max_tokens",
                       code="context_length_exceeded")
    fit = min(room, cap or room, want or room)
    if fit != want:
        try:
            return dataclasses.replace(params, max_tokens=fit)
        except ValueError as e:  # min_tokens no longer fits
            raise ApiError(400, f"min_tokens does not fit the context: {e}", param="min_tokens") from e
    return params


def echoed_text(req: ChatRequest) -> str:
    """vLLM's chat `echo`: the final message's text when it is the reply's role (the assistant's), else ""."""
    last = req.messages[-1]
    if not req.echo or last.get("role") != "assistant":
        return ""
    content = last.get("content") or ""
    return content if isinstance(content, str) else "\n".join(p["text"] for p in content)


def truncated_ids(ids: list[int], params: SamplingParams, max_model_len: int) -> list[int]:
    """The prompt's last `truncate_prompt_tokens` tokens (vLLM's field), or all of it."""
    try:
        return truncated_prompt(ids, params, max_model_len)
    except ValueError as e:
        raise ApiError(400, str(e), param="truncate_prompt_tokens", code="invalid_value") from e


def check_request_template(req: ChatRequest, trusted: bool) -> None:
    """A 400 for a request that gives its own chat template to a server not started with
    `--trust-request-chat-template` (vLLM's flag)."""
    given = "chat_template" if req.chat_template is not None else (
        "chat_template_kwargs" if "chat_template" in req.chat_template_kwargs else None)
    if given is not None and not trusted:
        raise ApiError(400, f"a chat template given in '{given}' needs the server started with "
                            "--trust-request-chat-template", param=given, code="unsupported_parameter")


def chat_prompt(tokenizer: Any, req: ChatRequest, template: str | None,
                images: Any = None) -> tuple[str, list[int], list[Any]]:
    """The request's conversation rendered by the chat template (`template`, else the tokenizer's), its ids, and
    its images' sources in order; with `images` (an image-text engine's `multimodal.ImageSpec`), image parts are
    taken (their placeholders not yet expanded: `read_images`)."""
    found: list[Any] | None = [] if images is not None else None
    try:
        kwargs = dict(req.chat_template_kwargs)
        if req.documents is not None:
            kwargs["documents"] = req.documents
        if found is not None:
            kwargs.update(images=found, image_placeholder=images.placeholder,
                          video_placeholder=images.video_placeholder)
        text = tokenizer.apply_chat_template(req.messages, add_generation_prompt=req.add_generation_prompt,
                                             tools=req.tools, chat_template=req.chat_template or template,
                                             continue_final_message=req.continue_final_message, **kwargs)
        ids = tokenizer.encode(text, add_special_tokens=req.common.add_special_tokens)
        if found:
            images.check_count(found)
    except TypeError as e:
        raise ApiError(400, f"chat_template_kwargs not accepted: {e}", param="chat_template_kwargs") from e
    except ValueError as e:  # ChatTemplateError included: the template refused the conversation
        raise ApiError(400, str(e), param="messages", code="invalid_messages") from e
    return text, ids, found or []


def prompt_fits(max_model_len: int, ids: list[int], req: ChatRequest) -> bool:
    """Whether `fit_to_context` takes a prompt of `ids` for this request."""
    try:
        fit_to_context(max_model_len, ids, req.common.params, max_tokens_given=req.common.max_tokens_given,
                       prompt_param="messages")
    except ApiError:
        return False
    return True


def drop_turns_to_fit(tokenizer: Any, req: ChatRequest, template: str | None, max_model_len: int,
                      images: Any = None) -> tuple[ChatRequest, str, list[int], list[Any]]:
    """`req` without the fewest oldest turns that let its prompt fit (`drop_oldest_turns`), and that prompt (as
    `chat_prompt` gives it)."""
    def fits(messages: list[dict[str, Any]]) -> bool:
        return prompt_fits(max_model_len, chat_prompt(tokenizer, dataclasses.replace(req, messages=messages),
                                                      template, images)[1], req)

    req = dataclasses.replace(req, messages=drop_oldest_turns(req.messages, fits))
    return (req, *chat_prompt(tokenizer, req, template, images))


def fitted_chat_prompt(tokenizer: Any, req: ChatRequest, template: str | None, max_model_len: int,
                       images: Any = None) -> tuple[ChatRequest, str, list[int], list[Any]]:
    """The request (without its oldest turns, under the Responses API's truncation "auto" when the whole does not
    fit) and its prompt, as `chat_prompt` gives it."""
    text, ids, found = chat_prompt(tokenizer, req, template, images)
    if req.drop_turns_to_fit and not prompt_fits(max_model_len, ids, req):
        return drop_turns_to_fit(tokenizer, req, template, max_model_len, images)
    return req, text, ids, found


async def read_images(spec: Any, ids: list[int], sources: list[Any],
                      encode: bool = True) -> tuple[list[int], list[Any]]:
    """A chat's images read (fetched, decoded) off the event loop (`multimodal.ImageSpec.load`; `encode`: encoded
    ahead too, for a request that will run), and its prompt with their placeholders expanded (an image's tokens
    may depend on its size); 400 naming what is wrong with one."""
    try:
        images = await asyncio.to_thread(spec.load, sources, encode)
    except ValueError as e:
        raise ApiError(400, str(e), param="messages", code="invalid_image") from e
    try:
        return spec.expanded(ids, images), images
    except ValueError as e:
        raise ApiError(400, str(e), param="messages", code="invalid_messages") from e
