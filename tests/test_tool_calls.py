"""tool_choice "auto": the tool-call parsers, whole and streamed, and the server that uses them
(a Hypercorn server on 127.0.0.1 over the fake engine with scripted replies)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.chat_template import ChatTemplateError, load_chat_template
from server.config import ServerConfig
from server.fake_engine import FakeAsyncEngine, replies_by_last_word
from server.json_calls import CallDelta, JsonValue
from server.runner import serve_in_thread
from server.tool_parsers import PARSERS, ParsedCall, join_calls, tool_parser

W = ParsedCall("get_weather", '{"city": "Paris"}')
T = ParsedCall("get_time", '{"zone": "CET", "hours": [1, 2], "dst": true}')

# (parser, reply, content, calls): what a whole reply parses to.
CASES = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "", [W]),
    ("hermes", 'Checking.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
               '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\", \\"hours\\": [1, 2], '
               '\\"dst\\": true}"}</tool_call>', "Checking.", [W, T]),
    ("hermes", '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
               '{"name": "get_time", "parameters": {"zone": "CET", "hours": [1, 2], "dst": true}}]</tool_call>',
     "", [W, T]),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}', "", [W]),  # unclosed, whole
    ("hermes", "A plain answer < with <tool a bracket.", "A plain answer < with <tool a bracket.", []),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n\n', "", [W]),
    ("hermes", "Text that ends in spaces \n ", "Text that ends in spaces \n ", []),
    ("hermes", '<tool_call>{"name": "get_weather", "argu</tool_call> and on',
     '<tool_call>{"name": "get_weather", "argu</tool_call> and on', []),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": [1]}</tool_call>',
     '<tool_call>{"name": "get_weather", "arguments": [1]}</tool_call>', []),
    # Cut short once its arguments began (they went out as they came): the call keeps what was written.
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"ci', "", [ParsedCall("get_weather", '{"ci')]),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call> So',
     " So", [ParsedCall("get_weather", '{"city": ')]),
    # Calls, then text that is not: the text is content.
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}} and on</tool_call> done',
     " and on</tool_call> done", [W]),
    ("hermes", '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": 7}]</tool_call>',
     ', {"name": 7}]</tool_call>', [W]),
    # Arguments before the name, or null: the call goes out whole, or is no call.
    ("hermes", '<tool_call>{"arguments": {"city": "Paris"}, "id": 7, "name": "get_weather"}</tool_call>', "", [W]),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": null}</tool_call>',
     '<tool_call>{"name": "get_weather", "arguments": null}</tool_call>', []),
    # Arguments are written as json.dumps writes them, whatever the model's spacing and escapes.
    ("hermes", '<tool_call>{ "name" : "get_weather" , "arguments" :{"city":"Par\\u00eds \\ud83d\\ude00\\n",'
               '"n":1.50E1 ,"k":[ ],"o":{ },"t":[true,null]} }</tool_call>',
     "", [ParsedCall("get_weather", '{"city": "París 😀\\n", "n": 15.0, "k": [], "o": {}, "t": [true, null]}')]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [W]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                    '{"name": "get_time", "parameters": {"zone": "CET", "hours": [1, 2], "dst": true}}', "", [W, T]),
    ("llama3_json", 'Use {"name": "x"} later', 'Use {"name": "x"} later', []),
    ("llama3_json", '  {"name": "get_weather"', '  {"name": "get_weather"', []),
    ("mistral", 'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', "Sure.", [W]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]'
                '{"zone": "CET", "hours": [1, 2], "dst": true}', "", [W, T]),
    ("mistral", "[TOOL_CALLS]not json", "[TOOL_CALLS]not json", []),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"} and then', " and then", [W]),
    ("phi4_mini_json", 'functools[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", '
                       '"arguments": {"zone": "CET", "hours": [1, 2], "dst": true}}]', "", [W, T]),
    ("phi4_mini_json", 'Let me check. functools[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
     "Let me check.", [W]),
    ("phi4_mini_json", "The functools module helps.", "The functools module helps.", []),
    ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", '
                '"arguments": {"zone": "CET", "hours": [1, 2], "dst": true}}]', "", [W, T]),
    ("granite", ' <tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]', "", [W]),
    ("granite", "No <|tool_call|> here.", "No <|tool_call|> here.", []),
    ("phi4_mini_json", 'functools{"name": "get_weather"}', 'functools{"name": "get_weather"}', []),
    ("pythonic", '[get_weather(city="Paris"), get_time(zone="CET", hours=[1, 2], dst=True)]', "", [W, T]),
    ("pythonic", '<|python_start|>[get_weather(city="Paris")]<|python_end|>', "", [W]),
    ("pythonic", "[1, 2] is a list", "[1, 2] is a list", []),
    ("pythonic", "[f(*args)]", "[f(*args)]", []),
    ("pythonic", "Say [get_weather(city='Paris')]", "Say [get_weather(city='Paris')]", []),
    ("pythonic", '[get_weather(city="Paris"), oops]', ", oops]", [W]),
    ("pythonic", "[f(), g(a=1,), ]", "", [ParsedCall("f", "{}"), ParsedCall("g", '{"a": 1}')]),
    ("pythonic", '[f(s="\\x41\\u00e9\\101\\N{BULLET}\\q", t=\'it\\\'s\')]', "",
     [ParsedCall("f", json.dumps({"s": "AéA•\\q", "t": "it's"}, ensure_ascii=False))]),
    ("pythonic", '[f(s="""a,b""", r=r"c\\d", e="", l=[1, (2, 3)], d={"k": None}, x=-1.5e3)]', "",
     [ParsedCall("f", '{"s": "a,b", "r": "c\\\\d", "e": "", "l": [1, [2, 3]], "d": {"k": null}, "x": -1500.0}')]),
    ("pythonic", "[f(a=1), g(b=unknown)]", ", g(b=unknown)]", [ParsedCall("f", '{"a": 1}')]),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
                    "</tool_call>", "", [W]),
    ("qwen3_coder", "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "</function>\n<function=get_time>\n<parameter=zone>\nCET\n</parameter>\n<parameter=hours>\n"
                    "[1, 2]\n</parameter>\n<parameter=dst>\nTrue\n</parameter>\n</function>\n</tool_call>",
     "Checking.", [W, T]),
    # Unclosed parameters and an unclosed function at the end of the reply.
    ("qwen3_coder", "<tool_call><function=get_time><parameter=zone>CET<parameter=hours>[1, 2]<parameter=dst>true",
     "", [T]),
    ("qwen3_coder", '<tool_call>{"name": "get_weather"}</tool_call>', '<tool_call>{"name": "get_weather"}</tool_call>',
     []),
    # A call gone out is closed where the format stops; the rest is content.
    ("qwen3_coder", "<tool_call><function=get_weather><parameter=city>Paris</parameter>so<parameter=x>1</parameter>"
                    "</function></tool_call>", "so<parameter=x>1</parameter></function></tool_call>", [W]),
    ("qwen3_coder", "<tool_call><function=get_weather><parameter=city>\nParis\n</parameter>\n<parameter=ci",
     "<parameter=ci", [W]),
    ("qwen3_coder", "<tool_call><function=get_time>\n</function><function=get_weather>\n<parameter=city>\n"
                    "Paris\n", "", [ParsedCall("get_time", "{}"), W]),
    ("qwen3_coder", "<tool_call><function=get_weather>so<parameter=city>Paris</parameter></function></tool_call>",
     "<tool_call><function=get_weather>so<parameter=city>Paris</parameter></function></tool_call>", []),
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>", "", [W]),
    ("glm45", "Checking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>\n"
              "<tool_call>get_time\n<arg_key>zone</arg_key>\n<arg_value>CET</arg_value>\n<arg_key>hours</arg_key>\n"
              "<arg_value>[1, 2]</arg_value>\n<arg_key>dst</arg_key>\n<arg_value>true</arg_value>\n</tool_call>",
     "Checking.", [W, T]),
    # No arguments; a tool without a schema (its values JSON where they are, else text).
    ("glm45", "<tool_call>get_time\n</tool_call>", "", [ParsedCall("get_time", "{}")]),
    ("glm45", "<tool_call>lookup\n<arg_key>n</arg_key>\n<arg_value>42</arg_value>\n<arg_key>q</arg_key>\n"
              "<arg_value>a b</arg_value>\n<arg_key>o</arg_key>\n<arg_value>{\"k\": [1]}</arg_value>\n</tool_call>", "",
     [ParsedCall("lookup", '{"n": 42, "q": "a b", "o": {"k": [1]}}')]),
    # Not this format: JSON inside the tags, text between an argument's key and value.
    ("glm45", '<tool_call>{"name": "get_weather"}</tool_call>', '<tool_call>{"name": "get_weather"}</tool_call>', []),
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>so<arg_value>Paris</arg_value></tool_call>",
     "<tool_call>get_weather\n<arg_key>city</arg_key>so<arg_value>Paris</arg_value></tool_call>", []),
    # A string value is the text between the tags, newlines and markup included; one cut short by the reply's end
    # is what was written; a call without arguments may end at the region's end.
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>São <b>Paulo</b>\n</arg_value>\n</tool_call>",
     "", [ParsedCall("get_weather", '{"city": "São <b>Paulo</b>\\n"}')]),
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par", "",
     [ParsedCall("get_weather", '{"city": "Par"}')]),
    ("glm45", "<tool_call>get_time</tool_call>", "", [ParsedCall("get_time", "{}")]),
    # GLM-4.7's template writes no newlines between the name and the arguments (vLLM's `glm47`: the same reader).
    ("glm47", "Checking.<tool_call>get_time<arg_key>zone</arg_key><arg_value>CET</arg_value><arg_key>hours</arg_key>"
              "<arg_value>[1, 2]</arg_value><arg_key>dst</arg_key><arg_value>true</arg_value></tool_call>",
     "Checking.", [T]),
    ("seed_oss", "Let me check.\n<seed:tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                 "</function>\n</seed:tool_call>", "Let me check.", [W]),
    ("seed_oss", "<tool_call><function=get_weather></function></tool_call>",
     "<tool_call><function=get_weather></function></tool_call>", []),
    # MiniMax-M2's tags (names in quotes); values typed by their schemas; not this format: Qwen3-Coder's tags.
    ("minimax_m2", 'Checking.\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris'
                   '</parameter>\n</invoke>\n<invoke name="get_time">\n<parameter name="zone">CET</parameter>\n'
                   '<parameter name="hours">[1, 2]</parameter>\n<parameter name="dst">true</parameter>\n</invoke>\n'
                   "</minimax:tool_call>", "Checking.", [W, T]),
    ("minimax_m2", '<minimax:tool_call><invoke name="get_time"></invoke></minimax:tool_call>', "",
     [ParsedCall("get_time", "{}")]),
    ("minimax_m2", "<minimax:tool_call><function=get_weather></function></minimax:tool_call>",
     "<minimax:tool_call><function=get_weather></function></minimax:tool_call>", []),
    # Text after an argument: the call as it stood, the rest content.
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key><arg_value>Paris</arg_value>oops</tool_call>",
     "oops</tool_call>", [W]),
    ("mistral", '[TOOL_CALLS]get_weather[CALL_ID]abc123def[ARGS]{"city": "Paris"}', "", [W]),  # Mistral's v11
    # gpt-oss's harmony calls, as the openai_gptoss reasoning parser passes them on, or as the model writes them.
    ("openai", 'Checking.<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
               "<|call|><|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{}<|call|>",
     "Checking.", [W, ParsedCall("get_time", "{}")]),
    ("openai", '<|channel|>commentary to=functions.get_weather json<|message|>{"city": "Paris"}', "", [W]),
    ("openai", "<|channel|>commentary to=browser.search <|constrain|>json<|message|>{}", "",
     [ParsedCall("browser.search", "{}")]),
    ("openai", "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>not json<|call|>",
     "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>not json<|call|>", []),
    # DeepSeek-V3.1's calls between its markers; V3's with a type and a fenced JSON block; Kimi K2's by id.
    ("deepseek_v31", 'Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}'
                     '<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"zone": "CET", "hours": [1, 2], '
                     '"dst": true}<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "Let me check.", [W, T]),
    ("deepseek_v31", "A<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>not json<｜tool▁call▁end｜>"
                     "<｜tool▁calls▁end｜>", "A<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>not json"
                     "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", []),
    ("deepseek_v31", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}'
                     "<｜tool▁call▁end｜>oops<｜tool▁calls▁end｜>", "oops<｜tool▁calls▁end｜>", [W]),
    ("deepseek_v31", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Par', "",
     [ParsedCall("get_weather", '{"city": "Par')]),
    ("deepseek_v3", 'Hi<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": '
                    '"Paris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{"zone": '
                    '"CET", "hours": [1, 2], "dst": true}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "Hi", [W, T]),
    ("deepseek_v3", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": }\n'
                    "```<｜tool▁call▁end｜><｜tool▁calls▁end｜>", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>'
                    'get_weather\n```json\n{"city": }\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', []),
    ("kimi_k2", 'Sure.<|tool_calls_section_begin|> <|tool_call_begin|> functions.get_weather:0 <|tool_call_argument_begin|>'
                ' {"city": "Paris"} <|tool_call_end|> <|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>'
                '{"zone": "CET", "hours": [1, 2], "dst": true}<|tool_call_end|><|tool_calls_section_end|>', "Sure.", [W, T]),
    ("kimi_k2", '<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
                '{"city": "Paris"}<|tool_call_end|>', "", [W]),
    # Gemma 4's compact calls: bare keys, strings between <|"|> markers, bare numbers and booleans, nested lists;
    # two calls in one region or one region each; a region that is not this format is content.
    ("gemma4", '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>', "", [W]),
    ("gemma4", 'Checking.<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}call:get_time{zone:<|"|>CET<|"|>,'
               'hours:[1,2],dst:true}<tool_call|>', "Checking.", [W, T]),
    ("gemma4", '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|><|tool_call>call:get_time{}'
               '<tool_call|>', "", [W, ParsedCall("get_time", "{}")]),
    ("gemma4", '<|tool_call>call:lookup{q:<|"|>a, {b}: [c]<|"|>,n:-2.5e1,opts:{deep:[<|"|>x<|"|>,null]},zone:CET}'
               '<tool_call|>', "", [ParsedCall("lookup", '{"q": "a, {b}: [c]", "n": -25.0, "opts": {"deep": ["x", '
                                              'null]}, "zone": "CET"}')]),
    ("gemma4", '<|tool_call>call:get_time{zone:7}<tool_call|>', "", [ParsedCall("get_time", '{"zone": "7"}')]),
    ("gemma4", '<|tool_call>get_weather(city="Paris")<tool_call|>', '<|tool_call>get_weather(city="Paris")'
               '<tool_call|>', []),
    # ... a JSON-quoted string, bare text that begins as the string marker does, empty containers, spaces; text
    # after a call is content; a call cut short is closed where it stands.
    ("gemma4", '<|tool_call> call:get_time{ zone : "C\\"E\\u0054" , hours:[ ], dst:{}}\ncall:get_weather{city:<Paris>}'
               '<tool_call|>', "", [ParsedCall("get_time", '{"zone": "C\\"ET", "hours": [], "dst": {}}'),
                                    ParsedCall("get_weather", '{"city": "<Paris>"}')]),
    ("gemma4", '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}oops<tool_call|>', "oops<tool_call|>", [W]),
    ("gemma4", 'Sure.<|tool_call>call:get_time{hours:[1,<|"|>2', "Sure.",
     [ParsedCall("get_time", '{"hours": [1, "2"]}')]),
]
# The tools' parameter schemas, which `qwen3_coder` types its values by (the other formats write JSON).
SCHEMAS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}}},
           "get_time": {"type": "object", "properties": {"zone": {"type": "string"}, "hours": {"type": "array"},
                                                         "dst": {"type": "boolean"}}}}


@pytest.mark.parametrize("name, reply, content, calls", CASES)
def test_parsers_find_the_calls_and_lose_no_text(name, reply, content, calls):
    assert tool_parser(name).parse(reply, SCHEMAS) == (content, calls)


def _streamed(name: str, reply: str, cuts: list[int]) -> tuple[str, list[ParsedCall]]:
    stream = tool_parser(name).stream(SCHEMAS)
    content, pieces, at = "", [], 0
    for cut in sorted(cuts) + [len(reply)]:
        more, found = stream.feed(reply[at:cut])
        content, pieces, at = content + more, pieces + found, cut
    more, found = stream.finish()
    return content + more, join_calls(pieces + found)


@settings(max_examples=300, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.floats(0, 1), max_size=12))
def test_a_stream_cut_anywhere_parses_as_the_whole_reply(case, cuts):
    name, reply, content, calls = case
    assert _streamed(name, reply, [int(c * len(reply)) for c in cuts]) == (content, calls)


def test_stream_gives_content_at_once_and_arguments_as_they_come():
    s = tool_parser("hermes").stream()
    assert s.feed("Let me look. <tool") == ("Let me look.", []), "a possible opener and the space are held"
    assert s.feed('_call>{"name": "get_weather", "argu') == ("", []), "no call before its arguments begin"
    assert s.feed('ments": {"ci') == ("", [CallDelta(0, "get_weather", '{"ci')])
    assert s.feed('ty":"Pa') == ("", [CallDelta(0, None, 'ty": "Pa')]), "json.dumps' spacing"
    assert s.feed('ris", "n": 12') == ("", [CallDelta(0, None, 'ris", "n": ')]), "a number goes out once it ends"
    assert s.feed('}}</tool_') == ("", [CallDelta(0, None, "12}")])
    assert s.feed("call> <tool_call>") == ("", [])
    assert s.feed('{"arguments": {"city": "Paris"}, "name": "get_weather"}') == (
        "", [CallDelta(1, "get_weather", '{"city": "Paris"}')]), "arguments before the name: whole at the end"
    assert s.feed("</tool_call> Done") == (" Done", [])
    assert s.finish() == ("", [])
    plain = tool_parser("llama3_json").stream()
    assert plain.feed("  ") == ("", []) and plain.feed("Hi {x}") == ("  Hi {x}", [])
    mistral = tool_parser("mistral").stream()
    assert mistral.feed('[TOOL_CALLS]get_time[ARGS]{"zone": "C') == ("", [CallDelta(0, "get_time", '{"zone": "C')])
    assert mistral.feed('ET"}[TOOL_CALLS]get_weather[A') == ("", [CallDelta(0, None, 'ET"}')])
    assert mistral.feed('RGS]{"city"') == ("", [CallDelta(1, "get_weather", '{"city"')])


def test_deepseek_v31_and_kimi_k2_stream_a_calls_arguments():
    """A call's name goes out once its arguments begin, its arguments as they are written; the end markers are
    the calls', not content."""
    for name, begin, sep, end, header in (
            ("deepseek_v31", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>", "write"),
            ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>", "<|tool_call_argument_begin|>",
             "<|tool_call_end|>", "functions.write:0")):
        s = tool_parser(name).stream(SCHEMAS)
        assert s.feed(f"Writing.{begin}{header}") == ("Writing.", []), name
        assert s.feed(f'{sep}{{"text": "line one') == ("", [CallDelta(0, "write", '{"text": "line one')]), name
        assert s.feed('\\nline two"}' + end) == ("", [CallDelta(0, None, '\\nline two"}')]), name
        assert s.finish() == ("", []), name


