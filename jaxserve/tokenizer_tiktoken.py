"""tiktoken's byte-level BPE (mergeable ranks) as a `tokenizers` BPE, and the tiktoken vocabularies of Moonshot's
models (Kimi K2, Moonlight: `tiktoken.model` with `TikTokenTokenizer`, no `tokenizer.json`) and Tencent's Hunyuan
(`hy.tiktoken` with `HYTokenizer`).

tiktoken merges the adjacent pair whose join has the lowest rank and takes a piece that is itself a token whole:
the same as a BPE whose merges are ordered by the rank of what they make and that ignores merges for whole
tokens (`ignore_merges`). Mistral's tekken files (`tokenizer_tekken`) are such ranks too.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers

# Moonshot's split (its `TikTokenTokenizer.pat_str`): Han runs apart, cased words without Han, digits up to three.
KIMI_PATTERN = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
# Moonshot's special tokens follow the ranks: 256 reserved and 2 more, named by the config or filled in.
_KIMI_SPECIALS = 256 + 2
# Hunyuan's split (its `tokenization_hy.PAT_STR`: GPT-2's, each digit apart) and its special tokens after the ranks
# (named by the config where it names them).
HY_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
              r"|\s+(?!\S)|\s+")
HY_SPECIALS = ("<|endoftext|>", "<|startoftext|>", "<|bos|>", "<|eos|>", "<|pad|>",
               *(f"<|extra_{i}|>" for i in range(205)))
# tokenizer_config.json's `tokenizer_class` -> (its vocabulary's file, its split)
TIKTOKEN_FILES = {"TikTokenTokenizer": "tiktoken.model", "HYTokenizer": "hy.tiktoken"}


def _byte_table() -> dict[int, str]:
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_TABLE = _byte_table()  # (a str.translate table: latin-1 character b -> byte b's character)


def byte_level(data: bytes) -> str:
    """`data` in the byte-level alphabet (GPT-2's: each byte one printable character)."""
    return data.decode("latin-1").translate(_BYTE_TABLE)


def ranked_bpe(ranks: Mapping[bytes, int], pattern: str, specials: Mapping[str, int], first_id: int = 0,
               source: Any = "") -> tokenizers.Tokenizer:
    """The BPE that encodes as tiktoken does with mergeable `ranks` (a token's id: its rank plus `first_id`), text
    split by `pattern` first, `specials` (text -> id) as special tokens; ValueError (naming `source`) where a special
    token is also a regular token's text or does not keep its id."""
    # Each token's merge: its two parts that are tokens, the pair of lowest ranks first; merges in the order of
    # the ranks of what they make (tiktoken's rule).
    merges = []
    for token, rank in ranks.items():
        pairs = [(ranks[token[:i]], ranks[token[i:]], token[:i], token[i:]) for i in range(1, len(token))
                 if token[:i] in ranks and token[i:] in ranks]
        merges += [(rank, *p) for p in sorted(pairs)]
    merges.sort()
    ids = {byte_level(t): r + first_id for t, r in ranks.items()}
    if clash := set(specials) & set(ids):
        raise ValueError(f"{source}: special tokens {sorted(clash)} are also regular tokens' text")
    # The special tokens in the model's vocabulary too, so that as added tokens they keep their ids.
    bpe = models.BPE({**specials, **ids}, [(byte_level(m[3]), byte_level(m[4])) for m in merges], fuse_unk=False,
                     ignore_merges=True)
    backend = tokenizers.Tokenizer(bpe)
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([tokenizers.AddedToken(s, special=True, normalized=False) for s in specials])
    for s, i in specials.items():
        if backend.token_to_id(s) != i:
            raise ValueError(f"{source}: special token {s!r} did not land at id {i}")
    return backend


def read_tiktoken_dir(root: str | os.PathLike[str], config: Mapping[str, Any]) -> tokenizers.Tokenizer:
    """The tokenizer of a directory holding Moonshot's `tiktoken.model` (lines of base64 token bytes and rank) or
    Hunyuan's `hy.tiktoken` (ranked by line, a repeated token skipped, as its `HYTokenizer` reads it; text NFC
    normalized first) and its `tokenizer_config.json` (`config`: `added_tokens_decoder` names the special tokens
    after the ranks); ValueError for another tokenizer class, whose split is not known."""
    cls = config.get("tokenizer_class")
    name = TIKTOKEN_FILES.get(cls) or next((f for f in TIKTOKEN_FILES.values() if (Path(root) / f).is_file()), "")
    path = Path(root) / name
    if cls not in TIKTOKEN_FILES or not path.is_file():
        raise ValueError(f"{path}: tokenizer_class {cls!r} is not supported (Moonshot's TikTokenTokenizer with "
                         "tiktoken.model and Hunyuan's HYTokenizer with hy.tiktoken are, whose splits are known; give "
                         "a tokenizer.json)")
    hy = cls == "HYTokenizer"
    ranks: dict[bytes, int] = {}
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                token, rank = line.split()
                token_bytes = base64.b64decode(token, validate=True)
                if not (hy and token_bytes in ranks):
                    ranks[token_bytes] = len(ranks) if hy else int(rank)
            except ValueError as e:
                raise ValueError(f"{path}:{n}: not a base64 token and its rank: {line[:60]!r}") from e
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: its {len(ranks)} ranks are not 0 to {len(ranks) - 1}, each once")
    named = {int(i): t["content"] for i, t in (config.get("added_tokens_decoder") or {}).items()}
    base = len(ranks)
    if hy:
        specials = {named.get(base + j, s): base + j for j, s in enumerate(HY_SPECIALS)}
    else:
        specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(base, base + _KIMI_SPECIALS)}
    backend = ranked_bpe(ranks, HY_PATTERN if hy else KIMI_PATTERN, specials, source=path)
    if hy:
        backend.normalizer = normalizers.NFC()
    return backend
