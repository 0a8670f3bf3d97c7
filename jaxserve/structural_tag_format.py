"""Structural tags in their `format` form (xgrammar's, which vLLM passes through): a tree of formats, written as
one Lark grammar for llguidance.

`{"type": "structural_tag", "format": F}` where F is one of:
- `const_string` {value}; `json_schema` {json_schema, max_whitespace_cnt?} (at most that many whitespace characters
  in a row); `regex` {pattern}; `grammar` {grammar, syntax?} (EBNF / GBNF, or "lark"); `token` {token} (an id, or a
  special token's text `<...>`), `exclude_token` / `any_tokens`
  {exclude_tokens, max_tokens?} (one token, or any number up to `max_tokens`, not among those ids);
- `any_text` {excludes?, max_chars?, max_tokens?}: any text (without the `excludes` strings, where it ends the
  output; at most `max_chars` characters; at most `max_tokens` tokens where it ends the output or comes before a
  closing token);
- `sequence` {elements}, `or` {elements}, `optional` / `plus` / `star` {content}, `repeat` {content, min, max};
- `tag` {begin, content, end}: `begin`, the content, then `end` (a string or a list of strings; either may be a
  `token` format);
- `triggered_tags` {triggers, tags, at_least_one?, stop_after_first?, excludes?}: free text in which each trigger
  opens one of the tags whose begin it starts (the text never holds a trigger otherwise, nor an excluded string);
  `at_least_one`: the output opens with a tag; `stop_after_first`: it ends with the first tag;
- `tags_with_separator` {tags, separator, at_least_one?, stop_after_first?}: tags one after another with the
  separator between them (none allowed unless `at_least_one`; one at most with `stop_after_first`);
- `token_triggered_tags` {trigger_tokens, tags, exclude_tokens?, at_least_one?, stop_after_first?}: the same over
  tokens (ids): tokens other than the triggers and the excluded ones, each trigger opening the tag whose begin is
  that token; `at_least_one` opens the output with a tag, `stop_after_first` ends it with one;
- `dispatch` {rules: [[pattern, format], ...], loop?, excludes?}: free text in which each pattern string is followed
  by its format (without `loop`, the output ends after the first); `token_dispatch` {rules: [[token id, format],
  ...], loop?, exclude_tokens?}: the same over tokens.

Text of `any_text` is matched as xgrammar matches it: inside a tag it ends at the tag's first end string; followed
by a `const_string` it is any text that the string then ends; last, it runs to the end of the output. Anything
else (an `any_text` before another kind of format) is refused by name. Before a closing token, an
`any_text` is any text (special tokens aside).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

TEXT = "(?s:.*)"
_REPEAT_MAX = 64
_TOKENS_MAX = 1024  # an any_tokens' max_tokens: its bound is written out as a repetition
# Each format's keys besides "type"; another key is refused unless it holds its default (as a client that dumps
# xgrammar's models with every field sends them: None, False, [], the "json" style).
_KEYS = {"const_string": {"value"}, "json_schema": {"json_schema", "max_whitespace_cnt"}, "regex": {"pattern"},
         "grammar": {"grammar", "syntax"}, "any_text": {"excludes", "max_chars", "max_tokens"}, "sequence": {"elements"}, "or": {"elements"},
         "optional": {"content"}, "plus": {"content"}, "star": {"content"}, "repeat": {"content", "min", "max"},
         "tag": {"begin", "content", "end"},
         "triggered_tags": {"triggers", "tags", "at_least_one", "stop_after_first", "excludes"},
         "tags_with_separator": {"tags", "separator", "at_least_one", "stop_after_first"},
         "token": {"token"}, "exclude_token": {"exclude_tokens"}, "any_tokens": {"exclude_tokens", "max_tokens"},
         "token_triggered_tags": {"trigger_tokens", "tags", "exclude_tokens", "at_least_one", "stop_after_first"},
         "dispatch": {"rules", "loop", "excludes"}, "token_dispatch": {"rules", "loop", "exclude_tokens"}}


def _literal(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def _regex(pattern: str) -> str:
    return "/" + pattern.replace("/", "\\/") + "/"


def _without(strings: Sequence[str], text: str = TEXT) -> str:
    """A terminal's body: text (`text`, a regex: any) holding none of `strings`."""
    if not strings:
        return _regex(text)
    return f"{_regex(text)} & ~{_regex(TEXT + '(' + '|'.join(re.escape(s) for s in strings) + ')' + TEXT)}"


