"""The tokenizer and chat template against transformers on the bundled SmolLM2 GGUF."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from jaxserve.chat_template import ChatTemplateError, compile_chat_template, render_chat_template
from jaxserve.tokenizer import Tokenizer, byte_alphabet

TEXTS = [
    "Hello, world! How are you today?",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)  # slow\n",
    "Pi is 3.14159, e is 2.71828; 1,000,000 + 12345678 = 13345678 (0x1F, 1e-9)",
    "你好，世界！机器学习很有趣。日本語のテキストも。한국어 문장입니다.",
    "Emoji: 😀 👍🏽 🇫🇷 👨‍👩‍👧 ❤️ ✨🚀",
    "  leading spaces,\ttabs\t\tand\n\n\nnewlines \r\n trailing   ",
    "Ünïcödé naïve café — «quotes» ‘single’ “double” …",
    "<|im_start|>user\nspecial tokens inside text<|im_end|>\n",
    "",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "List three prime numbers."},
    ],
    [
        {"role": "user", "content": "Explain photosynthesis in one sentence."},
        {"role": "assistant", "content": "Plants turn light, water and CO2 into sugar and oxygen."},
        {"role": "user", "content": "And chlorophyll? 🌿 叶绿素"},
    ],
]


@pytest.fixture(scope="module")
def ours(smollm_path) -> Tokenizer:
    return Tokenizer.from_gguf(smollm_path)


@pytest.fixture(scope="module")
def hf(hf_smollm):
    return hf_smollm[1]  # the session's transformers tokenizer on the same GGUF (loading one takes ~15 s)


@pytest.fixture(scope="module")
def saved_dir(ours, tmp_path_factory):
    return ours.save_hf(tmp_path_factory.mktemp("smollm_tokenizer"))


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_encode_decode_match_transformers(ours, hf, text):
    ids = ours.encode(text)
    assert ids == hf(text, add_special_tokens=False)["input_ids"]
    assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)


def test_digits_are_split_one_by_one(ours):
    # SmolLM's pre-tokenizer: each digit is its own token and a space before a number stands alone.
    assert _pieces(ours, "year 2024!") == ["year", "Ġ", "2", "0", "2", "4", "!"]
    ids = ours.encode("year 2024")
    assert [ours.id_to_token(i) for i in ids] == ["year", "Ġ", "2", "0", "2", "4"]


def test_special_tokens(ours, hf):
    assert ours.vocab_size == len(hf) == 49152
    assert (ours.bos_token_id, ours.eos_token_ids, ours.pad_token_id) == (1, (2,), 2)
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == (hf.bos_token, hf.eos_token, hf.pad_token)
    assert ours.model_max_length == 8192
    hf_special = {i for i, t in hf.added_tokens_decoder.items() if t.special}
    assert set(ours.all_special_ids) == hf_special
    assert ours.encode("<|im_start|>") == [1]
    assert ours.token_to_id("<|im_end|>") == 2 and ours.id_to_token(2) == "<|im_end|>"
    assert ours.decode([1, 2]) == ""


@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=["user", "system", "multi_turn"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours, hf, conversation, add_generation_prompt):
    text = ours.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    expected = hf.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert text == expected
    hf_ids = hf.apply_chat_template(conversation, tokenize=True, add_generation_prompt=add_generation_prompt)
    hf_ids = hf_ids["input_ids"] if hasattr(hf_ids, "keys") else hf_ids
    assert ours.encode_chat(conversation, add_generation_prompt=add_generation_prompt) == list(hf_ids)


@pytest.mark.parametrize("final", ["The capital is", "  Paris, of course.  "])
def test_continue_final_message_matches_transformers(ours, hf, final):
    """The rendered chat ends with the final message's text, as transformers cuts it (its spacing kept); with
    text parts, after the last one."""
    conversation = [{"role": "user", "content": "What is the capital of France?"},
                    {"role": "assistant", "content": final}]
    text = ours.apply_chat_template(conversation, add_generation_prompt=False, continue_final_message=True)
    assert text == hf.apply_chat_template(conversation, tokenize=False, continue_final_message=True)
    assert text.endswith(final)
    parts = [conversation[0], {"role": "assistant", "content": [{"type": "text", "text": "A."},
                                                                 {"type": "text", "text": "B"}]}]
    assert ours.apply_chat_template(parts, add_generation_prompt=False, continue_final_message=True).endswith(
        "<|im_start|>assistant\nA.\nB")
    with pytest.raises(ValueError, match="cannot both be set"):
        ours.apply_chat_template(conversation, add_generation_prompt=True, continue_final_message=True)


def test_content_parts_are_joined(ours, hf):
    parts = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {
            "role": "user",
            "content": [{"type": "text", "text": "First part."}, {"type": "text", "text": "Second."}],
        },
    ]
    plain = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "First part.\nSecond."},
    ]
    assert ours.apply_chat_template(parts) == hf.apply_chat_template(
        plain, tokenize=False, add_generation_prompt=True
    )


def test_unsupported_content_part_is_refused(ours):
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(ValueError, match="image_url"):
        ours.apply_chat_template(image)


# Exercises what differs between a plain Jinja environment and transformers': whitespace trimming,
# tojson (no HTML escaping, key order kept, non-ASCII kept), namespace, loop controls, {% generation %}.
RICH_TEMPLATE = """{{ bos_token }}
{% set ns = namespace(n=0) %}
{% if tools %}
    Tools: {{ tools | tojson }}
    Indented: {{ tools[0] | tojson(indent=2) }}
{% endif %}
{% for m in messages %}
    {% if m.role == 'skip' %}{% continue %}{% endif %}
    {% set ns.n = ns.n + 1 %}
    {% if m.role == 'assistant' %}
        {% generation %}<a>{{ m.content }}{{ eos_token }}</a>{% endgeneration %}
    {% else %}
        <{{ m.role }}>{{ m.content | trim }}</{{ m.role }}>
    {% endif %}
    {% if ns.n >= 4 %}{% break %}{% endif %}
{% endfor %}
count={{ ns.n }} {{ dict(a=1) | tojson }} {{ custom_flag }}
{% if add_generation_prompt %}<a>{% endif %}"""


def test_rich_template_matches_transformers(ours, hf):
    messages = [
        {"role": "user", "content": "  <b>&</b> 'quoted' 中文  "},
        {"role": "skip", "content": "never shown"},
        {"role": "assistant", "content": "Sure."},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "cut by break"},
    ]
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Wetter <heute> & morgen",
                "parameters": {"z": 1, "a": "é"},
            },
        }
    ]
    ours_text = render_chat_template(
        RICH_TEMPLATE, messages, tools=tools, custom_flag=True, **ours.special_tokens_map
    )
    hf_text = hf.apply_chat_template(
        messages,
        chat_template=RICH_TEMPLATE,
        tools=tools,
        tokenize=False,
        add_generation_prompt=True,
        custom_flag=True,
    )
    assert ours_text == hf_text
    assert "<heute> & morgen" in ours_text and '"z": 1, "a": "é"' in ours_text
    assert "cut by break" not in ours_text and "never shown" not in ours_text


def test_template_helpers_and_errors():
    assert render_chat_template("{{ strftime_now('%Y') | length }}", [{"role": "user", "content": ""}]) == "4"
    refusing = (
        "{% if messages[0].role != 'system' %}{{ raise_exception('need a system message') }}{% endif %}"
    )
    with pytest.raises(ChatTemplateError, match="need a system message"):
        render_chat_template(refusing, [{"role": "user", "content": "hi"}])
    with pytest.raises(ChatTemplateError, match="compile"):
        render_chat_template("{% for %}", [{"role": "user", "content": "hi"}])
    with pytest.raises(ChatTemplateError):  # the sandbox keeps templates away from Python internals
        render_chat_template(
            "{% set ns = namespace() %}{% set ns.__class__ = 1 %}", [{"role": "user", "content": ""}]
        )
    with pytest.raises(ValueError, match="empty"):
        render_chat_template("x", [])
    # Compiled once per distinct text.
    assert compile_chat_template(RICH_TEMPLATE) is compile_chat_template(RICH_TEMPLATE)


def test_none_content_is_dropped_like_transformers(ours, hf):
    messages = [{"role": "user", "content": "hi", "name": None}]
    template = "{% for m in messages %}{{ m.name is defined }}{{ m.content }}{% endfor %}"
    assert render_chat_template(template, messages) == "Falsehi"
    assert hf.apply_chat_template(messages, chat_template=template, tokenize=False) == "Falsehi"


def test_save_hf_loads_in_transformers(ours, saved_dir):
    transformers = pytest.importorskip("transformers")
    names = set(os.listdir(saved_dir))
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= names
    config = json.loads((saved_dir / "tokenizer_config.json").read_text())
    assert config["chat_template"] == ours.chat_template and config["model_max_length"] == 8192

    reloaded = transformers.AutoTokenizer.from_pretrained(str(saved_dir))
    for text in TEXTS:
        for add_special in (False, True):
            ids = ours.encode(text, add_special_tokens=add_special)
            assert reloaded(text, add_special_tokens=add_special)["input_ids"] == ids
            assert reloaded.decode(ids, skip_special_tokens=True) == ours.decode(ids)
    assert (reloaded.bos_token_id, reloaded.eos_token_id, reloaded.pad_token_id) == (1, 2, 2)
    for conversation in CONVERSATIONS:
        assert reloaded.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True) == (
            ours.apply_chat_template(conversation)
        )


def test_from_hf_dir_round_trip(ours, saved_dir, tmp_path):
    loaded = Tokenizer.from_hf_dir(saved_dir)
    for text in TEXTS:
        assert loaded.encode(text) == ours.encode(text)
    assert loaded.vocab_size == ours.vocab_size
    assert (loaded.bos_token_id, loaded.eos_token_ids, loaded.pad_token_id) == (1, (2,), 2)
    assert loaded.all_special_ids == ours.all_special_ids
    assert loaded.chat_template == ours.chat_template and loaded.model_max_length == 8192

    # Extra end-of-generation ids come from generation_config.json and survive save_hf.
    (saved_dir / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [2, 0], "temperature": 0.2})
    )
    try:
        with_gen = Tokenizer.from_hf_dir(saved_dir)
    finally:
        (saved_dir / "generation_config.json").unlink()
    assert with_gen.eos_token_ids == (2, 0)
    again = Tokenizer.from_hf_dir(with_gen.save_hf(tmp_path / "again"))
    assert again.eos_token_ids == (2, 0)

    # An image-text model's processor file chat_template.json serves when the config has no template.
    config = json.loads((tmp_path / "again" / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tmp_path / "again" / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "again" / "chat_template.json").write_text(json.dumps({"chat_template": "<{{ messages[0].content }}>"}))
    assert Tokenizer.from_hf_dir(tmp_path / "again").apply_chat_template([{"role": "user", "content": "x"}]) == "<x>"
    # A standalone chat_template.jinja wins over the config entry, as in transformers.
    (tmp_path / "again" / "chat_template.jinja").write_text("{{ messages[0].content }}!")
    assert (
        Tokenizer.from_hf_dir(tmp_path / "again").apply_chat_template([{"role": "user", "content": "x"}])
        == "x!"
    )


def test_missing_files_are_named(saved_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "tokenizer.json")):
        Tokenizer.from_hf_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes((saved_dir / "tokenizer.json").read_bytes())
    with pytest.raises(FileNotFoundError, match="tokenizer_config.json"):
        Tokenizer.from_hf_dir(tmp_path)
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        Tokenizer.from_gguf(tmp_path / "nope.gguf")


def _tiny_gguf(path, *, model="gpt2", pre="llama-bpe", add_bos=False):
    """A GGUF holding only a tokenizer: the 256 byte tokens, two merges and two control tokens."""
    gguf = pytest.importorskip("gguf")
    tokens = [byte_alphabet()[b] for b in range(256)] + ["Ġo", "Ġok", "<s>", "</s>"]
    types = [1] * 258 + [3, 3]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(["Ġ o", "Ġo k"])
    writer.add_bos_token_id(258)
    writer.add_eos_token_id(259)
    writer.add_bool("tokenizer.ggml.add_bos_token", add_bos)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _pieces(tok: Tokenizer, text: str) -> list[str]:
    return [piece for piece, _ in tok.backend.pre_tokenizer.pre_tokenize_str(text)]


def test_llama3_and_qwen2_pre_tokenizers(tmp_path):
    from jaxserve.loader.gguf_header import GGUFHeader
    from jaxserve.tokenizer_gguf import _QWEN35_SPLIT

    llama = Tokenizer.from_gguf(
        GGUFHeader(_tiny_gguf(tmp_path / "l.gguf", pre="llama-bpe", add_bos=True))
    )
    assert _pieces(llama, "I'm 12345 ok\n\nyes") == ["I", "'m", "Ġ", "123", "45", "Ġok", "ĊĊ", "yes"]
    assert llama.encode(" ok") == [257] and llama.encode(" ok", add_special_tokens=True) == [258, 257]
    assert llama.decode([258, 257, 259], skip_special_tokens=False) == "<s> ok</s>"
    assert llama.all_special_ids == (258, 259)

    qwen = Tokenizer.from_gguf(_tiny_gguf(tmp_path / "q.gguf", pre="qwen2"))
    assert _pieces(qwen, "I'm 12345 ok") == ["I", "'m", "Ġ", "1", "2", "3", "4", "5", "Ġok"]
    assert qwen.encode("e\u0301") == qwen.encode("\u00e9")  # NFC, as Qwen2's tokenizer.json has
    assert qwen.encode(" ok", add_special_tokens=True) == [257]
    # Qwen3.5's: combining marks kept in words, where Qwen2's cuts them off; NFC too
    qwen35 = Tokenizer.from_gguf(_tiny_gguf(tmp_path / "q35.gguf", pre="qwen35"))
    assert _pieces(qwen35, "I'm 12345 ok") == _pieces(qwen, "I'm 12345 ok")
    marked = "xa\u0308\u0301y ok"
    assert _pieces(qwen35, marked) == _regex_pieces((_QWEN35_SPLIT,), marked)
    assert len(_pieces(qwen35, marked)) == 2 and len(_pieces(qwen, marked)) == 4
    assert qwen35.encode("e\u0301") == qwen35.encode("\u00e9")


@pytest.mark.parametrize("pre", ["tekken", "gpt-4o", "deepseek-r1-qwen", "dbrx"])
def test_more_byte_level_pre_tokenizers_split_as_transformers(tmp_path, pre):
    """Mistral Nemo's Tekken, OpenAI's o200k (Phi-4-mini), DeepSeek-R1's Qwen distills and the Llama 3 split
    under another name: each text splits into the pieces transformers' reading of the file gives."""
    transformers = pytest.importorskip("transformers")
    ours = Tokenizer.from_gguf(_tiny_gguf(tmp_path / "b.gguf", pre=pre))
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="b.gguf").backend_tokenizer
    for text in ["I'm 12345 ok\n\nyes", "HelloWorld and CamelCaseWords' don't", "x = a/b;\r\n  tabs\tend ",
                 "Ünïcödé 東京タワー 123 45678", "It's THE end.\n"]:
        assert _pieces(ours, text) == [p for p, _ in ref.pre_tokenizer.pre_tokenize_str(text)], (pre, text)
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False).ids, (pre, text)


