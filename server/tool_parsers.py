"""Tool-call parsers for `tool_choice: "auto"`: finding the calls a model wrote, in its own format.

With "auto" the model decides between text and calls, and writes calls the way it was trained to.
A parser knows one such format (named as vLLM's `--tool-call-parser` names them):

| name | the model writes | models |
| --- | --- | --- |
| `hermes` | `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one or more, between text; a JSON list inside the tags is taken too | Hermes, Qwen 2.5 / 3, SmolLM2 / 3 |
| `llama3_json` | a reply that is `{"name": ..., "parameters": {...}}` (several joined by `;`), after an optional `<|python_tag|>` | Llama 3.1 / 3.2 / 3.3 |
| `mistral` | text, then `[TOOL_CALLS]` and a JSON list of `{"name", "arguments"}`, or `[TOOL_CALLS]name[ARGS]{...}` per call | Mistral |
| `pythonic` | a reply that is a Python list of calls, `[f(a=1), g(b="x")]` | Llama 3.2 / 4, ToolACE |
| `qwen3_coder` | `<tool_call><function=name><parameter=key>value</parameter></function></tool_call>`, values typed by the tool's schema | Qwen3-Coder |
| `phi4_mini_json` | `functools[{"name": ..., "arguments": {...}}, ...]`, between text | Phi-4-mini |
| `granite` | a reply that is `<|tool_call|>` (or `<tool_call>`) and a JSON list of `{"name", "arguments"}` | Granite 3.x |
| `seed_oss` | as `qwen3_coder`, in a `<seed:tool_call>` region (its markers special tokens) | Seed-OSS |
| `glm45` | `<tool_call>name` then `<arg_key>key</arg_key><arg_value>value</arg_value>` per argument, `</tool_call>`; string values bare, others JSON, typed by the tool's schema | GLM-4.5, GLM-4.6; as `glm47`, GLM-4.7 (no newlines between them) |
| `deepseek_v3`, `deepseek_v31`, `kimi_k2` | calls between special-token markers (server/marked_calls.py) | DeepSeek-V3 / R1-0528, DeepSeek-V3.1 / V3.2, Kimi K2 |
| `gemma4` | `<|tool_call>call:NAME{KEY:VALUE,...}<tool_call|>`, bare keys, strings between `<|"|>` markers, objects and lists nested (server/gemma4_calls.py; its markers special tokens) | Gemma 4 |
| `openai` | harmony messages to a recipient, `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}`, ended by `<|call|>` or the reply's end; with `--reasoning-parser openai_gptoss`, which puts every call in this form (server/harmony.py) | gpt-oss |

A `ToolCallStream` (server/tool_stream.py) reads a reply in any of them as it grows.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any, Literal

from server.gemma4_calls import Gemma4CallReader, gemma4_calls
from server.glm_calls import GlmCallReader
from server.harmony import CALL, CALL_OPENER, MESSAGE
from server.json_calls import JsonCallReader, NamedArgsReader, Reader
from server.marked_calls import DeepSeekV3Parser, DeepSeekV31Parser, KimiK2Parser
from server.py_calls import PythonCallReader
from server.tool_parser_base import ToolParser, call_of, calls_of, json_calls, json_values
from server.tool_stream import ParsedCall, Schemas, join_calls  # noqa: F401 (importable from here)
from server.xml_calls import MINIMAX, QWEN3_CODER, Tags, XmlCallReader, typed

ParserName = Literal["hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder", "phi4_mini_json", "granite",
                     "glm45", "seed_oss", "openai", "deepseek_v3", "deepseek_v31", "kimi_k2", "gemma4"]


class HermesParser(ToolParser):
    name = "hermes"
    openers = ("<tool_call>",)
    closer = "</tool_call>"

    def parse_region(self, opener: str, body: str, schemas: Schemas) -> list[ParsedCall] | None:
        return json_calls(body)  # an object per tag, or SmolLM2's list of calls in one tag

    def reader(self, opener: str, head: str, schemas: Schemas) -> Reader:
        return JsonCallReader(lists=None)


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    openers = ("<|python_tag|>", "{")
    leading = True
    keeps_special_tokens = True

    def parse_region(self, opener: str, body: str, schemas: Schemas) -> list[ParsedCall] | None:
        text = body if opener == "<|python_tag|>" else opener + body
        values = json_values(text, separators=";")
        return None if values is None else calls_of(values)

    def reader(self, opener: str, head: str, schemas: Schemas) -> Reader:
        r = JsonCallReader(lists=False, separators=";")
        if opener == "{":  # the opener is the first call's brace
            r.feed(opener)
        return r


class MistralParser(ToolParser):
    name = "mistral"
    openers = ("[TOOL_CALLS]",)
    keeps_special_tokens = True

    def parse_region(self, opener: str, body: str, schemas: Schemas) -> list[ParsedCall] | None:
        if "[ARGS]" not in body:
            return json_calls(body)
        calls = []
        for piece in body.split(opener):  # `name[ARGS]{...}` per call, each after its own [TOOL_CALLS]
            name, sep, args = piece.partition("[ARGS]")
            values = json_values(args) if sep else None
            name = name.split("[CALL_ID]")[0]  # (v11's `name[CALL_ID]id[ARGS]{...}`)
            call = call_of({"name": name.strip(), "arguments": values[0]}) if values and len(values) == 1 else None
            if call is None:
                return None
            calls.append(call)
        return calls

    def reader(self, opener: str, head: str, schemas: Schemas) -> Reader:
        return JsonCallReader(lists=None) if head in "[{" else NamedArgsReader()


class Phi4MiniParser(ToolParser):
    name = "phi4_mini_json"
    openers = ("functools",)

    def parse_region(self, opener: str, body: str, schemas: Schemas) -> list[ParsedCall] | None:
        values = json_values(body)  # the one JSON list of calls that follows the word
        return calls_of(values[0]) if values and len(values) == 1 and isinstance(values[0], list) else None

    def reader(self, opener: str, head: str, schemas: Schemas) -> Reader:
        return JsonCallReader(lists=True)


class GraniteParser(ToolParser):
    name = "granite"
    openers = ("<|tool_call|>", "<tool_call>")  # Granite 3.0's special token, 3.1's text
    leading = True
    keeps_special_tokens = True

    def parse_region(self, opener: str, body: str, schemas: Schemas) -> list[ParsedCall] | None:
        return json_calls(body)

    def reader(self, opener: str, head: str, schemas: Schemas) -> Reader:
        return JsonCallReader(lists=None)


class PythonicParser(ToolParser):
    name = "pythonic"
    openers = ("<|python_start|>", "[")
    leading = True
    keeps_special_tokens = True

    def parse_region(self, opener: str, body: str, schemas: Schemas) -> list[ParsedCall] | None:
        text = opener + body if opener == "[" else body
        text = text.strip().removesuffix("<|python_end|>").strip()
        try:
            tree = ast.parse(text, mode="eval").body
        except (SyntaxError, ValueError):
            return None
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                return None
            try:
                args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
                arguments = json.dumps(args, ensure_ascii=False)
            except (ValueError, TypeError, SyntaxError):
                return None
            if len(args) != len(node.keywords):  # a `**kwargs` expansion
                return None
            calls.append(ParsedCall(node.func.id, arguments))
        return calls

    def reader(self, opener: str, head: str, schemas: Schemas) -> Reader:
        return PythonCallReader(opened=opener == "[")


def _patterns(tags: Tags) -> tuple[re.Pattern[str], re.Pattern[str]]:
    """A dialect's function and parameter (name, body) patterns, each ending where the format lets it end."""
    e = re.escape
    function = re.compile(rf"{e(tags.function)}([^>\n]+)>(.*?)(?:{e(tags.end_function)}|\Z)", re.S)
    parameter = re.compile(rf"{e(tags.parameter)}([^>\n]+)>(.*?)(?:{e(tags.end_parameter)}|(?={e(tags.parameter)})|\Z)",
                           re.S)
    return function, parameter


