"""Several hosts as one cluster: `jax.distributed` start-up and the lock-step replay of process 0's decisions.

Every process runs the same jitted steps over one global mesh; a collective that one process
skips hangs the others. So process 0 decides (it receives the requests and runs the scheduler)
and broadcasts its decisions before every step; the other processes (followers) replay them.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import signal
import time
from typing import Any

import jax
import numpy as np

from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.multimodal import PreparedImage, PreparedVideo, images_of, media_data
from jaxserve.engine.multimodal_onevision import OnevisionImage
from jaxserve.engine_args import EngineArgs
from jaxserve.lora_request import LoRARequest
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 16  # one broadcast's payload: a fixed shape, so it compiles once; longer messages take several
IDLE_BROADCAST_S = 1.0  # an idle process 0 still broadcasts this often, so followers never wait long in a collective


def initialize_distributed(coordinator_address: str | None, num_processes: int, process_id: int) -> None:
    """Join the cluster (once per process, before anything touches a device).

    On one process this does nothing. With several, process 0 serves as the coordinator at
    `coordinator_address` (host:port reachable from every host); the call blocks until all
    `num_processes` have joined, after which `jax.devices()` lists every host's devices.
    """
    if num_processes <= 1 or jax.distributed.is_initialized():
        return
    if not coordinator_address:
        raise ValueError("several processes need a coordinator address (host:port of process 0)")
    # JAX's preemption notifier would take SIGTERM over; the server drains on it and the followers
    # outlast it (process 0 stops them), so the signal stays with them.
    jax.config.update("jax_enable_preemption_service", False)
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id)
    logger.info("joined cluster as process %d of %d: %d global devices, %d local", jax.process_index(),
                jax.process_count(), jax.device_count(), jax.local_device_count())


def shutdown_distributed() -> None:
    """Leave the cluster (a barrier: every process calls it once it has stopped stepping)."""
    if jax.distributed.is_initialized():
        jax.distributed.shutdown()


def broadcast_message(message: Any) -> Any:
    """Process 0's JSON-serializable `message`, on every process (what others pass is ignored).

    The bytes travel in fixed-size chunks, each one collective; every chunk carries the total
    length, so the receivers know after the first how many follow.
    """
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        return message
    data = json.dumps(message).encode() if jax.process_index() == 0 else b""
    received = bytearray()
    while True:
        buf = np.zeros(CHUNK_BYTES + 8, np.uint8)  # [total length as uint64 | chunk]
        if jax.process_index() == 0:
            chunk = data[len(received):len(received) + CHUNK_BYTES]
            buf[:8] = np.frombuffer(np.uint64(len(data)).tobytes(), np.uint8)
            buf[8:8 + len(chunk)] = np.frombuffer(chunk, np.uint8)
        buf = np.asarray(multihost_utils.broadcast_one_to_all(buf))
        total = int(np.frombuffer(buf[:8].tobytes(), np.uint64)[0])
        received += buf[8:8 + min(CHUNK_BYTES, total - len(received))].tobytes()
        if len(received) >= total:
            return json.loads(bytes(received).decode())


def host_value(x: Any) -> np.ndarray:
    """A replicated (possibly multi-process) array as a host numpy array."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    return np.asarray(x.addressable_data(0))