def _regex_pieces(patterns: tuple[str, ...], text: str) -> list[str]:
    """`text` split by each pattern in turn (its matches isolated within the pieces the ones before left), by
    Python's `regex`, each piece in the byte-level alphabet."""
    regex = pytest.importorskip("regex")
    pieces = [text]
    for pattern in patterns:
        out = []
        for piece in pieces:
            at = 0
            for m in regex.finditer(pattern, piece):
                out += [piece[at:m.start()]] if m.start() > at else []
                out += [m.group()] if m.end() > m.start() else []
                at = m.end()
            out += [piece[at:]] if at < len(piece) else []
        pieces = out
    spell = byte_alphabet()
    return ["".join(spell[b] for b in p.encode()) for p in pieces]


@pytest.mark.parametrize("pre", ["deepseek-v3", "deepseek-llm", "deepseek-coder"])
def test_deepseek_pre_tokenizers_split_as_their_regexes(tmp_path, pre):
    """DeepSeek's splits, one after another: the pieces Python's `regex` cuts with llama.cpp's patterns (V3's:
    digits up to three, a run of CJK and kana apart, a punctuation mark joined to the ASCII word after it)."""
    from jaxserve.tokenizer_gguf import _DEEPSEEK_SPLITS

    ours = Tokenizer.from_gguf(_tiny_gguf(tmp_path / "d.gguf", pre=pre))
    texts = ["I'm 12345 ok\n\nyes", "HelloWorld and CamelCaseWords' don't", "x = a/b;\r\n  tabs\tend ",
             "Ünïcödé 東京タワー 123 45678 한국어", "It's THE end.\n", "（全角！） Ωmega Kelvin ᾳ ok", "a.b_c(d) -> #tag"]
    for text in texts:
        assert _pieces(ours, text) == _regex_pieces(_DEEPSEEK_SPLITS[pre], text), (pre, text)
    if pre == "deepseek-v3":
        assert _pieces(ours, "a.b 1234 東京タワー") == ["a", ".b", "Ġ", "123", "4", "Ġ", "æĿ±äº¬ãĤ¿ãĥ¯ãĥ¼"]