def _check_keys(f: Mapping[str, Any], where: str) -> None:
    kind = f["type"]
    for key, value in f.items():
        if key != "type" and key not in _KEYS.get(kind, {key}) and value not in (None, False, [], "json"):
            raise ValueError(f"{where}: {kind}'s {key!r} ({value!r}) is not supported")


def _other_tokens(ids: Sequence[int]) -> str:
    """One token not among `ids`."""
    return f"<[^{','.join(map(str, dict.fromkeys(ids)))}]>"


def _cap(f: Mapping[str, Any], key: str, where: str) -> int | None:
    value = f.get(key)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**31):
        raise ValueError(f"{where}.{key} must be a non-negative integer")
    return value


def _any_text(f: Mapping[str, Any], where: str, tokens_capped: bool) -> str:
    """An `any_text`'s text as a regex: any, or at most `max_chars` characters. `tokens_capped`: whether its place
    takes a `max_tokens` (where its text is a lexeme of its own)."""
    if _cap(f, "max_tokens", where) is not None and not tokens_capped:
        raise ValueError(f"{where}: any_text's max_tokens is taken where the any_text ends the output or comes "
                         "before a closing token")
    chars = _cap(f, "max_chars", where)
    return TEXT if chars is None else f"(?s:.{{0,{chars}}})"


