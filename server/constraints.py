"""Constraints on what a request may generate, from its JSON: `response_format`, vLLM's
`structured_outputs` and `guided_*` fields, and tool calls (`tools` with `tool_choice`).
Each becomes a `StructuredOutputsParams`; anything malformed is an `ApiError(400)` naming its field."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from jaxserve.structured_outputs import StructuredOutputsParams
from server.errors import bad_field

# vLLM's earlier request fields for structured outputs, and the `structured_outputs` key each is.
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


@dataclass(frozen=True)
class ToolChoice:
    """What the tools may do to the reply. "function" (`name` set) and "required" (a list of one or
    more calls of any of the tools) force it to be calls, through structured outputs; with "auto" the
    model chooses between text and calls, and the server's tool-call parser finds the calls it wrote.
    `parallel` False (OpenAI's `parallel_tool_calls`) keeps only the first call of an "auto" reply, and
    makes a "required" reply one call."""

    mode: Literal["auto", "required", "function"]
    name: str | None = None
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.mode != "auto"


def _response_format(fmt: Any) -> dict[str, Any] | None:
    """OpenAI's `response_format` as `structured_outputs` fields (None for plain text)."""
    if not isinstance(fmt, Mapping):
        raise bad_field("response_format", "'response_format' must be an object with a 'type'", "invalid_type")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, Mapping) or not isinstance(spec.get("schema"), Mapping):
            raise bad_field("response_format", "response_format of type 'json_schema' needs 'json_schema': "
                                               "{'name': ..., 'schema': {...}}")
        return {"json": spec["schema"]}
    if kind == "structural_tag":  # vLLM's: {"type": "structural_tag", ...}, its structures and triggers or format
        return {"structural_tag": {k: v for k, v in fmt.items() if k != "type"}}
    raise bad_field("response_format", "response_format type must be 'text', 'json_object', 'json_schema' or "
                                       f"'structural_tag', got {kind!r}")


def structured_outputs(body: Mapping[str, Any]) -> StructuredOutputsParams | None:
    """The output constraint, from one of `response_format` (OpenAI), `structured_outputs` (vLLM) or
    vLLM's earlier `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`."""
    sources: dict[str, dict[str, Any]] = {}
    fmt = body.get("response_format")
    if fmt is not None:
        fields = _response_format(fmt)
        if fields is not None:
            sources["response_format"] = fields
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, Mapping):
            raise bad_field("structured_outputs", "'structured_outputs' must be an object", "invalid_type")
        unknown = sorted(set(so) - {"json", "regex", "choice", "grammar", "json_object", "structural_tag"})
        if unknown:
            raise bad_field("structured_outputs", f"'structured_outputs' has unsupported fields: {', '.join(unknown)}",
                            "unsupported_parameter")
        sources["structured_outputs"] = {k: v for k, v in so.items() if v is not None}
    for name, key in _GUIDED.items():
        if body.get(name) is not None:
            sources[name] = {key: body[name]}
    if not sources:
        return None
    if len(sources) > 1:
        names = sorted(sources)
        raise bad_field(names[1], f"give one output constraint, not several: {', '.join(names)}")
    (param, fields), = sources.items()
    try:
        return StructuredOutputsParams(**fields)
    except ValueError as e:
        raise bad_field(param, str(e)) from e


_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_NO_PARAMETERS = {"type": "object", "properties": {}}


def tools_and_choice(body: Mapping[str, Any]) -> tuple[list[dict[str, Any]] | None, ToolChoice | None]:
    """`tools` (function tools, checked) and `tool_choice`: "auto" (the default with tools), "required",
    a named function, or "none" (the chat template sees the tools; the reply is text, as with no tools)."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_field("parallel_tool_calls", "'parallel_tool_calls' must be true or false", "invalid_type")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise bad_field("tool_choice", "'tool_choice' needs 'tools'")
        return None, None
    if not isinstance(tools, list):
        raise bad_field("tools", "'tools' must be a list of function tools", "invalid_type")
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(tool, Mapping) or tool.get("type") != "function" or not isinstance(fn, Mapping):
            raise bad_field(where, f"{where} must be {{'type': 'function', 'function': {{'name': ...}}}}", "invalid_type")
        name = fn.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
            raise bad_field(f"{where}.function.name", f"{where}.function.name must be 1-64 letters, digits, '_' or '-', "
                                                      f"got {name!r}")
        if any(t["function"]["name"] == name for t in out):
            raise bad_field(f"{where}.function.name", f"tool name {name!r} is given twice")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, Mapping):
            raise bad_field(f"{where}.function.parameters", f"{where}.function.parameters must be a JSON schema object",
                            "invalid_type")
        out.append({"type": "function", "function": {**fn, "parameters": dict(params or _NO_PARAMETERS)}})
    if choice is None or choice == "auto":
        return out, ToolChoice("auto", parallel=parallel is not False)
    if choice == "none":
        return out, None
    if choice == "required":
        return out, ToolChoice("required", parallel=parallel is not False)
    fn = choice.get("function") if isinstance(choice, Mapping) else None
    if not isinstance(choice, Mapping) or choice.get("type") != "function" or not isinstance(fn, Mapping):
        raise bad_field("tool_choice", "'tool_choice' must be 'none', 'auto', 'required' or "
                                       "{'type': 'function', 'function': {'name': ...}}")
    if not any(t["function"]["name"] == fn.get("name") for t in out):
        raise bad_field("tool_choice", f"tool_choice names {fn.get('name')!r}, which is not among the tools")
    return out, ToolChoice("function", fn["name"])


def tool_call_schema(tools: list[dict[str, Any]], choice: ToolChoice) -> dict[str, Any]:
    """The JSON schema a forced reply follows: the named function's parameters (the reply is its
    arguments), or for "required" a list of one or more {"name", "parameters"} objects (exactly one
    without parallel tool calls)."""
    if choice.mode == "function":
        return next(t["function"]["parameters"] for t in tools if t["function"]["name"] == choice.name)
    calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                               "parameters": t["function"]["parameters"]},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    return {"type": "array", "minItems": 1, "items": {"anyOf": calls}, **({} if choice.parallel else {"maxItems": 1})}