class LockstepEngine(LLMEngine):
    """An `LLMEngine` that every process of a cluster runs in lock-step.

    Process 0 (the leader) takes the requests: `add_request` and `abort_request` apply at once
    there (raising as `LLMEngine` does) and are queued. Each `step()` broadcasts the queue, then
    steps; on the other processes (followers) `step()` receives the queue, applies the same changes
    in the same order, then steps. The scheduler is a deterministic function of those calls (arrival
    times travel with them), so every process schedules the same batch and enters the same
    collectives. `stop()` on the leader ends the followers' loops.
    """

    def __init__(self, args: EngineArgs | None = None, loaded: Any = None, progress: bool = True,
                 idle_broadcast_s: float = IDLE_BROADCAST_S):
        super().__init__(args, loaded=loaded, progress=progress)  # joins the cluster while loading
        self.is_leader = jax.process_index() == 0
        self.idle_broadcast_s = idle_broadcast_s
        self.stopped = False
        self.last_busy = False
        """Whether process 0 had requests to run at the latest step."""
        self._ops: list[dict[str, Any]] = []
        self._last_sent = time.monotonic()
        if self.loras is not None and self.is_leader:  # adapters loaded or unloaded here, in order
            self.loras.on_change = lambda name, path: self._ops.append({"lora_change": name, "path": path})

    # -- process 0 ---------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, *, priority: int = 0,
                    cache_salt: str | None = None, arrival_time: float | None = None,
                    lora_request: LoRARequest | str | None = None, multi_modal_data: dict[str, Any] | None = None,
                    ) -> None:
        """Queue a request on process 0 (followers receive it at the next step). Its images are read and
        processed here, and their pixels go to the followers, whose encoders make the same embeddings."""
        if not self.is_leader:
            raise RuntimeError("only process 0 takes requests; followers replay its steps")
        # The arrival time orders the queue: every process must use process 0's.
        arrival_time = time.time() if arrival_time is None else arrival_time
        images = images_of(multi_modal_data)
        if images and self.images is not None:
            images = [self.images.prepare(image) for image in images]
            multi_modal_data = media_data(images)
        super().add_request(request_id, prompt, params, priority=priority, cache_salt=cache_salt,
                            arrival_time=arrival_time, lora_request=lora_request, multi_modal_data=multi_modal_data)
        lora = dataclasses.asdict(lora_request) if isinstance(lora_request, LoRARequest) else lora_request
        self._ops.append({"add": request_id, "prompt": prompt, "params": dataclasses.asdict(params),
                          "priority": priority, "cache_salt": cache_salt, "arrival_time": arrival_time,
                          "lora_request": lora, "images": [_image_message(im) for im in images]})

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a request on process 0 (followers abort it at the next step)."""
        if not self.is_leader:
            raise RuntimeError("only process 0 aborts requests; followers replay its steps")
        out = super().abort_request(request_id)
        if out is not None:
            self._ops.append({"abort": request_id})
        return out

    def _fail_images(self, failed: dict[str, Exception]) -> None:
        """An image that failed to encode fails the whole step, as on one process: aborting its request here alone
        would reach the followers only after they had stepped with it."""
        raise next(iter(failed.values()))

    def has_unfinished_requests(self) -> bool:
        """Whether `step()` has work: requests to run, changes to send, or an idle broadcast due.

        The idle broadcast keeps the followers from waiting in one collective for ever; an
        `AsyncEngine` whose `idle_wait_s` is `idle_broadcast_s` sends it at that cadence."""
        if not self.is_leader:
            return not self.stopped
        due = time.monotonic() - self._last_sent >= self.idle_broadcast_s
        return super().has_unfinished_requests() or bool(self._ops) or due

    def stop(self) -> None:
        """Tell the followers to leave their loops (process 0, once it has stopped stepping)."""
        if self.is_leader and not self.stopped:
            self._send(stop=True)
        self.stopped = True

    def _send(self, stop: bool = False) -> dict[str, Any]:
        msg = {"ops": self._ops, "busy": LLMEngine.has_unfinished_requests(self), "stop": stop}
        self._ops = []
        self._last_sent = time.monotonic()
        return broadcast_message(msg)

    # -- every process -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One lock-step iteration: process 0 sends its queued changes, followers apply them; all step."""
        if self.stopped:
            return []
        if self.is_leader:
            msg = self._send()
        else:
            msg = broadcast_message(None)
            self._replay(msg["ops"])
            self.stopped = msg["stop"]
        self.last_busy = msg["busy"]
        if not msg["busy"] or self.stopped:
            return []
        if self.is_leader:
            return super().step()
        try:
            return super().step()
        except Exception:  # noqa: BLE001 - process 0's engine thread survives a failed step, and so do we
            logger.exception("engine step failed")
            return []

    def _replay(self, ops: list[dict[str, Any]]) -> None:
        for op in ops:
            if "abort" in op:
                super().abort_request(op["abort"])
                continue
            if "lora_change" in op:  # an adapter process 0 loaded (from the same path here) or unloaded
                name, path = op["lora_change"], op["path"]
                self.loras.load(name, path) if path is not None else self.loras.unload(name)
                continue
            lora = op["lora_request"]
            images = [_image_from_message(m) for m in op.get("images", ())]
            try:
                super().add_request(op["add"], op["prompt"], SamplingParams(**op["params"]), priority=op["priority"],
                                    cache_salt=op["cache_salt"], arrival_time=op["arrival_time"],
                                    lora_request=LoRARequest(**lora) if isinstance(lora, dict) else lora,
                                    multi_modal_data=media_data(images) if images else None)
            except ValueError:
                # Process 0 accepted it, so this process has diverged; say so loudly.
                logger.exception("request %s, accepted by process 0, was refused here", op["add"])

    def run_until_idle(self) -> dict[str, RequestOutput]:
        """Step until process 0 has nothing left; returns the finished outputs by request id."""
        finished = {}
        while True:
            for out in self.step():
                if out.finished:
                    finished[out.request_id] = out
            if not self.last_busy:
                return finished


