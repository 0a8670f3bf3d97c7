"""Rendering a model's Jinja chat template the way HF transformers renders it.

Chat templates ship with models and are written against transformers' Jinja environment, so ours
matches it: a sandbox that cannot modify its inputs, `trim_blocks` and `lstrip_blocks`, the loop
controls extension, a `tojson` that does not escape HTML and keeps key order, and the globals
`raise_exception` and `strftime_now`. `{% generation %}` blocks (used by transformers for assistant
masks) render their body. Templates are compiled once per distinct text.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import jinja2.utils

from jaxserve.videos import VideoRef


class ChatTemplateError(ValueError):
    """The chat template refused the conversation, or could not be compiled or rendered."""


IMAGE_PARTS = ("image_url", "input_image", "image", "image_pil")
"""Content parts that carry an image: OpenAI's `image_url` (`{"url": ...}` or the URL), the Responses API's
`input_image`, and `image` / `image_pil` (an image object or a URL), as vLLM takes them from Python."""
VIDEO_PARTS = ("video_url", "video")
"""Content parts that carry a video: vLLM's `video_url` (`{"url": ...}` or the URL) and `video` (frames, or a URL)."""


def normalize_messages(messages: Sequence[Mapping[str, Any]], images: list[Any] | None = None,
                       placeholder: str | None = None, video_placeholder: str = "") -> list[dict[str, Any]]:
    """Copies of `messages` ready for a template: None-valued keys dropped, text parts joined.

    OpenAI clients send `content` either as a string or as a list of parts. Text parts are joined with
    newlines into one string so every template, even one that concatenates `message['content']`, can render
    it. With `images` (a list, an image-text model's), image parts are understood too: their images are
    appended to `images` in order, and each stands in the content as `placeholder` (the text of the model's
    image token) or, without one, the content stays a list of parts, `{"type": "image"}` for an image, as
    transformers gives it to templates that place images themselves. Video parts likewise: each video goes to
    `images` as a `VideoRef`, and stands as `video_placeholder` or `{"type": "video"}`.
    """
    out = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(
                f"message {index} must be a mapping with 'role' and 'content', got {type(message).__name__}"
            )
        # Clients send `content: null` on tool-call messages; templates handle a missing key, not None.
        plain = {k: v for k, v in message.items() if v is not None}
        if isinstance(plain.get("tool_calls"), list):
            plain["tool_calls"] = [_tool_call_for_template(call) for call in plain["tool_calls"]]
        content = plain.get("content")
        if isinstance(content, list) and images is not None:
            parts = [_image_or_text(index, part, images) for part in content]
            stand = {"image": placeholder, "video": video_placeholder}
            plain["content"] = parts if placeholder is None else "\n".join(
                stand[p["type"]] if p["type"] in stand else p["text"] for p in parts)
        elif isinstance(content, list):
            plain["content"] = "\n".join(_text_of_part(index, part) for part in content)
        elif content is not None and not isinstance(content, str):
            raise ValueError(
                f"message {index} content must be a string or a list of parts, got {type(content).__name__}"
            )
        out.append(plain)
    return out


def _tool_call_for_template(call: Any) -> Any:
    """An assistant message's tool call with its `arguments` as an object: OpenAI clients send the
    JSON text, and templates (as transformers documents them) expect the mapping."""
    fn = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"])
    except ValueError:
        return call  # not JSON: the template gets the text as it came
    return {**call, "function": {**fn, "arguments": args}}


def load_chat_template(value: str) -> str:
    """A chat template given on the command line: a file's path, or the template's text itself."""
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"chat template {value!r} is neither a file nor a Jinja template")


def _text_of_part(index: int, part: Any) -> str:
    if not isinstance(part, Mapping):
        raise ValueError(f"message {index} has a content part that is not an object: {part!r}")
    kind = part.get("type")
    if kind in IMAGE_PARTS + VIDEO_PARTS:
        what = "an image" if kind in IMAGE_PARTS else "a video"
        raise ValueError(f"message {index} has {what} ({kind!r} part); this model takes text only")
    if kind != "text":
        raise ValueError(
            f"message {index} has a content part of type {kind!r}; only 'text' parts are supported"
        )
    text = part.get("text")
    if not isinstance(text, str):
        raise ValueError(f"message {index} has a text part without a string 'text'")
    return text


