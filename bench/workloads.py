"""Benchmark workloads: what is sent, with the prompt and output lengths each request promises.

- `random`: raw completion prompts of a given token length (from a range), made of whole-word tokens so
  that they re-tokenize to exactly that length.
- `fixed`: the chat prompts of a JSONL file (`bench/data/prompts.jsonl` by default), cycled.
- `shared-prefix`: groups of chat requests sharing a long system prompt, as SGLang's
  generated-shared-prefix dataset: groups x prompts per group x system length x question length.
- `multi-turn`: conversations whose every turn resends the history with the previous replies.

Output lengths are forced (the client sends `ignore_eos` and `min_tokens`), so every system does the
same work. Lengths are counted with the tokenizer passed in (our tokenizer of the served model).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from jaxserve.tokenizer import Tokenizer

WorkloadName = Literal["random", "fixed", "shared-prefix", "multi-turn"]
WORKLOADS: tuple[str, ...] = ("random", "fixed", "shared-prefix", "multi-turn")
DEFAULT_PROMPTS = Path(__file__).parent / "data" / "prompts.jsonl"

Message = dict[str, Any]


@dataclass(frozen=True)
class BenchRequest:
    """One request: a raw prompt (completions API) or chat messages, and its promised lengths."""

    prompt_len: int  # tokens the server should see (chat: after the chat template)
    output_len: int  # tokens to generate, forced
    prompt: str | None = None
    messages: tuple[Message, ...] | None = None
    group: int | None = None  # shared-prefix group

    @property
    def is_chat(self) -> bool:
        return self.messages is not None


@dataclass(frozen=True)
class Conversation:
    """A multi-turn conversation: each user turn is sent after the reply to the previous one."""

    user_turns: tuple[str, ...]
    output_len: int
    system: str | None = None
    turn_lens: tuple[int, ...] = field(default=())  # tokens of each user message (content only)


Workload = list[BenchRequest] | list[Conversation]


# -- text of an exact token length --------------------------------------------------------------------------


class WordTokens:
    """Vocabulary entries that are one space-led lowercase word and re-tokenize to themselves alone.

    Text made of such words, each led by a space, tokenizes to one token per word for byte-level BPE
    tokenizers that split before spaces (Llama 3, GPT-2, SmolLM, Qwen), so its length is exact.
    """

    def __init__(self, tokenizer: Tokenizer, min_chars: int = 3):
        words = []
        for tid in range(tokenizer.vocab_size):
            text = tokenizer.decode([tid], skip_special_tokens=False)
            w = text[1:]
            if len(text) > min_chars and text[0] == " " and w.isascii() and w.isalpha() and w.islower():
                if tokenizer.encode(text) == [tid]:
                    words.append(w)
        if len(words) < 100:
            raise ValueError(f"the tokenizer has only {len(words)} single-token words; random text needs more")
        self.tokenizer = tokenizer
        self.words = words

    def text(self, n: int, rng: random.Random) -> str:
        """Text of exactly `n` tokens (each ' word')."""
        return "".join(" " + rng.choice(self.words) for _ in range(n))


def _lengths(mean: int, range_ratio: float, n: int, rng: random.Random) -> list[int]:
    """n integers uniform in [mean * (1 - r), mean * (1 + r)], at least 1 (vLLM's --random-range-ratio)."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
    lo, hi = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def random_requests(tokenizer: Tokenizer, num: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                    seed: int = 0, words: WordTokens | None = None, images: int = 0,
                    image_size: tuple[int, int] = (512, 512)) -> list[BenchRequest]:
    """Raw completion prompts of `input_len` tokens (+- range_ratio), `output_len` (+- range_ratio) outputs; with
    `images`, chat messages of that many random images (PNG data URLs of `image_size` (width, height), each its
    own, as vLLM's random-mm) before the text, for an image-text model (the server counts their tokens)."""
    rng = random.Random(seed)
    words = words or WordTokens(tokenizer)
    ins = _lengths(input_len, range_ratio, num, rng)
    outs = _lengths(output_len, range_ratio, num, rng)
    if not images:
        return [BenchRequest(prompt_len=i, output_len=o, prompt=words.text(i, rng))
                for i, o in zip(ins, outs, strict=True)]
    return [BenchRequest(prompt_len=i, output_len=o, messages=({"role": "user", "content": [
        *({"type": "image_url", "image_url": {"url": random_png(image_size, rng)}} for _ in range(images)),
        {"type": "text", "text": words.text(i, rng)}]},)) for i, o in zip(ins, outs, strict=True)]


def random_png(size: tuple[int, int], rng: random.Random) -> str:
    """A PNG of random pixels, (width, height), as a data URL."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(rng.getrandbits(32)).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


# -- fixed prompts ------------------------------------------------------------------------------------------


def load_prompts(path: str | Path = DEFAULT_PROMPTS) -> list[list[Message]]:
    """The conversations of a JSONL file: one object per line with `messages` (or a `prompt` string)."""
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "messages" in row:
                out.append([{"role": m["role"], "content": m["content"]} for m in row["messages"]])
            elif "prompt" in row:
                out.append([{"role": "user", "content": row["prompt"]}])
            else:
                raise ValueError(f"{path}:{lineno}: a line needs 'messages' or 'prompt'")
    if not out:
        raise ValueError(f"{path} holds no prompts")
    return out


def fixed_requests(tokenizer: Tokenizer, num: int, output_len: int, path: str | Path = DEFAULT_PROMPTS
                   ) -> list[BenchRequest]:
    """`num` chat requests cycling through the prompts of `path`."""
    convs = load_prompts(path)
    lens = [len(tokenizer.encode_chat(c)) for c in convs]
    return [BenchRequest(prompt_len=lens[i % len(convs)], output_len=output_len,
                         messages=tuple(convs[i % len(convs)])) for i in range(num)]


# -- shared prefix ------------------------------------------------------------------------------------------


def shared_prefix_requests(tokenizer: Tokenizer, num_groups: int, prompts_per_group: int, system_len: int,
                           question_len: int, output_len: int, seed: int = 0, shuffle: bool = True,
                           words: WordTokens | None = None) -> list[BenchRequest]:
    """Groups of chat requests: a system prompt of `system_len` tokens shared within a group, then a user
    question of `question_len` tokens; requests of all groups interleaved at random when `shuffle`."""
    rng = random.Random(seed)
    words = words or WordTokens(tokenizer)
    reqs = []
    for g in range(num_groups):
        system = words.text(system_len, rng)
        for _ in range(prompts_per_group):
            msgs = ({"role": "system", "content": system}, {"role": "user", "content": words.text(question_len, rng)})
            reqs.append(BenchRequest(prompt_len=len(tokenizer.encode_chat(list(msgs))), output_len=output_len,
                                     messages=msgs, group=g))
    if shuffle:
        rng.shuffle(reqs)
    return reqs


# -- multi-turn ---------------------------------------------------------------------------------------------


def multi_turn_conversations(tokenizer: Tokenizer, num: int, num_turns: int, input_len: int, output_len: int,
                             seed: int = 0, system: str | None = None, words: WordTokens | None = None
                             ) -> list[Conversation]:
    """`num` conversations of `num_turns` user turns of `input_len` tokens each, `output_len` per reply."""
    rng = random.Random(seed)
    words = words or WordTokens(tokenizer)
    return [Conversation(tuple(words.text(input_len, rng) for _ in range(num_turns)), output_len, system,
                         (input_len,) * num_turns) for _ in range(num)]


def turn_messages(conv: Conversation, turn: int, replies: Sequence[str]) -> list[Message]:
    """The messages of `turn` (0-based): the system prompt, earlier turns with their replies, this turn."""
    msgs: list[Message] = [{"role": "system", "content": conv.system}] if conv.system else []
    for k in range(turn):
        msgs.append({"role": "user", "content": conv.user_turns[k]})
        msgs.append({"role": "assistant", "content": replies[k]})
    msgs.append({"role": "user", "content": conv.user_turns[turn]})
    return msgs


# -- from flags ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkloadSpec:
    """Everything that defines a workload; defaults follow `vllm bench serve` and SGLang's bench_serving."""

    name: WorkloadName = "fixed"
    num_prompts: int = 64
    seed: int = 0
    dataset_path: str | None = None
    output_len: int = 128
    random_input_len: int = 200
    random_range_ratio: float = 0.0
    random_images: int = 0  # images per request (chat messages, for an image-text model)
    random_image_size: tuple[int, int] = (512, 512)  # (width, height)
    gsp_num_groups: int = 4
    gsp_prompts_per_group: int = 16
    gsp_system_prompt_len: int = 1024
    gsp_question_len: int = 64
    multi_turn_num_turns: int = 3
    multi_turn_input_len: int = 64

    def __post_init__(self) -> None:
        if self.name not in WORKLOADS:
            raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, got {self.name!r}")
        for k in ("num_prompts", "output_len", "random_input_len", "gsp_num_groups", "gsp_prompts_per_group",
                  "gsp_system_prompt_len", "gsp_question_len", "multi_turn_num_turns", "multi_turn_input_len"):
            if getattr(self, k) < 1:
                raise ValueError(f"{k} must be >= 1, got {getattr(self, k)}")
        if self.random_images < 0 or min(self.random_image_size) < 1:
            raise ValueError(f"random_images must be >= 0 and random_image_size positive, got {self.random_images} "
                             f"and {self.random_image_size}")
        if self.random_images and self.name != "random":
            raise ValueError(f"random_images go with the random workload, not {self.name!r}")

    def build(self, tokenizer: Tokenizer) -> Workload:
        """The requests (or conversations) this spec describes."""
        if self.name == "random":
            return random_requests(tokenizer, self.num_prompts, self.random_input_len, self.output_len,
                                   self.random_range_ratio, self.seed, images=self.random_images,
                                   image_size=self.random_image_size)
        if self.name == "fixed":
            return fixed_requests(tokenizer, self.num_prompts, self.output_len,
                                  self.dataset_path or DEFAULT_PROMPTS)
        if self.name == "shared-prefix":
            return shared_prefix_requests(tokenizer, self.gsp_num_groups, self.gsp_prompts_per_group,
                                          self.gsp_system_prompt_len, self.gsp_question_len, self.output_len,
                                          self.seed)
        return multi_turn_conversations(tokenizer, self.num_prompts, self.multi_turn_num_turns,
                                        self.multi_turn_input_len, self.output_len, self.seed)

    def to_dict(self) -> dict[str, Any]:
        """The fields that matter to this workload (the others are left out of reports)."""
        keep = {"name", "num_prompts", "seed", "output_len"}
        prefix = {"random": ("random_",), "fixed": ("dataset_",), "shared-prefix": ("gsp_",),
                  "multi-turn": ("multi_turn_",)}[self.name]
        d = {k: v for k, v in self.__dict__.items() if k in keep or k.startswith(prefix)}
        if not self.random_images:
            d.pop("random_images", None)
            d.pop("random_image_size", None)
        if self.name == "shared-prefix":
            d.pop("num_prompts")
        if self.name == "fixed" and d.get("dataset_path") is None:
            d["dataset_path"] = str(DEFAULT_PROMPTS)
        return d
