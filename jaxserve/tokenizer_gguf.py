"""Building a tokenizer from a GGUF file's `tokenizer.*` metadata.

llama.cpp stores the vocabulary, merges (or scores), token kinds, special ids and chat templates of a
model in its GGUF file. `read_gguf_tokenizer` turns them into a HF `tokenizers.Tokenizer` (the Rust BPE)
plus the special ids and templates `Tokenizer` needs, for two kinds of vocabulary:

- `gpt2`: byte-level BPE, for the families in `SUPPORTED_GGUF_PRE` (Llama 3, Qwen2, SmolLM, GPT-2, Mistral's
  Tekken, OpenAI's o200k);
- `llama`: SentencePiece BPE (Llama 2, Mistral, Gemma, ...): pieces spelled with `▁` for spaces, bytes
  outside the vocabulary as `<0xNN>` tokens, and merges that apply the highest-scoring piece first (the
  file's merges when it has them, else derived from its scores), as transformers reads such a file.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from jaxserve.tokenizer_tiktoken import KIMI_PATTERN

if TYPE_CHECKING:
    from jaxserve.loader.gguf_header import GGUFHeader

# llama.cpp's token kinds (`tokenizer.ggml.token_type`).
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4

# Split patterns of the byte-level BPE families we support, keyed by their llama.cpp `tokenizer.ggml.pre`.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3.5's (`Qwen3_5Tokenizer`): Qwen2's with combining marks kept in words.
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Control tokens that end a model's turn in the chat formats llama.cpp recognizes by their text (not
# <|endoftext|>, which files whose turns end otherwise keep as a document separator).
_TURN_ENDS = frozenset({"<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|end_of_text|>",
                        "<EOT>", "_<EOT>", "<end_of_utterance>", "<|return|>", "<|call|>", "<turn|>"})
# Gemma 4's generation config also stops where the model hands over to a tool's response (a user-defined token in its
# files, not a control one).
_GEMMA4_ENDS = ("<|tool_response>",)
# Mistral's Tekken (Mistral Nemo) and OpenAI's o200k (Phi-4-mini): cased words, digits one (Tekken) or up
# to three (o200k) at a time.
_CASED_WORD = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+{c}"
               r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*{c}")
_TAIL = r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_TEKKEN_SPLIT = _CASED_WORD.replace("{c}", "") + r"|\p{N}" + _TAIL
_GPT4O_SPLIT = _CASED_WORD.replace("{c}", r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?") + r"|\p{N}{1,3}" + _TAIL
# llama.cpp's names for each split (files name their tokenizer's family, or a model that shares its split).
_LLAMA3_PRE = ("llama-bpe", "llama3", "llama-v3", "dbrx", "smaug-bpe", "falcon3", "pixtral")
# GLM-4's (GLM-4.5's files too): Llama 3's split, its merges always applied, and no BOS (llama.cpp drops the file's:
# GLM's chat template writes its [gMASK]<sop> prefix itself).
_GLM4_PRE = ("glm4", "chatglm-bpe")
# o200k's split under MiniMax-M2's name.
_GPT4O_PRE = ("gpt-4o", "minimax-m2")
_QWEN2_PRE = ("qwen2", "deepseek-r1-qwen", "hunyuan")
# DeepSeek's splits, each splitting the pieces the ones before it left (llama.cpp's `llm_tokenizer_bpe`; DeepSeek-V3's
# tokenizer.json has the same three), written with their non-ASCII characters as escapes.
_DEEPSEEK_SPLITS: dict[str, tuple[str, ...]] = {
    "deepseek-v3": (
        "\\p{N}{1,3}",
        "[\u4E00-\u9FA5\u3040-\u309F\u30A0-\u30FF]+",
        ("[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+|"
         " ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"),
    ),
    "deepseek-llm": (
        "[\r\n]",
        ("\\s?[A-Za-z\u00B5\u00C0-\u00D6\u00D8-\u00F6\u00F8-\u01BA\u01BC-\u01BF\u01C4-\u0293\u0295-\u02AF"
         "\u0370-\u0373\u0376\u0377\u037B-\u037D\u037F\u0386\u0388-\u038A\u038C\u038E-\u03A1\u03A3-\u03F5"
         "\u03F7-\u0481\u048A-\u052F\u0531-\u0556\u10A0-\u10C5\u13A0-\u13F5\u13F8-\u13FD\u1C90-\u1CBA"
         "\u1CBD-\u1CBF\u1D00-\u1D2B\u1D6B-\u1D77\u1D79-\u1D9A\u1E00-\u1F15\u1F18-\u1F1D\u1F20-\u1F45"
         "\u1F48-\u1F4D\u1F50-\u1F57\u1F59\u1F5B\u1F5D\u1F5F-\u1F7D\u1F80-\u1FB4\u1FB6-\u1FBC\u1FBE\u1FC2-"
         "\u1FC4\u1FC6-\u1FCC\u1FD0-\u1FD3\u1FD6-\u1FDB\u1FE0-\u1FEC\u1FF2-\u1FF4\u1FF6-\u1FFC\u2102\u2107"
         "\u210A-\u2113\u2115\u2119-\u211D\u2124\u2126\u2128\u212A-\u212D\u212F-\u2134\u2139\u213C-\u213F"
         "\u2145-\u2149\u214E\u2183\u2184\u2C00-\u2C7B\u2C7E-\u2CE4\u2CEB-\u2CEE\u2CF2\u2CF3\uA640-\uA66D"
         "\uA680-\uA69B\uA722-\uA76F\uA771-\uA787\uA78B-\uA78E\uAB70-\uABBF\uFB00-\uFB06\uFB13-\uFB17"
         "\uFF21-\uFF3A\uFF41-\uFF5A\U00010400-\U0001044F\U000104B0-\U000104D3\U000104D8-\U000104FB"
         "\U00010C80-\U00010CB2\U00010CC0-\U00010CF2\U000118A0-\U000118DF\U0001E900-\U0001E943]+"),
        "\\s?[!-/:-~\uFF01-\uFF0F\uFF1A-\uFF5E\u2018-\u201F\u3000-\u3002]+",
        "\\s+$",
        "[\u4E00-\u9FA5\u0800-\u4E00\uAC00-\uD7FF]+",
        "\\p{N}+",
    ),
    "deepseek-coder": (
        "[\r\n]",
        "\\s?\\p{L}+",
        "\\s?\\p{P}+",
        "[\u4E00-\u9FA5\u0800-\u4E00\uAC00-\uD7FF]+",
        "\\p{N}",
    ),
}
# GPT-2's split under other names (EXAONE 4's among them); SmolLM's (digits one at a time, then GPT-2's) under
# others (Command R's, EXAONE 3's), as llama.cpp groups them.
_GPT2_PRE = ("gpt-2", "exaone4", "mpt", "olmo", "jais", "trillion", "granite-docling")
_SMOLLM_PRE = ("smollm", "command-r", "exaone", "starcoder", "refact", "codeshell", "minerva-7b")
SUPPORTED_GGUF_PRE = (*_GPT2_PRE, *_SMOLLM_PRE, *_LLAMA3_PRE, *_GLM4_PRE, *_QWEN2_PRE, "qwen35", "tekken",
                      *_GPT4O_PRE, *_DEEPSEEK_SPLITS, "hunyuan-dense", "kimi-k2")


@dataclass(frozen=True)
class GGUFTokenizer:
    """What a GGUF file's tokenizer metadata describes: the BPE backend, special ids, templates, limits."""

    backend: tokenizers.Tokenizer
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    unk_token_id: int | None
    chat_templates: Mapping[str, str]
    add_bos_token: bool
    add_eos_token: bool
    model_max_length: int | None
    vocab_size: int