def _array_message(a: np.ndarray) -> dict[str, Any]:
    a = np.ascontiguousarray(a, np.float32)
    return {"bytes": base64.b64encode(a.tobytes()).decode(), "shape": list(a.shape)}


def _array_from_message(m: dict[str, Any]) -> np.ndarray:
    return np.frombuffer(base64.b64decode(m["bytes"]), np.float32).reshape(m["shape"])


def _image_message(image: PreparedImage) -> dict[str, Any]:
    """A prepared image (or video) as JSON for the step message: its pixels (base64 bytes and shape), size and digest
    (a video's grid, time step, times and texts too; LLaVA-OneVision's square form)."""
    extra = {"grid": list(image.grid), "time_step": image.time_step, "timestamps": list(image.timestamps),
             "texts": list(image.texts)} if isinstance(image, PreparedVideo) else {}
    if isinstance(image, OnevisionImage):
        extra = {"square": _array_message(image.square)}
    return {"pixels": _array_message(image.pixels), "size": list(image.size), "digest": image.digest.hex(), **extra}


def _image_from_message(m: dict[str, Any]) -> PreparedImage:
    pixels, size, digest = _array_from_message(m["pixels"]), tuple(m["size"]), bytes.fromhex(m["digest"])
    if "grid" in m:
        return PreparedVideo(pixels, size, digest, tuple(m["grid"]), m["time_step"], tuple(m["timestamps"]),
                             tuple(m["texts"]))
    if "square" in m:
        return OnevisionImage(pixels, size, digest, _array_from_message(m["square"]))
    return PreparedImage(pixels, size, digest)


class LockstepAsyncEngine(AsyncEngine):
    """Process 0's `AsyncEngine` over a `LockstepEngine`: idle, it wakes every `idle_broadcast_s` to
    broadcast; when its thread ends (shutdown) it tells the followers to stop."""

    def __init__(self, engine: LockstepEngine, start: bool = True):
        self.idle_wait_s = engine.idle_broadcast_s
        super().__init__(engine, start=start)

    @classmethod
    def from_engine_args(cls, args: EngineArgs, start: bool = True, progress: bool = True) -> LockstepAsyncEngine:
        """Join the cluster, load the model, warm up (with the followers) and start the engine thread."""
        return cls(LockstepEngine(args, progress=progress), start=start)

    def _run(self) -> None:
        try:
            super()._run()
        finally:
            self.engine.stop()


def run_follower(args: EngineArgs, progress: bool = False) -> int:
    """A process other than 0: load, warm up and replay process 0's steps until it stops; the exit code.

    A follower serves no HTTP. SIGTERM/SIGINT alone do not stop it (process 0 may still be draining
    requests that need this process's devices): it stops when process 0 does; a second signal ends it.
    """
    signals = []

    def on_signal(signum: int, frame: Any) -> None:
        signals.append(signum)
        if len(signals) > 1:
            raise SystemExit(1)
        logger.info("signal %d: following process 0 until it stops (a second signal exits now)", signum)

    if args.process_id == 0:
        raise ValueError("process 0 leads (it runs the server); run_follower is for the other processes")
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    engine = LockstepEngine(args, progress=progress)
    logger.info("process %d following process 0", jax.process_index())
    steps = 0
    # A failed broadcast (process 0 gone) raises out of here: the exit code says so.
    while not engine.stopped:
        engine.step()
        steps += engine.last_busy
    logger.info("process 0 stopped after %d busy steps; leaving the cluster", steps)
    shutdown_distributed()
    return 0
