"""L0 -> L1: the OpenAI request JSON, checked field by field and normalized.

`parse_chat` and `parse_completion` turn a decoded JSON body into a `ChatRequest` or
`CompletionRequest`, raising `ApiError(400)` that names the offending field (`param`) for anything
malformed, out of range or unsupported. Sampling fields (OpenAI's and vLLM's extras) become one
`SamplingParams`. Tokenizing and length checks need the model, so they happen later (serving.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from jaxserve.chat_template import compile_chat_template
from jaxserve.sampling_params import MAX_LOGPROBS, SamplingParams
from jaxserve.structured_outputs import StructuredOutputsParams
from server.beam import check_beam_request
from server.constraints import ToolChoice, structured_outputs, tool_call_schema, tools_and_choice
from server.errors import ApiError, bad_field
from server.fields import UNSET as _UNSET
from server.fields import field as _get
from server.fields import get_bool, get_int, get_number, get_str
from server.fields import int_list as _int_list
from server.fields import logit_bias as _logit_bias
from server.fields import stop as _stop
from server.fields import str_list as _str_list

MAX_N = 128
# Fields that change what a client gets back and that jaxserve cannot honour: refused, not ignored.
_REFUSED = ("audio", "functions", "function_call")
# vLLM's hooks into code this server does not have (custom logits processors and their arguments, its KV
# connectors, arguments to its multimodal processors): refused when they ask for something.
_REFUSED_NONEMPTY = ("logits_processors", "vllm_xargs", "kv_transfer_params", "mm_processor_kwargs")


@dataclass(frozen=True)
class StreamOptions:
    """`stream_options`: a final usage chunk, and (vLLM) usage on every chunk."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


@dataclass(frozen=True)
class CommonFields:
    """What chat and completions requests share once checked."""

    model: str | None
    params: SamplingParams
    max_tokens_given: bool
    stream: bool
    stream_options: StreamOptions
    priority: int
    cache_salt: str | None
    add_special_tokens: bool
    prompt_logprobs: int | None = None  # vLLM's `prompt_logprobs`, when the request gave it
    use_beam_search: bool = False  # vLLM's: `n` beams, ranked with `length_penalty` (server/beam.py)
    length_penalty: float = 1.0
    return_token_ids: bool = False  # vLLM's: the prompt's and each completion's token ids in the response
    tokens_as_ids: bool = False  # vLLM's `return_tokens_as_token_ids`: logprobs' tokens as "token_id:N"


@dataclass(frozen=True)
class ChatRequest:
    """A checked `/v1/chat/completions` body."""

    common: CommonFields
    messages: list[dict[str, Any]]
    logprobs: bool
    add_generation_prompt: bool
    continue_final_message: bool
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    tools: list[dict[str, Any]] | None = None  # function tools, for the chat template
    tool_choice: ToolChoice | None = None  # None: the reply is text (no tools, or tool_choice 'none')
    include_reasoning: bool = True  # with a reasoning parser: return the reasoning (vLLM's field)
    chat_template: str | None = None  # the request's own template (vLLM's; `--trust-request-chat-template`)
    documents: list[dict[str, Any]] | None = None  # for the chat template (retrieval-augmented models)
    echo: bool = False  # vLLM's: a final message of the reply's role leads the reply's content
    drop_turns_to_fit: bool = False  # the Responses API's truncation "auto" (server/responses_input.py)


@dataclass(frozen=True)
class CompletionRequest:
    """A checked `/v1/completions` body; `prompts` holds strings, token id lists or embeddings ([N, E] arrays from
    `prompt_embeds`, before the others)."""

    common: CommonFields
    prompts: list[Any]
    echo: bool


def _refuse_unsupported(body: Mapping[str, Any]) -> None:
    for name in _REFUSED:
        if body.get(name) not in (None, _UNSET):
            raise bad_field(name, f"'{name}' is not supported by this server", "unsupported_parameter")
    for name in _REFUSED_NONEMPTY:
        if body.get(name):
            hint = " per request (the server's --mm-processor-kwargs sets them)" if name == "mm_processor_kwargs" else ""
            raise bad_field(name, f"'{name}' is not supported by this server{hint}", "unsupported_parameter")
    suffix = body.get("suffix")
    if suffix:
        raise bad_field("suffix", "'suffix' is not supported by this server", "unsupported_parameter")