class Qwen3CoderParser(ToolParser):
    """`<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>`: values are
    untyped text (code, paths, JSON), typed by the tool's parameter schema."""

    name = "qwen3_coder"
    openers = ("<tool_call>",)
    closer = "</tool_call>"
    tags: Tags = QWEN3_CODER

    def parse_region(self, opener: str, body: str, schemas: Schemas) -> list[ParsedCall] | None:
        functions, parameters = _patterns(self.tags)
        if functions.sub("", body).strip():
            return None  # text beside the functions: not this format
        calls = []
        for fn in functions.finditer(body):
            name = self.tags.name(fn.group(1))
            if not name or parameters.sub("", fn.group(2)).strip():
                return None  # text between the parameters
            props = (schemas.get(name) or {}).get("properties") or {}
            args = {}
            for param in parameters.finditer(fn.group(2)):
                key, value = self.tags.name(param.group(1)), param.group(2)
                value = value[1:] if value.startswith("\n") else value  # the newlines the format puts
                value = value[:-1] if value.endswith("\n") else value  # around each value
                args[key] = typed(value, props.get(key))
            calls.append(ParsedCall(name, json.dumps(args, ensure_ascii=False)))
        return calls or None

    def reader(self, opener: str, head: str, schemas: Schemas) -> Reader:
        return XmlCallReader(schemas, self.tags)


class SeedOssParser(Qwen3CoderParser):
    """Qwen3-Coder's functions and parameters in `<seed:tool_call>` regions."""

    name = "seed_oss"
    openers = ("<seed:tool_call>",)
    closer = "</seed:tool_call>"
    keeps_special_tokens = True