@functools.cache
def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map that byte-level BPE vocabularies are spelled in."""
    # Printable Latin-1 bytes stand for themselves; the rest are moved past 255 so no byte is whitespace.
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in kept}
    moved = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + moved)
            moved += 1
    return table


def _eos_ids(reader: Any, kinds: list[tuple[str, int]]) -> list[int]:
    """The ids that end generation: the file's EOS, and (as llama.cpp) its end-of-turn / end-of-message tokens when
    it names them and the control tokens that end a turn in the chat formats it knows (a Gemma file names no
    <end_of_turn>)."""
    named = (_gguf_value(reader, f"tokenizer.ggml.{k}") for k in ("eos_token_id", "eot_token_id", "eom_token_id"))
    eos_ids = [int(i) for i in named if i is not None]
    gemma4 = _gguf_value(reader, "tokenizer.ggml.model") == "gemma4"
    return eos_ids + [i for i, (t, k) in enumerate(kinds) if (k == _CONTROL and t in _TURN_ENDS or gemma4 and t in
                                                                _GEMMA4_ENDS) and i not in eos_ids]


def gguf_eos_ids(reader: GGUFHeader) -> tuple[int, ...]:
    """A GGUF file's ids that end generation, as its tokenizer gives them, without building the tokenizer."""
    tokens = _gguf_value(reader, "tokenizer.ggml.tokens") or []
    types = _gguf_value(reader, "tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    return tuple(_eos_ids(reader, list(zip(tokens, types, strict=False))))


def read_gguf_tokenizer(path_or_reader: str | os.PathLike[str] | GGUFHeader) -> GGUFTokenizer:
    """Read the tokenizer a GGUF file describes in its `tokenizer.*` metadata."""
    from jaxserve.loader.gguf_header import GGUFHeader

    reader = path_or_reader
    if not isinstance(reader, GGUFHeader):
        if not Path(reader).is_file():
            raise FileNotFoundError(f"GGUF file not found: {reader}")
        from jaxserve.loader.gguf_file import gguf_reader

        reader = gguf_reader(reader)

    model = _gguf_value(reader, "tokenizer.ggml.model")
    tokens: list[str] = _gguf_value(reader, "tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError("GGUF file lacks tokenizer.ggml.tokens")
    token_types: list[int] = _gguf_value(reader, "tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    if len(token_types) != len(tokens):
        raise ValueError(f"GGUF has {len(tokens)} tokens but {len(token_types)} token types")
    if model == "gpt2":
        backend = _byte_level_backend(reader, tokens, token_types)
    elif model in ("llama", "gemma4"):  # (Gemma 4's: SentencePiece pieces with the file's merges)
        backend = _sentencepiece_backend(reader, tokens, str(_gguf_value(reader, "general.architecture", "")))
    else:
        raise ValueError(
            f"unsupported GGUF tokenizer model tokenizer.ggml.model={model!r}; jaxserve supports 'gpt2' "
            "(byte-level BPE), 'llama' and 'gemma4' (SentencePiece BPE)"
        )
    # Control tokens stay whole and count as special; user-defined ones stay whole but are ordinary text.
    kinds = list(zip(tokens, token_types, strict=True))
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in kinds if k == _CONTROL]
    )
    backend.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, k in kinds if k == _USER_DEFINED]
    )

    def token_id(key: str) -> int | None:
        value = _gguf_value(reader, f"tokenizer.ggml.{key}")
        return None if value is None else int(value)

    bos_id, eos_id, pad_id, unk_id = (
        token_id(k) for k in ("bos_token_id", "eos_token_id", "padding_token_id", "unknown_token_id")
    )
    if _gguf_value(reader, "tokenizer.ggml.pre") in _GLM4_PRE:
        bos_id = None
    eos_ids = _eos_ids(reader, kinds)
    # A SentencePiece vocabulary that does not say gets BOS, as llama.cpp and transformers give it.
    # Gemma 4's files say to add BOS, but its own tokenizer adds none (its chat template writes <bos>): as transformers.
    add_bos = model != "gemma4" and bool(_gguf_value(reader, "tokenizer.ggml.add_bos_token", model == "llama"))
    add_eos = bool(_gguf_value(reader, "tokenizer.ggml.add_eos_token", False))
    if (add_bos and bos_id is not None) or (add_eos and eos_id is not None):
        backend.post_processor = _template_processing(
            tokens[bos_id] if add_bos and bos_id is not None else None,
            bos_id,
            tokens[eos_id] if add_eos and eos_id is not None else None,
            eos_id,
        )

    templates: dict[str, str] = {}
    if (default := _gguf_value(reader, "tokenizer.chat_template")) is not None:
        templates["default"] = default
    for name in _gguf_value(reader, "tokenizer.chat_templates") or []:
        if (named := _gguf_value(reader, f"tokenizer.chat_template.{name}")) is not None:
            templates[name] = named

    arch = _gguf_value(reader, "general.architecture")
    context = _gguf_value(reader, f"{arch}.context_length") if arch else None
    return GGUFTokenizer(
        backend=backend,
        bos_token_id=bos_id,
        eos_token_ids=tuple(eos_ids),
        pad_token_id=pad_id,
        unk_token_id=unk_id,
        chat_templates=templates,
        add_bos_token=add_bos,
        add_eos_token=add_eos,
        model_max_length=int(context) if context is not None else None,
        vocab_size=len(tokens),
    )


