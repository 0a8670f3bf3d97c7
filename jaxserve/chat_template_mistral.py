"""The chat templates of Mistral's instruct formats, for models whose tokenizer is a tekken file (`tekken.json`) or
a SentencePiece `tokenizer.model.v3` / `.v7`, which carry no template: Mistral writes its prompts in code (mistral_common), one format per tokenizer version.

| version | system prompt | tools | a call | a tool's result |
| --- | --- | --- | --- | --- |
| v3 | joined, before the last user message's text | `[AVAILABLE_TOOLS]` before the last user message | `[TOOL_CALLS]` and a JSON list of `{"name", "arguments", "id"}` | `[TOOL_RESULTS]{"content", "call_id"}[/TOOL_RESULTS]` |
| v7 | `[SYSTEM_PROMPT]...[/SYSTEM_PROMPT]` where it stands | as v3 | as v3 | `[TOOL_RESULTS]id[TOOL_CONTENT]content[/TOOL_RESULTS]` |
| v11 | as v7 | as v3 | `[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}` per call | as v7 |
| v13 (and later) | as v7 | `[AVAILABLE_TOOLS]` before the first user message | `[TOOL_CALLS]name[ARGS]{...}` per call | `[TOOL_RESULTS]content[/TOOL_RESULTS]` |

Consecutive user messages are joined by a blank line; every assistant message ends with `</s>`; an image part is
`[IMG]` where it stands (the engine writes the image's rows of `[IMG]`, `[IMG_BREAK]`, `[IMG_END]` in its place). The template
renders what mistral_common encodes for the same conversation (tests/test_tokenizer_tekken.py).
"""

from __future__ import annotations

_TEMPLATE = """{%- macro text(c) -%}
{%- if c is string -%}{{ c }}{%- elif c -%}{%- for p in c -%}
{%- if p.type == 'text' -%}{{ p.text }}{%- elif p.type == 'image' -%}[IMG]{%- endif -%}
{%- endfor -%}{%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(msgs=[], system=[], last_user=-1, first_user=-1, listed=[], calls=[]) -%}
{%- for m in messages -%}
  {%- if m.role == 'system' and version < 7 -%}
    {%- set ns.system = ns.system + [text(m.content)] -%}
  {%- elif m.role == 'user' and ns.msgs and ns.msgs[-1].role == 'user' -%}
    {%- set ns.msgs = ns.msgs[:-1] + [dict(role='user', content=ns.msgs[-1].content ~ '\\n\\n' ~ text(m.content))] -%}
  {%- elif m.role == 'user' -%}
    {%- set ns.msgs = ns.msgs + [dict(role='user', content=text(m.content))] -%}
  {%- else -%}
    {%- set ns.msgs = ns.msgs + [m] -%}
  {%- endif -%}
{%- endfor -%}
{%- for m in ns.msgs -%}
  {%- if m.role == 'user' -%}
    {%- set ns.last_user = loop.index0 -%}
    {%- if ns.first_user < 0 -%}{%- set ns.first_user = loop.index0 -%}{%- endif -%}
  {%- endif -%}
{%- endfor -%}
{%- set tools_at = ns.first_user if version >= 13 else ns.last_user -%}
{{- bos_token -}}
{%- for m in ns.msgs -%}
  {%- if m.role == 'user' -%}
    {%- if tools and loop.index0 == tools_at -%}
      {%- set ns.listed = [] -%}
      {%- for t in tools -%}
        {%- set f = t.function if t.function is defined else t -%}
        {%- set ns.listed = ns.listed + [dict(type='function', function=dict(
              name=f.name, description=f.description or '', parameters=f.parameters))] -%}
      {%- endfor -%}
      [AVAILABLE_TOOLS]{{- ns.listed | tojson -}}[/AVAILABLE_TOOLS]
    {%- endif -%}
    [INST]{%- if ns.system and loop.index0 == ns.last_user -%}{{- ns.system | join('\\n\\n') -}}{{- '\\n\\n' -}}{%- endif -%}
    {{- m.content -}}[/INST]
  {%- elif m.role == 'system' -%}
    [SYSTEM_PROMPT]{{- text(m.content) -}}[/SYSTEM_PROMPT]
  {%- elif m.role == 'assistant' -%}
    {{- text(m.content) -}}
    {%- if m.tool_calls -%}
      {%- if version < 11 -%}
        {%- set ns.calls = [] -%}
        {%- for tc in m.tool_calls -%}
          {%- set f = tc.function if tc.function is defined else tc -%}
          {%- set call = dict(name=f.name, arguments=f.arguments) -%}
          {%- set ns.calls = ns.calls + [dict(call, id=tc.id) if tc.id else call] -%}
        {%- endfor -%}
        [TOOL_CALLS]{{- ns.calls | tojson -}}
      {%- else -%}
        {%- for tc in m.tool_calls -%}
          {%- set f = tc.function if tc.function is defined else tc -%}
          [TOOL_CALLS]{{- f.name -}}{%- if version < 13 -%}[CALL_ID]{{- tc.id -}}{%- endif -%}[ARGS]
          {{- f.arguments if f.arguments is string else f.arguments | tojson -}}
        {%- endfor -%}
      {%- endif -%}
    {%- endif -%}
    {{- eos_token -}}
  {%- elif m.role == 'tool' -%}
    {%- if version < 7 -%}
      [TOOL_RESULTS]{{- dict(content=text(m.content), call_id=m.tool_call_id) | tojson -}}[/TOOL_RESULTS]
    {%- elif version < 13 -%}
      [TOOL_RESULTS]{{- m.tool_call_id -}}[TOOL_CONTENT]{{- text(m.content) -}}[/TOOL_RESULTS]
    {%- else -%}
      [TOOL_RESULTS]{{- text(m.content) -}}[/TOOL_RESULTS]
    {%- endif -%}
  {%- endif -%}
{%- endfor -%}"""


def mistral_template(version: str) -> str:
    """The chat template of tokenizer version `version` ("v3", "v7", "v11", "v13", ...)."""
    number = int(version.lstrip("v").split(".")[0] or 3)
    return "{%- set version = " + str(number) + " -%}\n" + _TEMPLATE
