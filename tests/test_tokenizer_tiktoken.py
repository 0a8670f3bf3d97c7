"""Moonshot's tiktoken vocabularies (Kimi K2, Moonlight: `tiktoken.model`, no `tokenizer.json`) against tiktoken's
own rule, run here in Python: split by Moonshot's pattern (Python's `regex`, whose V1 mode reads its class
intersections), then merge each piece's adjacent pair whose join has the lowest rank until none is a token.

The vocabulary is learned here on a small corpus (single bytes ranked out of byte order, as tiktoken's are), its
special tokens after the ranks as Moonshot's tokenizer_config.json names them, the rest filled in.
"""

from __future__ import annotations

import base64
import collections
import json
import random

import pytest

from jaxserve.tokenizer import Tokenizer
from jaxserve.tokenizer_tiktoken import KIMI_PATTERN

regex = pytest.importorskip("regex")

CORPUS = ("Hello world, the quick brown fox jumps over the lazy dog. It's 2025 and we're testing 12345 tokens!\n"
          "你好世界，这是一个测试。Hello世界 WÖRLD wörld CamelCaseWord don't\n\n  indented  code(x) -> y;")
TEXTS = ["Hello world", "the fox's dog jumps 1234567", "你好世界Hello世界", "CamelCaseWord WÖRLD wörld",
         "  two  spaces\n\nand\tTabs ", "x = f(a, b) -> [1, 2];", "It's<|im_end|>done[EOS]", "", "🙂 émoji"]


def _learn_ranks(merges: int = 150) -> dict[bytes, int]:
    order = list(range(256))
    random.Random(0).shuffle(order)
    ranks = {bytes([b]): i for i, b in enumerate(order)}
    words = [[bytes([b]) for b in piece.encode()] for piece in regex.findall(KIMI_PATTERN, CORPUS, flags=regex.V1)]
    for _ in range(merges):
        pairs = collections.Counter(p for w in words for p in zip(w, w[1:], strict=False))
        if not pairs:
            break
        (a, b), _count = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        ranks[a + b] = len(ranks)
        for w in words:
            i = 0
            while i < len(w) - 1:
                if (w[i], w[i + 1]) == (a, b):
                    w[i:i + 2] = [a + b]
                i += 1
    return ranks


RANKS = _learn_ranks()
BASE = len(RANKS)
NAMED = {BASE: "[BOS]", BASE + 1: "[EOS]", BASE + 2: "<|im_end|>", BASE + 3: "<|im_user|>"}


def _tiktoken(text: str) -> list[int]:
    """tiktoken's encoding with every special token allowed."""
    specials = {s: i for i, s in NAMED.items()}
    out = []
    for part in regex.split("(" + "|".join(map(regex.escape, specials)) + ")", text):
        if part in specials:
            out.append(specials[part])
            continue
        for piece in regex.findall(KIMI_PATTERN, part, flags=regex.V1):
            out += _merged(piece)
    return out


def _merged(piece: str) -> list[int]:
    """tiktoken's merges of one piece: its adjacent pair whose join has the lowest rank, until none is a token."""
    parts = [bytes([b]) for b in piece.encode()]
    while len(parts) > 1:
        joins = [RANKS.get(a + b, 1 << 30) for a, b in zip(parts, parts[1:], strict=False)]
        rank, i = min((r, i) for i, r in enumerate(joins))
        if rank == 1 << 30:
            break
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return [RANKS[p] for p in parts]


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    root = tmp_path_factory.mktemp("kimi")
    (root / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in RANKS.items()))
    config = {"tokenizer_class": "TikTokenTokenizer", "bos_token": "[BOS]", "eos_token": "[EOS]",
              "added_tokens_decoder": {str(i): {"content": s, "special": True} for i, s in NAMED.items()},
              "chat_template": "{% for m in messages %}<|im_user|>{{ m.content }}<|im_end|>{% endfor %}"}
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return root, Tokenizer.from_hf_dir(root)


