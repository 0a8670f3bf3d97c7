"""Prefill/decode disaggregation, the router's side (L3): which requests split, and the handoff order.

Rule: a request is disaggregated when prefill and decode workers are both registered and healthy,
its token ids are known, and the part of its prompt not already cached on the picked decode worker
is at least `pd_min_uncached_tokens` long. Otherwise the decode worker serves it whole (a short
or mostly cached prompt costs less to prefill in place than to move).

Order of one split request:
  1. pick the decode worker (the configured policy, so cached prefixes count) and a prefill worker
     (least load);
  2. `POST {prefill}/v1/pd/prefill` with the request: the prefill worker computes the prompt's KV
     and first token, pins the prompt's full pages and answers the control metadata
     (`jaxserve.engine.kv_transfer.TransferMeta`);
  3. send the request to the decode worker with `X-KV-Transfer: {prefill}/v1/pd/kv/{id}`: the decode
     worker pulls the payload from the prefill worker itself (KV never flows through the router),
     checks readiness, imports the pages, acknowledges, and streams the answer through the router;
  4. whatever happened, `DELETE {prefill}/v1/pd/kv/{id}` afterwards (idempotent), so pinned pages
     never outlive the request even if the decode worker never asked for them.
If step 2 fails, the decode worker gets the plain request and computes the prefill itself.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import httpx
from starlette.responses import Response

from router.policy import RouteRequest

if TYPE_CHECKING:
    from router.router import Router


class Disaggregator:
    """Runs the prefill-then-decode sequence of one request (see the module docstring)."""

    def __init__(self, router: Router):
        self.router = router

    @property
    def enabled(self) -> bool:
        """Whether any prefill worker is registered."""
        return any(w.role == "prefill" for w in self.router.pool.workers.values())

    async def generate(self, request_id: str, path: str, raw: bytes, body: dict[str, Any],
                       headers: dict[str, str], stream: bool, info: RouteRequest,
                       ids: list[int] | None) -> Response:
        """Serve one request, disaggregated when the rule says so."""
        r = self.router
        decode = r.pool.healthy("decode") or r.pool.healthy("both")
        prefill = r.pool.healthy("prefill")
        if not decode:
            return await r.forward(request_id, path, raw, headers, stream, info, role="prefill")
        d = r.pick(request_id, decode, info)
        row = next(c for c in d.candidates if c["url"] == d.worker.url)
        cached = row.get("matched_pages", 0) * (d.worker.page_size or r.config.page_size)
        uncached = (len(ids) - cached) if ids is not None else 0
        split = ids is not None and bool(prefill) and uncached >= r.config.pd_min_uncached_tokens
        r.trace.record(request_id, "L3", "plan", {
            "disaggregate": split, "decode": d.worker.url, "prompt_tokens": len(ids) if ids else None,
            "uncached_tokens": uncached, "min_uncached_tokens": r.config.pd_min_uncached_tokens})
        if not split:
            return await r.forward(request_id, path, raw, headers, stream, info, role=d.worker.role,
                                   first=d.worker)
        p = r.picker.pick(prefill, RouteRequest(), "least-load").worker
        kind = "completion" if path == "/v1/completions" else "chat"  # /v1/responses: `body` is its chat body
        t0 = time.time()
        meta = None
        p.in_flight += 1
        try:
            resp = await r.client.post(p.url + "/v1/pd/prefill", json={"kind": kind, "body": body},
                                       headers={**headers, "x-request-id": request_id})
            if resp.status_code == 200:
                meta = resp.json()
            else:
                r.trace.record(request_id, "L3", "prefill_failed", {"prefill": p.url, "status": resp.status_code,
                                                                    "body": resp.text[:300]})
        except httpx.HTTPError as e:
            r.pool.mark_failed(p, f"/v1/pd/prefill: {type(e).__name__}")
            r.trace.record(request_id, "L3", "prefill_failed", {"prefill": p.url, "error": type(e).__name__})
        finally:
            p.in_flight -= 1
        if meta is None:
            return await r.forward(request_id, path, raw, headers, stream, info, role=d.worker.role,
                                   first=d.worker)
        url = f"{p.url}/v1/pd/kv/{meta['transfer_id']}"
        r.trace.record(request_id, "L3", "prefill_done", {
            "prefill": p.url, "seconds": round(time.time() - t0, 4), "transfer": url,
            "num_pages": len(meta.get("page_ids", ())), "num_tokens": meta.get("num_tokens"),
            "first_token": meta.get("first_token")})
        try:
            return await r.forward(request_id, path, raw, headers, stream, info, role=d.worker.role,
                                   first=d.worker, extra_headers={"x-kv-transfer": url})
        finally:
            try:
                await r.client.delete(url, timeout=5.0)
            except httpx.HTTPError:
                pass  # the prefill worker's timeout frees the pages