class _Writer:
    """The rules of one grammar as they are made, each format a Lark expression."""

    def __init__(self) -> None:
        self.rules: list[str] = []
        self.grammars: list[dict[str, str]] = []  # named sub-grammars (`grammar` formats), referenced as @name

    def rule(self, body: str, lazy: bool = False, terminal: bool = False, max_tokens: int | None = None) -> str:
        name = f"{'R' if terminal else 'r'}{len(self.rules)}"
        attrs = ["lazy"] * lazy + ([] if max_tokens is None else [f"max_tokens={max_tokens}"])
        self.rules.append(f"{name}{'[' + ', '.join(attrs) + ']' if attrs else ''}: {body}")
        return name

    def text(self, f: Mapping[str, Any], body: str) -> str:
        """A terminal of `body` for an `any_text`, within its `max_tokens` if it has one."""
        text = self.rule(body, terminal=True)
        return text if f.get("max_tokens") is None else self.rule(text, max_tokens=f["max_tokens"])

    def format(self, f: Any, where: str, ends: list[str] | None = None, last: bool = False) -> tuple[str, bool]:
        """`f`'s expression and whether it took the `ends` after it (an `any_text` that runs to them); `last`:
        nothing follows it in the output."""
        if not isinstance(f, Mapping) or not isinstance(f.get("type"), str):
            raise ValueError(f"{where} must be an object with a 'type'")
        kind = f["type"]
        _check_keys(f, where)
        if kind == "any_text":
            excludes = _strings(f.get("excludes", []), f"{where}.excludes", empty=True)
            if ends:
                if excludes:
                    raise ValueError(f"{where}: any_text with excludes must end the output")
                text = self.rule(_regex(_any_text(f, where, False)), terminal=True)
                return self.rule(f"{text} ({' | '.join(map(_literal, ends))})", lazy=True), True
            if not last:
                raise ValueError(f"{where}: any_text must end the output, be (or end) a tag's content, or be "
                                 "followed by a const_string")
            return self.text(f, _without(excludes, _any_text(f, where, True))), False
        if kind == "const_string":
            return _literal(_string(f.get("value"), f"{where}.value")), False
        if kind == "json_schema":
            schema = f.get("json_schema")
            if not isinstance(schema, (Mapping, bool)):
                raise ValueError(f"{where}.json_schema must be a JSON schema")
            spaces = _cap(f, "max_whitespace_cnt", where)
            if spaces == 0:
                raise ValueError(f"{where}.max_whitespace_cnt must be a positive integer")
            if spaces is not None:  # at most that many whitespace characters in a row, between the JSON's tokens
                schema = {} if schema is True else {"not": {}} if schema is False else dict(schema)
                options = {**schema.get("x-guidance", {}), "whitespace_pattern": f"[ \\n\\r\\t]{{0,{spaces}}}"}
                schema = {**schema, "x-guidance": options}
            return f"%json {json.dumps(schema)}", False
        if kind == "regex":
            return _regex(_string(f.get("pattern"), f"{where}.pattern")), False
        if kind == "grammar":
            return self.grammar(f, where), False
        if kind == "token":
            return _token(f.get("token"), f"{where}.token"), False
        if kind in ("exclude_token", "any_tokens"):
            ids = _ids(f.get("exclude_tokens"), f"{where}.exclude_tokens")
            one = _other_tokens(ids)
            if kind == "exclude_token":
                return one, False
            cap = _cap(f, "max_tokens", where)
            if cap is not None and cap > _TOKENS_MAX:
                raise ValueError(f"{where}: any_tokens' max_tokens is taken up to {_TOKENS_MAX}")
            return (f"{one}*" if cap is None else f"({one} ~ 0..{cap})"), False
        if kind in ("triggered_tags", "token_triggered_tags", "dispatch", "token_dispatch"):
            if not last:
                raise ValueError(f"{where}: {kind} must end the output")
            write = {"triggered_tags": self.triggered, "token_triggered_tags": self.token_triggered}.get(kind,
                                                                                                     self.dispatch)
            return write(f, where), False
        if kind == "sequence":
            return self.sequence(_formats(f, "elements", where), where, ends, last)
        if kind == "or":
            parts = [self.format(e, f"{where}.elements[{i}]", last=last)[0]
                     for i, e in enumerate(_formats(f, "elements", where))]
            return f"({' | '.join(parts)})", False
        if kind in ("optional", "plus", "star"):
            inner = self.format(f.get("content"), f"{where}.content", last=last and kind == "optional")[0]
            return f"({inner}){ {'optional': '?', 'plus': '+', 'star': '*'}[kind]}", False
        if kind == "repeat":
            return self.repeat(f, where), False
        if kind == "tag":
            return self.tag(f, where), False
        if kind == "tags_with_separator":
            each = [self.tag(t, f"{where}.tags[{i}]") for i, t in enumerate(_formats(f, "tags", where))]
            tags = "(" + " | ".join(each) + ")"
            sep = _literal(_string(f.get("separator"), f"{where}.separator", empty=True))
            one = tags if f.get("stop_after_first") else f"{tags} ({sep} {tags})*"
            return one if f.get("at_least_one") else f"({one})?", False
        raise ValueError(f"{where}: format type {kind!r} is not supported (supported: const_string, json_schema, "
                         "regex, grammar, token, exclude_token, any_tokens, any_text, sequence, or, optional, plus, "
                         "star, repeat, tag, triggered_tags, token_triggered_tags, tags_with_separator, dispatch, "
                         "token_dispatch)")

    def sequence(self, elements: list[Any], where: str, ends: list[str] | None, last: bool) -> tuple[str, bool]:
        parts, took, i = [], False, 0
        while i < len(elements):
            e, here, final = elements[i], f"{where}.elements[{i}]", i == len(elements) - 1
            if isinstance(e, Mapping) and e.get("type") == "any_text" and not final \
                    and isinstance(elements[i + 1], Mapping) and elements[i + 1].get("type") == "const_string":
                _check_keys(e, here)
                if e.get("excludes"):
                    raise ValueError(f"{here}: any_text with excludes must end the output")
                value = _string(elements[i + 1].get("value"), f"{where}.elements[{i + 1}].value")
                parts.append(self.rule(_regex(_any_text(e, here, False) + re.escape(value)), terminal=True))
                i += 2
                continue
            expr, took = self.format(e, here, ends if final else None, last and final)
            parts.append(expr)
            i += 1
        return " ".join(parts) or '""', took

    def grammar(self, f: Mapping[str, Any], where: str) -> str:
        """A nested grammar (xgrammar's EBNF, llama.cpp's GBNF, or Lark), referenced as a grammar of its own."""
        from jaxserve.structured_outputs import _llguidance

        text, syntax = _string(f.get("grammar"), f"{where}.grammar"), f.get("syntax", "ebnf")
        if syntax not in ("ebnf", "lark"):
            raise ValueError(f"{where}.syntax must be 'ebnf' or 'lark', got {syntax!r}")
        name = f"g{len(self.grammars)}"
        try:
            lark = _llguidance().grammar_from("grammar", text) if syntax == "ebnf" else text
        except ValueError as e:
            raise ValueError(f"{where}.grammar: {e}") from None
        self.grammars.append({"name": name, "lark_grammar": lark})
        return f"@{name}"

    def repeat(self, f: Mapping[str, Any], where: str) -> str:
        lo, hi = f.get("min", 0), f.get("max", -1)
        if not (isinstance(lo, int) and isinstance(hi, int) and 0 <= lo and (hi == -1 or lo <= hi <= _REPEAT_MAX)
                and lo <= _REPEAT_MAX):
            raise ValueError(f"{where}: repeat needs 0 <= min <= max <= {_REPEAT_MAX} (max -1: unbounded)")
        inner = self.rule(self.format(f.get("content"), f"{where}.content")[0])
        tail = f"{inner}*" if hi == -1 else " ".join([f"{inner}?"] * (hi - lo))
        return "(" + " ".join([inner] * lo + [tail]) + ")"

    def tag(self, f: Any, where: str, trigger: tuple[str, str] | None = None) -> str:
        """A tag's expression; `trigger`: (a rule that matched text and then a trigger, that trigger), which the
        rest of the begin follows. A begin or an end may be a token format (`{"type": "token", ...}`)."""
        begin, end = _check_tag(f, where)
        head = _token(begin.get("token"), f"{where}.begin.token") if isinstance(begin, Mapping) else None
        tail = _token(end.get("token"), f"{where}.end.token") if isinstance(end, Mapping) else None
        text = "" if head else _string(begin, f"{where}.begin")
        ends = [] if tail else _strings([end] if isinstance(end, str) else end, f"{where}.end")
        inner = f.get("content")
        if tail and isinstance(inner, Mapping) and inner.get("type") == "any_text" and not inner.get("excludes"):
            # any text, up to the closing token
            content, took = self.text(inner, _regex(_any_text(inner, f"{where}.content", True))), False
        else:
            content, took = self.format(inner, f"{where}.content", ends or None)
        if head is None and trigger is None:
            head = _literal(text)
        elif head is None:
            rest = text[len(trigger[1]):]
            head = f"{trigger[0]} {_literal(rest)}" if rest else trigger[0]
        closing = tail or "(" + " | ".join(map(_literal, ends)) + ")"
        return f"({head} {content}{'' if took else ' ' + closing})"

    def triggered(self, f: Mapping[str, Any], where: str) -> str:
        triggers = _strings(f.get("triggers"), f"{where}.triggers")
        excludes = _strings(f.get("excludes", []), f"{where}.excludes", empty=True)
        free = self.rule(_without(triggers + excludes), terminal=True)  # text with no trigger (nor excluded string)
        opened = {t: self.rule(f"{free} {_literal(t)}", lazy=True) for t in triggers}  # such text, then a trigger
        first, later = [], []
        for i, t in enumerate(_formats(f, "tags", where)):
            begin = _string(_check_tag(t, f"{where}.tags[{i}]")[0], f"{where}.tags[{i}].begin")
            trigger = [g for g in triggers if begin.startswith(g)]
            if len(trigger) != 1:
                raise ValueError(f"{where}.tags[{i}].begin {begin!r} must start with exactly one of the triggers "
                                 f"{triggers}")
            first.append(self.tag(t, f"{where}.tags[{i}]"))
            later.append(self.tag(t, f"{where}.tags[{i}]", (opened[trigger[0]], trigger[0])))
        at_least_one, stop = f.get("at_least_one", False), f.get("stop_after_first", False)
        any_first, any_later = "(" + " | ".join(first) + ")", "(" + " | ".join(later) + ")"
        if stop:
            return any_first if at_least_one else f"({free} | {any_later})"
        return f"{any_first} {any_later}* {free}" if at_least_one else f"{any_later}* {free}"

    def dispatch(self, f: Mapping[str, Any], where: str) -> str:
        """`dispatch`: free text in which each pattern string is followed by its format; `token_dispatch`: free
        tokens in which each pattern token is. `loop` (the default): free text again after each; else the output
        ends after the first."""
        rules = _rules(f, where)
        if f["type"] == "dispatch":
            patterns = [_string(p, f"{where}.rules[{i}][0]") for i, (p, _) in enumerate(rules)]
            excludes = _strings(f.get("excludes", []), f"{where}.excludes", empty=True)
            free = self.rule(_without(patterns + excludes), terminal=True)
            heads = [self.rule(f"{free} {_literal(p)}", lazy=True) for p in patterns]  # text, then the pattern
        else:
            patterns = _ids([p for p, _ in rules], f"{where}.rules' patterns")
            excludes = _ids(f.get("exclude_tokens", []), f"{where}.exclude_tokens", empty=True)
            free = f"{_other_tokens(patterns + excludes)}*"
            heads = [f"{free} <[{p}]>" for p in patterns]
        branch = "(" + " | ".join(f"{head} {self.format(fmt, f'{where}.rules[{i}][1]')[0]}"
                                  for i, (head, (_, fmt)) in enumerate(zip(heads, rules, strict=True))) + ")"
        return f"{branch}* {free}" if f.get("loop", True) else f"({free} | {branch})"

    def token_triggered(self, f: Mapping[str, Any], where: str) -> str:
        """Tokens other than the triggers (and `exclude_tokens`), in which each trigger token opens the tag
        that begins with it."""
        triggers = _ids(f.get("trigger_tokens"), f"{where}.trigger_tokens")
        excludes = _ids(f.get("exclude_tokens", []), f"{where}.exclude_tokens", empty=True)
        free = f"{_other_tokens(triggers + excludes)}*"
        tags = []
        for i, t in enumerate(_formats(f, "tags", where)):
            begin = _check_tag(t, f"{where}.tags[{i}]")[0]
            token = begin.get("token") if isinstance(begin, Mapping) and begin.get("type") == "token" else None
            if token not in triggers:
                raise ValueError(f"{where}.tags[{i}].begin must be a token format whose token id is one of the "
                                 f"trigger_tokens {triggers}, got {begin!r}")
            tags.append(self.tag(t, f"{where}.tags[{i}]"))
        tag = "(" + " | ".join(tags) + ")"
        at_least_one, stop = f.get("at_least_one", False), f.get("stop_after_first", False)
        if stop:  # (as with string triggers, `at_least_one` opens the output with a tag)
            return tag if at_least_one else f"{free} {tag}?"
        return f"{tag} ({free} {tag})* {free}" if at_least_one else f"({free} {tag})* {free}"