def test_gemma4_streams_strings_and_gives_bare_values_whole():
    """A call goes out with its `{`, a `<|"|>` string as it is written (all but what may be its closing marker),
    a bare value once it ends, typed by the tool's schema."""
    s = tool_parser("gemma4").stream(SCHEMAS)
    assert s.feed("Checking.<|tool_call>call:get_ti") == ("Checking.", [])
    assert s.feed('me{zone:<|"|>Central "Eu') == ("", [CallDelta(0, "get_time", '{"zone": "Central \\"Eu')])
    assert s.feed('rope<|"') == ("", [CallDelta(0, None, "rope")])
    assert s.feed('|>,hours:[1') == ("", [CallDelta(0, None, '", "hours": [')])
    assert s.feed(",2],dst:tr") == ("", [CallDelta(0, None, '1, 2], "dst": ')]), "a bare value once it ends"
    assert s.feed("ue}<tool_call|>Done.") == ("Done.", [CallDelta(0, None, "true}")])
    assert s.finish() == ("", [])


def test_glm45_streams_string_values_and_gives_typed_ones_whole():
    s = tool_parser("glm45").stream(SCHEMAS)
    assert s.feed("Sure. <tool_call>get_time\n<arg_key>zo") == ("Sure.", []), "no call before a value begins"
    assert s.feed("ne</arg_key>\n<arg_value>CE") == ("", [CallDelta(0, "get_time", '{"zone": "CE')])
    assert s.feed("T</arg_val") == ("", [CallDelta(0, None, "T")]), "a possible end tag is held"
    assert s.feed("ue>\n<arg_key>hours</arg_key><arg_value>[1,") == ("", [CallDelta(0, None, '", "hours": ')])
    assert s.feed(" 2]</arg_value></tool_call>") == ("", [CallDelta(0, None, "[1, 2]"), CallDelta(0, None, "}")]), \
        "typed: whole at its end"
    assert s.finish() == ("", [])


