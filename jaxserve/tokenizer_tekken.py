"""Mistral's tekken tokenizer files (`tekken.json`) as a `tokenizers` byte-level BPE.

A tekken file lists its byte-level BPE tokens by rank (tiktoken's mergeable ranks, base64 bytes), the regular
expression that splits text before BPE, and its special tokens, which take the first ids (`<unk>`, `<s>`, `</s>`,
`[INST]`, ... then `<SPECIAL_{id}>` fillers up to `default_num_special_tokens`); a regular token's id is its rank
plus that number, and only the first `default_vocab_size` ids are the model's. tiktoken merges the adjacent pair
whose join has the lowest rank and takes a piece that is itself a token whole: the same as a BPE whose merges are
ordered by the rank of what they make and that ignores merges for whole tokens (`ignore_merges`).

Mistral's own encoder (mistral_common) reads special tokens' text as text; this one, as every `tokenizers`
tokenizer here, reads it as the special token (a chat template writes `[INST]` and means the token).
"""

from __future__ import annotations

import base64
import json
import os
from dataclasses import dataclass
from pathlib import Path

import tokenizers

from jaxserve.tokenizer_tiktoken import ranked_bpe

# Files before v7 name no special tokens; they are these (mistral_common's list for them).
_DEPRECATED_SPECIALS = ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                        "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]",
                        "[IMG_END]", "[PREFIX]", "[MIDDLE]", "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
                        "[TOOL_CONTENT]")


@dataclass(frozen=True)
class TekkenSpec:
    backend: tokenizers.Tokenizer
    version: str  # "v3", "v7", "v11", "v13", ...: the instruct format (`chat_template.mistral_template`)
    specials: tuple[str, ...]  # by id
    vocab_size: int


def read_tekken(path: str | os.PathLike[str]) -> TekkenSpec:
    """The tokenizer a `tekken.json` describes; ValueError naming what the file lacks."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    try:
        config, vocab = data["config"], data["vocab"]
        pattern, size, num_special = config["pattern"], config["default_vocab_size"], config[
            "default_num_special_tokens"]
    except (KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a tekken tokenizer file: it has no {e}") from e
    version = str(config.get("version") or "v3")
    named = [t["token_str"] for t in sorted(data.get("special_tokens") or [], key=lambda t: t["rank"])]
    specials = tuple(named or _DEPRECATED_SPECIALS)
    if len(specials) > num_special or len(set(specials)) != len(specials):
        raise ValueError(f"{path}: {len(specials)} special tokens (unique) must fit in {num_special}")
    specials += tuple(f"<SPECIAL_{i}>" for i in range(len(specials), num_special))
    inner = size - num_special
    if not 0 < inner <= len(vocab):
        raise ValueError(f"{path}: a vocabulary of {size} with {num_special} special tokens needs {inner} of its "
                         f"{len(vocab)} tokens")
    ranks = {base64.b64decode(t["token_bytes"]): i for i, t in enumerate(vocab[:inner])}
    if len(ranks) != inner:
        raise ValueError(f"{path}: its first {inner} tokens are not distinct")
    backend = ranked_bpe(ranks, pattern, {s: i for i, s in enumerate(specials)}, first_id=num_special, source=path)
    return TekkenSpec(backend, version, specials, size)
