"""Chat replies: the answer, the reasoning and the tool calls in one reply, whole and streamed.

Tool calls:
- A named function (forced): the reply is the call's arguments. They stream as they come; the
  first piece carries the call's id and name.
- "required" (forced): the reply is a JSON list of `{"name", "parameters"}`; each call streams as it
  is written (its id and name, then its arguments in pieces), read as "auto" JSON calls are.
- "auto": the server's tool-call parser (server/tool_parsers.py) splits the reply into content and
  calls. Content streams as it comes; a call's first piece carries its id and name, and its arguments
  follow as the model writes them (in the JSON formats; in the others each call goes out whole as soon
  as the parser has all of it).
A reply made of calls has `content: null` and finishes with "tool_calls"; one cut by `max_tokens`
keeps "length".

Reasoning: with a reasoning parser (server/reasoning.py) the thoughts go to `reasoning` (and
`reasoning_content`), and only the answer is content, is searched for "auto" tool calls, or is a forced
call. An output constraint (a forced tool call, a JSON schema, ...) holds from where the answer begins
(`server.reasoning.constraint_after_reasoning`), unless the engine cannot tell where that is: such a reply
is all answer.
"""

from __future__ import annotations

import uuid
from typing import Any

from jaxserve.outputs import CompletionOutput
from server.constraints import ToolChoice
from server.json_calls import CallDelta, JsonCallReader
from server.reasoning import ReasoningParser
from server.responses import ChoiceCursor, Delta
from server.tool_parsers import ToolParser
from server.tool_stream import ParsedCall, join_calls


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call_json(call: ParsedCall, index: int | None = None) -> dict[str, Any]:
    obj: dict[str, Any] = {"id": new_tool_call_id(), "type": "function",
                           "function": {"name": call.name, "arguments": call.arguments}}
    return obj if index is None else {"index": index, **obj}