def test_tiktoken_vocabulary_encodes_as_tiktoken(kimi):
    _, tok = kimi
    assert len([t for t in RANKS if len(t) > 1]) > 100  # (until every corpus word is one token)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == _tiktoken(text), text
        assert tok.decode(ids, skip_special_tokens=False) == text
    # Han runs apart from the cased words beside them (the pattern's class intersections, read as such).
    pieces = [p for p, _ in tok.backend.pre_tokenizer.pre_tokenize_str("Hello世界x")]
    assert pieces == ["Hello", "ä¸ĸçķĮ", "x"]


def test_tiktoken_special_tokens_follow_the_ranks(kimi):
    _, tok = kimi
    assert (tok.bos_token_id, tok.eos_token_ids[0]) == (BASE, BASE + 1)
    assert tok.encode("<|im_end|>") == [BASE + 2]
    assert tok.backend.token_to_id(f"<|reserved_token_{BASE + 10}|>") == BASE + 10
    assert tok.backend.get_vocab_size() == BASE + 258
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert tok.encode(prompt) == [BASE + 3, *_tiktoken("Hi"), BASE + 2]


def test_other_tiktoken_tokenizers_and_broken_files_are_refused(kimi, tmp_path):
    root, _ = kimi
    (tmp_path / "tiktoken.model").write_text((root / "tiktoken.model").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "QWenTokenizer"}))
    with pytest.raises(ValueError, match="QWenTokenizer.* not supported"):
        Tokenizer.from_hf_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "TikTokenTokenizer"}))
    (tmp_path / "tiktoken.model").write_text("SGVsbG8= 0\nnot-base64! 1\n")
    with pytest.raises(ValueError, match="tiktoken.model:2: not a base64 token"):
        Tokenizer.from_hf_dir(tmp_path)
    (tmp_path / "tiktoken.model").write_text("SGVsbG8= 0\nd29ybGQ= 2\n")
    with pytest.raises(ValueError, match="ranks are not 0 to 1"):
        Tokenizer.from_hf_dir(tmp_path)


def _converter_merges() -> list[str]:
    """The merges llama.cpp's converter writes for a tiktoken vocabulary: each token of two bytes or more, as the
    two parts tiktoken's rule leaves when only lower ranks may merge, in rank order, in the byte-level alphabet."""
    from jaxserve.tokenizer_gguf import byte_alphabet

    spell = byte_alphabet()
    merges = []
    for token, rank in sorted(RANKS.items(), key=lambda kv: kv[1]):
        if len(token) < 2:
            continue
        parts = [bytes([b]) for b in token]
        while len(parts) > 2:
            joins = [RANKS.get(a + b, 1 << 30) for a, b in zip(parts, parts[1:], strict=False)]
            best, i = min((r, i) for i, r in enumerate(joins))
            if best >= rank:
                break
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        assert len(parts) == 2, token
        merges.append(" ".join("".join(spell[b] for b in p) for p in parts))
    return merges


def test_gguf_kimi_k2_encodes_as_tiktoken(tmp_path):
    """A GGUF of a Kimi tokenizer as llama.cpp's converter writes one (pre `kimi-k2`, the ranks as byte-level tokens
    and their merges, the special tokens after them as control tokens): Moonshot's split, whole pieces looked up
    first, as tiktoken encodes."""
    gguf = pytest.importorskip("gguf")
    from jaxserve.tokenizer_gguf import byte_alphabet

    spell = byte_alphabet()
    tokens = ["".join(spell[b] for b in t) for t, _ in sorted(RANKS.items(), key=lambda kv: kv[1])]
    tokens += [NAMED[i] for i in sorted(NAMED)]
    writer = gguf.GGUFWriter(str(tmp_path / "k.gguf"), "deepseek2")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("kimi-k2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * BASE + [3] * len(NAMED))
    writer.add_token_merges(_converter_merges())
    writer.add_bos_token_id(BASE)
    writer.add_eos_token_id(BASE + 1)
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file,
                  writer.close):
        write()
    tok = Tokenizer.from_gguf(tmp_path / "k.gguf")
    for text in TEXTS:
        assert tok.encode(text) == _tiktoken(text), text
    assert [p for p, _ in tok.backend.pre_tokenizer.pre_tokenize_str("Hello世界x")] == ["Hello", "ä¸ĸçķĮ", "x"]


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "required": ["city"],
                                                          "properties": {"unit": {"enum": ["c", "f"], "type": "string"},
                                                                         "city": {"type": "string"}}}}}]