def _byte_level_backend(reader: GGUFHeader, tokens: list[str], token_types: list[int]) -> tokenizers.Tokenizer:
    pre = _gguf_value(reader, "tokenizer.ggml.pre", "gpt-2")
    normalizer, pre_tokenizer, ignore_merges = _byte_level_stages(pre)
    merges: list[str] = _gguf_value(reader, "tokenizer.ggml.merges")
    if merges is None:
        raise ValueError("GGUF file lacks tokenizer.ggml.merges (a byte-level BPE needs them)")
    backend = tokenizers.Tokenizer(
        models.BPE(
            vocab=_byte_level_vocab(tokens, token_types),
            merges=[tuple(m.split(" ", 1)) for m in merges],
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=ignore_merges,
        )
    )
    if normalizer is not None:
        backend.normalizer = normalizer
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_backend(reader: GGUFHeader, tokens: list[str], arch: str) -> tokenizers.Tokenizer:
    gemma = arch.startswith("gemma")
    if gemma:  # Gemma's files store its whitespace tokens with spaces; its pieces spell those with ▁
        tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    merges: list[str] | None = _gguf_value(reader, "tokenizer.ggml.merges")
    if merges is not None:
        pairs = [tuple(m.split(" ", 1)) for m in merges]
    elif gemma:  # Gemma's scores do not follow its merge order; the order of its vocabulary does
        pairs = _merges_from_scores(vocab, {t: -float(i) for t, i in vocab.items()})
    else:
        scores = _gguf_value(reader, "tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise ValueError("a GGUF SentencePiece vocabulary needs tokenizer.ggml.merges or one score per token "
                             "(tokenizer.ggml.scores)")
        pairs = _merges_from_scores(vocab, {t: float(scores[i]) for t, i in vocab.items()})
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=True, byte_fallback=True))
    # The leading space SentencePiece adds to a text (unless the file turns it off) goes before its first
    # piece only, and the decoder takes it off again.
    prefix = bool(_gguf_value(reader, "tokenizer.ggml.add_space_prefix", True))
    if arch == "phi3" and prefix:  # Phi-3's tokenizer puts the space before each text between special tokens
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="\u2581", prepend_scheme="first" if prefix else "never", split=False)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence([*steps, decoders.Strip(content=" ", left=1, right=0)] if prefix else steps)
    return backend


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece BPE vocabulary implies: every split of a piece into two pieces, ranked by
    the whole piece's score (highest first), so BPE builds the best-scoring piece first as SentencePiece
    does; ties go to the longer left part, as transformers ranks them."""
    found = []
    for piece, score in scores.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                found.append((-score, -len(left), -len(right), vocab[left], vocab[right], left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def _byte_level_vocab(tokens: list[str], token_types: list[int]) -> dict[str, int]:
    """Token text -> id, every plain token spelled in the byte alphabet; the first id of a repeated text wins."""
    spell = byte_alphabet()
    alphabet = frozenset(spell.values())
    vocab: dict[str, int] = {}
    for i, (tok, kind) in enumerate(zip(tokens, token_types, strict=True)):
        if kind == _NORMAL and not alphabet.issuperset(tok):
            # A plain token written as raw text: respell it in the byte alphabet so BPE can reach it.
            tok = "".join(spell[b] for b in tok.encode("utf-8"))
        vocab.setdefault(tok, i)
    return vocab


def _byte_level_stages(pre: str) -> tuple[Any, Any, bool]:
    """`(normalizer, pre_tokenizer, ignore_merges)` of the byte-level BPE named by GGUF `tokenizer.ggml.pre`."""
    if pre in _SMOLLM_PRE:
        # SmolLM's merges were learned on single digits, so digits are split before the GPT-2 regex.
        pre_tok = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
            ]
        )
        return None, pre_tok, False
    if pre in _GPT2_PRE:
        return (
            None,
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
            False,
        )
    if pre == "tekken" or pre in _GPT4O_PRE:
        return None, _split_then_bytes(_TEKKEN_SPLIT if pre == "tekken" else _GPT4O_SPLIT), False
    if pre in _GLM4_PRE:
        return None, _split_then_bytes(_LLAMA3_SPLIT), False
    if pre in _LLAMA3_PRE:
        # Llama 3's own tokenizer.json looks whole words up in the vocabulary before merging.
        return None, _split_then_bytes(_LLAMA3_SPLIT), True
    if pre in _QWEN2_PRE or pre == "qwen35":  # (NFC, as their tokenizer.json files have it)
        return normalizers.NFC(), _split_then_bytes(_QWEN35_SPLIT if pre == "qwen35" else _QWEN2_SPLIT), False
    if pre in _DEEPSEEK_SPLITS or pre == "hunyuan-dense":  # (Hunyuan's dense models: DeepSeek-V3's splits)
        return None, _split_then_bytes(*_DEEPSEEK_SPLITS.get(pre, _DEEPSEEK_SPLITS["deepseek-v3"])), False
    if pre == "kimi-k2":  # Moonshot's split (llama.cpp's hand-written K2 handler); whole pieces looked up first, as
        return None, _split_then_bytes(KIMI_PATTERN), True  # tiktoken, Kimi's own tokenizer, does
    raise ValueError(
        f"unsupported GGUF pre-tokenizer tokenizer.ggml.pre={pre!r}; jaxserve supports {list(SUPPORTED_GGUF_PRE)}"
    )


def _split_then_bytes(*patterns: str) -> Any:
    """Each pattern's matches isolated, one after another, then the byte-level alphabet."""
    return pre_tokenizers.Sequence(
        [
            *(pre_tokenizers.Split(Regex(p), behavior="isolated", invert=False) for p in patterns),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )


def _gguf_value(reader: GGUFHeader, key: str, default: Any = None) -> Any:
    return reader.values.get(key, default)


def _template_processing(bos: str | None, bos_id: int | None, eos: str | None, eos_id: int | None) -> Any:
    """A post-processor that adds BOS and/or EOS around each sequence."""
    head = [bos] if bos is not None else []
    tail = [eos] if eos is not None else []
    special = [(t, i) for t, i in ((bos, bos_id), (eos, eos_id)) if t is not None]
    return processors.TemplateProcessing(
        single=[*head, "$A", *tail],
        pair=[*head, "$A", *tail, *head, "$B:1", *tail],
        special_tokens=special,
    )
