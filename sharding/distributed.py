"""Several hosts as one cluster: `jax.distributed` start-up and the lock-step broadcast of each step's work.

Every process runs the same jitted steps over one global mesh; a collective that one process
skips hangs the others. So process 0 decides (it receives the requests and runs the scheduler)
and broadcasts its decisions before every step; the other processes replay them.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import jax
import numpy as np

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 1 << 16  # one step's broadcast payload (a fixed shape, so it compiles once)


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
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id)
    logger.info("joined cluster as process %d of %d: %d global devices, %d local", jax.process_index(),
                jax.process_count(), jax.device_count(), jax.local_device_count())


def broadcast_message(message: Any) -> Any:
    """Process 0's JSON-serializable `message`, on every process (what others pass is ignored)."""
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        return message
    buf = np.zeros(MAX_MESSAGE_BYTES + 4, np.uint8)
    if jax.process_index() == 0:
        data = json.dumps(message).encode()
        if len(data) > MAX_MESSAGE_BYTES:
            raise ValueError(f"step message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
        buf[:4] = np.frombuffer(np.uint32(len(data)).tobytes(), np.uint8)
        buf[4:4 + len(data)] = np.frombuffer(data, np.uint8)
    buf = np.asarray(multihost_utils.broadcast_one_to_all(buf))
    n = int(np.frombuffer(buf[:4].tobytes(), np.uint32)[0])
    return json.loads(buf[4:4 + n].tobytes().decode())


def host_value(x: Any) -> np.ndarray:
    """A replicated (possibly multi-process) array as a host numpy array."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    return np.asarray(x.addressable_data(0))


class LockstepEngine:
    """An `LLMEngine` run by every process of a cluster in lock-step.

    Process 0 takes the requests. Before each step it broadcasts what arrived (and whether to stop);
    every process adds the same requests in the same order and steps, so the deterministic scheduler
    makes the same decisions everywhere and every process enters the same collectives.
    """

    def __init__(self, engine: Any):
        self.engine = engine
        self._pending: list[dict] = []
        self._aborts: list[str] = []

    def add_request(self, request_id: str, prompt: list[int] | str, params: Any) -> None:
        """Queue a request for the next step (only process 0's requests count)."""
        import dataclasses

        self._pending.append({"id": request_id, "prompt": prompt, "params": dataclasses.asdict(params)})

    def abort_request(self, request_id: str) -> None:
        self._aborts.append(request_id)

    def step(self) -> tuple[list[Any], bool]:
        """One lock-step iteration: (this step's outputs, whether process 0 has work left)."""
        from jaxserve.sampling_params import SamplingParams

        busy = bool(self._pending) or self.engine.has_unfinished_requests()
        msg = broadcast_message({"add": self._pending, "abort": self._aborts, "busy": busy})
        self._pending, self._aborts = [], []
        for r in msg["add"]:
            params = SamplingParams(**{k: tuple(v) if isinstance(v, list) else v for k, v in r["params"].items()})
            self.engine.add_request(r["id"], r["prompt"], params)
        for rid in msg["abort"]:
            self.engine.abort_request(rid)
        if not msg["busy"]:
            return [], False
        return self.engine.step(), True

    def run_until_idle(self) -> dict[str, Any]:
        """Step until process 0 has nothing left; returns the finished outputs by request id."""
        finished = {}
        while True:
            outs, busy = self.step()
            for out in outs:
                if out.finished:
                    finished[out.request_id] = out
            if not busy:
                return finished
