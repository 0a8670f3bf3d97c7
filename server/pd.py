"""Prefill/decode disaggregation, the worker's side (L3): export a finished prefill, import it to decode.

A worker's `--role` is `both` (aggregated, the default), `prefill` or `decode`; every worker can
answer a plain request (the fallback when a handoff fails).

Prefill side, `POST /v1/pd/prefill` with `{"kind": "chat"|"completion", "body": <the OpenAI body>}`:
the prompt is rendered and tokenized exactly as the generation endpoints do it, run for one token,
and its full pages are pinned in the prefix cache. The answer is the control metadata
(`jaxserve.engine.kv_transfer.TransferMeta`). `GET /v1/pd/kv/{id}` sends the payload;
`DELETE /v1/pd/kv/{id}` acknowledges it and unpins the pages. Pages not acknowledged within
`pin_timeout_s` are unpinned anyway.

Decode side: a generation request carrying `X-KV-Transfer: <payload URL>` first pulls the payload
through the `KVTransport`, checks readiness (transfer id, layout, dtype, every page, checksum),
writes the pages into its own pool and prefix cache, acknowledges, and only then enters the engine,
whose admission finds the prompt's pages as a prefix hit. Any failure (unreachable sender, cut or
corrupt payload, full pool) is recorded in the trace and the request simply recomputes its prefill.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve.engine.kv_transfer import (
    Imported,
    KVLayout,
    KVPayload,
    KVTransport,
    Pin,
    TransferError,
    TransferMeta,
    check_ready,
    import_pages,
    pin_prompt,
    read_pages,
    release_import,
    unpin,
)
from jaxserve.engine.multimodal import media_data, prompt_cache_ids
from jaxserve.sampling_params import SamplingParams
from server.errors import ApiError
from server.trace import TraceStore

logger = logging.getLogger("jaxserve.server")

Role = Literal["both", "prefill", "decode"]
ROLES: tuple[str, ...] = ("both", "prefill", "decode")
TRANSFER_HEADER = "x-kv-transfer"


@dataclass(frozen=True)
class PDConfig:
    """A worker's part in disaggregated serving."""

    role: Role = "both"
    pin_timeout_s: float = 30.0
    """Pinned pages are freed this long after the prefill even if nobody acknowledged them."""
    fetch_timeout_s: float = 10.0
    """A decode worker gives up on a transfer after this long and recomputes."""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.pin_timeout_s <= 0 or self.fetch_timeout_s <= 0:
            raise ValueError("pin_timeout_s and fetch_timeout_s must be > 0")


class HttpKVTransport:
    """`KVTransport` over HTTP: GET the payload from the sender, DELETE to acknowledge."""

    def __init__(self) -> None:
        self._client: httpx.AsyncClient | None = None

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient()
        return self._client

    async def fetch(self, source: str, timeout: float) -> KVPayload:
        """The payload at `source`; TransferError on any failure."""
        try:
            r = await self._http().get(source, timeout=timeout)
        except httpx.HTTPError as e:
            raise TransferError(f"fetching {source}: {type(e).__name__}: {e}") from e
        if r.status_code != 200:
            raise TransferError(f"{source} answered {r.status_code}")
        return KVPayload.decode(r.content)

    async def acknowledge(self, source: str) -> None:
        """Best effort: the sender's timeout frees the pages if this is lost."""
        try:
            await self._http().delete(source, timeout=5.0)
        except httpx.HTTPError:
            pass


@dataclass
class _Export:
    meta: TransferMeta
    pin: Pin
    timer: asyncio.TimerHandle | None = None