def test_openai_streams_a_harmony_calls_arguments():
    """gpt-oss's call (a file's text, say) goes out as it is written: its name once its arguments begin."""
    s = tool_parser("openai").stream(SCHEMAS)
    assert s.feed("<|channel|>commentary to=functions.write_file <|constrain|>json<|mess") == ("", [])
    assert s.feed('age|>{"text": "line one') == ("", [CallDelta(0, "write_file", '{"text": "line one')])
    assert s.feed('\\nline two"}') == ("", [CallDelta(0, None, '\\nline two"}')])
    assert s.finish() == ("", [])


def test_qwen3_coder_streams_text_values_and_gives_typed_ones_whole():
    s = tool_parser("qwen3_coder").stream(SCHEMAS)
    assert s.feed("<tool_call>\n<function=get_time>\n") == ("", []), "no call before its first parameter"
    assert s.feed("<parameter=zone>\nC") == ("", [CallDelta(0, "get_time", '{"zone": "C')])
    assert s.feed('E"T\n') == ("", [CallDelta(0, None, 'E\\"T')]), "the newline before an end tag is held"
    assert s.feed("</para") == ("", [])
    assert s.feed("meter>\n<parameter=hours>\n[1,") == ("", [CallDelta(0, None, '", "hours": ')])
    assert s.feed(" 2]\n</parameter>\n</function>") == ("", [CallDelta(0, None, "[1, 2]}")])
    assert s.feed("\n</tool_call>") == ("", [])
    assert s.finish() == ("", [])
    assert tool_parser("qwen3_coder").parse("<tool_call><function=f><parameter=code>\na\n\n</tool_call>") == (
        "", [ParsedCall("f", '{"code": "a\\n"}')])


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                     | st.text(), lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=6)