@pytest.mark.parametrize("pre,same_as,twelve", [
    ("command-r", "smollm", ["Ġ", "1", "2"]), ("exaone", "smollm", ["Ġ", "1", "2"]), ("exaone4", "gpt-2", ["Ġ12"]),
    ("glm4", "llama-bpe", ["Ġ", "12"]), ("chatglm-bpe", "llama-bpe", ["Ġ", "12"]), ("minimax-m2", "gpt-4o", ["Ġ", "12"]),
    ("hunyuan", "qwen2", ["Ġ", "1", "2"]), ("hunyuan-dense", "deepseek-v3", ["Ġ", "12"]),
])
def test_pre_tokenizers_under_other_names_split_as_theirs(tmp_path, pre, same_as, twelve):
    """Command R's and EXAONE 3's files name SmolLM's split (each digit apart, then GPT-2's), EXAONE 4's GPT-2's,
    GLM-4's Llama 3's, MiniMax-M2's o200k's, Hunyuan-A13B's Qwen2's, Hunyuan's dense models' DeepSeek-V3's."""
    ours = Tokenizer.from_gguf(_tiny_gguf(tmp_path / "a.gguf", pre=pre, add_bos=True))
    theirs = Tokenizer.from_gguf(_tiny_gguf(tmp_path / "b.gguf", pre=same_as))
    text = "I'm 12345 ok\n\nyes, x=a/b  end"
    assert _pieces(ours, text) == _pieces(theirs, text)
    assert _pieces(ours, " 12") == twelve
    # GLM-4's files get no BOS, whatever they say (llama.cpp's rule: the chat template writes GLM's prefix)
    assert (ours.bos_token_id is None) == pre.startswith(("glm4", "chatglm"))