def _image_or_text(index: int, part: Any, images: list[Any]) -> dict[str, Any]:
    """A content part as a template sees it; an image part's image (a video part's video, as a `VideoRef`) goes to
    `images`."""
    kind = part.get("type") if isinstance(part, Mapping) else None
    if kind not in IMAGE_PARTS + VIDEO_PARTS:
        return {"type": "text", "text": _text_of_part(index, part)}
    value = part.get("image_url" if kind == "input_image" else kind)
    if kind in ("image_url", "input_image", "video_url") and isinstance(value, Mapping):
        value = value.get("url")
    if value is None:
        raise ValueError(f"message {index} has an {kind!r} part without its {'video' if 'video' in kind else 'image'}")
    if kind in VIDEO_PARTS:
        images.append(VideoRef(value))
        return {"type": "video"}
    images.append(value)
    return {"type": "image"}


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    images: list[Any] | None = None,
    image_placeholder: str | None = None,
    video_placeholder: str | None = None,
    **variables: Any,
) -> str:
    """Render `template` over `messages`; `variables` (e.g. `bos_token`, `enable_thinking`) reach the template.

    With `images` (a list: an image-text model's), the messages' images are appended to it in order and the
    text holds one `image_placeholder` for each, where it stands: from the template, when it writes the
    placeholder for the image parts it is given, else (a template that only reads text) from the content
    written as text with the placeholder in each image's place (vLLM's two content formats). Videos likewise, each
    one a `videos.VideoRef` in `images`, `video_placeholder` its token's text."""
    if not messages:
        raise ValueError("cannot apply a chat template to an empty conversation")
    if tools is not None and not all(isinstance(t, Mapping) for t in tools):
        raise ValueError("tools must be JSON schema objects")
    compiled = compile_chat_template(template)
    seen: list[Any] = []
    parts = normalize_messages(messages, seen) if images is not None else None
    if seen:
        text = None
        try:
            text = _render(compiled, parts, add_generation_prompt, tools, documents, variables)
        except (ChatTemplateError, TypeError):  # a template that takes text content only
            pass
        videos = sum(isinstance(x, VideoRef) for x in seen)
        if text is None or (image_placeholder is not None and text.count(image_placeholder) != len(seen) - videos) \
                or (videos and video_placeholder is not None and text.count(video_placeholder) != videos):
            text = _render(compiled, normalize_messages(messages, [], image_placeholder, video_placeholder or ""),
                           add_generation_prompt, tools, documents, variables)
        images.extend(seen)
        return text
    return _render(compiled, normalize_messages(messages), add_generation_prompt, tools, documents, variables)


def _render(compiled: jinja2.Template, messages: list[dict[str, Any]], add_generation_prompt: bool,
            tools: Sequence[Mapping[str, Any]] | None, documents: Sequence[Mapping[str, Any]] | None,
            variables: dict[str, Any]) -> str:
    try:
        return compiled.render(
            messages=messages,
            tools=None if tools is None else [dict(t) for t in tools],
            documents=None if documents is None else [dict(d) for d in documents],
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except jinja2.TemplateError as e:
        # `raise_exception(...)` in a template lands here: the conversation is one the model cannot take.
        raise ChatTemplateError(f"chat template error: {e.message or e}") from e


@functools.lru_cache(maxsize=32)
def compile_chat_template(template: str) -> jinja2.Template:
    """The compiled template (cached by its text)."""
    try:
        return _environment().from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not compile (line {e.lineno}): {e.message}") from e


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: marks assistant text for training masks; renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore attributes, which could reach Python internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates may not set namespace attribute {name!r}")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own `tojson` escapes <, >, & and ' for HTML and sorts keys; templates expect plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _make_dict(*args: Any, **kwargs: Any) -> dict[str, Any]:
    return dict(*args, **kwargs)


@functools.cache
def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    # The builtin type itself would expose its classmethods; a plain function does not.
    env.globals["dict"] = _make_dict
    return env