def test_pythonic_streams_plain_strings_and_gives_other_literals_whole():
    s = tool_parser("pythonic").stream()
    assert s.feed("[write(path=") == ("", []), "no call before its first value"
    assert s.feed('"a.py", text="def f():\\n') == ("", [CallDelta(0, "write", '{"path": "a.py", "text": "def f():\\n')])
    assert s.feed('  return 1", n=[1,') == ("", [CallDelta(0, None, '  return 1", "n": ')])
    assert s.feed(" 2]), ping()]") == ("", [CallDelta(0, None, "[1, 2]}"), CallDelta(1, "ping", "{}")])
    assert s.finish() == ("", [])


@settings(max_examples=150, deadline=None)
@given(calls=st.lists(st.tuples(st.text(st.characters(codec="utf-8", exclude_characters="<>"), min_size=1,
                                        max_size=8), st.dictionaries(st.text(max_size=5), _JSON, max_size=3)),
                      min_size=1, max_size=3),
       indent=st.sampled_from([None, 1]), ascii_only=st.booleans(), as_list=st.booleans(),
       cuts=st.lists(st.floats(0, 1), max_size=10))
def test_any_json_calls_stream_to_the_calls_written(calls, indent, ascii_only, as_list, cuts):
    """Whatever the names, arguments, spacing and escapes, and wherever the reply is cut, the streamed
    pieces join to each call's arguments as json.dumps writes them."""
    objs = [{"name": n, "arguments": a} for n, a in calls]
    dump = lambda v: json.dumps(v, indent=indent, ensure_ascii=ascii_only)  # noqa: E731
    body = dump(objs) if as_list else "\n".join(dump(o) for o in objs)
    reply = f"Sure. <tool_call>{body}</tool_call>"
    want = [ParsedCall(n, json.dumps(a, ensure_ascii=False)) for n, a in calls]
    assert _streamed("hermes", reply, [int(c * len(reply)) for c in cuts]) == ("Sure.", want)


