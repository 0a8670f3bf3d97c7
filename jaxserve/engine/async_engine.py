"""`AsyncEngine`: the engine loop in its own thread, outputs pushed to asyncio queues.

The asyncio side never touches the device: `generate` puts a command on the engine thread's
inbox and awaits its own queue, which the engine thread fills with `loop.call_soon_threadsafe`.
A request that fails inside the engine is finished with an `EngineError`; the loop and every
other request keep running.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from jaxserve.engine.errors import EngineError
from jaxserve.engine.llm_engine import EngineStats, LLMEngine
from jaxserve.engine.memory import EngineSleepingError
from jaxserve.engine.multimodal import image_spec
from jaxserve.engine_args import EngineArgs
from jaxserve.outputs import EmbeddingRequestOutput, RequestOutput
from jaxserve.pooling_params import PoolingParams
from jaxserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int
    cache_salt: str | None
    arrival_time: float
    sink: _Sink
    lora_request: Any = None
    multi_modal_data: Any = None


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Callable[[LLMEngine], Any]
    done: queue.Queue


class _Sink:
    """Where one request's outputs go: an asyncio queue on the caller's loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed: nobody is listening any more
            pass


class AsyncEngine:
    """An `LLMEngine` driven by a background thread, for servers and asyncio programs."""

    idle_wait_s: float | None = None
    """How long the idle engine thread waits for work before asking the engine again (None: until work arrives)."""

    def __init__(self, engine: LLMEngine, start: bool = True):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = engine.model.name
        self.lora_modules = engine.loras.paths if getattr(engine, "loras", None) else {}
        """LoRA adapters, name to path (the engine's own map: adapters loaded later appear in it)."""
        self.max_model_len = engine.max_model_len
        self.vocab_size, self.eos_ids = engine.model.config.vocab_size, engine.eos_ids
        self.sampling_defaults = engine.model.sampling_defaults  # the model's (`jaxserve.generation_config`)
        self.long_rope_context = engine.long_rope_context  # prompts past it are cached apart (jaxserve.rope)
        self.sleep_mode = engine.args.enable_sleep_mode  # sleep and weight updates over HTTP (server/sleep_admin.py)
        self.images = image_spec(engine)  # an image-text model's placeholder and limits (None: text only)
        self.classifier = getattr(engine, "classifier", None)
        """A sequence classification model's head (its labels), or None."""
        sched = engine.scheduler
        self.prefix_cache_page_size = sched.pool.page_size if sched.cache is not None else None
        """The page size of the engine's prefix cache (None: it caches no prefixes)."""
        self._inbox: queue.Queue = queue.Queue()
        self._sinks: dict[str, _Sink] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stats = engine.stats()
        self._lock = threading.Lock()
        self.is_ready = False
        self.dead_error: BaseException | None = None
        if start:
            self.start()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, start: bool = True, progress: bool = True) -> AsyncEngine:
        """Load the model, warm up every bucket (blocking) and start the engine thread."""
        return cls(LLMEngine(args, progress=progress), start=start)

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        self._thread.start()
        self.is_ready = True

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; unfinished requests end with an error."""
        self.is_ready = False
        self._stop.set()
        self._inbox.put(None)
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    # -- requests ----------------------------------------------------------------------------------

    async def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: Any = None,
        multi_modal_data: dict[str, Any] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield cumulative outputs of one request; the last has `finished=True`. `lora_request`: a
        `LoRARequest` or an adapter's name; `multi_modal_data`: its images, as `LLMEngine.add_request` takes them.

        Raises ValueError before the first output for requests that can never run, and
        EngineError if the request fails inside the engine. Closing the iterator early
        (a client gone) aborts the request.
        """
        if self.dead_error is not None:
            raise EngineError(f"the engine has stopped: {self.dead_error}")
        if not self.is_ready:
            raise EngineError("the engine is not running")
        sink = _Sink(asyncio.get_running_loop())
        with self._lock:
            if request_id in self._sinks:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._sinks[request_id] = sink
        self._inbox.put(_Add(request_id, prompt, sampling_params, priority, cache_salt, time.time(), sink,
                             lora_request, multi_modal_data))
        finished = False
        try:
            while True:
                item = await sink.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                # Coalesce outputs that piled up while the consumer was busy: they are cumulative.
                while not item.finished and not sink.queue.empty():
                    nxt = sink.queue.get_nowait()
                    if isinstance(nxt, BaseException):
                        finished = True
                        raise nxt
                    item = nxt
                if item.finished:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._inbox.put(_Abort(request_id))

    async def encode(self, prompt: str | list[int], pooling_params: PoolingParams | None, request_id: str, *,
                     priority: int = 0, cache_salt: str | None = None) -> AsyncIterator[EmbeddingRequestOutput]:
        """An embedding model's `generate`: yields the request's output once, finished, with its embedding."""
        async for out in self.generate(prompt, pooling_params or PoolingParams(), request_id, priority=priority,
                                       cache_salt=cache_salt):
            yield out

    async def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    def stats(self) -> EngineStats:
        """The latest snapshot (updated by the engine thread after every step)."""
        return self._stats

    def call_on_engine(self, fn: Callable[[LLMEngine], Any], timeout: float = 60.0) -> Any:
        """Run `fn(engine)` on the engine thread between two steps and return its result (blocking).

        The scheduler, page pool and KV pages belong to the engine thread; this is the one way
        other threads touch them (KV export/import, event subscriptions, trace hooks).
        """
        done: queue.Queue = queue.Queue()
        self._inbox.put(_Call(fn, done))
        ok, value = done.get(timeout=timeout)
        if not ok:
            raise value
        return value

    async def run_on_engine(self, fn: Callable[[LLMEngine], Any], timeout: float = 60.0) -> Any:
        """`call_on_engine` for asyncio callers: the event loop is not blocked while it waits."""
        return await asyncio.to_thread(self.call_on_engine, fn, timeout)

    # -- sleep mode and weight updates (jaxserve.engine.memory), between two steps ---------------------

    async def sleep(self, level: int = 1) -> None:
        await self.run_on_engine(lambda e: e.memory.sleep(level), timeout=600)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self.run_on_engine(lambda e: e.memory.wake_up(tags), timeout=600)

    async def load_weights(self, source: Any = None) -> None:
        await self.run_on_engine(lambda e: e.memory.load_weights(source), timeout=3600)

    async def reset_prefix_cache(self) -> bool:
        return await self.run_on_engine(lambda e: e.reset_prefix_cache())

    async def is_sleeping(self) -> bool:
        return self.engine.memory.asleep

    def subscribe_kv_events(self, callback: Callable[[Any], None]) -> bool:
        """Send the prefix cache's KV events to `callback` (on the engine thread); False without a cache.

        The cache's current pages come first, as one `BlockStored` per cached page chain, so a
        subscriber that joins late still sees everything the cache holds.
        """
        def subscribe(engine: LLMEngine) -> bool:
            cache = engine.scheduler.cache
            if cache is None:
                return False
            from jaxserve.engine.kv_events import BlockStored

            hashes = tuple(cache.block_hashes())
            if hashes:
                callback(BlockStored(hashes, None, (), cache.page_size))
            cache.subscribe(callback)
            return True

        return self.call_on_engine(subscribe)

    def set_tracer(self, callback: Callable[[str, str, str, dict], None] | None) -> None:
        """Record every request's engine-side layers through `callback(request_id, layer, event, data)`."""
        self.engine.trace = callback

    def check_integrity(self) -> None:
        """Run the page pool/cache checks on the engine thread and wait for the answer."""
        done: queue.Queue = queue.Queue()
        self._inbox.put(("check", done))
        result = done.get(timeout=60)
        if isinstance(result, BaseException):
            raise result

    # -- the engine thread -------------------------------------------------------------------------

    def _drain_inbox(self, block: bool) -> None:
        while True:
            try:
                item = self._inbox.get(block=block, timeout=self.idle_wait_s)
            except queue.Empty:
                return
            block = False
            if item is None:
                return
            if isinstance(item, _Add):
                self._add(item)
            elif isinstance(item, _Abort):
                self._abort(item.request_id)
            elif isinstance(item, _Call):
                try:
                    item.done.put((True, item.fn(self.engine)))
                except BaseException as e:  # noqa: BLE001 - reported to the caller
                    item.done.put((False, e))
            elif isinstance(item, tuple) and item[0] == "check":
                try:
                    self.engine.check_integrity()
                    item[1].put(None)
                except BaseException as e:  # noqa: BLE001 - reported to the caller
                    item[1].put(e)

    def _add(self, cmd: _Add) -> None:
        try:
            extra = {"lora_request": cmd.lora_request} if cmd.lora_request is not None else {}
            if cmd.multi_modal_data:
                extra["multi_modal_data"] = cmd.multi_modal_data
            self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params, priority=cmd.priority,
                                    cache_salt=cmd.cache_salt, arrival_time=cmd.arrival_time, **extra)
        except (ValueError, EngineSleepingError) as e:
            self._finish_sink(cmd.request_id, e)
        except Exception as e:  # noqa: BLE001 - one bad request must not stop the loop
            logger.exception("request %s failed to start", cmd.request_id)
            self._finish_sink(cmd.request_id, EngineError(f"request {cmd.request_id} failed: {e}"))

    def _abort(self, request_id: str) -> None:
        out = self.engine.abort_request(request_id)
        with self._lock:
            sink = self._sinks.pop(request_id, None)
        if sink is not None and out is not None:
            sink.put(out)

    def _finish_sink(self, request_id: str, item) -> None:
        with self._lock:
            sink = self._sinks.pop(request_id, None)
        if sink is not None:
            sink.put(item)

    def _run(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            self._drain_inbox(block=not engine.has_unfinished_requests())
            self._stats = engine.stats()  # aborts and admissions change it even without a step
            if self._stop.is_set():
                break
            if not engine.has_unfinished_requests():
                continue
            try:
                outputs = engine.step()
            except Exception as e:  # noqa: BLE001 - fail the step's requests, keep serving the rest
                logger.exception("engine step failed")
                self._fail_running(e)
                continue
            finally:
                self._stats = engine.stats()
                self._fail_alone()
            for out in outputs:
                with self._lock:
                    sink = self._sinks.get(out.request_id)
                    if out.finished:
                        self._sinks.pop(out.request_id, None)
                if sink is not None:
                    sink.put(out)
        self._fail_all(EngineError("the engine was shut down"))

    def _fail_alone(self) -> None:
        """Requests the engine failed alone (an image that would not encode), the others stepping on."""
        for request_id, error in getattr(self.engine, "take_failures", dict)().items():
            self._finish_sink(request_id, EngineError(f"request {request_id} failed in the engine: {error}"))

    def _fail_running(self, error: BaseException) -> None:
        """A step failed: abort the requests that were in it, so the others can go on."""
        running = [r.request_id for r in self.engine.scheduler.running]
        groups = {self.engine._seq_group[rid].request_id for rid in running if rid in self.engine._seq_group}
        for request_id in groups:
            self.engine.abort_request(request_id)
            self._finish_sink(request_id, EngineError(f"request {request_id} failed in the engine: {error}"))

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            ids = list(self._sinks)
        for request_id in ids:
            self.engine.abort_request(request_id)
            self._finish_sink(request_id, error)
