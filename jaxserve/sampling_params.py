"""Per-request sampling parameters, named and checked as vLLM's `SamplingParams` are."""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping, Sequence

from jaxserve.structured_outputs import StructuredOutputsParams

MAX_LOGPROBS = 20
"""The most top logprobs a request may ask for per generated token."""

MAX_LOGIT_BIAS = 128
"""The most `logit_bias` entries a request may give (the sampler's fixed width on the device)."""

GREEDY_EPS = 1e-5
"""Temperatures below this are greedy (argmax), as in vLLM."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick the tokens of one request; defaults and meanings follow vLLM.

    Attributes:
      n: number of completions to return for the prompt.
      temperature: softmax temperature; 0 means greedy (argmax).
      top_p: keep the smallest set of most likely tokens whose probability reaches top_p.
      top_k: keep the top_k most likely tokens; 0 or -1 turns it off (stored as 0).
      min_p: drop tokens less likely than min_p times the most likely one.
      repetition_penalty: >1 discourages tokens seen in the prompt or the output
        (positive logits divided by it, negative ones multiplied).
      presence_penalty: subtracted once from the logit of every token already generated.
      frequency_penalty: subtracted from a token's logit once per time it was generated.
      seed: makes the request's random choices reproducible whatever else is batched with it.
      stop: strings that end the generation (a single string is accepted).
      stop_token_ids: token ids that end the generation.
      ignore_eos: keep generating past the model's end-of-sequence token.
      max_tokens: the most tokens to generate; None means up to the context length.
      min_tokens: EOS and stop_token_ids are forbidden until this many tokens are generated.
      logprobs: number of top logprobs to return per generated token (0: only the
        sampled token's); None returns none.
      prompt_logprobs: number of top logprobs to return per prompt token (0: only the prompt
        token's own), None returns none. The first prompt token has none (None in the list); such
        a request computes its whole prompt (it reads no cached prefix).
      skip_special_tokens: leave special tokens out of the detokenized text.
      detokenize: turn the output into text (False: `text` stays empty and logprob entries carry no
        `decoded_token`; for a client that reads `token_ids` only). Stop strings need it.
      include_stop_str_in_output: keep the matched stop string at the end of the text.
      logit_bias: {token id: bias} added to the logits before any penalty or filter; biases
        are clamped to [-100, 100] (OpenAI's range): -100 bans a token, +100 all but forces it.
        At most MAX_LOGIT_BIAS entries.
      structured_outputs: constrain the output to a JSON schema, a regex, a choice or a grammar
        (a `StructuredOutputsParams`, or a mapping of its fields); None leaves it free.
      allowed_token_ids: the only tokens the request may generate (None: any).
      bad_words: words never generated: each is tokenized as it would start the text and after a space
        (vLLM's way), and the last token of either form is forbidden wherever the output ends with the
        tokens before it (a one-token word: everywhere).
      truncate_prompt_tokens: keep only the prompt's last N tokens (-1: as many as the model's context
        holds); None keeps the whole prompt.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: Mapping[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    allowed_token_ids: Sequence[int] | None = None
    bad_words: Sequence[str] | None = None
    truncate_prompt_tokens: int | None = None
    prediction: str | Sequence[int] | None = None
    """OpenAI's predicted output: text (or token ids) the output is expected to mostly be. With speculative decoding
    that drafts from tokens (methods "ngram" and "suffix"), drafts are also taken from it where the output so far
    matches it; the output itself never depends on it (`CompletionOutput.accepted_prediction_tokens`)."""

    def __post_init__(self) -> None:
        # Normalize first so that the checks and every later reader see one form.
        stop = self.stop
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        else:
            stop = list(stop)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", list(self.stop_token_ids or []))
        if stop and not self.detokenize:
            raise ValueError("stop strings are found in the output's text: they need detokenize=True (stop_token_ids "
                             "work without it)")
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        if self.allowed_token_ids is not None:
            if isinstance(self.allowed_token_ids, (str, bytes)) or not isinstance(self.allowed_token_ids, Sequence):
                raise ValueError(f"allowed_token_ids must be a list of token ids, got {self.allowed_token_ids!r}")
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        if self.bad_words is not None:
            words = [self.bad_words] if isinstance(self.bad_words, str) else list(self.bad_words)
            object.__setattr__(self, "bad_words", words)
        if self.prediction is not None and not isinstance(self.prediction, str):
            if isinstance(self.prediction, bytes) or not isinstance(self.prediction, Sequence):
                raise ValueError(f"prediction must be a string or a list of token ids, got {self.prediction!r}")
            for t in self.prediction:
                _check_int("prediction token id", t)
            object.__setattr__(self, "prediction", [int(t) for t in self.prediction])
        so = self.structured_outputs
        if isinstance(so, Mapping):
            object.__setattr__(self, "structured_outputs", StructuredOutputsParams(**so))
        elif so is not None and not isinstance(so, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got {type(so).__name__}")
        self._check()

    def _check(self) -> None:
        _check_int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        _check_float("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        _check_float("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k)
        if self.top_k < 0:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or at least 1, got {self.top_k}")
        _check_float("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        _check_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_float(name, value)
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if self.seed is not None:
            _check_int("seed", self.seed)
        for s in self.stop:
            if not isinstance(s, str):
                raise ValueError(f"stop must be a string or a list of strings, got {s!r} in it")
            if not s:
                raise ValueError("stop must not contain an empty string")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t)
            if t < 0:
                raise ValueError(f"stop_token_ids must be >= 0, got {t}")
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be at least 1 (or None), got {self.max_tokens}")
        _check_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs)
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}] (or None), got {self.logprobs}")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty")
            for t in self.allowed_token_ids:
                _check_int("allowed_token_ids", t)
                if t < 0:
                    raise ValueError(f"allowed_token_ids must be >= 0, got {t}")
        for w in self.bad_words or []:
            if not isinstance(w, str) or not w.strip():
                raise ValueError(f"bad_words must be non-blank strings, got {w!r}")
        if self.truncate_prompt_tokens is not None:
            _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens)
            if self.truncate_prompt_tokens < 1 and self.truncate_prompt_tokens != -1:
                raise ValueError(f"truncate_prompt_tokens must be -1 (the model's context) or at least 1, got "
                                 f"{self.truncate_prompt_tokens}")
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs)
            if not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
                raise ValueError(
                    f"prompt_logprobs must be in [0, {MAX_LOGPROBS}] (or None), got {self.prompt_logprobs}"
                )

    @property
    def is_greedy(self) -> bool:
        """Whether tokens are picked by argmax rather than drawn."""
        return self.temperature < GREEDY_EPS

    def all_stop_token_ids(self, eos_token_ids: Sequence[int]) -> list[int]:
        """Token ids that end this request: stop_token_ids, plus EOS unless ignore_eos."""
        ids = list(self.stop_token_ids)
        if not self.ignore_eos:
            ids.extend(t for t in eos_token_ids if t not in ids)
        return ids


def _logit_bias(value: object) -> dict[int, float]:
    """`logit_bias` checked and normalized: int ids, float biases clamped to [-100, 100]."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"logit_bias must be a mapping of token ids to biases, got {value!r}")
    if len(value) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias has {len(value)} entries; at most {MAX_LOGIT_BIAS} are supported")
    out = {}
    for tid, bias in value.items():
        _check_int("logit_bias token id", tid)
        if tid < 0:
            raise ValueError(f"logit_bias token id must be >= 0, got {tid}")
        _check_float(f"logit_bias[{tid}]", bias)
        out[int(tid)] = min(100.0, max(-100.0, float(bias)))
    return out


def _check_int(name: str, value: object) -> None:
    # bool is an int subclass; True as a count is almost always a caller's mistake.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")


def _check_float(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