@settings(max_examples=200, deadline=None)
@given(value=_JSON,
       indent=st.sampled_from([None, 0, 2]), ascii_only=st.booleans(), cuts=st.lists(st.floats(0, 1), max_size=8))
def test_json_read_in_pieces_is_written_as_json_dumps_writes_it(value, indent, ascii_only, cuts):
    text = json.dumps(value, indent=indent, ensure_ascii=ascii_only, separators=(",", ":") if indent is None else None)
    v, out, at = JsonValue(), "", 0
    for cut in sorted(int(c * len(text)) for c in cuts) + [len(text)]:
        piece, n = v.feed(text[at:cut])
        assert n == cut - at
        out, at = out + piece, cut
    if isinstance(value, (dict, list, str)):  # (a number at the top has no end to be read at)
        assert v.done and out == json.dumps(value, ensure_ascii=False)


@pytest.mark.parametrize("text", ['{"a" 1}', '{"a": 1,}', "[1,]", "[1 2]", '{"a": tru}', '"\\x"', '"\\u12g4"',
                                  '"a\nb"', "{'a': 1}", '{"a": 1]', "[}", "-", '{"a": 01}'])
def test_json_that_is_not_is_refused_where_it_goes_wrong(text):
    with pytest.raises(ValueError):
        JsonValue().feed(text + " ")