def test_kimi_tokenizer_sorts_tool_schemas(kimi, tmp_path):
    """Kimi K2's tokenizer class (`tokenization_kimi.TikTokenTokenizer`) sorts the tools' keys at every depth before
    its template renders them (`tools | tojson` keeps the order it is given); another tokenizer keeps them."""
    root, _ = kimi
    config = json.loads((root / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ tools | tojson(separators=(',', ':')) }}{{ messages[0].content }}"
    (tmp_path / "tiktoken.model").write_text((root / "tiktoken.model").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    plain = Tokenizer.from_hf_dir(tmp_path).apply_chat_template([{"role": "user", "content": "Hi"}], tools=TOOLS)
    assert plain == json.dumps(TOOLS, separators=(",", ":"), ensure_ascii=False) + "Hi"
    config["auto_map"] = {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.sort_tool_keys
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tools=TOOLS)
    assert text == json.dumps(TOOLS, separators=(",", ":"), ensure_ascii=False, sort_keys=True) + "Hi"
    assert text.index('"city"') < text.index('"unit"') and text.index('"description"') < text.index('"name"')
    assert text != plain


HY_NAMED = {1: "<|startoftext|>", 3: "<|eos|>", 5: "<|extra_0|>"}  # (after the ranks)
HY_RENAMED = {209: "<|hy_custom|>"}  # (a name the config gives in place of <|extra_204|>)


def _hy_tiktoken(text: str) -> list[int]:
    """Hunyuan's encoding (`HYTokenizer`: NFC first, every special token allowed, its split, tiktoken's merges)."""
    import unicodedata

    from jaxserve.tokenizer_tiktoken import HY_PATTERN, HY_SPECIALS

    specials = {s: BASE + j for j, s in enumerate(HY_SPECIALS)}
    out = []
    text = unicodedata.normalize("NFC", text)
    for part in regex.split("(" + "|".join(map(regex.escape, specials)) + ")", text):
        if part in specials:
            out.append(specials[part])
            continue
        for piece in regex.findall(HY_PATTERN, part):
            out += _merged(piece)
    return out


def test_hunyuan_tiktoken_vocabulary_encodes_as_its_tokenizer(tmp_path):
    """Hunyuan's `hy.tiktoken` (`HYTokenizer`): ranks by line, a repeated token skipped (the rank column not read),
    text NFC normalized, GPT-2's split with each digit apart; its 210 special tokens after the ranks
    (`<|endoftext|>`, `<|startoftext|>`, `<|bos|>`, `<|eos|>`, `<|pad|>`, `<|extra_0|>` ...)."""
    lines = [f"{base64.b64encode(t).decode()} {7 * r}" for t, r in sorted(RANKS.items(), key=lambda kv: kv[1])]
    lines.insert(300, lines[5])  # (a repeat: skipped, as HYTokenizer skips it)
    (tmp_path / "hy.tiktoken").write_text("\n".join(lines) + "\n")
    config = {"tokenizer_class": "HYTokenizer", "bos_token": "<|startoftext|>", "eos_token": "<|eos|>",
              "added_tokens_decoder": {str(BASE + i): {"content": s, "special": True}
                                       for i, s in {**HY_NAMED, **HY_RENAMED}.items()}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_hf_dir(tmp_path)
    decomposed = "Cafe\u0301 1234 n\u0303"  # (NFC turns these into é and ñ, as HYTokenizer's encode does)
    for text in [*TEXTS, decomposed, "<|startoftext|>Hi<|extra_4|>x<|eos|>"]:
        assert tok.encode(text) == _hy_tiktoken(text), text
    assert tok.encode("1234") == [RANKS[d] for d in (b"1", b"2", b"3", b"4")]  # (one digit a piece)
    assert (tok.bos_token_id, tok.eos_token_ids[0]) == (BASE + 1, BASE + 3)
    assert tok.backend.get_vocab_size() == BASE + 210 and tok.backend.token_to_id("<|extra_203|>") == BASE + 208
    assert tok.backend.token_to_id("<|hy_custom|>") == BASE + 209 and tok.backend.token_to_id("<|extra_204|>") is None
    assert tok.decode(tok.encode("Hello world"), skip_special_tokens=False) == "Hello world"