def _common(body: Mapping[str, Any], *, logprobs: int | None, max_tokens_names: tuple[str, ...],
            max_tokens_default: int | None, forced: StructuredOutputsParams | None = None,
            prompt_logprobs: int | None = None) -> CommonFields:
    """The shared fields; `forced` is the output constraint of a forced tool call; `prompt_logprobs`
    the least the request needs (vLLM's `prompt_logprobs` field may ask for more)."""
    _refuse_unsupported(body)
    asked = get_int(body, "prompt_logprobs", None, 0, MAX_LOGPROBS)
    if asked is not None and get_bool(body, "stream", False):
        raise bad_field("prompt_logprobs", "'prompt_logprobs' is not supported with 'stream' (use echo with logprobs "
                                           "on /v1/completions)", "unsupported_parameter")
    if asked is not None or prompt_logprobs is not None:
        prompt_logprobs = max(asked or 0, prompt_logprobs or 0)
    structured = structured_outputs(body)
    if forced is not None:
        if structured is not None:
            raise bad_field("tool_choice", "a forced tool call cannot be combined with another output constraint "
                                           "(response_format, structured_outputs or guided_*)")
        structured = forced
    model = get_str(body, "model")
    n = get_int(body, "n", 1, 1, MAX_N)
    best_of = get_int(body, "best_of", None, 1)
    if best_of is not None and best_of != n:
        raise bad_field("best_of", "'best_of' other than n is not supported by this server", "unsupported_parameter")
    max_tokens, given = max_tokens_default, False
    for name in max_tokens_names:  # the first one given wins (max_completion_tokens over max_tokens)
        value = get_int(body, name, None, 1)
        if value is not None:
            max_tokens, given = value, True
            break
    top_k = get_int(body, "top_k", 0, -1)
    min_tokens = get_int(body, "min_tokens", 0, 0)
    if max_tokens is not None and min_tokens > max_tokens:
        raise bad_field("min_tokens", f"'min_tokens' ({min_tokens}) must be <= max_tokens ({max_tokens})")
    ranges = {"temperature": (0.0, None), "top_p": (0.0, 1.0), "min_p": (0.0, 1.0),
              "presence_penalty": (-2.0, 2.0), "frequency_penalty": (-2.0, 2.0)}
    defaults = {"temperature": 1.0, "top_p": 1.0, "min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
    floats = {}
    for name, (lo, hi) in ranges.items():
        v = get_number(body, name, defaults[name])
        if v < lo or (hi is not None and v > hi) or (name == "top_p" and v == 0):
            bounds = "in (0, 1]" if name == "top_p" else f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
            raise bad_field(name, f"'{name}' must be {bounds}, got {v}")
        floats[name] = v
    rep = get_number(body, "repetition_penalty", 1.0)
    if rep <= 0:
        raise bad_field("repetition_penalty", f"'repetition_penalty' must be > 0, got {rep}")
    seed = get_int(body, "seed", None, -(2**63), 2**64 - 1)
    stream = get_bool(body, "stream", False)
    opts = _get(body, "stream_options")
    options = StreamOptions()
    if opts is not _UNSET and opts is not None:
        if not stream:
            raise bad_field("stream_options", "'stream_options' is only allowed when 'stream' is true")
        if not isinstance(opts, Mapping):
            raise bad_field("stream_options", "'stream_options' must be an object", "invalid_type")
        options = StreamOptions(get_bool(opts, "include_usage", False),
                                get_bool(opts, "continuous_usage_stats", False))
    try:
        params = SamplingParams(
            n=n, temperature=floats["temperature"], top_p=floats["top_p"], top_k=top_k, min_p=floats["min_p"],
            repetition_penalty=rep, presence_penalty=floats["presence_penalty"],
            frequency_penalty=floats["frequency_penalty"], seed=seed, stop=_stop(body),
            stop_token_ids=_int_list(body, "stop_token_ids"), ignore_eos=get_bool(body, "ignore_eos", False),
            max_tokens=max_tokens, min_tokens=min_tokens, logprobs=logprobs,
            skip_special_tokens=get_bool(body, "skip_special_tokens", True),
            include_stop_str_in_output=get_bool(body, "include_stop_str_in_output", False),
            logit_bias=_logit_bias(body), structured_outputs=structured, prompt_logprobs=prompt_logprobs,
            allowed_token_ids=_int_list(body, "allowed_token_ids") if _get(body, "allowed_token_ids") not in (
                _UNSET, None) else None, bad_words=_str_list(body, "bad_words"),
            truncate_prompt_tokens=get_int(body, "truncate_prompt_tokens", None, -1), prediction=_prediction(body))
    except ValueError as e:  # a check we do not repeat above; SamplingParams names the field first
        raise bad_field(str(e).split(" ", 1)[0], str(e)) from e
    use_beam_search, length_penalty = get_bool(body, "use_beam_search", False), get_number(body, "length_penalty", 1.0)
    if use_beam_search:
        check_beam_request(body, params, length_penalty)
    elif length_penalty != 1.0:
        raise bad_field("length_penalty", "'length_penalty' applies only with use_beam_search")
    return CommonFields(
        model=model, params=params, max_tokens_given=given, stream=stream, stream_options=options,
        priority=get_int(body, "priority", 0), cache_salt=get_str(body, "cache_salt"),
        add_special_tokens=get_bool(body, "add_special_tokens", False), prompt_logprobs=asked,
        use_beam_search=use_beam_search, length_penalty=length_penalty,
        return_token_ids=get_bool(body, "return_token_ids", False),
        tokens_as_ids=get_bool(body, "return_tokens_as_token_ids", False))


def _prediction(body: Mapping[str, Any]) -> str | None:
    """OpenAI's predicted output, `{"type": "content", "content": text or [text parts]}`: its text."""
    p = _get(body, "prediction")
    if p is _UNSET or p is None:
        return None
    content = p.get("content") if isinstance(p, Mapping) and p.get("type") == "content" else None
    if isinstance(content, list) and all(isinstance(x, Mapping) and x.get("type") == "text"
                                         and isinstance(x.get("text"), str) for x in content):
        content = "".join(x["text"] for x in content)
    if not isinstance(content, str):
        raise bad_field("prediction", "'prediction' must be {\"type\": \"content\", \"content\": <text or text "
                        "parts>}", "invalid_type")
    return content


def _check_body(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_type")
    return body


def check_messages(value: Any) -> list[dict[str, Any]]:
    """The `messages` list: non-empty, objects with a string role and content of text (and image) parts."""
    if value is _UNSET or value is None:
        raise bad_field("messages", "'messages' is required", "missing_required_parameter")
    if not isinstance(value, list) or not value:
        raise bad_field("messages", "'messages' must be a non-empty list of messages")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping):
            raise bad_field(where, f"{where} must be an object with 'role' and 'content'", "invalid_type")
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise bad_field(f"{where}.role", f"{where}.role must be a non-empty string", "invalid_type")
        content = m.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                pw = f"{where}.content[{j}]"
                if not isinstance(part, Mapping):
                    raise bad_field(pw, f"{pw} must be a content part object", "invalid_type")
                if part.get("type") in ("image_url", "input_image", "video_url"):
                    key = "video_url" if part["type"] == "video_url" else "image_url"
                    url = part.get(key)
                    if not isinstance(url.get("url") if isinstance(url, Mapping) else url, str):
                        raise bad_field(f"{pw}.{key}", f"{pw}.{key} must be a URL or an object with a 'url'",
                                        "invalid_type")
                    continue
                if part.get("type") != "text":
                    raise bad_field(f"{pw}.type", f"{pw} has type {part.get('type')!r}; 'text', 'image_url' and "
                                                  "'video_url' content parts are supported", "unsupported_content")
                if not isinstance(part.get("text"), str):
                    raise bad_field(f"{pw}.text", f"{pw}.text must be a string", "invalid_type")
        elif content is not None and not isinstance(content, str):
            raise bad_field(f"{where}.content", f"{where}.content must be a string or a list of content parts",
                            "invalid_type")
        out.append(dict(m))
    return out


def parse_chat(body: Any) -> ChatRequest:
    """Check a `/v1/chat/completions` body."""
    body = _check_body(body)
    messages = check_messages(_get(body, "messages"))
    want = get_bool(body, "logprobs", False)
    top = get_int(body, "top_logprobs", None, 0, MAX_LOGPROBS)
    if top is not None and not want:
        raise bad_field("top_logprobs", "'top_logprobs' needs 'logprobs' set to true")
    tools, tool_choice = tools_and_choice(body)
    forced = None
    if tool_choice is not None and tool_choice.forced:
        try:
            forced = StructuredOutputsParams(json=tool_call_schema(tools, tool_choice))
        except ValueError as e:
            raise bad_field("tools", f"the tools' parameters are not a usable JSON schema: {e}") from e
    common = _common(body, logprobs=(top or 0) if want else None,
                     max_tokens_names=("max_completion_tokens", "max_tokens"), max_tokens_default=None, forced=forced)
    kwargs = _get(body, "chat_template_kwargs")
    if kwargs is _UNSET or kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, Mapping):
        raise bad_field("chat_template_kwargs", "'chat_template_kwargs' must be an object", "invalid_type")
    effort = get_str(body, "reasoning_effort")  # OpenAI's; to the chat template, as the Responses API does
    if effort is not None:
        kwargs = {"reasoning_effort": effort, **kwargs}
    documents = _get(body, "documents")
    if documents is _UNSET or documents is None:
        documents = None
    elif not isinstance(documents, list) or not all(isinstance(d, Mapping) for d in documents):
        raise bad_field("documents", "'documents' must be a list of objects (e.g. {\"title\", \"text\"})",
                        "invalid_type")
    template = get_str(body, "chat_template")
    if template is not None:
        try:
            compile_chat_template(template)
        except ValueError as e:
            raise bad_field("chat_template", str(e)) from e
    add_gen = get_bool(body, "add_generation_prompt", True)
    cont = get_bool(body, "continue_final_message", False)
    if add_gen and cont and "add_generation_prompt" in body:
        raise bad_field("continue_final_message",
                        "'continue_final_message' and 'add_generation_prompt' cannot both be true")
    if cont and messages[-1].get("role") != "assistant":
        raise bad_field("continue_final_message", "'continue_final_message' needs a final assistant message")
    return ChatRequest(common=common, messages=messages, logprobs=want, add_generation_prompt=add_gen and not cont,
                       continue_final_message=cont, chat_template_kwargs=dict(kwargs), tools=tools,
                       tool_choice=tool_choice, include_reasoning=get_bool(body, "include_reasoning", True),
                       chat_template=template, documents=None if documents is None else [dict(d) for d in documents],
                       echo=get_bool(body, "echo", False))


