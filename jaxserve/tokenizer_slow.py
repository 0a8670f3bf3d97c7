"""An HF tokenizer directory's files; without `tokenizer.json`, the slow tokenizer's read into the same Rust BPE.

Many checkpoints (older Qwen and InternVL releases, GPT-2-style models, fine-tunes saved with a slow tokenizer) ship
`vocab.json` and `merges.txt` and no `tokenizer.json`. Those are a byte-level BPE: the vocabulary (already spelled in
the byte alphabet) and its merges in rank order. What the file pair does not say, the tokenizer class named in
`tokenizer_config.json` does, as transformers' own converter reads it: GPT-2's split (`GPT2Tokenizer`) or Qwen2's
split after NFC normalization (`Qwen2Tokenizer`, which Qwen2/2.5/3 and InternVL 2 / 2.5 name). The added tokens
(`added_tokens_decoder`) take their stated ids, special or not; one whose id does not follow the vocabulary is refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, decoders, models

from jaxserve.tokenizer_gguf import _byte_level_stages

# tokenizer_config.json's `tokenizer_class` -> the split it stands for (llama.cpp's names, `tokenizer_gguf`).
_CLASS_SPLIT = {"GPT2Tokenizer": "gpt-2", "GPT2TokenizerFast": "gpt-2", "Qwen2Tokenizer": "qwen2",
                "Qwen2TokenizerFast": "qwen2"}


def read_tokenizer_files(root: Path) -> tuple[tokenizers.Tokenizer, dict[str, Any]]:
    """The tokenizer of HF directory `root` and its `tokenizer_config.json`: from `tokenizer.json`, else Moonshot's
    `tiktoken.model` or Hunyuan's `hy.tiktoken` (`tokenizer_tiktoken`), else `vocab.json` and `merges.txt`
    (`read_slow_bpe`), else SentencePiece's `tokenizer.model` (`tokenizer_sentencepiece`)."""
    tokenizer_file, slow = root / "tokenizer.json", (root / "vocab.json").is_file() and (root / "merges.txt").is_file()
    spm = (root / "tokenizer.model").is_file()
    tiktoken = any((root / name).is_file() for name in ("tiktoken.model", "hy.tiktoken"))
    if not tokenizer_file.is_file() and not tiktoken and not slow and not spm:
        raise FileNotFoundError(f"tokenizer file not found: {tokenizer_file} (nor tiktoken.model or hy.tiktoken, nor "
                                "vocab.json with merges.txt, nor tokenizer.model)")
    if not (root / "tokenizer_config.json").is_file():
        raise FileNotFoundError(f"tokenizer file not found: {root / 'tokenizer_config.json'}")
    with (root / "tokenizer_config.json").open(encoding="utf-8") as f:
        config = json.load(f)
    if tokenizer_file.is_file():
        return tokenizers.Tokenizer.from_file(str(tokenizer_file)), config
    if slow:
        return read_slow_bpe(root, config), config
    if not tiktoken:
        from jaxserve.tokenizer_sentencepiece import read_sentencepiece_dir

        return read_sentencepiece_dir(root, config), config
    from jaxserve.tokenizer_tiktoken import read_tiktoken_dir

    return read_tiktoken_dir(root, config), config


def read_slow_bpe(root: Path, config: dict[str, Any]) -> tokenizers.Tokenizer:
    """The byte-level BPE of `root`'s `vocab.json` and `merges.txt`, split as `config["tokenizer_class"]` says, with
    the added tokens of `config["added_tokens_decoder"]`; ValueError naming what it cannot read."""
    cls = config.get("tokenizer_class")
    if cls not in _CLASS_SPLIT:
        raise ValueError(f"{root}: a tokenizer of vocab.json and merges.txt of class {cls!r} is not supported (read: "
                         f"{', '.join(_CLASS_SPLIT)}); a tokenizer.json would be read whatever its class")
    if config.get("add_prefix_space"):
        raise ValueError(f"{root}: add_prefix_space true is not supported for a tokenizer of vocab.json and merges.txt")
    with (root / "vocab.json").open(encoding="utf-8") as f:
        vocab = {str(k): int(v) for k, v in json.load(f).items()}
    merges = []
    with (root / "merges.txt").open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.rstrip("\r\n")
            if not line or line.startswith("#version"):
                continue
            pair = line.split(" ")
            if len(pair) != 2:
                raise ValueError(f"{root / 'merges.txt'} line {n} is not a merge of two tokens: {line!r}")
            merges.append((pair[0], pair[1]))
    normalizer, pre_tokenizer, ignore_merges = _byte_level_stages(_CLASS_SPLIT[cls])
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                                              ignore_merges=ignore_merges))
    if normalizer is not None:
        backend.normalizer = normalizer
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    _add_tokens(backend, config.get("added_tokens_decoder") or {}, root)
    return backend


def _add_tokens(backend: tokenizers.Tokenizer, added: dict[str, Any], root: Path) -> None:
    """The added tokens at their ids, in id order: one already in the vocabulary keeps its id; a new one must come
    next after the vocabulary and the tokens added before it."""
    for tid, spec in sorted(((int(k), v) for k, v in added.items()), key=lambda kv: kv[0]):
        content = spec["content"] if isinstance(spec, dict) else str(spec)
        token = AddedToken(content, special=bool(spec.get("special", False)),
                           normalized=bool(spec.get("normalized", not spec.get("special", False))),
                           lstrip=bool(spec.get("lstrip", False)), rstrip=bool(spec.get("rstrip", False)),
                           single_word=bool(spec.get("single_word", False)))
        have = backend.token_to_id(content)
        if have is None and tid != backend.get_vocab_size(with_added_tokens=True):
            raise ValueError(f"{root / 'tokenizer_config.json'}: added token {content!r} has id {tid}; the "
                             f"vocabulary and the tokens before it end at {backend.get_vocab_size(True) - 1}")
        (backend.add_special_tokens if token.special else backend.add_tokens)([token])
        if backend.token_to_id(content) != tid:
            raise ValueError(f"{root}: added token {content!r} has id {tid} in tokenizer_config.json and "
                             f"{backend.token_to_id(content)} in vocab.json")