class MiniMaxM2Parser(Qwen3CoderParser):
    """MiniMax-M2's: `<minimax:tool_call><invoke name="NAME"><parameter name="KEY">VALUE</parameter>...</invoke>
    </minimax:tool_call>`, values typed by the tool's parameter schema as Qwen3-Coder's."""

    name = "minimax_m2"
    openers = ("<minimax:tool_call>",)
    closer = "</minimax:tool_call>"
    tags = MINIMAX
    keeps_special_tokens = True  # (its tags are added tokens of its vocabulary)


_ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)
_NAME = re.compile(r"[\w.:-]+")


class Glm45Parser(ToolParser):
    """`<tool_call>NAME` then `<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>` per argument (newlines
    between), then `</tool_call>`. GLM-4.5's chat template writes a string value as it is and any other as
    JSON: a value is a string where the tool's schema says so, else the JSON (or Python literal) it spells,
    else its text. String values stream (server/glm_calls.py)."""

    name = "glm45"
    openers = ("<tool_call>",)
    closer = "</tool_call>"

    def parse_region(self, opener: str, body: str, schemas: Schemas) -> list[ParsedCall] | None:
        first = body.find("<arg_key>")
        name, rest = (body, "") if first < 0 else (body[:first], body[first:])
        name = name.strip()
        if not _NAME.fullmatch(name) or _ARGUMENT.sub("", rest).strip():
            return None  # no name, or text between the arguments: not this format
        props = (schemas.get(name) or {}).get("properties") or {}
        args = {m.group(1).strip(): _glm_value(m.group(2), props.get(m.group(1).strip()))
                for m in _ARGUMENT.finditer(body)}
        return [ParsedCall(name, json.dumps(args, ensure_ascii=False))]

    def reader(self, opener: str, head: str, schemas: Schemas) -> Reader:
        return GlmCallReader(schemas, _glm_value)


def _glm_value(raw: str, schema: Any) -> Any:
    if schema is not None:
        return typed(raw, schema)
    try:  # no schema: what the JSON the template wrote for a non-string spells, else the text
        return json.loads(raw)
    except ValueError:
        try:
            return ast.literal_eval(raw.strip())
        except (ValueError, SyntaxError):
            return raw


class OpenAIParser(ToolParser):
    """gpt-oss's harmony calls: a message to `functions.NAME` (any other recipient is named as it is), its body the
    arguments' JSON (server/harmony.py)."""

    name = "openai"
    openers = (CALL_OPENER,)
    closer = CALL
    keeps_special_tokens = True

    def parse_region(self, opener: str, body: str, schemas: Schemas) -> list[ParsedCall] | None:
        header, sep, args = body.partition(MESSAGE)
        values = json_values(args) if sep else None
        if not _recipient(header) or not values or len(values) != 1 or not isinstance(values[0], dict):
            return None
        return [ParsedCall(_recipient(header), json.dumps(values[0], ensure_ascii=False))]

    def reader(self, opener: str, head: str, schemas: Schemas) -> Reader:
        def name_of(header: str) -> str:
            if not _recipient(header):
                raise ValueError("a call without a recipient")
            return _recipient(header)

        return NamedArgsReader(args_marker=MESSAGE, call_marker=CALL, name_of=name_of)


class Gemma4Parser(ToolParser):
    """`<|tool_call>call:NAME{KEY:VALUE,...}<tool_call|>` (server/gemma4_calls.py)."""

    name = "gemma4"
    openers = ("<|tool_call>",)
    closer = "<tool_call|>"
    keeps_special_tokens = True

    def parse_region(self, opener: str, body: str, schemas: Schemas) -> list[ParsedCall] | None:
        return gemma4_calls(body, schemas)

    def reader(self, opener: str, head: str, schemas: Schemas) -> Reader:
        return Gemma4CallReader(schemas)


def _recipient(header: str) -> str:
    """The call's name in a harmony call's header after `to=` (`functions.NAME <|constrain|>json`): NAME."""
    words = header.split("<|")[0].split()
    return words[0].removeprefix("functions.") if words else ""


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser,
                                                           Phi4MiniParser, PythonicParser, Qwen3CoderParser,
                                                           GraniteParser, Glm45Parser, SeedOssParser, OpenAIParser,
                                                           DeepSeekV3Parser, DeepSeekV31Parser, KimiK2Parser,
                                                           MiniMaxM2Parser, Gemma4Parser)}
PARSERS["qwen3_xml"] = Qwen3CoderParser  # vLLM's second name for the format
PARSERS["glm47"] = Glm45Parser  # GLM-4.7's calls (no newlines between the name and the arguments): vLLM's name


def tool_parser(name: str) -> ToolParser:
    """The parser registered as `name`; ValueError naming the choices otherwise."""
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(sorted(PARSERS))}")
    return PARSERS[name]()
