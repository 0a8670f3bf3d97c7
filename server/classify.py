"""`POST /classify` (and `/v1/classify`): vLLM's classification API, for a sequence classification model
(`*ForSequenceClassification`) run with `--runner pooling`.

`input` is what `/v1/embeddings` takes (a string, strings, token ids, lists of them), or `messages`
rendered with the chat template; also `truncate_prompt_tokens`, `add_special_tokens`, `priority` and
`activation` (false: the head's raw logits instead of probabilities). Each result names its most
likely label (the config's `id2label`) and gives every class's probability.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve.pooling_params import PoolingParams
from server.embeddings import (
    fit_prompt,
    open_request,
    pool_prompts,
    pooling_endpoint,
    request_pooling_params,
    request_prompts,
)
from server.errors import ApiError
from server.protocol import get_bool, get_int

_KNOWN = {"input", "messages", "model", "user", "truncate_prompt_tokens", "add_special_tokens", "priority",
          "activation", "chat_template_kwargs", "add_generation_prompt", "tools"}


def classifier_of(state: Any) -> Any:
    """The served model's classification head; a 400 naming the problem when it has none."""
    head = getattr(state.engine, "classifier", None)
    if head is None:
        raise ApiError(400, f"model {state.model_name!r} is not a sequence classification model: /classify needs a "
                            "*ForSequenceClassification checkpoint served with --runner pooling",
                       code="invalid_request")
    return head


@pooling_endpoint
async def classify(request: Request) -> Response:
    """`POST /classify`, `POST /v1/classify`."""
    state, body, arrival = await open_request(request, _KNOWN, "classify")
    head = classifier_of(state)
    max_len = state.engine.max_model_len
    params = request_pooling_params({k: body[k] for k in ("truncate_prompt_tokens",) if k in body}, max_len)
    prompts = [fit_prompt(ids, params, max_len, i) for i, ids in enumerate(request_prompts(state, body))]
    params = PoolingParams(task="classify", activation=get_bool(body, "activation", True))
    outs = await pool_prompts(request, state, prompts, params, get_int(body, "priority", 0), arrival)
    n = sum(len(ids) for ids in prompts)
    data = []
    for i, out in enumerate(outs):
        probs = out.outputs.probs
        best = max(range(len(probs)), key=probs.__getitem__)
        data.append({"index": i, "label": head.labels[best], "probs": probs, "num_classes": len(probs)})
    return JSONResponse({
        "id": f"classify-{request.scope['state']['request_id']}", "object": "list", "created": int(arrival),
        "model": state.model_name, "data": data,
        "usage": {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0, "prompt_tokens_details": None},
    })