def test_unsupported_gguf_tokenizers_are_refused(tmp_path):
    with pytest.raises(ValueError, match="'grok-2'"):
        Tokenizer.from_gguf(_tiny_gguf(tmp_path / "p.gguf", pre="grok-2"))
    with pytest.raises(ValueError, match="'bert'.* supports 'gpt2' .*'llama' and 'gemma4'"):
        Tokenizer.from_gguf(_tiny_gguf(tmp_path / "m.gguf", model="bert"))


SPM_CORPUS = "hello world the quick brown fox jumps over the lazy dog hello there wide world of words"
SPM_TEXTS = ["Hello world", "hello there, the world", "  two  spaces and\nnew lines\n\n", "café naïve — 東京 🙂",
             "the fox</s>jumps <tool> over", "", " leading space", "tabs\tand 123456", "<s>hello"]


def spm_vocab(arch: str = "llama") -> tuple[list[str], list[int], list[float]]:
    """A SentencePiece BPE vocabulary as llama.cpp writes one (tokens, kinds, scores): <unk>, <s>, </s>, the
    256 byte tokens, the corpus's characters and its pieces of 2-5 characters seen twice or more (each piece
    scored by how often it occurs), and a user-defined <tool>. Gemma's (`arch`) as its files have it: runs of
    spaces as tokens, and scores out of the vocabulary's order."""
    import collections

    words = ["\u2581" + w for w in SPM_CORPUS.split()]
    counts = collections.Counter(w[i:j] for w in words for i in range(len(w)) for j in range(i + 2, min(len(w), i + 5) + 1))
    pieces = sorted((p for p, c in counts.items() if c >= 2), key=lambda p: (-counts[p], p))
    chars = sorted(set("".join(words)))
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *chars, *pieces, "<tool>"]
    types = [2, 3, 3, *[6] * 256, *[1] * (len(chars) + len(pieces)), 4]
    scores = [0.0] * 259 + [-1000.0 - i for i in range(len(chars))] + [-float(i) for i in range(len(pieces))] + [0.0]
    if arch.startswith("gemma"):
        tokens[-1:-1], types[-1:-1], scores[-1:-1] = ["  ", "   "], [1, 1], [-5000.0, -5001.0]
        scores = [float(x) for x in np.random.default_rng(0).permutation(scores)]
    return tokens, types, scores


