"""OpenAI-style errors: one exception type that every handler raises, and its JSON body."""

from __future__ import annotations

import json

from starlette.responses import JSONResponse

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}


class ApiError(Exception):
    """A request refused with `status`; `param` names the offending field when there is one."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        """`{"error": {"message", "type", "param", "code"}}`."""
        return error_body(self.status, self.message, param=self.param, code=self.code)

    def response(self) -> JSONResponse:
        """The JSON response that carries this error."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict:
    """An OpenAI error object."""
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def sse_error(status: int, message: str, code: str | None = None) -> bytes:
    """An error sent inside an already started SSE stream (followed by `[DONE]` by the caller)."""
    return b"data: " + json.dumps(error_body(status, message, code=code)).encode() + b"\n\n"


def bad_field(param: str, message: str, code: str = "invalid_value") -> ApiError:
    """A 400 that names the offending request field."""
    return ApiError(400, message, param=param, code=code)