class ChatReplies:
    """Formats the replies of one chat request: `choice` its tool choice (None: plain text), `tools`
    the server's tool-call parser, `reasoning` its reasoning parser (None: no reasoning split)."""

    def __init__(self, choice: ToolChoice | None, tools: ToolParser | None, reasoning: ReasoningParser | None,
                 *, constrained: bool = False, include_reasoning: bool = True,
                 function_tools: list[dict[str, Any]] | None = None):
        if choice is not None and choice.mode == "auto" and tools is None:
            raise ValueError("tool_choice 'auto' needs a tool-call parser")
        self.choice, self.tools = choice, tools
        # Each tool's parameter schema, for formats that write argument values untyped.
        self.schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in function_tools or ()}
        self.reasoning = None if constrained else reasoning
        self.include_reasoning = include_reasoning

    def _auto_calls(self, calls: list[ParsedCall]) -> list[ParsedCall]:
        assert self.choice is not None
        return calls if self.choice.parallel else calls[:1]

    def _with_reasoning(self, out: dict[str, Any], reasoning: str | None) -> dict[str, Any]:
        if reasoning is None or not self.include_reasoning:
            return out
        return {"reasoning": reasoning, "reasoning_content": reasoning, **out}

    def delta(self, cursor: ChoiceCursor, c: CompletionOutput, d: Delta) -> tuple[dict[str, Any], str | None]:
        """A streamed chunk's delta and finish reason. An empty delta with no finish reason means
        the text is held (a marker or a call not yet whole)."""
        reasoning, text = "", d.text
        if self.reasoning is not None:
            if cursor.reasoning_stream is None:
                cursor.reasoning_stream = self.reasoning.stream()
            reasoning, text = cursor.reasoning_stream.feed(d.text)
            if d.finish_reason is not None:
                more, rest = cursor.reasoning_stream.finish()
                reasoning, text = reasoning + more, text + rest
        if self.choice is not None and self.choice.forced:
            out, finish = self._forced_delta(cursor, text, d.finish_reason)
        elif self.choice is None:
            out, finish = ({"content": text} if text else {}), d.finish_reason
        else:
            out, finish = self._auto_delta(cursor, text, d.finish_reason)
        return self._with_reasoning(out, reasoning or None), finish

    def _forced_delta(self, cursor: ChoiceCursor, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        """A forced call's chunk from the answer's new `text` (the reply after any reasoning)."""
        choice = self.choice
        assert choice is not None
        cursor.answer += text
        if choice.mode == "function":
            delta: dict[str, Any] = {}
            if text:
                call: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
                if not cursor.tool_call_id:
                    cursor.tool_call_id = new_tool_call_id()
                    call = {"index": 0, "id": cursor.tool_call_id, "type": "function",
                            "function": {"name": choice.name, "arguments": text}}
                delta = {"tool_calls": [call]}
            return delta, "tool_calls" if finish == "stop" and cursor.tool_call_id else finish
        if cursor.calls_reader is None:  # "required": the list of calls, read as it grows
            cursor.calls_reader = JsonCallReader(lists=True)
        calls = self._call_deltas(cursor, cursor.calls_reader.feed(text), parallel=choice.parallel)
        if finish is not None and not cursor.calls_sent:  # cut short before a call began
            return {"content": cursor.answer}, finish
        delta = {"tool_calls": calls} if calls else {}
        return delta, "tool_calls" if finish == "stop" else finish

    def _auto_delta(self, cursor: ChoiceCursor, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        assert self.tools is not None
        if cursor.tool_stream is None:
            cursor.tool_stream = self.tools.stream(self.schemas)
        content, pieces = cursor.tool_stream.feed(text)
        if finish is not None:
            more, last = cursor.tool_stream.finish()
            content, pieces = content + more, pieces + last
        assert self.choice is not None
        calls = self._call_deltas(cursor, pieces, self.choice.parallel)
        delta: dict[str, Any] = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = calls
        return delta, "tool_calls" if finish == "stop" and cursor.calls_sent else finish

    @staticmethod
    def _call_deltas(cursor: ChoiceCursor, pieces: list[CallDelta], parallel: bool) -> list[dict[str, Any]]:
        """The `tool_calls` of a chunk: a call's first piece with its id and name, the others its arguments."""
        calls: list[dict[str, Any]] = []
        for p in pieces:
            if p.index > 0 and not parallel:
                continue
            if p.name is not None:
                calls.append({"index": p.index, "id": new_tool_call_id(), "type": "function",
                              "function": {"name": p.name, "arguments": p.arguments}})
                cursor.calls_sent += 1
            elif calls and calls[-1]["index"] == p.index:
                calls[-1]["function"]["arguments"] += p.arguments
            else:
                calls.append({"index": p.index, "function": {"arguments": p.arguments}})
        return calls

    def message(self, c: CompletionOutput) -> tuple[dict[str, Any], str | None]:
        """A whole reply's message and finish reason."""
        choice = self.choice
        reasoning, text = self.reasoning.parse(c.text) if self.reasoning is not None else (None, c.text)
        if choice is not None and choice.forced:
            if choice.name is not None:  # (an empty answer: no call)
                calls = [ParsedCall(choice.name, text)] if text else []
            else:
                calls = join_calls(JsonCallReader(lists=True).feed(text))[:None if choice.parallel else 1]
            if not calls:
                return self._with_reasoning({"role": "assistant", "content": text}, reasoning), c.finish_reason
            return (self._with_reasoning({"role": "assistant", "content": None,
                                          "tool_calls": [_call_json(x) for x in calls]}, reasoning),
                    "tool_calls" if c.finish_reason == "stop" else c.finish_reason)
        content: str | None = text
        calls = None
        if choice is not None:
            assert self.tools is not None
            content, found = self.tools.parse(text, self.schemas)
            calls = self._auto_calls(found) or None
        if (calls or reasoning is not None) and not content:
            content = None
        message: dict[str, Any] = self._with_reasoning({"role": "assistant", "content": content}, reasoning)
        if calls is None:
            return message, c.finish_reason
        message["tool_calls"] = [_call_json(x) for x in calls]
        return message, "tool_calls" if c.finish_reason == "stop" else c.finish_reason
