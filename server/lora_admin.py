"""`POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter`: LoRA adapters added and removed while
serving, as vLLM offers them, and only where vLLM's `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` is set in the
environment (anyone who can reach the server could otherwise load files from its disk).
"""

from __future__ import annotations

import asyncio
import os

from starlette.requests import Request
from starlette.responses import Response

from server.errors import ApiError, bad_field
from server.protocol import get_str
from server.serving import read_json

ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def _allowed() -> bool:
    return os.environ.get(ENV, "").lower() in ("1", "true")


async def _change(request: Request, unload: bool) -> Response:
    state = request.app.state.server
    state.check_serving()
    if not _allowed():
        raise ApiError(404, f"runtime LoRA updating is off; set {ENV}=True to serve {request.url.path}",
                       code="not_found")
    body = await read_json(request, state.config.max_request_body_bytes)
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_type")
    name = get_str(body, "lora_name")
    if not name:
        raise bad_field("lora_name", "'lora_name' is required", "missing_required_parameter")
    path = get_str(body, "lora_path")
    if not unload and not path:
        raise bad_field("lora_path", "'lora_path' is required", "missing_required_parameter")
    call = getattr(state.engine, "call_on_engine", None)  # every replica's engine, behind -dp
    if call is None:
        raise ApiError(400, "this engine serves no LoRA adapters", code="invalid_request")

    def change(engine) -> None:
        if engine.loras is None:
            raise ValueError("this engine serves no LoRA adapters; start it with --enable-lora")
        engine.loras.unload(name) if unload else engine.loras.load(name, path)

    try:
        await asyncio.to_thread(call, change)
    except ValueError as e:
        raise ApiError(400, str(e), param="lora_name", code="invalid_request") from e
    verb = "removed" if unload else "added"
    return Response(f"Success: LoRA adapter '{name}' {verb} successfully.", media_type="text/plain")


async def load_lora_adapter(request: Request) -> Response:
    """`POST /v1/load_lora_adapter` {"lora_name", "lora_path"}."""
    return await _change(request, unload=False)


async def unload_lora_adapter(request: Request) -> Response:
    """`POST /v1/unload_lora_adapter` {"lora_name"}."""
    return await _change(request, unload=True)
