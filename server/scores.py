"""`POST /score` and `POST /rerank` (vLLM's, and Jina's and Cohere's rerank shape) on an embedding model,
where each score is the cosine similarity of the two texts' embeddings, or on a cross-encoder (a sequence
classification model with one label), where each pair is one input, the tokenizer's pair encoding of the
two texts (or the server's `--chat-template` rendered over the roles "query" and "document", as vLLM
applies a score template), and its score is the model's relevance probability (its logit with
`activation: false`).

`/score` pairs `text_1` with `text_2`: one with many (1:N) or element by element (N:N). `/rerank`
scores each of `documents` against `query` and returns them best first, the first `top_n`. A text
that appears more than once in a request is embedded once. Both take `truncate_prompt_tokens` and
`priority`; texts are tokenized with the model's special tokens, as `/v1/embeddings` does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve.engine.classifier import cross_encoder_prompt
from jaxserve.pooling_params import PoolingParams
from server.embeddings import (
    embed_prompts,
    fit_prompt,
    open_request,
    pool_prompts,
    pooling_endpoint,
    request_pooling_params,
)
from server.errors import ApiError, bad_field
from server.protocol import get_bool, get_int

_COMMON = {"model", "truncate_prompt_tokens", "priority", "user", "activation"}


def _texts(body: Mapping[str, Any], name: str, single: bool = False) -> list[str]:
    value = body.get(name)
    if value is None:
        raise bad_field(name, f"'{name}' is required", "missing_required_parameter")
    if isinstance(value, str) and not single:
        value = [value]
    ok = (isinstance(value, str) if single else
          isinstance(value, list) and value and all(isinstance(t, str) for t in value))
    if not ok:
        raise bad_field(name, f"'{name}' must be {'a string' if single else 'a string or a non-empty list of strings'}",
                        "invalid_type")
    items = [value] if single else value
    if any(t == "" for t in items):
        raise bad_field(name, f"'{name}' must not contain empty strings")
    return items


async def _scores(request: Request, state: Any, body: Mapping[str, Any], arrival: float,
                  firsts: list[tuple[str, int, str]], seconds: list[tuple[str, int, str]]) -> tuple[list[float], int]:
    """Scores of the pairs (firsts[k], seconds[k]), each text a (field, index, text), and the prompt tokens
    computed: a cross-encoder's, or the cosine similarities of embeddings (every distinct text embedded once)."""
    max_len = state.engine.max_model_len
    params = request_pooling_params({k: body[k] for k in ("truncate_prompt_tokens",) if k in body}, max_len)
    tok = state.tokenizer_for("scoring texts")
    head = getattr(state.engine, "classifier", None)
    if head is not None:
        return await _cross_scores(request, state, body, arrival, firsts, seconds, params, head)
    if "activation" in body:
        raise bad_field("activation", "'activation' applies to cross-encoders; this model scores by the cosine of "
                                      "embeddings")
    ids_of: dict[str, list[int]] = {}
    for name, i, text in firsts + seconds:
        if text not in ids_of:
            ids_of[text] = fit_prompt(tok.encode(text, add_special_tokens=True), params, max_len, i, name)
    texts = list(ids_of)
    vectors = await embed_prompts(request, state, [ids_of[t] for t in texts], PoolingParams(normalize=True),
                                  get_int(body, "priority", 0), arrival)
    unit = dict(zip(texts, (np.asarray(v, np.float64) for v in vectors), strict=True))
    scores = [float(np.clip(unit[a] @ unit[b], -1.0, 1.0)) for (_, _, a), (_, _, b) in zip(firsts, seconds, strict=True)]
    return scores, sum(len(ids_of[t]) for t in texts)


async def _cross_scores(request: Request, state: Any, body: Mapping[str, Any], arrival: float,
                        firsts: list[tuple[str, int, str]], seconds: list[tuple[str, int, str]], params: PoolingParams,
                        head: Any) -> tuple[list[float], int]:
    """A cross-encoder's score of each pair (firsts[k], seconds[k]), each pair one input; and the prompt tokens."""
    if not head.is_cross_encoder:
        raise ApiError(400, f"model {state.model_name!r} classifies into {head.num_labels} labels; scoring needs a "
                            "cross-encoder (one label) or an embedding model", code="invalid_request")
    tok, max_len = state.tokenizer_for("scoring texts"), state.engine.max_model_len
    template = state.config.chat_template  # a score template, when the server has one
    try:
        pairs = [fit_prompt(cross_encoder_prompt(tok, a, b, template), params, max_len, i, name)
                 for (_, _, a), (name, i, b) in zip(firsts, seconds, strict=True)]
    except (TypeError, ValueError) as e:  # the template refused the pair
        raise ApiError(400, f"the score template failed: {e}", code="invalid_request") from e
    cls = PoolingParams(task="classify", activation=get_bool(body, "activation", True))
    outs = await pool_prompts(request, state, pairs, cls, get_int(body, "priority", 0), arrival)
    return [out.outputs.probs[0] for out in outs], sum(map(len, pairs))


@pooling_endpoint
async def score(request: Request) -> Response:
    """`POST /score`, `POST /v1/score`."""
    state, body, arrival = await open_request(request, _COMMON | {"text_1", "text_2"}, "score")
    first, second = _texts(body, "text_1"), _texts(body, "text_2")
    if len(first) == 1:
        first = first * len(second)
    elif len(first) != len(second):
        raise bad_field("text_2", f"'text_1' has {len(first)} texts and 'text_2' {len(second)}: send one 'text_1' "
                                  "to score against each 'text_2', or lists of the same length")
    scores, n = await _scores(request, state, body, arrival, [("text_1", i, t) for i, t in enumerate(first)],
                                    [("text_2", i, t) for i, t in enumerate(second)])
    return JSONResponse({
        "id": f"score-{request.scope['state']['request_id']}", "object": "list", "created": int(arrival),
        "model": state.model_name, "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": {"prompt_tokens": n, "total_tokens": n},
    })


@pooling_endpoint
async def rerank(request: Request) -> Response:
    """`POST /rerank`, `/v1/rerank`, `/v2/rerank`."""
    state, body, arrival = await open_request(request, _COMMON | {"query", "documents", "top_n", "return_documents"},
                                              "rerank")
    query = _texts(body, "query", single=True)[0]
    docs = body.get("documents")
    if isinstance(docs, list):  # Cohere's documents may be {"text": ...} objects
        docs = [d.get("text") if isinstance(d, Mapping) else d for d in docs]
    documents = _texts({"documents": docs}, "documents")
    top_n = get_int(body, "top_n", len(documents), 0) or len(documents)
    scores, n = await _scores(request, state, body, arrival, [("query", 0, query)] * len(documents),
                                    [("documents", i, d) for i, d in enumerate(documents)])
    order = sorted(range(len(documents)), key=lambda i: (-scores[i], i))[:top_n]
    with_docs = get_bool(body, "return_documents", True)
    return JSONResponse({
        "id": f"rerank-{request.scope['state']['request_id']}", "model": state.model_name,
        "usage": {"prompt_tokens": n, "total_tokens": n},
        "results": [{"index": i, "relevance_score": scores[i], **({"document": {"text": documents[i]}} if with_docs
                                                                   else {})} for i in order],
    })