def _rules(f: Mapping[str, Any], where: str) -> list[tuple[Any, Any]]:
    rules = f.get("rules")
    if not isinstance(rules, list) or not rules or not all(isinstance(r, (list, tuple)) and len(r) == 2 for r in rules):
        raise ValueError(f"{where}.rules must be a non-empty list of [pattern, format] pairs")
    return [tuple(r) for r in rules]


def _ids(value: Any, where: str, empty: bool = False) -> list[int]:
    if not isinstance(value, list) or (not value and not empty) or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value):
        raise ValueError(f"{where} must be a {'' if empty else 'non-empty '}list of token ids")
    return value


def _token(value: Any, where: str) -> str:
    """One token, by id or as a special token's text (`<...>`, as llguidance names them)."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return f"<[{value}]>"
    if isinstance(value, str) and re.fullmatch(r"<[^<>\s]+>", value):
        return value
    raise ValueError(f"{where} must be a token id or a special token's text written <...>, got {value!r}")


def _string(value: Any, where: str, empty: bool = False) -> str:
    if not isinstance(value, str) or (not value and not empty):
        raise ValueError(f"{where} must be a {'' if empty else 'non-empty '}string")
    return value


def _strings(value: Any, where: str, empty: bool = False) -> list[str]:
    if not isinstance(value, list) or (not value and not empty):
        raise ValueError(f"{where} must be a {'' if empty else 'non-empty '}list of strings")
    return [_string(v, f"{where}[{i}]") for i, v in enumerate(value)]


def _formats(f: Mapping[str, Any], key: str, where: str) -> list[Any]:
    value = f.get(key)
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}.{key} must be a non-empty list of formats")
    return value


def _check_tag(f: Any, where: str) -> tuple[Any, Any]:
    """A tag's begin and end, as given."""
    if not isinstance(f, Mapping) or f.get("type", "tag") != "tag":
        raise ValueError(f"{where} must be a tag {{'begin', 'content', 'end'}}")
    return f.get("begin"), f.get("end")


def format_grammar(tag: Mapping[str, Any]) -> str:
    """The llguidance grammar of a structural tag's `format`: its Lark text, or with nested grammars the JSON of
    all of them (the first the format's); ValueError naming what is wrong."""
    w = _Writer()
    start, _ = w.format(tag.get("format"), "format", last=True)
    lark = "\n".join([f"start: {start}", *w.rules]) + "\n"
    return json.dumps({"grammars": [{"lark_grammar": lark}, *w.grammars]}) if w.grammars else lark
