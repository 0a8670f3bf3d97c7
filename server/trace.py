"""Per-request traces: what each layer saw of a request, and when, under the request's id.

A record is `{"t": unix seconds, "layer": "L1".."L7", "event": name, "where": who recorded it,
"data": {...}}`. The server records L1 (the validated request), the engine L4 (queue entry,
schedule decisions with chunk sizes, pages and prefix hits, preemptions), L5/L6 (step ids and
bucket shapes, tokens as they are sampled) and L7 (attention backend and kernel shapes); a router
adds L2 (candidates, scores, pick) and L3 (the prefill/decode handoff). `GET /v1/requests/{id}/trace`
returns them in time order.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response


class TraceStore:
    """The traces of the most recent `max_requests` requests, safe to record from any thread."""

    def __init__(self, where: str = "worker", max_requests: int = 4096, max_records: int = 4096):
        self.where = where
        self._traces: collections.OrderedDict[str, list[dict[str, Any]]] = collections.OrderedDict()
        self._max_requests, self._max_records = max_requests, max_records
        self._lock = threading.Lock()

    def record(self, request_id: str, layer: str, event: str, data: dict[str, Any] | None = None,
               t: float | None = None) -> None:
        """Append one record to `request_id`'s trace (the oldest trace goes past `max_requests`)."""
        item = {"t": time.time() if t is None else t, "layer": layer, "event": event, "where": self.where,
                "data": data or {}}
        with self._lock:
            records = self._traces.get(request_id)
            if records is None:
                records = self._traces[request_id] = []
                while len(self._traces) > self._max_requests:
                    self._traces.popitem(last=False)
            if len(records) < self._max_records:
                records.append(item)

    def engine_hook(self, request_id: str, layer: str, event: str, data: dict[str, Any]) -> None:
        """The callback an engine's `set_tracer` takes."""
        self.record(request_id, layer, event, data)

    def get(self, request_id: str) -> list[dict[str, Any]] | None:
        """`request_id`'s records in time order, or None if it was never seen (or is forgotten)."""
        with self._lock:
            records = self._traces.get(request_id)
            return None if records is None else sorted(records, key=lambda r: r["t"])


def attach_tracer(store: TraceStore, engine: Any) -> None:
    """Have `engine` record into `store` (once; engines without `set_tracer` record nothing)."""
    if getattr(engine, "_jaxserve_trace_store", None) is store or not getattr(engine, "is_ready", False):
        return
    set_tracer = getattr(engine, "set_tracer", None)
    if set_tracer is not None:
        set_tracer(store.engine_hook)
    engine._jaxserve_trace_store = store


def summarize_request(kind: str, body: Any) -> dict[str, Any]:
    """The L1 view of a generation request: its shape and parameters, not its text."""
    if not isinstance(body, dict):
        return {"kind": kind}
    out: dict[str, Any] = {"kind": kind}
    if kind == "chat" and isinstance(body.get("messages"), list):
        out["messages"] = len(body["messages"])
        out["prompt_chars"] = sum(len(str(m.get("content") or "")) for m in body["messages"] if isinstance(m, dict))
    elif "prompt" in body or "input" in body:
        p = body.get("prompt", body.get("input"))
        out["prompt_chars" if isinstance(p, str) else "prompt_items"] = len(p) if hasattr(p, "__len__") else 0
    for key in ("model", "stream", "max_tokens", "max_completion_tokens", "max_output_tokens", "temperature", "top_p",
                "top_k", "n",
                "seed", "priority", "cache_salt"):
        if key in body:
            out[key] = body[key]
    return out


async def request_trace(request: Request) -> Response:
    """`GET /v1/requests/{request_id}/trace`: the request's records on this worker, in time order."""
    from server.errors import ApiError

    request_id = request.path_params["request_id"]
    records = request.app.state.trace.get(request_id)
    if records is None:
        raise ApiError(404, f"no trace of request {request_id!r} (unknown, or too old)", code="not_found")
    return JSONResponse({"request_id": request_id, "records": records})