def test_unknown_parser_is_named():
    with pytest.raises(ValueError, match="hermes"):
        tool_parser("qwen9")
    assert sorted(PARSERS) == ["deepseek_v3", "deepseek_v31", "gemma4", "glm45", "glm47", "granite", "hermes", "kimi_k2",
                               "llama3_json",
                               "minimax_m2", "mistral", "openai", "phi4_mini_json", "pythonic", "qwen3_coder",
                               "qwen3_xml", "seed_oss"]
    assert tool_parser("qwen3_xml").parse("<tool_call><function=f></function></tool_call>")[1] == [ParsedCall("f", "{}")]


def test_qwen3_coder_values_take_their_schema_types_or_stay_text():
    """Each value is typed by its parameter's schema (a list of types or an anyOf counts its first non-null);
    text that is not of the type, or a parameter the schema does not name, stays the text written; a
    value's surrounding newlines are the format's, the rest (code) is kept."""
    props = {"n": {"type": "integer"}, "x": {"type": ["number", "null"]}, "ok": {"type": "boolean"},
             "cfg": {"anyOf": [{"type": "null"}, {"type": "object"}]}, "ids": {"type": "array"},
             "s": {"type": "string"}, "bad": {"type": "integer"}, "none": {"type": "integer"}}
    params = {"n": "42", "x": "2.5", "ok": "false", "cfg": "{'a': 1, 'b': [True]}", "ids": "[1, 2]", "s": "007",
              "bad": "4x", "none": "null", "extra": "7", "code": "\ndef f():\n    return 1\n\n"}
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    _, calls = tool_parser("qwen3_coder").parse(f"<tool_call>\n<function=f>\n{body}</function>\n</tool_call>",
                                               {"f": {"type": "object", "properties": props}})
    assert [c.name for c in calls] == ["f"]
    assert json.loads(calls[0].arguments) == {
        "n": 42, "x": 2.5, "ok": False, "cfg": {"a": 1, "b": [True]}, "ids": [1, 2], "s": "007", "bad": "4x",
        "none": None, "extra": "7", "code": "\ndef f():\n    return 1\n\n"}
    # Without schemas every value is text.
    _, calls = tool_parser("qwen3_coder").parse("<tool_call><function=f><parameter=n>42</parameter></function>"
                                                "</tool_call>")
    assert calls[0].arguments == '{"n": "42"}'


