"""Beam search over the engine, as vLLM's `LLM.beam_search` offers it.

Each step asks the engine for one token of every live beam, with the top `2 * beam_width` logprobs of
the raw distribution; each beam's candidates are its tokens plus one of those, scored by cumulative
logprob. Per prompt the `beam_width` best candidates go on: those ending in EOS (unless `ignore_eos`)
are complete, the others are the next step's beams. A beam's request shares its prompt and earlier
tokens with the others' through the prefix cache, so a step computes only the pages it does not hold.
After `max_tokens` steps (or once no beam is live, or one reaches the model's length), the complete and
live beams are ranked by `cumulative_logprob / length ** length_penalty` (the length counts the prompt,
without a final EOS) and the best `beam_width` are returned, best first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from jaxserve.sampling_params import MAX_LOGPROBS, SamplingParams


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's beam search parameters: `beam_width` beams kept per prompt, up to `max_tokens` new tokens
    each; `ignore_eos` keeps a beam going past EOS; `length_penalty` is the exponent of the length that
    divides a beam's cumulative logprob when the beams are ranked at the end."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if 2 * self.beam_width > MAX_LOGPROBS:
            raise ValueError(f"beam_width must be at most {MAX_LOGPROBS // 2} (each step reads the top "
                             f"2 * beam_width logprobs, at most {MAX_LOGPROBS}), got {self.beam_width}")
        if not isinstance(self.length_penalty, (int, float)) or isinstance(self.length_penalty, bool):
            raise ValueError(f"length_penalty must be a number, got {self.length_penalty!r}")


@dataclass
class BeamSearchSequence:
    """One beam: `tokens` (the prompt's, then the generated ones), the logprob of each generated token,
    their sum, the generated text, and why it ended ("stop": EOS; "length": max_tokens or the model's
    length; None: cut by the search while still live, which cannot be returned)."""

    tokens: list[int]
    logprobs: list[float] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str = ""
    finish_reason: str | None = None


@dataclass
class BeamSearchOutput:
    """The best beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def beam_score(beam: BeamSearchSequence, eos_token_ids: Sequence[int], length_penalty: float) -> float:
    """The beam's cumulative logprob over its length (prompt included, a final EOS not) to the power
    `length_penalty`."""
    n = len(beam.tokens) - (1 if beam.tokens and beam.tokens[-1] in eos_token_ids else 0)
    return beam.cum_logprob / (max(n, 1) ** length_penalty)


NextLogprobs = Callable[[list[list[int]], int], list[dict[int, float]]]


def beam_search(prompts: Sequence[list[int]], params: BeamSearchParams, *, max_model_len: int,
                eos_token_ids: Sequence[int], decode: Callable[[list[int]], str],
                next_logprobs: NextLogprobs) -> list[BeamSearchOutput]:
    """Beam search for each prompt (token ids). `next_logprobs(token_lists, k)` gives, for each list, the
    logprobs of at least its k most likely next tokens (the engine's one-token requests)."""
    for i, p in enumerate(prompts):
        if not p or len(p) >= max_model_len:
            raise ValueError(f"prompt {i} has {len(p)} tokens; beam search needs 1 to {max_model_len - 1} "
                             f"(the model's length is {max_model_len})")
    width, eos = params.beam_width, set(eos_token_ids)
    live = [[BeamSearchSequence(list(p))] for p in prompts]
    done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
    for step in range(params.max_tokens):
        owners = []
        for i, beams in enumerate(live):
            for b in beams:
                if len(b.tokens) < max_model_len:
                    owners.append((i, b))
                else:  # a beam at the model's length ends there
                    b.finish_reason = "length"
                    done[i].append(b)
        if not owners:
            break
        found = next_logprobs([b.tokens for _, b in owners], 2 * width)
        candidates: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        for (i, b), logprobs in zip(owners, found, strict=True):
            top = sorted(logprobs.items(), key=lambda kv: -kv[1])[:2 * width]
            for tid, lp in top:
                candidates[i].append(BeamSearchSequence([*b.tokens, tid], [*b.logprobs, lp], b.cum_logprob + lp))
        last = step == params.max_tokens - 1
        for i, cands in enumerate(candidates):
            cands.sort(key=lambda c: -c.cum_logprob)  # stable: ties keep the beams' and tokens' order
            live[i] = []
            for c in cands[:width]:
                if c.tokens[-1] in eos and not params.ignore_eos:
                    c.finish_reason = "stop"
                    done[i].append(c)
                elif last:
                    c.finish_reason = "length"
                    done[i].append(c)
                else:
                    live[i].append(c)
    outputs = []
    for i, prompt in enumerate(prompts):
        ranked = sorted(done[i], key=lambda b: -beam_score(b, eos_token_ids, params.length_penalty))[:width]
        for b in ranked:
            generated = b.tokens[len(prompt):]
            if b.finish_reason == "stop":
                generated = generated[:-1]
            b.text = decode(generated)
        outputs.append(BeamSearchOutput(ranked))
    return outputs


def one_token_params(k: int) -> SamplingParams:
    """The engine request of one beam step: one greedy token with the top `k` logprobs, EOS not special."""
    return SamplingParams(temperature=0.0, max_tokens=1, logprobs=k, ignore_eos=True)
