"""The server's lifecycle state: the engine in use, the requests in flight, and draining."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from server.config import ServerConfig
from server.conversations import ConversationStore
from server.errors import ApiError
from server.metrics import ServerMetrics
from server.reasoning import reasoning_parser
from server.response_store import ResponseStore
from server.tool_parsers import tool_parser


class LoadingEngine:
    """Stands in for the engine while the real one loads: never ready, no tokenizer, zero counters."""

    tokenizer = None
    is_ready = False

    def __init__(self, model_name: str, max_model_len: int = 0):
        self.model_name = model_name
        self.max_model_len = max_model_len

    def stats(self) -> Any:
        from server.fake_engine import zero_engine_stats

        return zero_engine_stats()

    async def abort(self, request_id: str) -> None:
        """Nothing to abort before the engine exists."""

    def shutdown(self) -> None:
        """Nothing to stop."""


class ServerState:
    """Shared by every handler: which engine serves, which engine requests are in flight, draining or not.

    Invariant: `active` holds exactly the engine request ids submitted and not yet finished or aborted;
    `idle` is set whenever it is empty.
    """

    def __init__(self, engine: Any, config: ServerConfig):
        self.config = config
        self.engine = engine
        self.served_names: tuple[str, ...] = config.served_model_names or (engine.model_name,)
        self.metrics = ServerMetrics(_EngineView(self), self.served_names[0])
        # The parser that finds tool calls in "auto" replies; None refuses tool_choice "auto".
        self.tool_parser = (tool_parser(config.tool_call_parser)
                            if config.enable_auto_tool_choice and config.tool_call_parser else None)
        # The parser that splits a thinking model's reasoning from its answer; None: no split.
        self.reasoning_parser = reasoning_parser(config.reasoning_parser) if config.reasoning_parser else None
        self.responses = ResponseStore(config.responses_store_capacity)  # `/v1/responses` answers kept
        self.conversations = ConversationStore(config.responses_store_capacity)  # the Conversations API's
        self.created = int(time.time())
        self.draining = False
        self.sleeping = False  # the engine is asleep (server/sleep_admin.py): requests get 503
        self.active: set[str] = set()
        self._idle: asyncio.Event | None = None

    def set_engine(self, engine: Any) -> None:
        """Swap in the loaded engine."""
        self.engine = engine

    @property
    def model_name(self) -> str:
        """The name reported in responses."""
        return self.served_names[0]

    @property
    def lora_modules(self) -> dict[str, str]:
        """The engine's LoRA adapters, name to path (served as models of their own)."""
        return dict(getattr(self.engine, "lora_modules", None) or {})

    def check_model(self, model: str | None) -> str | None:
        """404 unless `model` is one of the served names or a LoRA adapter's (None means the default);
        returns the adapter's name when it names one."""
        if model is None or model in self.served_names:
            return None
        if model in self.lora_modules:
            return model
        available = ", ".join((*self.served_names, *self.lora_modules))
        raise ApiError(404, f"The model `{model}` does not exist. Available: {available}", param="model",
                       code="model_not_found")

    def check_serving(self) -> None:
        """503 while not ready or draining."""
        retry = {"Retry-After": str(self.config.retry_after_s)}
        if self.draining:
            self.metrics.rejected.labels(self.model_name, "draining").inc()
            raise ApiError(503, "the server is shutting down", code="server_shutting_down", headers=retry)
        if not self.engine.is_ready:
            self.metrics.rejected.labels(self.model_name, "not_ready").inc()
            raise ApiError(503, "the model is still loading; retry shortly", code="model_not_ready",
                           headers=retry)

    def tokenizer_for(self, what: str) -> Any:
        """The engine's tokenizer, for `what`; 400 naming it when the server runs without one
        (--skip-tokenizer-init: prompts are token ids, outputs token ids)."""
        if (tok := self.engine.tokenizer) is None:
            raise ApiError(400, f"{what} needs the tokenizer, and the server was started with --skip-tokenizer-init: "
                                "send prompts as token ids to /v1/completions", code="unsupported_parameter")
        return tok

    def vocab_size(self) -> int:
        """Token ids a request may name: the tokenizer's, else (without one) the model's."""
        tok = self.engine.tokenizer
        return tok.vocab_size if tok is not None else self.engine.vocab_size

    def check_awake(self) -> None:
        """503 while the engine sleeps (server/sleep_admin.py)."""
        if self.sleeping:
            self.metrics.rejected.labels(self.model_name, "sleeping").inc()
            raise ApiError(503, "the engine is sleeping (POST /wake_up wakes it)", code="engine_sleeping",
                           headers={"Retry-After": str(self.config.retry_after_s)})

    def admit(self, count: int) -> None:
        """503 while the engine sleeps; 429 if `count` more requests would push its waiting queue past its limit."""
        self.check_awake()
        stats = self.engine.stats()
        # Requests handed to the engine but not yet seen by its loop are waiting too.
        waiting = max(stats.num_waiting, len(self.active) - stats.num_running)
        if waiting + count > self.config.max_waiting_requests:
            self.metrics.rejected.labels(self.model_name, "queue_full").inc()
            raise ApiError(429, f"too many requests waiting ({waiting}, limit "
                                f"{self.config.max_waiting_requests}); retry later",
                           code="rate_limit_exceeded", headers={"Retry-After": str(self.config.retry_after_s)})

    def engine_id(self, request_id: str) -> str:
        """`request_id`, made unique among the requests in flight if a client reused it."""
        return request_id if request_id not in self.active else f"{request_id}-{uuid.uuid4().hex[:8]}"

    def start(self, engine_id: str) -> None:
        """Mark an engine request as in flight."""
        self.active.add(engine_id)
        if self._idle is not None:
            self._idle.clear()

    def finish(self, engine_id: str) -> None:
        """Mark an engine request as done."""
        self.active.discard(engine_id)
        if not self.active and self._idle is not None:
            self._idle.set()

    async def drain(self, timeout: float) -> bool:
        """Stop admitting and wait up to `timeout` s for in-flight requests; True if they all finished."""
        self.draining = True
        if not self.active:
            return True
        if self._idle is None:
            self._idle = asyncio.Event()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True


class _EngineView:
    """Whatever engine the state holds now (the metrics collector outlives a swap)."""

    def __init__(self, state: ServerState):
        self._state = state

    def stats(self) -> Any:
        return self._state.engine.stats()