def test_chat_reply_types_qwen3_coder_values_by_the_request_tools():
    from jaxserve.outputs import CompletionOutput
    from server.chat_replies import ChatReplies
    from server.constraints import ToolChoice

    tools = [{"type": "function", "function": {"name": n, "parameters": SCHEMAS[n]}} for n in SCHEMAS]
    text = ("<tool_call>\n<function=get_time>\n<parameter=zone>\nCET\n</parameter>\n<parameter=hours>\n[1, 2]\n"
            "</parameter>\n<parameter=dst>\ntrue\n</parameter>\n</function>\n</tool_call>")
    replies = ChatReplies(ToolChoice("auto"), tool_parser("qwen3_coder"), None, function_tools=tools)
    message, finish = replies.message(CompletionOutput(0, text, [], None, None, "stop"))
    assert finish == "tool_calls" and message["content"] is None
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [
        {"zone": "CET", "hours": [1, 2], "dst": True}]


def test_server_config_and_chat_template_flag(tmp_path):
    with pytest.raises(ValueError, match="tool_call_parser"):
        ServerConfig(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        ServerConfig(tool_call_parser="nope")
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ServerConfig(chat_template="{% for m in messages %}")
    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0].content }}")
    assert load_chat_template(str(f)) == "{{ messages[0].content }}"
    assert load_chat_template("{% if 1 %}x{% endif %}") == "{% if 1 %}x{% endif %}"
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        load_chat_template(str(tmp_path / "missing.jinja"))


# Scripted replies, chosen by the last word of the prompt (the fake vocabulary's number words).
REPLIES = {
    "one": 'I will check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
           '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET", "hours": [1, 2], "dst": true}}\n</tool_call>',
    "two": "It is sunny in <b>Paris</b>, no tool needed.",
    "three": '<tool_call>{"name": "get_weather", "argu</tool_call>',
    "five": '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]',
    "four": '<tool_call>{"name": "write_file", "arguments": {"path": "a.py", "text": "def f():\\n    return 1\\n"}}'
            '</tool_call>',
}
TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
         for n in ("get_weather", "get_time")]
TEMPLATE = ("{% for m in messages %}{{ m.content }} {% endfor %}{% if tools %}{% for t in tools %}system "
            "{% endfor %}{% endif %}{% if add_generation_prompt %}assistant{% endif %}")


@pytest.fixture(scope="module")
def engine():
    eng = FakeAsyncEngine(step_delay=0.001, scripted_reply=replies_by_last_word(REPLIES))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    config = ServerConfig(port=0, enable_auto_tool_choice=True, tool_call_parser="hermes", chat_template=TEMPLATE)
    with serve_in_thread(engine, config) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _ask(client, word, **kw):
    return client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": word}],
                                          tools=TOOLS, **kw)


def _accumulate(chunks):
    """A streamed reply put back together as an OpenAI client does."""
    content, calls, finish = "", {}, None
    for ch in chunks:
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            call = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = tc.id or call["id"]
            call["name"] += tc.function.name or ""
            call["arguments"] += tc.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_auto_reply_with_calls(client, engine):
    r = _ask(client, "one")
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and m.content == "I will check both."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET", "hours": [1, 2], "dst": True})]
    assert all(c.id.startswith("call_") and c.type == "function" for c in m.tool_calls)
    assert len({c.id for c in m.tool_calls}) == 2
    ids = engine.submitted[-1][1]
    assert engine.tokenizer.decode(ids, False) == "one system system assistant", "--chat-template, with the tools"
    content, calls, finish = _accumulate(_ask(client, "one", stream=True))
    assert (content, finish) == ("I will check both.", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.function.name, c.function.arguments)
                                                            for c in m.tool_calls]
    assert all(c["id"].startswith("call_") for c in calls)


def test_auto_reply_of_text_is_untouched(client):
    r = _ask(client, "two")
    assert r.choices[0].message.content == REPLIES["two"] and r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason == "stop"
    assert _accumulate(_ask(client, "two", stream=True)) == (REPLIES["two"], [], "stop")