class PDWorker:
    """One worker's exports (pinned prefills) and imports."""

    def __init__(self, state: Any, trace: TraceStore, config: PDConfig | None = None,
                 transport: KVTransport | None = None):
        self.state = state
        self.trace = trace
        self.config = config or PDConfig()
        self.transport: KVTransport = transport or HttpKVTransport()
        self.exports: dict[str, _Export] = {}

    @property
    def role(self) -> str:
        """This worker's role (the loaded engine may carry the one given on the command line)."""
        return getattr(self.state.engine, "pd_role", self.config.role)

    def _engine(self) -> Any:
        engine = self.state.engine
        if not hasattr(engine, "run_on_engine"):
            raise ApiError(400, "this engine cannot move KV pages", code="pd_unsupported")
        return engine

    def _trace(self, request: Request | None, request_id: str, event: str, **data: Any) -> None:
        self.trace.record(request_id, "L3", event, data)

    # -- prefill side ----------------------------------------------------------------------------

    async def prefill(self, request: Request) -> Response:
        """`POST /v1/pd/prefill`: compute the prompt's KV and first token, pin the pages, answer the metadata."""
        from server.fields import with_server_defaults
        from server.protocol import parse_chat, parse_completion
        from server.serving import _chat_jobs, _completion_jobs, _defaults, read_json

        state = self.state
        state.check_serving()
        state.check_awake()
        if self.role == "decode":
            raise ApiError(400, "this worker runs as --role decode", code="wrong_role")
        engine = self._engine()
        outer = await read_json(request, state.config.max_request_body_bytes)
        kind = outer.get("kind") if isinstance(outer, dict) else None
        if kind not in ("chat", "completion") or not isinstance(outer.get("body"), dict):
            raise ApiError(400, "expected {'kind': 'chat'|'completion', 'body': {...}}", code="invalid_request")
        # the first token is drawn as the decode's
        body = with_server_defaults(outer["body"], state.config, _defaults(state))
        req = parse_chat(body) if kind == "chat" else parse_completion(body)
        if state.check_model(req.common.model) is not None:
            raise ApiError(400, f"the LoRA adapter {req.common.model!r} is served by aggregated workers only, not "
                                "prefilled for another worker", param="model", code="unsupported_parameter")
        request_id = request.scope["state"]["request_id"]
        from server.trace import summarize_request

        self.trace.record(request_id, "L1", "received", {**summarize_request(kind, outer["body"]), "pd": "prefill"})
        jobs = await (_chat_jobs(state, req, request_id) if kind == "chat"
                      else _completion_jobs(state, req, request_id))
        if len(jobs) != 1 or req.common.params.n != 1:
            raise ApiError(400, "disaggregated requests take one prompt and n=1", code="invalid_request")
        job = jobs[0]
        salt = req.common.cache_salt
        images = {"multi_modal_data": media_data(job.images)} if job.images else {}
        t0 = time.time()
        self._trace(request, request_id, "prefill_start", prompt_tokens=len(job.prompt_ids))
        last = None
        state.start(job.engine_id)
        try:
            async for out in engine.generate(job.prompt_ids, SamplingParams(max_tokens=1, temperature=0.0),
                                             job.engine_id, priority=req.common.priority, cache_salt=salt, **images):
                last = out
        except ValueError as e:
            raise ApiError(400, str(e), code="invalid_request") from e
        finally:
            state.finish(job.engine_id)
        first = last.outputs[0].token_ids[0] if last is not None and last.outputs[0].token_ids else None
        # The pages go under the ids the prefix cache keys them by (an image's tokens: its content's id), which
        # the decode worker's admission of the same request computes alike.
        pin, layout = await engine.run_on_engine(
            lambda e: (pin_prompt(e, prompt_cache_ids(e, job.prompt_ids, job.images), salt), KVLayout.of_engine(e)))
        if pin is None:
            raise ApiError(409, "the prompt has no full page to transfer", code="nothing_to_transfer")
        transfer_id = uuid.uuid4().hex
        meta = TransferMeta(transfer_id, request_id, pin.token_ids, pin.pages, layout, engine.model_name,
                            str(request.base_url).rstrip("/"), salt, len(job.prompt_ids), first,
                            time.time() + self.config.pin_timeout_s)
        export = self.exports[transfer_id] = _Export(meta, pin)
        export.timer = asyncio.get_running_loop().call_later(
            self.config.pin_timeout_s, lambda: asyncio.ensure_future(self._release(transfer_id, "timeout")))
        self._trace(request, request_id, "pinned", transfer_id=transfer_id, pages=len(pin.pages),
                    tokens=len(pin.token_ids), first_token=first, seconds=round(time.time() - t0, 4))
        return JSONResponse(meta.to_json())

    async def send_kv(self, request: Request) -> Response:
        """`GET /v1/pd/kv/{id}`: the pinned pages as a `KVPayload`."""
        export = self.exports.get(request.path_params["transfer_id"])
        if export is None:
            raise ApiError(404, "no such transfer (acknowledged, expired or unknown)", code="not_found")
        engine = self._engine()
        k, v = await engine.run_on_engine(lambda e: read_pages(e, export.pin))
        body = KVPayload.build(export.meta, k, v).encode()
        self._trace(request, export.meta.request_id, "sent", transfer_id=export.meta.transfer_id, bytes=len(body))
        return Response(body, media_type="application/octet-stream")

    async def ack_kv(self, request: Request) -> Response:
        """`DELETE /v1/pd/kv/{id}`: the receiver has the pages (or gave up): unpin them."""
        transfer_id = request.path_params["transfer_id"]
        if not await self._release(transfer_id, "acknowledged"):
            raise ApiError(404, "no such transfer (acknowledged, expired or unknown)", code="not_found")
        return JSONResponse({"released": transfer_id})

    async def _release(self, transfer_id: str, why: str) -> bool:
        export = self.exports.pop(transfer_id, None)
        if export is None:
            return False
        if export.timer is not None:
            export.timer.cancel()
        try:
            await self.state.engine.run_on_engine(lambda e: unpin(e, export.pin))
        except Exception:  # noqa: BLE001 - an engine gone with its pages
            logger.exception("unpinning transfer %s failed", transfer_id)
        self._trace(None, export.meta.request_id, "unpinned", transfer_id=transfer_id, why=why)
        return True

    async def pinned_pages(self) -> int:
        """Pages currently pinned for transfers (0 once every transfer is acknowledged or expired)."""
        return sum(len(e.pin.pages) for e in self.exports.values())

    # -- decode side -----------------------------------------------------------------------------

    async def import_for(self, request: Request, request_id: str) -> Imported | None:
        """Pull and import the KV named by the request's `X-KV-Transfer` header; None means recompute."""
        source = request.headers.get(TRANSFER_HEADER)
        if not source:
            return None
        engine = self.state.engine
        if not hasattr(engine, "run_on_engine"):
            self._trace(request, request_id, "import_skipped", reason="engine cannot import KV")
            return None
        t0 = time.time()
        self._trace(request, request_id, "fetch_start", source=source)
        try:
            payload = await asyncio.wait_for(self.transport.fetch(source, self.config.fetch_timeout_s),
                                             self.config.fetch_timeout_s)
        except (TransferError, TimeoutError) as e:
            self._trace(request, request_id, "transfer_failed", reason=str(e) or type(e).__name__,
                        fallback="recompute")
            await self.transport.acknowledge(source)
            return None
        local = await engine.run_on_engine(KVLayout.of_engine)
        ready = check_ready(payload.meta, payload, local)
        if ready.ok and not source.rstrip("/").endswith("/" + payload.meta.transfer_id):
            ready = type(ready)(False, f"payload of transfer {payload.meta.transfer_id} from {source}")
        if not ready.ok:
            self._trace(request, request_id, "not_ready", reason=ready.reason, fallback="recompute")
            await self.transport.acknowledge(source)
            return None
        imported = await engine.run_on_engine(lambda e: import_pages(e, payload))
        await self.transport.acknowledge(source)
        if imported is None:
            self._trace(request, request_id, "import_failed", reason="KV pool full", fallback="recompute")
            return None
        self._trace(request, request_id, "imported", pages_written=imported.pages_written,
                    tokens=imported.num_tokens, bytes=payload.k.nbytes + payload.v.nbytes,
                    seconds=round(time.time() - t0, 4), prefill_first_token=payload.meta.first_token)
        return imported

    async def release_import(self, imported: Imported) -> None:
        """The request holds its pages now: drop the import's lock."""
        await self.state.engine.run_on_engine(lambda e: release_import(e, imported))


def _pd(request: Request) -> PDWorker:
    return request.app.state.pd


async def pd_prefill(request: Request) -> Response:
    """`POST /v1/pd/prefill`."""
    return await _pd(request).prefill(request)


async def pd_send_kv(request: Request) -> Response:
    """`GET /v1/pd/kv/{transfer_id}`."""
    return await _pd(request).send_kv(request)


async def pd_ack_kv(request: Request) -> Response:
    """`DELETE /v1/pd/kv/{transfer_id}`."""
    return await _pd(request).ack_kv(request)


async def pd_info(request: Request) -> Response:
    """`GET /v1/pd/info`: this worker's role and its pinned transfers."""
    pd = _pd(request)
    return JSONResponse({"role": pd.role, "pinned_transfers": len(pd.exports),
                         "pinned_pages": await pd.pinned_pages()})
