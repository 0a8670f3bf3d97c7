"""Structural tags in their `format` form (xgrammar's tree of formats, as vLLM takes it), through the grammar
matcher the engine masks with, on the bundled model's tokenizer. Each text below is taken or refused as
xgrammar 0.2.9's own grammar of the same structural tag takes or refuses it (compared text by text: 153 texts,
none differing; the Lark sub-grammar aside, xgrammar's Lark being another dialect)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.structured_outputs import GrammarCompiler, StructuredOutputsParams, bitmask_width
from jaxserve.tokenizer import Tokenizer
from server.constraints import structured_outputs

A = {"type": "any_text"}


def S(value: str) -> dict:
    return {"type": "const_string", "value": value}


def J(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": schema}


def call(name: str, content: dict | None = None, close: str = "</f>") -> dict:
    return {"type": "tag", "begin": f"<{close[2]}={name}>", "content": content or J({"type": "integer"}), "end": close}


TEXTS = ["", "hi", "<f=a>1</f>", "x<f=a>1</f>", "<f=a>1</f>y", "<f=a>1</f><f=b>2</f>", "x<f=a>1</f>y<f=b>2</f>z",
         "<f=c>1</f>", "<f=a>x</f>", "<f", "a<g=b>7</g>", "<g=b>7</g>x<f=a>3</f>", "x<g=1"]
# (at_least_one, stop_after_first): the texts taken; every other one of TEXTS is refused.
TRIGGERED = {
    (False, False): ["", "hi", "<f=a>1</f>", "x<f=a>1</f>", "<f=a>1</f>y", "<f=a>1</f><f=b>2</f>",
                     "x<f=a>1</f>y<f=b>2</f>z", "<f", "a<g=b>7</g>", "<g=b>7</g>x<f=a>3</f>"],
    (False, True): ["", "hi", "<f=a>1</f>", "x<f=a>1</f>", "<f", "a<g=b>7</g>"],
    (True, False): ["<f=a>1</f>", "<f=a>1</f>y", "<f=a>1</f><f=b>2</f>", "<g=b>7</g>x<f=a>3</f>"],
    (True, True): ["<f=a>1</f>"],
}
SEPARATED_TEXTS = ["", "<f=a>1</f>", "<f=a>1</f>,<f=b>2</f>", "<f=a>1</f><f=b>2</f>", "x<f=a>1</f>", "<f=a>1</f>,",
                   "<f=b>3</f>,<f=b>4</f>,<f=a>5</f>"]
SEPARATED = {
    (False, False): ["", "<f=a>1</f>", "<f=a>1</f>,<f=b>2</f>", "<f=b>3</f>,<f=b>4</f>,<f=a>5</f>"],
    (False, True): ["", "<f=a>1</f>"],
    (True, False): ["<f=a>1</f>", "<f=a>1</f>,<f=b>2</f>", "<f=b>3</f>,<f=b>4</f>,<f=a>5</f>"],
    (True, True): ["<f=a>1</f>"],
}
OTHERS = [  # (format, taken, refused)
    ({"type": "sequence", "elements": [S("A"), A, S("B")]}, ["AB", "AxyB", "AxBB"], ["AxB y", "A"]),
    ({"type": "sequence", "elements": [S("A"), A]}, ["A", "Axyz"], ["B"]),
    ({"type": "tag", "begin": "<t>", "content": A, "end": ["</t>", "</u>"]}, ["<t></t>", "<t>ab</u>"],
     ["<t>a</t>b</t>", "<t>a</t></t>", "<t>a"]),
    ({"type": "tag", "begin": "<t>", "content": {"type": "sequence", "elements": [J({"type": "string"}), A]},
      "end": "</t>"}, ['<t>"a"</t>', '<t>"a" more</t>'], ["<t>x</t>", '<t>"a"</t></t>']),
    ({"type": "triggered_tags", "triggers": ["<f="], "tags": [call("a", A)]},
     ["x<f=a>zz</f>y", "<f=a>z</f>", "<f=a></f><f=a>q</f>"], ["<f=a>z"]),
    ({"type": "sequence", "elements": [{"type": "tag", "begin": "<think>", "content": A, "end": "</think>"},
                                       {"type": "triggered_tags", "triggers": ["<f="], "tags": [call("a")],
                                        "at_least_one": True}]},
     ["<think>hm</think><f=a>1</f>", "<think>a</think><f=a>12</f>ok"],
     ["<think></think>", "<think>x</think>y<f=a>1</f>"]),
    ({"type": "or", "elements": [S("yes"), {"type": "regex", "pattern": "n[o]+"}]}, ["yes", "no", "nooo"],
     ["n", "yesno"]),
    ({"type": "any_text", "excludes": ["bad"]}, ["good", "ba d", ""], ["a bad one"]),
    ({"type": "optional", "content": S("x")}, ["", "x"], ["xx"]),
    ({"type": "plus", "content": S("ab")}, ["ab", "abab"], ["", "aba"]),
    ({"type": "star", "content": {"type": "regex", "pattern": "[0-9]"}}, ["", "1", "123"], ["1a"]),
    ({"type": "repeat", "content": S("z"), "min": 2, "max": 4}, ["zz", "zzzz"], ["z", "zzzzz"]),
    ({"type": "repeat", "content": S("z"), "min": 1, "max": -1}, ["z", "zzzzzzz"], [""]),
    ({"type": "sequence", "elements": [J({"type": "object", "properties": {"a": {"type": "integer"}},
                                          "required": ["a"]}), S("\nEND")]},
     ['{"a": 1}\nEND', '{"a":1}\nEND'], ['{"b": 1}\nEND', '{"a": 1}']),
    ({"type": "regex", "pattern": "a/b[0-9]"}, ["a/b1"], ["ab1"]),
    (S('héllo "q"'), ['héllo "q"'], ["hello"]),
    ({"type": "sequence", "elements": [S("A"), {"type": "grammar", "grammar": 'root ::= "x" [0-9]+'}, S("B")]},
     ["Ax1B", "Ax12B"], ["AxB", "x1"]),
    ({"type": "tag", "begin": "<g>", "end": "</g>",
      "content": {"type": "grammar", "grammar": 'root ::= item ("," item)*\nitem ::= [a-z]+'}},
     ["<g>ab,c</g>"], ["<g>ab,</g>", "<g>A</g>"]),
    ({"type": "tag", "begin": "<g>", "content": {"type": "grammar", "grammar": "start: /[a-z]+/", "syntax": "lark"},
      "end": "</g>"}, ["<g>ab</g>"], ["<g>a1</g>"]),
    ({"type": "triggered_tags", "triggers": ["<f="], "tags": [call("a")], "excludes": ["STOP", "<x>"]},
     ["hi", "S T O P<f=a>2</f>", "<f=a>1</f>"], ["hi STOP", "<f=a>1</f> STOP", "a<x>b"]),
    # At most max_whitespace_cnt whitespace characters in a row in the JSON (84 texts compared, none apart).
    ({"type": "json_schema", "json_schema": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {
        "type": "array", "items": {"type": "string"}}}, "required": ["a"]}, "max_whitespace_cnt": 2},
     ['{"a":1}', '{  "a":  1}', '{"a":\n\n1}', '{"a": 1, "b": [ "x" ,  "y"]}'],
     ['{   "a": 1}', '{"a":\n\n\n1}', '{"a": 1, "b": [   "x"]}', '{"a":1,\t\t\t"b":[]}']),
    ({"type": "json_schema", "json_schema": True, "max_whitespace_cnt": 1}, ['[1, 2]', '{"q": {"r": 1}}'],
     ['[1,  2]', '{"q": {"r":  1}}']),
    # At most max_chars characters of any_text: ending the output, as a tag's content, before a const_string.
    ({"type": "any_text", "max_chars": 5}, ["", "abc", "abcde"], ["abcdef", "hello world"]),
    ({"type": "tag", "begin": "<t>", "content": {"type": "any_text", "max_chars": 4}, "end": "</t>"},
     ["<t>abcd</t>", "<t></t>"], ["<t>abcde</t>", "<t>a</t>b</t>"]),
    ({"type": "sequence", "elements": [{"type": "any_text", "max_chars": 3}, S("END")]}, ["END", "abcEND"],
     ["abcdEND"]),
    # dispatch: free text, each pattern followed by its format; without `loop` the output ends after the first.
    ({"type": "dispatch", "rules": [["<a>", J({"type": "integer"})], ["<b>", S("done")]]},
     ["", "hi", "<a>1", "x<a>12 y", "<b>done", "<a>1<b>done", "q<a>1 r<a>2 s", "S<b>doneT"], ["<a>x", "<a>"]),
    ({"type": "dispatch", "rules": [["<a>", J({"type": "integer"})], ["<b>", S("done")]], "loop": False,
      "excludes": ["STOP"]},
     ["", "hi", "<a>1", "<b>done"], ["x<a>12 y", "<a>1<b>done", "<a>", "STOP", "<a>1 STOP", "S<b>doneT"]),
]


@pytest.fixture(scope="module")
def token_matcher(smollm_path):
    """(takes(format, ids): whether the constraint takes those tokens and then lets the output end, enc(text),
    the EOS id), on SmolLM2's tokenizer."""
    tokenizer = Tokenizer.from_gguf(smollm_path)
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size)
    eos = next(iter(tokenizer.eos_token_ids))

    def takes(fmt: dict, ids: list[int]) -> bool:
        matcher = compiler.matcher(StructuredOutputsParams(structural_tag={"format": fmt}))
        if not all(matcher.consume(t) for t in ids):
            return False
        mask = np.zeros((1, bitmask_width(tokenizer.vocab_size)), np.int32)
        matcher.fill_bitmask(mask, 0)
        return bool((mask[0, eos // 32] >> (eos % 32)) & 1)

    def enc(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    return takes, enc, eos


@pytest.fixture(scope="module")
def accepts(token_matcher):
    """Whether the constraint takes every token of a text and then lets the output end."""
    takes, enc, _ = token_matcher
    return lambda fmt, text: takes(fmt, enc(text))


@pytest.mark.parametrize("at_least_one,stop_after_first", list(TRIGGERED))
def test_triggered_tags(accepts, at_least_one, stop_after_first):
    fmt = {"type": "triggered_tags", "triggers": ["<f=", "<g="],
           "tags": [call("a"), call("b"), call("b", close="</g>")],
           "at_least_one": at_least_one, "stop_after_first": stop_after_first}
    assert [t for t in TEXTS if accepts(fmt, t)] == TRIGGERED[at_least_one, stop_after_first]


@pytest.mark.parametrize("at_least_one,stop_after_first", list(SEPARATED))
def test_tags_with_separator(accepts, at_least_one, stop_after_first):
    fmt = {"type": "tags_with_separator", "tags": [call("a"), call("b")], "separator": ",",
           "at_least_one": at_least_one, "stop_after_first": stop_after_first}
    assert [t for t in SEPARATED_TEXTS if accepts(fmt, t)] == SEPARATED[at_least_one, stop_after_first]


@pytest.mark.parametrize("fmt,taken,refused", OTHERS, ids=[f"{f['type']}-{i}" for i, (f, _, _) in enumerate(OTHERS)])
def test_each_format(accepts, fmt, taken, refused):
    assert [t for t in taken + refused if accepts(fmt, t)] == taken


def test_requests_name_the_format_as_vllm_does_and_bad_formats_are_named():
    fmt = {"type": "triggered_tags", "triggers": ["<f="], "tags": [call("a")]}
    params = structured_outputs({"response_format": {"type": "structural_tag", "format": fmt}})
    assert params == StructuredOutputsParams(structural_tag={"format": fmt})
    assert structured_outputs({"structured_outputs": {"structural_tag": {"type": "structural_tag", "format": fmt}}})
    # As xgrammar's models dump themselves: every field, defaults included.
    dumped = {"type": "tag", "begin": "<t>", "content": {"type": "json_schema", "json_schema": {"type": "integer"},
                                                         "style": "json", "max_whitespace": None, "excludes": []},
              "end": "</t>"}
    assert structured_outputs({"response_format": {"type": "structural_tag", "format": dumped}}).grammar_spec()
    compiler_cases = [
        ({"type": "dispatch", "rules": []}, r"format.rules must be a non-empty list of \[pattern, format\] pairs"),
        ({"type": "sequence", "elements": [{"type": "dispatch", "rules": [["<a>", S("x")]]}, S("y")]},
         r"format.elements\[0\]: dispatch must end the output"),
        ({"type": "cohere_tags"}, "format type 'cohere_tags' is not supported"),
        ({"type": "sequence", "elements": [A, J({"type": "integer"})]}, r"format.elements\[0\]: any_text must end"),
        ({"type": "triggered_tags", "triggers": ["<f="], "tags": [call("a", close="</g>")]},
         r"begin '<g=a>' must start with exactly one of the triggers"),
        ({"type": "tag", "begin": "", "content": A, "end": "x"}, r"format.begin must be a non-empty string"),
        ({"type": "repeat", "content": S("z"), "min": 3, "max": 2}, "repeat needs 0 <= min <= max"),
        ({"type": "grammar", "grammar": "root ::= \"x\" [", "syntax": "ebnf"}, r"format.grammar"),
        ({"type": "grammar", "grammar": "x", "syntax": "regex"}, r"format.syntax must be 'ebnf' or 'lark'"),
        ({"type": "json_schema", "json_schema": {}, "style": "qwen_xml"}, r"json_schema's 'style' \('qwen_xml'\)"),
        ({"type": "tag", "begin": "<t>", "content": {"type": "any_text", "max_tokens": 5}, "end": "</t>"},
         r"format.content: any_text's max_tokens is taken where the any_text ends the output or comes before a "
         r"closing token"),
        ({"type": "any_text", "max_chars": -1}, r"format.max_chars must be a non-negative integer"),
        ({"type": "sequence", "elements": [{"type": "any_text", "limit": 3}, S("x")]},
         r"format.elements\[0\]: any_text's 'limit' \(3\) is not supported"),
        ({"type": "json_schema", "json_schema": {}, "max_whitespace_cnt": 0},
         r"format.max_whitespace_cnt must be a positive integer"),
        ({"type": "any_tokens", "exclude_tokens": [5], "max_tokens": 5000}, r"any_tokens' max_tokens is taken up to"),
    ]
    from server.errors import ApiError

    for bad, message in compiler_cases:
        with pytest.raises((ValueError, ApiError), match=message):
            structured_outputs({"response_format": {"type": "structural_tag", "format": bad}}).grammar_spec()


def test_token_formats(token_matcher):
    """Tokens by id or by a special token's text, one token not among some, any number not among them, and tags
    opened and closed by tokens: matched token by token (SmolLM2: 1 is <|im_start|>, 3 <repo_name>, 5 <file_sep>)."""
    takes, enc, eos = token_matcher
    assert eos not in (1, 3, 5)

    tag = {"type": "tag", "begin": {"type": "token", "token": "<|im_start|>"}, "content": J({"type": "integer"}),
           "end": {"type": "token", "token": 5}}
    assert takes(tag, [1, *enc("12"), 5])
    assert not takes(tag, [1, *enc("x"), 5]) and not takes(tag, [1, *enc("12")]) and not takes(tag, [3, *enc("1"), 5])
    upto = {"type": "sequence", "elements": [{"type": "any_tokens", "exclude_tokens": [5, eos]},
                                             {"type": "token", "token": 5}]}
    assert takes(upto, [*enc("hi there"), 5]) and takes(upto, [5])
    assert not takes(upto, [*enc("hi"), 5, 5]) and not takes(upto, enc("hi"))
    one = {"type": "exclude_token", "exclude_tokens": [1, 5]}
    assert takes(one, [7]) and not takes(one, [1]) and not takes(one, [7, 8])
    assert takes({"type": "token", "token": "<repo_name>"}, [3]) and not takes({"type": "token", "token": 3}, [4])
    from server.errors import ApiError

    for bad, message in [({"type": "token", "token": "hello"}, "must be a token id or a special token's text"),
                         ({"type": "any_tokens", "exclude_tokens": []}, "non-empty list of token ids"),
                         ({"type": "triggered_tags", "triggers": ["<f="], "tags": [{**call("a"), "begin": {
                             "type": "token", "token": 1}}]}, r"begin must be a non-empty string")]:
        with pytest.raises((ValueError, ApiError), match=message):
            structured_outputs({"response_format": {"type": "structural_tag", "format": bad}}).grammar_spec()


# token_triggered_tags, each row as xgrammar 0.2.9 matches it token by token on the same tokenizer (275 sequences
# compared, none apart): tokens other than the triggers (and the excluded ones), each trigger opening its tag;
# `at_least_one` opens the output with a tag, `stop_after_first` ends it with one. 8 and 10 open tags that 9 and
# 11 close (SmolLM2's <issue_start>, <issue_closed>, <issue_comment>, <jupyter_start>); 12 is excluded.
def test_token_triggered_tags(token_matcher):
    takes, enc, _ = token_matcher
    J_INT = J({"type": "integer"})

    def tag(begin, end, content=J_INT):
        return {"type": "tag", "begin": {"type": "token", "token": begin}, "content": content,
                "end": {"type": "token", "token": end} if isinstance(end, int) else end}

    def fmt(**kw):
        return {"type": "token_triggered_tags", "trigger_tokens": [8, 10], "tags": [tag(8, 9), tag(10, 11)], **kw}

    one, two = [8, *enc("12"), 9], [10, *enc("3"), 11]
    rows = [  # ids, then taken by: plain, at_least_one, stop_after_first, both, plain with 12 excluded
        ([], (True, False, True, False, True)),
        (enc("hi"), (True, False, True, False, True)),
        (one, (True, True, True, True, True)),
        (enc("x") + one + enc("y"), (True, False, False, False, True)),
        (one + two, (True, True, False, False, True)),
        (one + enc("z") + two + enc("z"), (True, True, False, False, True)),
        ([9], (True, False, True, False, True)),
        ([8, *enc("x"), 9], (False,) * 5),
        ([8, *enc("1")], (False,) * 5),
        ([10, *enc("2"), 9], (False,) * 5),
        (enc("x") + [12] + enc("y"), (True, False, True, False, False)),
    ]
    forms = [fmt(), fmt(at_least_one=True), fmt(stop_after_first=True), fmt(at_least_one=True, stop_after_first=True),
             fmt(exclude_tokens=[12])]
    for ids, taken in rows:
        assert tuple(takes(f, ids) for f in forms) == taken, ids
    # A tag closed by a string; any tokens up to the closing token.
    assert takes({"type": "token_triggered_tags", "trigger_tokens": [8], "tags": [tag(8, "</f>")]},
                 enc("q") + [8, *enc("7</f>r")])
    upto = {"type": "token_triggered_tags", "trigger_tokens": [8], "tags": [tag(8, 9, {"type": "any_text"})]}
    assert takes(upto, [8, *enc("any <f> text"), 9]) and not takes(upto, [8, *enc("x"), 9, 9, 8])
    from server.errors import ApiError

    for bad, message in [(fmt(trigger_tokens=["<issue_start>"]), r"trigger_tokens must be a non-empty list of token ids"),
                         ({**fmt(), "tags": [tag(3, 9)]}, r"tags\[0\].begin must be a token format whose token id is one "
                                                          r"of the trigger_tokens \[8, 10\]"),
                         ({"type": "sequence", "elements": [fmt(), S("x")]}, "token_triggered_tags must end the output")]:
        with pytest.raises((ValueError, ApiError), match=message):
            structured_outputs({"response_format": {"type": "structural_tag", "format": bad}}).grammar_spec()


def test_token_dispatch(token_matcher):
    """Free tokens in which each pattern token is followed by its format (as xgrammar 0.2.9 matches them: 48
    sequences compared, none apart); without `loop` the output ends after the first."""
    takes, enc, _ = token_matcher
    rules = [[8, J({"type": "integer"})], [10, S("done")]]
    rows = [  # ids, then taken with loop, without it, with loop and 12 excluded
        ([], (True, True, True)), (enc("hi"), (True, True, True)), ([8, *enc("12")], (True, True, True)),
        (enc("x") + [8, *enc("1")] + enc(" y"), (True, False, True)), ([8, *enc("x")], (False, False, False)),
        ([8, *enc("1"), 10, *enc("done")], (True, False, True)), ([8], (False, False, False)),
        (enc("a") + [12], (True, True, False)), ([9], (True, True, True)),
    ]
    forms = [{"type": "token_dispatch", "rules": rules}, {"type": "token_dispatch", "rules": rules, "loop": False},
             {"type": "token_dispatch", "rules": rules, "exclude_tokens": [12]}]
    for ids, taken in rows:
        assert tuple(takes(f, ids) for f in forms) == taken, ids


def test_token_budgets(token_matcher):
    """`max_tokens` of an any_text (ending the output, or before a closing token) and of an any_tokens: a token
    past the budget is refused, as xgrammar 0.2.9's mask refuses it (32 sequences with the character caps above
    compared, mask-driven, none apart)."""
    takes, enc, _ = token_matcher
    last = {"type": "any_text", "max_tokens": 3}
    assert [takes(last, enc(t)) for t in ("", "a b", "a b c", "a b c d")] == [True, True, True, False]
    tag = {"type": "tag", "begin": {"type": "token", "token": 8}, "content": {"type": "any_text", "max_tokens": 2},
           "end": {"type": "token", "token": 9}}
    assert [takes(tag, [8, *enc(t), 9]) for t in ("", "a", "a b", "a b c")] == [True, True, True, False]
    upto = {"type": "sequence", "elements": [{"type": "any_tokens", "exclude_tokens": [5], "max_tokens": 2},
                                             {"type": "token", "token": 5}]}
    assert [takes(upto, ids) for ids in ([5], [7, 5], [7, 8, 5], [7, 8, 9, 5])] == [True, True, True, False]