def test_a_call_that_does_not_parse_comes_back_as_text(client):
    r = _ask(client, "three")
    assert r.choices[0].message.content == REPLIES["three"] and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"
    assert _accumulate(_ask(client, "three", stream=True)) == (REPLIES["three"], [], "stop")


def test_a_calls_arguments_stream_as_the_model_writes_them(client):
    chunks = list(_ask(client, "four", stream=True))
    pieces = [(tc.id, tc.function.name, tc.function.arguments) for ch in chunks if ch.choices
              for tc in ch.choices[0].delta.tool_calls or ()]
    first_id, name, _ = pieces[0]
    assert first_id.startswith("call_") and name == "write_file"
    assert len(pieces) > 10 and all(i is None and n is None for i, n, _ in pieces[1:]), "id and name once"
    arguments = "".join(a for _, _, a in pieces)
    assert json.loads(arguments) == {"path": "a.py", "text": "def f():\n    return 1\n"}
    assert arguments == _ask(client, "four").choices[0].message.tool_calls[0].function.arguments
    assert _accumulate(chunks)[2] == "tool_calls"


def test_parallel_tool_calls_false_keeps_the_first(client):
    r = _ask(client, "one", parallel_tool_calls=False)
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather"]
    _, calls, finish = _accumulate(_ask(client, "one", stream=True, parallel_tool_calls=False))
    assert [c["name"] for c in calls] == ["get_weather"] and finish == "tool_calls"


def test_a_reply_cut_inside_a_call_is_text_with_length(client):
    r = _ask(client, "one", max_tokens=12)  # 36 characters: inside the first call
    assert r.choices[0].finish_reason == "length" and not r.choices[0].message.tool_calls
    assert r.choices[0].message.content == REPLIES["one"][:36]
    assert _accumulate(_ask(client, "one", stream=True, max_tokens=12)) == (REPLIES["one"][:36], [], "length")


def test_a_reply_cut_inside_a_calls_arguments_keeps_them_with_length(client):
    r = _ask(client, "four", max_tokens=25)  # 75 characters: '... "text": "de'
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content is None
    call = r.choices[0].message.tool_calls[0]
    assert (call.function.name, call.function.arguments) == ("write_file", '{"path": "a.py", "text": "de')
    _, calls, finish = _accumulate(_ask(client, "four", stream=True, max_tokens=25))
    assert [(c["name"], c["arguments"]) for c in calls] == [("write_file", call.function.arguments)]
    assert finish == "length"


def test_required_calls_stream_as_they_are_written(client):
    r = _ask(client, "five", tool_choice="required")
    calls = r.choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in calls] == [("get_weather", '{"city": "Paris"}'),
                                                                        ("get_time", "{}")]
    assert r.choices[0].finish_reason == "tool_calls"
    chunks = list(_ask(client, "five", tool_choice="required", stream=True))
    assert sum(len(ch.choices[0].delta.tool_calls or ()) for ch in chunks if ch.choices) > 2
    _, streamed, finish = _accumulate(chunks)
    assert [(c["name"], c["arguments"]) for c in streamed] == [(c.function.name, c.function.arguments) for c in calls]
    assert finish == "tool_calls"
    cut = _ask(client, "five", tool_choice="required", max_tokens=4).choices[0]  # before the arguments
    assert (cut.message.content, cut.message.tool_calls, cut.finish_reason) == (REPLIES["five"][:12], None, "length")
    assert _accumulate(_ask(client, "five", tool_choice="required", max_tokens=4, stream=True)) == (
        REPLIES["five"][:12], [], "length")


def test_tool_choice_none_is_not_parsed(client):
    r = _ask(client, "one", tool_choice="none")
    assert r.choices[0].message.content == REPLIES["one"] and r.choices[0].finish_reason == "stop"


def test_tokenize_renders_with_the_server_template(server):
    r = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "two"}], "tools": TOOLS})
    assert r.status_code == 200
    assert r.json()["count"] == 4, r.json()  # two, system, system, assistant


def test_special_token_formats_keep_their_markers():
    """mistral, llama3_json and pythonic write their markers as special tokens: the server asks the
    engine to keep them in the text, or the parser would never see them."""
    eng = FakeAsyncEngine(step_delay=0.001, scripted_reply=lambda p: '[TOOL_CALLS][{"name": "get_time", '
                                                                     '"arguments": {}}]')
    try:
        with serve_in_thread(eng, ServerConfig(port=0, enable_auto_tool_choice=True,
                                               tool_call_parser="mistral")) as srv:
            c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
            r = _ask(c, "two")
            assert [x.function.name for x in r.choices[0].message.tool_calls] == ["get_time"]
            assert eng.submitted[-1][2].skip_special_tokens is False
            _ask(c, "two", tool_choice="none")
            assert eng.submitted[-1][2].skip_special_tokens is True
    finally:
        eng.shutdown()
