"""The model's tokenizer: text to token ids and back, its special tokens and its chat template.

A `Tokenizer` wraps a HF `tokenizers.Tokenizer` (the Rust BPE) and adds what serving needs on top:
the BOS/EOS/pad ids, every id that ends generation, and the chat template. It is built from a GGUF file's
metadata (`from_gguf`), a HF tokenizer directory (`from_hf_dir`) or a Mistral tekken file (`from_tekken`), never
from the network, and can be written back as a HF directory (`save_hf`) that `transformers` loads.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tokenizers

from jaxserve.chat_template import render_chat_template
from jaxserve.tokenizer_gguf import SUPPORTED_GGUF_PRE, byte_alphabet, read_gguf_tokenizer

if TYPE_CHECKING:
    from jaxserve.loader.gguf_header import GGUFHeader

# Re-exported: callers import the byte alphabet and the supported GGUF families from here.
__all__ = ["SUPPORTED_GGUF_PRE", "Tokenizer", "byte_alphabet"]

# transformers writes this for "no limit"; anything this large is not a real context length.
_NO_LIMIT = 10**12


def _token_content(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string, or an AddedToken dict with `content`."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"cannot read a special token from {value!r}")


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file not found: {path}")
    with path.open(encoding="utf-8") as f:
        return json.load(f)


_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _keys_sorted(value: Any) -> Any:
    """`value` with every mapping's keys in sorted order, at every depth (lists keep their order)."""
    if isinstance(value, Mapping):
        return {k: _keys_sorted(value[k]) for k in sorted(value)}
    if isinstance(value, list | tuple):
        return [_keys_sorted(v) for v in value]
    return value


def _tagged(message: Mapping[str, Any]) -> dict[str, Any]:
    """`message` with `_CONTINUE_TAG` after its text (its last text part's)."""
    content = message.get("content")
    if isinstance(content, str):
        return {**message, "content": content + _CONTINUE_TAG}
    parts = [dict(p) for p in content or ()]
    last = next((p for p in reversed(parts) if isinstance(p.get("text"), str)), None)
    if last is None:
        raise ValueError("continue_final_message: the final message has no text to continue")
    last["text"] += _CONTINUE_TAG
    return {**message, "content": parts}


