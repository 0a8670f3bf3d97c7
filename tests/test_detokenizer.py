"""Incremental detokenization and stop strings, on the bundled SmolLM2 tokenizer."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.detokenizer import IncrementalDetokenizer, StopChecker, find_stop, partial_stop_suffix
from jaxserve.tokenizer import Tokenizer, byte_alphabet

MULTIBYTE = "Emoji 😀👍🏽🇫🇷👨‍👩‍👧 then 中文字符，日本語のテキスト、한국어 ✨🚀 done. Ünïcödé ∑∞≠"


@pytest.fixture(scope="module")
def tok(smollm_path) -> Tokenizer:
    return Tokenizer.from_gguf(smollm_path)


def _stream(detok: IncrementalDetokenizer, ids: list[int], chunks: list[int]) -> list[str]:
    out, i = [], 0
    for n in chunks:
        out.append(detok.add(ids[i : i + n]))
        i += n
    out.append(detok.add(ids[i:]))
    out.append(detok.flush())
    return out


def test_token_by_token_multibyte(tok):
    ids = tok.encode(MULTIBYTE)
    # The text must really split characters across tokens, or this test proves nothing.
    assert sum("\ufffd" in tok.decode([i]) for i in ids) >= 5
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(i) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # some tokens had to be held back
    assert detok.flush() == ""
    assert "".join(deltas) == tok.decode(ids) == MULTIBYTE == detok.text
    assert detok.num_generated == len(ids)


def test_prompt_context_and_special_tokens(tok):
    prompt = tok.encode_chat([{"role": "user", "content": "Say hi 👋"}])
    generated = tok.encode("Hi 👋 你好!") + [tok.eos_token_ids[0]]
    for skip in (True, False):
        detok = IncrementalDetokenizer(tok, prompt_ids=prompt, skip_special_tokens=skip)
        text = "".join(detok.add(i) for i in generated) + detok.flush()
        assert text == tok.decode(generated, skip_special_tokens=skip)
    assert text.endswith("<|im_end|>")


def test_unresolved_byte_is_released_by_flush(tok):
    lead = tok.token_to_id(byte_alphabet()[0xF0])  # first byte of a 4-byte character, never completed
    detok = IncrementalDetokenizer(tok)
    assert detok.add(tok.encode("ok ")) == "ok "
    assert detok.add(lead) == ""
    assert detok.flush() == "\ufffd"
    assert detok.text == tok.decode(tok.encode("ok ") + [lead])


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_any_chunking_gives_the_full_decode(tok, data):
    text = data.draw(st.text(alphabet=st.sampled_from(list("ab 1\n你😀é👍🏽")), max_size=30))
    ids = tok.encode(text)
    chunks = data.draw(st.lists(st.integers(0, 4), max_size=len(ids)))
    deltas = _stream(IncrementalDetokenizer(tok), ids, chunks)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == text


def test_window_stays_short(tok):
    ids = tok.encode(MULTIBYTE * 20)
    detok = IncrementalDetokenizer(tok)
    longest = 0
    for i in ids:
        detok.add(i)
        longest = max(longest, len(detok._ids))
    # Only the pending ids plus the last emitted stretch are kept, never the whole output.
    assert longest <= 8
    assert detok.text == tok.decode(ids)


def test_find_stop():
    assert find_stop("abcSTOPdef", 10, ["STOP"]).end == 3
    m = find_stop("abcSTOPdef", 10, ["STOP"], include_stop_str_in_output=True)
    assert (m.end, m.stop_str, m.hold_back) == (7, "STOP", 0)
    # Earliest completion wins, whatever the list order: "b" completes before "abc" does.
    assert find_stop("xabc", 4, ["abc", "b"]) == find_stop("xabc", 4, ["b", "abc"])
    assert find_stop("xabc", 4, ["abc", "b"]).stop_str == "b"
    # Same end: the longer string, so more is cut.
    assert find_stop("xabc", 4, ["c", "bc"]).end == 2
    m = find_stop("Hello ST", 3, ["STOP", "\n\n"])
    assert (m.end, m.stop_str, m.hold_back) == (8, None, 2)
    # Only the tail the new characters can reach is searched: an old match is not found again.
    assert find_stop("STOP and more", 3, ["STOP"]).stop_str is None
    assert partial_stop_suffix("abcab", ["abx", "bc"]) == 2
    assert partial_stop_suffix("", ["abc"]) == 0


def test_stop_string_across_tokens(tok):
    answer, stop = "The answer is 42 😀.", "\nUser:"
    ids = tok.encode(answer + stop + " more text that must not appear")
    # The stop string spans several tokens.
    assert not any(stop in tok.decode([i]) for i in ids)
    for include in (False, True):
        detok, checker = IncrementalDetokenizer(tok), StopChecker([stop, "never"], include)
        streamed = ""
        for i in ids:
            out = checker.add(detok.add(i))
            streamed += out.text
            # Nothing of the stop string is streamed before it is known to match (the text has no other "\n").
            assert "\n" not in streamed or out.stop_str is not None
            if out.stop_str is not None:
                break
        assert checker.stop_str == stop
        assert streamed == (answer + stop if include else answer)


def _reference_cut(text: str, stop: list[str], include: bool) -> tuple[str, str | None]:
    """Check after every character; at the first completed stop string take the longest one."""
    for i in range(1, len(text) + 1):
        done = [s for s in stop if text[:i].endswith(s)]
        if done:
            s = max(done, key=len)
            return (text[:i] if include else text[: i - len(s)]), s
    return text, None


@settings(max_examples=150, deadline=None)
@given(
    text=st.text(alphabet="ab\n", max_size=25),
    stop=st.lists(st.text(alphabet="ab\n", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 25), max_size=8),
    include=st.booleans(),
)
def test_stop_checker_matches_char_by_char_reference(text, stop, cuts, include):
    expected, expected_stop = _reference_cut(text, stop, include)
    checker = StopChecker(stop, include)
    bounds = [0, *sorted(set(c for c in cuts if c <= len(text))), len(text)]
    streamed = ""
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        out = checker.add(text[lo:hi])
        streamed += out.text
        assert expected.startswith(streamed)  # never streams what a stop string later removes
        assert len(checker.held_back) < max(map(len, stop))
        if out.stop_str is not None:
            break
    else:
        streamed += checker.flush()
    assert (streamed, checker.stop_str) == (expected, expected_stop)


def test_stop_checker_refuses_misuse():
    with pytest.raises(ValueError):
        StopChecker(["ok", ""])
    checker = StopChecker(["x"])
    assert checker.add("ax").stop_str == "x"
    with pytest.raises(RuntimeError):
        checker.add("more")
    assert StopChecker([]).add("anything").text == "anything"


@pytest.fixture(scope="module")
def spm(tmp_path_factory) -> Tokenizer:
    """A SentencePiece vocabulary with byte fallback (Llama 2, Mistral, Gemma GGUFs'), read from a GGUF."""
    from tests.test_tokenizer import _spm_gguf

    return Tokenizer.from_gguf(_spm_gguf(tmp_path_factory.mktemp("spm") / "spm.gguf"))


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_sentencepiece_any_chunking_gives_the_full_decode(spm, data):
    """Pieces spelling spaces with ▁ and characters outside the vocabulary as <0xNN> bytes, streamed in any
    chunks after a prompt (or none): the text is what the tokens add to the prompt's (a leading ▁ is a space
    after a prompt, dropped at the very start, as SentencePiece decodes), no partial character ever sent."""
    text = data.draw(st.text(alphabet=st.sampled_from(list("the quick fox  é你😀\n")), max_size=30))
    ids = spm.encode(text)
    prompt = spm.encode(data.draw(st.sampled_from(["", "hello there", "the  wide"])), add_special_tokens=True)
    chunks = data.draw(st.lists(st.integers(0, 4), max_size=len(ids)))
    deltas = _stream(IncrementalDetokenizer(spm, prompt_ids=prompt or None), ids, chunks)
    assert all("\ufffd" not in d for d in deltas)
    whole, before = spm.decode(prompt + ids), spm.decode(prompt)
    assert whole.startswith(before) and "".join(deltas) == whole[len(before):]