def check_prompts(value: Any, param: str = "prompt") -> list[str | list[int]]:
    """A prompt field: a string, token ids, or a non-empty list of either, none empty; as a list."""
    if value is _UNSET or value is None:
        raise bad_field(param, f"'{param}' is required", "missing_required_parameter")

    def ids(x: Any) -> bool:
        return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if isinstance(value, str):
        prompts: list = [value]
    elif ids(value):
        prompts = [value]
    elif isinstance(value, list) and value and all(isinstance(p, str) or ids(p) for p in value):
        prompts = value
    else:
        raise bad_field(param, f"'{param}' must be a string, a list of strings, a list of token ids or a "
                               "list of token id lists, and not empty", "invalid_type")
    if any(p == "" for p in prompts):
        raise bad_field(param, f"'{param}' must not be empty or hold an empty string")
    return prompts


def parse_completion(body: Any) -> CompletionRequest:
    """Check a `/v1/completions` body."""
    body = _check_body(body)
    embeds = prompt_embeds(body)
    prompt = _get(body, "prompt")  # (with prompt_embeds, it may be left out)
    prompts = [*embeds, *(check_prompts(prompt) if not embeds or prompt not in (_UNSET, None, "", []) else [])]
    if embeds and get_bool(body, "use_beam_search", False):
        raise bad_field("use_beam_search", "beam search takes token prompts, not prompt_embeds")
    logprobs = get_int(body, "logprobs", None, 0, MAX_LOGPROBS)
    echo = get_bool(body, "echo", False)
    # `echo` with `logprobs` reports the prompt tokens' logprobs too (how evaluation harnesses score text).
    common = _common(body, logprobs=logprobs, max_tokens_names=("max_tokens",), max_tokens_default=16,
                     prompt_logprobs=logprobs if echo else None)
    # vLLM adds the model's BOS for completions by default; keep that unless the client says otherwise.
    common = CommonFields(**{**common.__dict__, "add_special_tokens": get_bool(body, "add_special_tokens", True)})
    return CompletionRequest(common=common, prompts=prompts, echo=echo)


def prompt_embeds(body: Mapping[str, Any]) -> list[Any]:
    """vLLM's `prompt_embeds`: each base64 string (or one) a tensor `torch.save` wrote, [tokens, hidden]; as arrays."""
    import base64
    import binascii

    from jaxserve.loader.keymap import CheckpointError
    from jaxserve.loader.torch_bin import read_torch_tensor

    value = _get(body, "prompt_embeds")
    if value in (_UNSET, None):
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items or not all(isinstance(x, str) for x in items):
        raise bad_field("prompt_embeds", "'prompt_embeds' must be a base64 string or a list of them", "invalid_type")
    out = []
    for i, item in enumerate(items):
        try:
            tensor = read_torch_tensor(base64.b64decode(item, validate=True), f"prompt_embeds[{i}]")
        except (binascii.Error, CheckpointError) as e:
            raise bad_field("prompt_embeds", f"prompt_embeds[{i}] is not a base64 torch.save'd tensor: {e}") from e
        if tensor.ndim != 2:
            raise bad_field("prompt_embeds", f"prompt_embeds[{i}] has shape {tensor.shape}; [tokens, hidden] is needed")
        out.append(tensor)
    return out
