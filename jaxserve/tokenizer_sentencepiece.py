"""An HF tokenizer directory whose tokenizer is SentencePiece's `tokenizer.model` (no `tokenizer.json`).

Llama 2 and Mistral fine-tunes, Yi, and other checkpoints saved with a slow tokenizer ship only the SentencePiece
model: a protobuf (`ModelProto`) holding each piece with its score and kind, the trainer's settings (BPE or unigram,
byte fallback, the special pieces' ids) and the normalizer's (the leading space, extra-whitespace removal, a
precompiled character map). `read_sentencepiece_dir` reads it (its own small protobuf reader: no `sentencepiece` or
`protobuf` package) into the Rust tokenizer, as transformers 5 builds it for the class `tokenizer_config.json` names:

- `LlamaTokenizer` / `LlamaTokenizerFast` (Llama 2, Mistral v0.1-v0.3, Yi, CodeLlama-style fine-tunes): a BPE over the
  pieces with byte fallback, merges ranked by the merged piece's id, the space marker `▁` put before the text's first
  chunk (`legacy: false`, transformers' default) or before every chunk between added tokens (`legacy: true`), none
  with `add_prefix_space: false`;
- `GemmaTokenizer` / `GemmaTokenizerFast`: spaces spelled `▁`, no leading space;
- no class, `TokenizersBackend` or `PreTrainedTokenizerFast`: the model's own settings, encoding as SentencePiece
  does (BPE merges ranked by score, or the unigram model; user-defined pieces whole; the normalizer spec).

The control pieces become special tokens and the user-defined pieces plain added tokens, at their ids; then the
config's `added_tokens_decoder` (an entry at a piece's id renames that piece, as fine-tunes give unused pieces chat
roles). Other classes are refused by name.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from jaxserve.tokenizer_gguf import _template_processing

_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4  # SentencePiece's piece kinds (UNUSED 5, BYTE 6)
_UNIGRAM = 1
_LLAMA = ("LlamaTokenizer", "LlamaTokenizerFast")
_GEMMA = ("GemmaTokenizer", "GemmaTokenizerFast")
_GENERIC = (None, "TokenizersBackend", "PreTrainedTokenizerFast")
# The special tokens each class names by default (transformers' constructors).
_CLASS_TOKENS = {**{c: {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"} for c in _LLAMA},
                 **{c: {"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>", "pad_token": "<pad>"}
                    for c in _GEMMA}}


@dataclass
class SentencePieceModel:
    """What a `tokenizer.model` says (`ModelProto`, with SentencePiece's defaults for the fields it leaves out)."""

    pieces: list[tuple[str, float, int]]  # (piece, score, kind) by id
    model_type: int = _UNIGRAM  # 1 unigram, 2 BPE (3 word, 4 char)
    byte_fallback: bool = False
    unk_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    unk_piece: str = "<unk>"
    bos_piece: str = "<s>"
    eos_piece: str = "</s>"
    add_dummy_prefix: bool = True
    remove_extra_whitespaces: bool = True
    escape_whitespaces: bool = True
    precompiled_charsmap: bytes = b""


def _fields(buf: bytes, where: str):
    """(field number, wire type, value) of a protobuf message: ints for varints, bytes for length-delimited fields,
    raw little-endian bytes for fixed-width ones."""
    i, n = 0, len(buf)

    def varint() -> int:
        nonlocal i
        shift = value = 0
        while True:
            if i >= n:
                raise ValueError(f"{where} is not a SentencePiece model: a protobuf varint runs past the end")
            b = buf[i]
            i += 1
            value |= (b & 0x7F) << shift
            if not b & 0x80:
                return value
            shift += 7

    while i < n:
        key = varint()
        field, wire = key >> 3, key & 7
        if wire == 0:
            yield field, wire, varint()
        elif wire in (1, 5):
            width = 8 if wire == 1 else 4
            if i + width > n:
                raise ValueError(f"{where} is not a SentencePiece model: a protobuf field runs past the end")
            yield field, wire, buf[i:i + width]
            i += width
        elif wire == 2:
            size = varint()
            if i + size > n:
                raise ValueError(f"{where} is not a SentencePiece model: a protobuf field runs past the end")
            yield field, wire, buf[i:i + size]
            i += size
        else:
            raise ValueError(f"{where} is not a SentencePiece model: protobuf wire type {wire} (field {field})")


def _int32(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def read_model_proto(path: Path) -> SentencePieceModel:
    """The pieces and settings of SentencePiece model file `path`; ValueError when it is not one."""
    where = str(path)
    data = path.read_bytes()
    model = SentencePieceModel(pieces=[])
    try:
        for field, wire, value in _fields(data, where):
            if field == 1 and wire == 2:  # SentencePiece
                piece, score, kind = "", 0.0, _NORMAL
                for f, w, v in _fields(value, where):
                    if f == 1 and w == 2:
                        piece = v.decode("utf-8")
                    elif f == 2 and w == 5:
                        score = struct.unpack("<f", v)[0]
                    elif f == 3 and w == 0:
                        kind = v
                model.pieces.append((piece, score, kind))
            elif field == 2 and wire == 2:  # TrainerSpec
                ints = {3: "model_type", 40: "unk_id", 41: "bos_id", 42: "eos_id"}
                strs = {45: "unk_piece", 46: "bos_piece", 47: "eos_piece"}
                for f, w, v in _fields(value, where):
                    if f in ints and w == 0:
                        setattr(model, ints[f], _int32(v))
                    elif f in strs and w == 2:
                        setattr(model, strs[f], v.decode("utf-8"))
                    elif f == 35 and w == 0:
                        model.byte_fallback = bool(v)
            elif field == 3 and wire == 2:  # NormalizerSpec
                flags = {3: "add_dummy_prefix", 4: "remove_extra_whitespaces", 5: "escape_whitespaces"}
                for f, w, v in _fields(value, where):
                    if f in flags and w == 0:
                        setattr(model, flags[f], bool(v))
                    elif f == 2 and w == 2:
                        model.precompiled_charsmap = bytes(v)
    except UnicodeDecodeError as e:
        raise ValueError(f"{where} is not a SentencePiece model (a piece is not UTF-8: {e})") from None
    if not model.pieces or not all(p for p, _, _ in model.pieces):
        raise ValueError(f"{where} is not a SentencePiece model (no pieces, or an empty one); a tiktoken "
                         "`tokenizer.model` (Llama 3's original files) is not read")
    return model


def read_sentencepiece_dir(root: Path, config: dict[str, Any]) -> tokenizers.Tokenizer:
    """The tokenizer of `root / "tokenizer.model"` built as `config["tokenizer_class"]` names it, with its added tokens;
    fills in `config`'s special-token names the class gives by default. ValueError naming what it cannot read."""
    cls = config.get("tokenizer_class")
    if cls not in (*_LLAMA, *_GEMMA, *_GENERIC):
        raise ValueError(f"{root}: a SentencePiece tokenizer.model of class {cls!r} is not supported (read: "
                         f"{', '.join(c for c in (*_LLAMA, *_GEMMA, *_GENERIC) if c)}, or no class); a tokenizer.json "
                         "would be read whatever its class")
    sp = read_model_proto(root / "tokenizer.model")
    pieces = [p for p, _, _ in sp.pieces]
    # An added token at a piece's id renames that piece (unless another piece keeps that name).
    added = {int(k): (v["content"] if isinstance(v, dict) else str(v))
             for k, v in (config.get("added_tokens_decoder") or {}).items()}
    kept = {p for i, p in enumerate(pieces) if i not in added}
    pieces = [added[i] if i in added and added[i] not in kept else p for i, p in enumerate(pieces)]
    kinds = [k for _, _, k in sp.pieces]
    if cls in _GENERIC:
        backend = _spm_backend(sp, pieces, legacy=bool(config.get("legacy", True)))
        named = {"bos_token": (sp.bos_id, sp.bos_piece), "eos_token": (sp.eos_id, sp.eos_piece),
                 "unk_token": (sp.unk_id, sp.unk_piece)}
        for name, (tid, piece) in named.items():
            if tid >= 0:
                config.setdefault(name, piece)
    else:
        for name, token in _CLASS_TOKENS[cls].items():
            if token in pieces:
                config.setdefault(name, token)
        backend = _class_backend(cls, sp, pieces, config)
    # Control pieces are special tokens; a class's user-defined pieces plain added tokens (the model's own
    # pre-tokenizer isolates them).
    add = (_CONTROL,) if cls in _GENERIC else (_CONTROL, _USER_DEFINED)
    for p, k in zip(pieces, kinds, strict=True):
        if k in add:
            token = AddedToken(p, special=k == _CONTROL, normalized=False)
            (backend.add_special_tokens if token.special else backend.add_tokens)([token])
    # The tokens the config names are special (skipped in decoding), as in transformers.
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        content = _content(config.get(name))
        if content is not None and content in pieces:
            backend.add_special_tokens([AddedToken(content, special=True, normalized=False)])
    from jaxserve.tokenizer_slow import _add_tokens

    # Under the model's own settings they are matched in the raw text, so each chunk between them gets its marker.
    raw = cls in _GENERIC and sp.add_dummy_prefix
    decoder = {k: ({**v, "normalized": False} if isinstance(v, dict) and raw else v)
               for k, v in (config.get("added_tokens_decoder") or {}).items()}
    _add_tokens(backend, decoder, root)
    bos, eos = _content(config.get("bos_token")), _content(config.get("eos_token"))
    add_bos = bool(config.get("add_bos_token", False)) and bos is not None
    add_eos = bool(config.get("add_eos_token", False)) and eos is not None
    if add_bos or add_eos:
        backend.post_processor = _template_processing(
            bos if add_bos else None, backend.token_to_id(bos) if add_bos else None,
            eos if add_eos else None, backend.token_to_id(eos) if add_eos else None)
    return backend


def _content(token: Any) -> str | None:
    """A config's special token: its text, or None."""
    return token.get("content") if isinstance(token, dict) else token if isinstance(token, str) else None


def _piece_ranked_merges(vocab: dict[str, int], rank: dict[str, tuple]) -> list[tuple[str, str]]:
    """Every split of a ranked piece into two pieces of `vocab`, best-ranked piece first (then the shorter left)."""
    found = []
    for piece, key in rank.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                found.append((key, cut, left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def _class_backend(cls: str, sp: SentencePieceModel, pieces: list[str], config: dict[str, Any]) -> tokenizers.Tokenizer:
    """The Llama / Gemma classes' tokenizer over the model's pieces (the class's settings, not the model's)."""
    vocab = {p: i for i, p in enumerate(pieces)}
    # Merges ranked by the merged piece's id: a BPE model's pieces come in merge order.
    merges = _piece_ranked_merges(vocab, {p: (i,) for p, i in vocab.items()})
    unk = _content(config.get("unk_token")) if cls in _GEMMA else None
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True,
                                              unk_token=unk))
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if cls in _GEMMA:
        backend.normalizer = normalizers.Replace(" ", "\u2581")
        backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
        backend.decoder = decoders.Sequence(steps)
        return backend
    prefix = config.get("add_prefix_space")
    prefix = True if prefix is None else bool(prefix)
    scheme = "never" if not prefix else "always" if config.get("legacy", False) else "first"
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme=scheme, split=False)
    backend.decoder = decoders.Sequence([*steps, decoders.Strip(content=" ", left=1, right=0)] if prefix else steps)
    return backend


def _spm_backend(sp: SentencePieceModel, pieces: list[str], legacy: bool) -> tokenizers.Tokenizer:
    """The model as SentencePiece runs it: its BPE (merges of plain pieces by score) or unigram, its normalizer spec,
    its user-defined pieces whole."""
    user = [p for p, (_, _, k) in zip(pieces, sp.pieces, strict=True) if k == _USER_DEFINED]
    if sp.model_type == _UNIGRAM:
        model = models.Unigram([(p, s) for p, (_, s, _) in zip(pieces, sp.pieces, strict=True)], sp.unk_id,
                               sp.byte_fallback)
    else:
        vocab = {p: i for i, p in enumerate(pieces)}
        plain = {p: (-s, i) for i, (p, (_, s, k)) in enumerate(zip(pieces, sp.pieces, strict=True)) if k == _NORMAL}
        model = models.BPE(vocab=vocab, merges=_piece_ranked_merges(plain, plain), fuse_unk=True,
                           unk_token=pieces[sp.unk_id] if 0 <= sp.unk_id < len(pieces) else None,
                           byte_fallback=sp.byte_fallback, ignore_merges=bool(user))
    backend = tokenizers.Tokenizer(model)
    steps = [normalizers.Precompiled(sp.precompiled_charsmap)] if sp.precompiled_charsmap else []
    if sp.remove_extra_whitespaces:  # spaces only: SentencePiece leaves newlines and tabs alone
        steps += [normalizers.Replace(Regex(r"\A +| +\z"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
    if sp.escape_whitespaces:
        steps.append(normalizers.Replace(" ", "\u2581"))
    if sp.add_dummy_prefix and legacy:  # SentencePiece adds the marker even before one already there
        steps.append(normalizers.Replace(Regex("\\A\u2581"), "\u2581\u2581"))
    backend.normalizer = normalizers.Sequence(steps)
    pre = []
    if sp.add_dummy_prefix:
        pre.append(pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always" if legacy else "first",
                                            split=False))
    if user:
        pattern = "|".join(re.escape(p) for p in sorted(user, key=len, reverse=True))
        pre.append(pre_tokenizers.Split(Regex(pattern), behavior="isolated"))
    if pre:
        backend.pre_tokenizer = pre_tokenizers.Sequence(pre)
    steps = [decoders.Replace("\u2581", " ")] + ([decoders.ByteFallback()] if sp.byte_fallback else [])
    if sp.add_dummy_prefix:
        steps += [decoders.Fuse(), decoders.Strip(content=" ", left=1, right=0)]
    elif sp.byte_fallback:
        steps.append(decoders.Fuse())
    backend.decoder = decoders.Sequence(steps)
    return backend


_MISTRAL_NAME = re.compile(r"^(?:.*\.)?model\.v(\d+)(?:m\d+)?$")


def mistral_tokenizer_file(root: str | Path) -> Path | None:
    """A Mistral-format directory's tokenizer: `tekken.json`, else its newest SentencePiece `tokenizer.model.vN`."""
    root = Path(root)
    if (root / "tekken.json").is_file():
        return root / "tekken.json"
    found = [(int(m.group(1)), p) for p in root.glob("*.model.v*") if (m := _MISTRAL_NAME.match(p.name)) and p.is_file()]
    return max(found)[1] if found else None


def read_mistral_sentencepiece(path: str | Path) -> Any:
    """Mistral's SentencePiece tokenizer file (`tokenizer.model.v3`, `.v7`: Mistral 7B v0.3, Codestral 22B, Mistral
    Large 2) as mistral_common encodes: each text between control tokens with its own leading space, `[INST]` and the
    other control pieces special; a `TekkenSpec` (`tokenizer_tekken`) with the version its file name gives."""
    from jaxserve.tokenizer_tekken import TekkenSpec

    path = Path(path)
    m = _MISTRAL_NAME.match(path.name)
    if m is None:
        raise ValueError(f"{path}: a Mistral SentencePiece tokenizer file is named *.model.vN")
    if int(m.group(1)) < 3:
        raise ValueError(f"{path}: Mistral's instruct formats before v3 (its [INST] spacing and system prompt) are not "
                         "rendered; an HF directory with this model's tokenizer.json and chat template is read "
                         "(--tokenizer)")
    sp = read_model_proto(path)
    pieces = [p for p, _, _ in sp.pieces]
    backend = _spm_backend(sp, pieces, legacy=True)
    backend.add_special_tokens([AddedToken(p, special=True, normalized=False)
                                for p, _, k in sp.pieces if k == _CONTROL])
    leading = next((i for i, (_, _, k) in enumerate(sp.pieces) if k not in (_CONTROL, _UNKNOWN)), len(pieces))
    return TekkenSpec(backend, f"v{m.group(1)}", tuple(pieces[:leading]), len(pieces))
