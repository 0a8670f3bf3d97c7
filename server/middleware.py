"""The ASGI layer every HTTP request crosses: request id, API key, and one access-log line.

Written as plain ASGI (not Starlette's BaseHTTPMiddleware) so streaming responses and client
disconnects pass through untouched.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
import uuid
from typing import Any

from starlette.datastructures import Headers

from server.errors import ApiError
from server.state import ServerState

access_logger = logging.getLogger("jaxserve.server.access")

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/version", "/ping"})
"""Routes that answer without the API key (probes and scrapers)."""


class ApiMiddleware:
    """Assigns the request id, checks `Authorization`, and logs the request when it ends."""

    def __init__(self, app: Any, state: ServerState):
        self.app = app
        self.state = state
        key = state.config.api_key
        self._expected = f"Bearer {key}".encode() if key is not None else None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        headers = Headers(scope=scope)
        given = headers.get("x-request-id")
        request_id = given if given and self._valid_id(given) else uuid.uuid4().hex
        access: dict[str, Any] = {}
        scope.setdefault("state", {})
        scope["state"]["request_id"] = request_id
        scope["state"]["access"] = access
        status: list[int] = [0]

        async def send_with_id(message: Any) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message = {**message, "headers": [*message.get("headers", []),
                                                   (b"x-request-id", request_id.encode("latin-1"))]}
            await send(message)

        try:
            error = self._refusal(scope, headers, given)
            if error is not None:
                await error.response()(scope, receive, send_with_id)
            else:
                await self.app(scope, receive, send_with_id)
        finally:
            if status[0] >= 400:
                self.state.metrics.http_errors.labels(self.state.model_name, str(status[0])).inc()
            line = {"request_id": request_id, "method": scope.get("method"), "path": scope.get("path"),
                    "status": status[0], "duration_s": round(time.perf_counter() - start, 4), **access}
            access_logger.info(json.dumps(line))

    def _valid_id(self, value: str) -> bool:
        return len(value) <= self.state.config.max_request_id_length and value.isprintable()

    def _refusal(self, scope: Any, headers: Headers, given: str | None) -> ApiError | None:
        if given is not None and not self._valid_id(given):
            return ApiError(400, f"X-Request-Id must be printable and at most "
                                 f"{self.state.config.max_request_id_length} characters",
                            param="X-Request-Id", code="invalid_request_id")
        if self._expected is None or route_path(scope) in OPEN_PATHS:
            return None
        got = headers.get("authorization", "").encode("latin-1")
        if not hmac.compare_digest(got, self._expected):
            return ApiError(401, "missing or invalid API key; send 'Authorization: Bearer <key>'",
                            code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return None


def route_path(scope: Any) -> str:
    """A request's path without the root path a proxy serves the API under (`ServerConfig.root_path`), if it has it."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root + "/") else path