def _spm_gguf(path, *, add_space_prefix: bool | None = None, merges: bool = False, arch: str = "llama") -> str:
    """A GGUF holding `spm_vocab(arch)` (with `merges`, its merges written out)."""
    import gguf

    tokens, types, scores = spm_vocab(arch)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_embedding_length(8)
    writer.add_head_count(1)
    writer.add_feed_forward_length(8)
    writer.add_context_length(64)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores(scores)
    if merges:  # the ones the scores imply, as a converter that writes them out does
        plain = Tokenizer.from_gguf(_spm_gguf(str(path) + ".plain", add_space_prefix=add_space_prefix))
        writer.add_token_merges([" ".join(m) for m in json.loads(plain.backend.to_str())["model"]["merges"]])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    if add_space_prefix is not None:
        writer.add_add_space_prefix(add_space_prefix)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.mark.parametrize("arch,merges", [("llama", False), ("llama", True), ("phi3", False)])
def test_sentencepiece_gguf_tokenizes_as_transformers(tmp_path, arch, merges):
    """A SentencePiece vocabulary (Llama 2, Mistral, Phi-3 GGUFs): ids with and without BOS, pieces, and
    decoded text equal transformers' tokenizer of the same file, for plain text, runs of spaces, newlines,
    characters only bytes can spell, and special and user-defined tokens inside the text."""
    transformers = pytest.importorskip("transformers")
    path = _spm_gguf(tmp_path / "spm.gguf", merges=merges, arch=arch)  # phi3: a space after each special token
    ours = Tokenizer.from_gguf(path)
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    assert ours.bos_token_id == 1 and ours.eos_token_ids == (2,) and ours.add_bos_token
    for text in SPM_TEXTS:
        for special in (False, True):
            want = ref.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == want, (text, special)
        ids = ours.encode(text)
        assert [ours.id_to_token(i) for i in ids] == ref.convert_ids_to_tokens(ids)
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), text
    ids = ours.encode("café 🙂 the world")
    assert any(ours.id_to_token(i).startswith("<0x") for i in ids)  # bytes spelled the characters
    assert "\u2581the" in {ours.id_to_token(i) for i in ids}  # and pieces the words
    assert ours.decode(ids) == "café 🙂 the world"


