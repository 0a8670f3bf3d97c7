"""Beam search over HTTP, as vLLM serves it: `use_beam_search: true` on chat or completions, `n` beams.

The `n` best beams come back as the request's `n` choices, best first, each with its text, finish reason
and (with `logprobs`) its tokens' logprobs. The search is jaxserve/beam_search.py's, driven over the async
engine: every step sends each live beam as a one-token request (they share the prompt's pages through the
prefix cache) and awaits them together. A beam is only known to be among the best once the search ends,
so a streamed beam search sends each choice whole, in one chunk, at the end.

The beams are ranked by the model's own next-token logprobs; whatever would reshape that distribution
(penalties, logit bias, top-k/top-p/min-p, stop strings, structured outputs, minimum lengths) is refused
with the field named. `temperature` is accepted and does not change the ranking (vLLM's behaviour).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Mapping
from typing import Any

from jaxserve.beam_search import BeamSearchParams, beam_search_async, one_token_params
from jaxserve.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprobs
from jaxserve.sampling_params import SamplingParams
from server.errors import bad_field

# The sampling fields a beam search cannot honour, with their neutral values (top_k: 0 or -1).
_RESHAPING = {"top_p": 1.0, "top_k": 0, "min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
              "repetition_penalty": 1.0, "min_tokens": 0}


def check_beam_request(body: Mapping[str, Any], params: SamplingParams, length_penalty: float) -> None:
    """400, naming the field, for what a beam search over `params` (whose `n` is the beam width) cannot do."""
    try:
        BeamSearchParams(beam_width=params.n, max_tokens=1, length_penalty=length_penalty)
    except ValueError as e:
        raise bad_field("n", f"with use_beam_search, 'n' is the beam width: {e}") from e
    for name, neutral in _RESHAPING.items():
        value = getattr(params, name)
        if value != neutral and not (name == "top_k" and value == -1):
            raise bad_field(name, f"'{name}' cannot be combined with use_beam_search: beams are ranked by the "
                                  f"model's own logprobs")
    given = {"stop": params.stop, "stop_token_ids": params.stop_token_ids, "logit_bias": params.logit_bias,
             "prompt_logprobs": params.prompt_logprobs is not None, "allowed_token_ids": params.allowed_token_ids,
             "bad_words": params.bad_words}
    for name, value in given.items():
        if value:
            raise bad_field(name, f"'{name}' cannot be combined with use_beam_search")
    if params.structured_outputs is not None:
        named = next((k for k in ("response_format", "structured_outputs", "tool_choice") if body.get(k)),
                     "structured_outputs")
        raise bad_field(named, f"an output constraint ('{named}') cannot be combined with use_beam_search")


def beam_params(params: SamplingParams, length_penalty: float) -> BeamSearchParams:
    """The search of a checked request whose `params` were fit to the context (max_tokens set)."""
    assert params.max_tokens is not None
    return BeamSearchParams(beam_width=params.n, max_tokens=params.max_tokens, ignore_eos=params.ignore_eos,
                            length_penalty=length_penalty)


async def _final(engine: Any, ids: list[int], params: SamplingParams, request_id: str,
                 **kwargs: Any) -> RequestOutput:
    outputs = engine.generate(ids, params, request_id, **kwargs)
    try:
        async for out in outputs:
            if out.finished:
                return out
        raise RuntimeError(f"engine request {request_id} ended unfinished")
    finally:
        await outputs.aclose()  # aborts the request if it is still running (a cancelled search)


async def beam_search_output(engine: Any, engine_id: str, prompt_ids: list[int], params: SamplingParams,
                             beam: BeamSearchParams, **kwargs: Any) -> RequestOutput:
    """The best `beam.beam_width` beams of one prompt as a finished request output, one completion each
    (best first). `kwargs` go to every engine request (priority, cache_salt, lora_request)."""
    metrics = RequestMetrics(arrival_time=time.time())
    steps = itertools.count()
    tok = engine.tokenizer

    async def next_logprobs(token_lists: list[list[int]], k: int) -> list[TokenLogprobs]:
        step, one = next(steps), one_token_params(k)
        async with asyncio.TaskGroup() as group:  # one beam's failure cancels the step's other requests
            tasks = [group.create_task(_final(engine, ids, one, f"{engine_id}-beam{step}.{j}", **kwargs))
                     for j, ids in enumerate(token_lists)]
        outs = [t.result() for t in tasks]
        if step == 0:
            metrics.first_token_time = time.time()
            first = outs[0].metrics
            if first is not None:
                metrics.first_scheduled_time, metrics.num_cached_tokens = (first.first_scheduled_time,
                                                                           first.num_cached_tokens)
        return [o.outputs[0].logprobs[0] for o in outs]

    (result,) = await beam_search_async(
        [prompt_ids], beam, max_model_len=engine.max_model_len,
        eos_token_ids=tok.eos_token_ids if tok else engine.eos_ids,  # (no tokenizer: --skip-tokenizer-init)
        decode=lambda ids: tok.decode(ids, params.skip_special_tokens) if tok else "", next_logprobs=next_logprobs,
        top_k=params.logprobs or 0)
    metrics.finished_time = time.time()
    n = len(prompt_ids)
    completions = [CompletionOutput(j, b.text, b.tokens[n:], b.cum_logprob,
                                    b.logprobs if params.logprobs is not None else None, b.finish_reason)
                   for j, b in enumerate(result.sequences)]
    return RequestOutput(engine_id, None, list(prompt_ids), completions, finished=True, metrics=metrics)
