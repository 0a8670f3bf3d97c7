"""What the engine checks before it queues a request: everything that would stop it from ever running."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxserve.engine.runner import MAX_STOP_IDS
from jaxserve.sampling_params import SamplingParams

NO_TOKENIZER = "the engine was started without a tokenizer (skip_tokenizer_init, --skip-tokenizer-init)"


def without_tokenizer(what: str) -> ValueError:
    """The error for what an engine without a tokenizer cannot do."""
    return ValueError(f"{what} needs the tokenizer; {NO_TOKENIZER}")


def _check_tokenizer_free(params: SamplingParams) -> None:
    """For an engine without a tokenizer: a ValueError naming the first part of the request that needs one."""
    needs = [("stop strings (give stop_token_ids)", bool(params.stop)), ("bad_words", bool(params.bad_words)),
             ("structured outputs", params.structured_outputs is not None),
             ("a text prediction (give token ids)", isinstance(params.prediction, str))]
    for what, asked in needs:
        if asked:
            raise without_tokenizer(what)


def prompt_token_ids(tokenizer: Any, prompt: str | Sequence[int], vocab_size: int,
                     add_special_tokens: bool = False, placeholders: Sequence[int] = ()) -> list[int]:
    """A prompt's token ids: text tokenized, ids checked against the vocabulary (and the media `placeholders` past
    it, `ImageEncoder.placeholder_ids`)."""
    if isinstance(prompt, str) and tokenizer is None:
        raise without_tokenizer("a text prompt (give token ids)")
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
    ids = [int(t) for t in prompt]
    bad = [t for t in ids if not 0 <= t < vocab_size and t not in placeholders]
    if bad:
        raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    return ids


def check_request(prompt_ids: Sequence[int], params: SamplingParams, *, max_model_len: int, max_logprobs: int,
                  vocab_size: int, eos_ids: Sequence[int], supports_prompt_logprobs: bool,
                  has_tokenizer: bool = True) -> tuple[int, tuple[int, ...]]:
    """The request's max_tokens (the room left in the context when not given) and its stop ids; a
    ValueError naming the problem if it can never run (`has_tokenizer` False: also what needs a tokenizer)."""
    if not has_tokenizer:
        _check_tokenizer_free(params)
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    room = max_model_len - len(prompt_ids)
    if room < 1:
        raise ValueError(
            f"the prompt has {len(prompt_ids)} tokens; this model's maximum context length is "
            f"{max_model_len} tokens, leaving no room to generate"
        )
    max_tokens = params.max_tokens if params.max_tokens is not None else room
    if max_tokens > room:
        raise ValueError(
            f"this model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{len(prompt_ids)} tokens and max_tokens is {max_tokens} (total {len(prompt_ids) + max_tokens})"
        )
    for name in ("logprobs", "prompt_logprobs"):
        if (getattr(params, name) or 0) > max_logprobs:
            raise ValueError(f"{name} must be <= {max_logprobs}, got {getattr(params, name)}")
    if params.prompt_logprobs is not None and not supports_prompt_logprobs:
        raise ValueError("prompt_logprobs need the model's hidden states, which this model does not return")
    for name, ids in (("logit_bias", params.logit_bias), ("allowed_token_ids", params.allowed_token_ids or ())):
        outside = sorted(t for t in ids if t >= vocab_size)
        if outside:
            raise ValueError(f"{name} token id {outside[0]} is outside the vocabulary of {vocab_size} tokens")
    stop_ids = tuple(params.all_stop_token_ids(eos_ids))
    if len(stop_ids) > MAX_STOP_IDS:
        raise ValueError(f"at most {MAX_STOP_IDS - len(eos_ids)} stop_token_ids are supported")
    return max_tokens, stop_ids


def truncated_prompt(prompt_ids: list[int], params: SamplingParams, max_model_len: int) -> list[int]:
    """The prompt's last `truncate_prompt_tokens` tokens (-1: the model's context), or all of it."""
    keep = params.truncate_prompt_tokens
    if keep is None:
        return prompt_ids
    keep = max_model_len if keep == -1 else keep
    if keep > max_model_len:
        raise ValueError(f"truncate_prompt_tokens {keep} exceeds this model's maximum context length {max_model_len}")
    return prompt_ids[-keep:]


def bad_words_token_ids(tokenizer: Any, words: Sequence[str]) -> list[list[int]]:
    """The token sequences `bad_words` forbid (vLLM's rule): each word as it would start the text, and, when that
    tokenizes to as many tokens with another first one, after a space."""
    out: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        for ids in (plain, spaced) if len(spaced) == len(plain) and spaced[:1] != plain[:1] else (plain,):
            if ids and ids not in out:
                out.append(ids)
    return out


def banned_now(bad_words: Sequence[Sequence[int]], output_ids: Sequence[int]) -> list[int]:
    """The tokens `bad_words` forbid next after these output tokens: each word's last token where the output ends
    with the tokens before it."""
    banned = []
    for word in bad_words:
        head = list(word[:-1])
        if len(head) <= len(output_ids) and (not head or list(output_ids[len(output_ids) - len(head):]) == head):
            banned.append(word[-1])
    return banned
