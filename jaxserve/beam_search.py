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

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from jaxserve.outputs import TokenLogprobs
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
    """One beam: `tokens` (the prompt's, then the generated ones), the logprobs of each generated position
    (the token's own and the top ones its step read, as a completion's), the generated tokens' summed
    logprob, the generated text, and why it ended ("stop": EOS; "length": max_tokens or the model's
    length; None: cut by the search while still live, which cannot be returned)."""

    tokens: list[int]
    logprobs: list[TokenLogprobs] = field(default_factory=list)
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


NextLogprobs = Callable[[list[list[int]], int], list[TokenLogprobs]]
AsyncNextLogprobs = Callable[[list[list[int]], int], Awaitable[list[TokenLogprobs]]]


class BeamSearch:
    """The search's state between steps, so that a synchronous (`beam_search`) and an asynchronous
    (`beam_search_async`) driver share it: `asks()` gives the token lists whose next-token logprobs the
    step needs (empty once the search is over), `advance()` takes them, `outputs()` ranks the beams."""

    def __init__(self, prompts: Sequence[list[int]], params: BeamSearchParams, *, max_model_len: int,
                 eos_token_ids: Sequence[int]):
        for i, p in enumerate(prompts):
            if not p or len(p) >= max_model_len:
                raise ValueError(f"prompt {i} has {len(p)} tokens; beam search needs 1 to {max_model_len - 1} "
                                 f"(the model's length is {max_model_len})")
        self.prompts = [list(p) for p in prompts]
        self.params, self.max_model_len, self.eos_token_ids = params, max_model_len, list(eos_token_ids)
        self.step = 0
        self._live = [[BeamSearchSequence(list(p))] for p in prompts]
        self._done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        self._owners: list[tuple[int, BeamSearchSequence]] = []

    @property
    def top_k(self) -> int:
        """How many of each beam's most likely next tokens the search needs (2 * beam_width)."""
        return 2 * self.params.beam_width

    def asks(self) -> list[list[int]]:
        """The live beams' tokens, each to be extended by one token; empty when the search is over."""
        self._owners = []
        if self.step >= self.params.max_tokens:
            return []
        for i, beams in enumerate(self._live):
            for b in beams:
                if len(b.tokens) < self.max_model_len:
                    self._owners.append((i, b))
                else:  # a beam at the model's length ends there
                    b.finish_reason = "length"
                    self._done[i].append(b)
        self._live = [[] for _ in self.prompts]
        return [b.tokens for _, b in self._owners]

    def advance(self, found: Sequence[TokenLogprobs]) -> None:
        """Take the next-token logprobs of each list `asks()` gave (at least its `top_k` most likely) and
        keep each prompt's `beam_width` best candidates."""
        width, eos = self.params.beam_width, set(self.eos_token_ids)
        candidates: list[list[BeamSearchSequence]] = [[] for _ in self.prompts]
        for (i, b), logprobs in zip(self._owners, found, strict=True):
            top = sorted(logprobs.items(), key=lambda kv: -kv[1].logprob)[:self.top_k]
            for tid, lp in top:
                candidates[i].append(BeamSearchSequence([*b.tokens, tid], [*b.logprobs, logprobs],
                                                        b.cum_logprob + lp.logprob))
        self.step += 1
        last = self.step == self.params.max_tokens
        for i, cands in enumerate(candidates):
            cands.sort(key=lambda c: -c.cum_logprob)  # stable: ties keep the beams' and tokens' order
            for c in cands[:width]:
                if c.tokens[-1] in eos and not self.params.ignore_eos:
                    c.finish_reason = "stop"
                    self._done[i].append(c)
                elif last:
                    c.finish_reason = "length"
                    self._done[i].append(c)
                else:
                    self._live[i].append(c)
        self._owners = []

    def outputs(self, decode: Callable[[list[int]], str]) -> list[BeamSearchOutput]:
        """Each prompt's best `beam_width` beams, best first, their text decoded (without a final EOS)."""
        outputs = []
        for i, prompt in enumerate(self.prompts):
            ranked = sorted(self._done[i], key=lambda b: -beam_score(b, self.eos_token_ids,
                                                                     self.params.length_penalty))
            ranked = ranked[:self.params.beam_width]
            for b in ranked:
                generated = b.tokens[len(prompt):]
                if b.finish_reason == "stop":
                    generated = generated[:-1]
                b.text = decode(generated)
            outputs.append(BeamSearchOutput(ranked))
        return outputs


def beam_search(prompts: Sequence[list[int]], params: BeamSearchParams, *, max_model_len: int,
                eos_token_ids: Sequence[int], decode: Callable[[list[int]], str],
                next_logprobs: NextLogprobs, top_k: int = 0) -> list[BeamSearchOutput]:
    """Beam search for each prompt (token ids). `next_logprobs(token_lists, k)` gives, for each list, the
    logprobs of at least its k most likely next tokens (the engine's one-token requests); k is the
    larger of 2 * beam_width and `top_k` (more kept for each token's reported alternatives)."""
    search = BeamSearch(prompts, params, max_model_len=max_model_len, eos_token_ids=eos_token_ids)
    while asks := search.asks():
        search.advance(next_logprobs(asks, max(search.top_k, top_k)))
    return search.outputs(decode)


async def beam_search_async(prompts: Sequence[list[int]], params: BeamSearchParams, *, max_model_len: int,
                            eos_token_ids: Sequence[int], decode: Callable[[list[int]], str],
                            next_logprobs: AsyncNextLogprobs, top_k: int = 0) -> list[BeamSearchOutput]:
    """`beam_search` with an awaitable `next_logprobs` (the server's, over `AsyncEngine`)."""
    search = BeamSearch(prompts, params, max_model_len=max_model_len, eos_token_ids=eos_token_ids)
    while asks := search.asks():
        search.advance(await next_logprobs(asks, max(search.top_k, top_k)))
    return search.outputs(decode)


def one_token_params(k: int) -> SamplingParams:
    """The engine request of one beam step: one greedy token with the top `k` logprobs, EOS not special."""
    return SamplingParams(temperature=0.0, max_tokens=1, logprobs=k, ignore_eos=True)