def test_gemma_gguf_vocabulary_tokenizes_as_transformers(tmp_path):
    """Gemma's files (no space prefix, runs of spaces stored as spaces, scores that do not give the merge
    order): ids and decoded text equal transformers' tokenizer of the same file."""
    transformers = pytest.importorskip("transformers")
    ours = Tokenizer.from_gguf(_spm_gguf(tmp_path / "g.gguf", add_space_prefix=False, arch="gemma2"))
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="g.gguf")
    for text in [*SPM_TEXTS, "the  fox   jumps    over"]:
        ids = ours.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
    assert ours.id_to_token(ours.encode("the  fox")[1]) == "\u2581\u2581"  # a run of spaces is one piece


def test_gguf_turn_end_tokens_end_generation(tmp_path):
    """A file that names only its EOS (as Gemma's name <eos>, not <end_of_turn>): the control tokens that end
    a turn in known chat formats end generation too; <|endoftext|> and user-defined look-alikes do not."""
    import gguf

    tokens = ["<unk>", "<s>", "</s>", "<end_of_turn>", "<|endoftext|>", "<|im_end|>", *(f"<0x{b:02X}>" for b in range(256))]
    types = [2, 3, 3, 3, 3, 4, *[6] * 256]
    writer = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "gemma2")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert Tokenizer.from_gguf(tmp_path / "t.gguf").eos_token_ids == (2, 3)


def test_sentencepiece_gguf_without_the_space_prefix(tmp_path):
    """`add_space_prefix: false` (Gemma's files): no space goes before the text, so a text tokenizes as
    the same text after one space does with the prefix; decoding gives the text back unchanged."""
    with_prefix = Tokenizer.from_gguf(_spm_gguf(tmp_path / "a.gguf"))
    without = Tokenizer.from_gguf(_spm_gguf(tmp_path / "b.gguf", add_space_prefix=False))
    for text in SPM_TEXTS:
        if text and not text.startswith((" ", "<")):
            assert without.encode(" " + text) == with_prefix.encode(text), text
            assert without.id_to_token(without.encode(text)[0])[0] != "\u2581", text
        assert without.decode(without.encode(text), skip_special_tokens=False) == text, text