class Tokenizer:
    """Text <-> token ids for one model, with its special token ids and chat template."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        pad_token_id: int | None = None,
        unk_token_id: int | None = None,
        chat_templates: Mapping[str, str] | None = None,
        add_bos_token: bool = False,
        add_eos_token: bool = False,
        model_max_length: int | None = None,
        vocab_size: int | None = None,
        sort_tool_keys: bool = False,
    ):
        self._backend = backend
        # Kimi K2's tokenizer sorts the keys of the tools' schemas, at every depth, before its template renders them.
        self.sort_tool_keys = sort_tool_keys
        self.bos_token_id = bos_token_id
        # Order is kept (the first is "the" EOS), duplicates dropped.
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self.pad_token_id = pad_token_id
        self.unk_token_id = unk_token_id
        self.chat_templates: dict[str, str] = dict(chat_templates or {})
        self.add_bos_token = add_bos_token
        self.add_eos_token = add_eos_token
        self.model_max_length = model_max_length
        self._vocab_size = (
            vocab_size if vocab_size is not None else backend.get_vocab_size(with_added_tokens=True)
        )
        for name, tid in (("bos", bos_token_id), ("pad", pad_token_id), ("unk", unk_token_id)):
            if tid is not None and not 0 <= tid < self._vocab_size:
                raise ValueError(f"{name}_token_id={tid} is outside the vocabulary of {self._vocab_size}")
        for tid in self.eos_token_ids:
            if not 0 <= tid < self._vocab_size:
                raise ValueError(f"eos token id {tid} is outside the vocabulary of {self._vocab_size}")

    # ----- construction -----

    @classmethod
    def from_gguf(cls, path_or_reader: str | os.PathLike[str] | GGUFHeader) -> Tokenizer:
        """Build the tokenizer a GGUF file describes in its `tokenizer.*` metadata (byte-level or SentencePiece BPE)."""
        spec = read_gguf_tokenizer(path_or_reader)
        return cls(
            spec.backend,
            bos_token_id=spec.bos_token_id,
            eos_token_ids=spec.eos_token_ids,
            pad_token_id=spec.pad_token_id,
            unk_token_id=spec.unk_token_id,
            chat_templates=spec.chat_templates,
            add_bos_token=spec.add_bos_token,
            add_eos_token=spec.add_eos_token,
            model_max_length=spec.model_max_length,
            vocab_size=spec.vocab_size,
        )

    @classmethod
    def from_tekken(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Build the tokenizer of a Mistral `tekken.json` (`tokenizer_tekken`) or SentencePiece `tokenizer.model.vN`
        (`tokenizer_sentencepiece`), with the chat template of its version's instruct format (`chat_template_mistral`);
        `<s>` opens a prompt encoded with special tokens."""
        from tokenizers.processors import TemplateProcessing

        from jaxserve.chat_template_mistral import mistral_template
        from jaxserve.tokenizer_sentencepiece import read_mistral_sentencepiece
        from jaxserve.tokenizer_tekken import read_tekken

        spec = read_tekken(path) if str(path).endswith(".json") else read_mistral_sentencepiece(path)
        bos, eos = spec.specials.index("<s>"), spec.specials.index("</s>")
        spec.backend.post_processor = TemplateProcessing(single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", bos)])
        pad = spec.specials.index("<pad>") if "<pad>" in spec.specials else None
        return cls(spec.backend, bos_token_id=bos, eos_token_ids=[eos], pad_token_id=pad,
                   unk_token_id=spec.specials.index("<unk>") if "<unk>" in spec.specials else None,
                   chat_templates={"default": mistral_template(spec.version)}, add_bos_token=True,
                   vocab_size=spec.vocab_size)

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load `tokenizer.json` (or Moonshot's `tiktoken.model`, Hunyuan's `hy.tiktoken`: `tokenizer_tiktoken`; or
        a slow tokenizer's `vocab.json` and `merges.txt`: `tokenizer_slow`; or SentencePiece's `tokenizer.model`:
        `tokenizer_sentencepiece`) + `tokenizer_config.json` (+ `chat_template.jinja`, `generation_config.json`)."""
        from jaxserve.tokenizer_slow import read_tokenizer_files

        root = Path(path)
        backend, config = read_tokenizer_files(root)
        gen_file = root / "generation_config.json"
        generation = _read_json(gen_file) if gen_file.is_file() else {}

        def id_of(name: str) -> int | None:
            content = _token_content(config.get(name))
            if content is None:
                return None
            tid = backend.token_to_id(content)
            if tid is None:
                raise ValueError(
                    f"{name} {content!r} of {root / 'tokenizer_config.json'} is not in the vocabulary"
                )
            return tid

        bos_id = id_of("bos_token")
        if bos_id is None:
            bos_id = next(iter(_ids(generation.get("bos_token_id"))), None)
        eos_ids = [i for i in [id_of("eos_token")] if i is not None] + _ids(generation.get("eos_token_id"))
        pad_id = id_of("pad_token")
        if pad_id is None:
            pad_id = next(iter(_ids(generation.get("pad_token_id"))), None)

        templates: dict[str, str] = {}
        raw = config.get("chat_template")
        if isinstance(raw, str):
            templates["default"] = raw
        elif isinstance(raw, list):  # older files: a list of {"name", "template"}
            templates.update({t["name"]: t["template"] for t in raw})
        if not templates and (processor_file := root / "chat_template.json").is_file():
            # An image-text model's processor template (Gemma 3), when the tokenizer's config has none.
            templates["default"] = _read_json(processor_file).get("chat_template", "")
        if (jinja_file := root / "chat_template.jinja").is_file():
            # transformers prefers the standalone file over the config entry; so do we.
            templates["default"] = jinja_file.read_text(encoding="utf-8")

        max_len = config.get("model_max_length")
        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_ids=eos_ids,
            pad_token_id=pad_id,
            unk_token_id=id_of("unk_token"),
            chat_templates=templates,
            add_bos_token=bool(config.get("add_bos_token", False)),
            add_eos_token=bool(config.get("add_eos_token", False)),
            model_max_length=int(max_len)
            if isinstance(max_len, int | float) and max_len < _NO_LIMIT
            else None,
            sort_tool_keys="tokenization_kimi." in json.dumps(config.get("auto_map")),
        )

    # ----- ids and text -----

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying HF `tokenizers.Tokenizer`."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._vocab_size

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special-token text in it is matched as special tokens, as in transformers."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_pair(self, text: str, pair: str) -> list[int]:
        """Two texts as one input, with the special tokens the tokenizer's pair template puts around and
        between them (what a cross-encoder reads, as `tokenizer(text, text_pair)` gives it)."""
        return list(self._backend.encode(text, pair, add_special_tokens=True).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; bytes that do not form a whole UTF-8 character come out as U+FFFD."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry (in the byte alphabet for byte-level BPE) of `token_id`, None if unknown."""
        return self._backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary entry, None if absent."""
        return self._backend.token_to_id(token)

    @property
    def bos_token(self) -> str | None:
        """The BOS token's text."""
        return None if self.bos_token_id is None else self.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        """The (first) EOS token's text."""
        return self.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else None

    @property
    def pad_token(self) -> str | None:
        """The padding token's text."""
        return None if self.pad_token_id is None else self.id_to_token(self.pad_token_id)

    @property
    def unk_token(self) -> str | None:
        """The unknown token's text."""
        return None if self.unk_token_id is None else self.id_to_token(self.unk_token_id)

    @functools.cached_property
    def all_special_ids(self) -> tuple[int, ...]:
        """Every special id: BOS, EOS, pad, unk and every added token marked special, sorted."""
        named = {self.bos_token_id, self.pad_token_id, self.unk_token_id, *self.eos_token_ids}
        added = {i for i, t in self._backend.get_added_tokens_decoder().items() if t.special}
        return tuple(sorted((named | added) - {None}))

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The named special tokens as text, as chat templates see them (`bos_token`, `eos_token`, ...)."""
        named = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "unk_token": self.unk_token,
            "pad_token": self.pad_token,
        }
        return {k: v for k, v in named.items() if v is not None}

    # ----- chat -----

    @property
    def chat_template(self) -> str | None:
        """The default chat template, None if the model has none."""
        return self.chat_templates.get("default")

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        """Render `messages` with the model's chat template, as transformers' `apply_chat_template` does;
        `chat_template` (a template's text) replaces the model's. With `continue_final_message` the text ends
        with the final message's (its last text part's) own text, whatever end of turn the template writes
        after it, so that the model continues it."""
        template = chat_template or (self.chat_templates.get("tool_use") if tools else None) or self.chat_template
        if template is None:
            raise ValueError("this tokenizer has no chat template; send a plain completion prompt instead")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be set")
        if continue_final_message:  # marked where the final message's text ends, as transformers marks it
            messages = [*messages[:-1], _tagged(messages[-1])]
        if tools and self.sort_tool_keys:
            tools = _keys_sorted(tools)
        text = render_chat_template(
            template,
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            **{**self.special_tokens_map, **kwargs},
        )
        if not continue_final_message:
            return text
        at = text.rfind(_CONTINUE_TAG.strip())
        if at < 0:
            raise ValueError("continue_final_message: the chat template drops the end of the final message")
        # A template that keeps the message's spacing shows the whole tag; one that trims it, not its space.
        return text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> list[int]:
        """Token ids of the rendered chat; the template writes its own special tokens, so none are added."""
        text = self.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs
        )
        return self.encode(text, add_special_tokens=False)

    # ----- saving -----

    def save_hf(self, directory: str | os.PathLike[str]) -> Path:
        """Write `tokenizer.json`, `tokenizer_config.json` and `special_tokens_map.json` for `transformers`."""
        root = Path(directory)
        root.mkdir(parents=True, exist_ok=True)
        self._backend.save(str(root / "tokenizer.json"))
        named = self.special_tokens_map
        extra = [
            t.content
            for i, t in sorted(self._backend.get_added_tokens_decoder().items())
            if t.special and t.content not in named.values()
        ]
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **named,
            "additional_special_tokens": extra,
            "add_bos_token": self.add_bos_token,
            "add_eos_token": self.add_eos_token,
            "clean_up_tokenization_spaces": False,
        }
        if self.chat_template is not None:
            if len(self.chat_templates) == 1:
                config["chat_template"] = self.chat_template
            else:
                config["chat_template"] = [{"name": n, "template": t} for n, t in self.chat_templates.items()]
        if self.model_max_length is not None:
            config["model_max_length"] = self.model_max_length
        _write_json(root / "tokenizer_config.json", config)
        _write_json(root / "special_tokens_map.json", {**named, "additional_special_tokens": extra})
        if len(self.eos_token_ids) > 1:
            # The only standard place for more than one EOS id; keep whatever else a model directory has there.
            gen_file = root / "generation_config.json"
            generation = _read_json(gen_file) if gen_file.is_file() else {}
            generation["eos_token_id"] = list(self.eos_token_ids)
            _write_json(gen_file, generation)
        return root

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token!r}, eos_ids={self.eos_token_ids}, "
            f"pad={self.pad_token!r}, chat_template={'yes' if self.chat_template else 'no'})"
        )


def _write_json(path: Path, obj: Any) -> None:
    with path.open("w", encoding="utf-8") as f:
        json.dump(obj, f, ensure_ascii=False, indent=2)
        f.write("\n")
