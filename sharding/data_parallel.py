"""Data parallelism: several engine replicas, each on its own slice of the mesh, behind one facade.

`DataParallelEngine` looks like one `AsyncEngine` to a server: `generate`, `abort`, `stats`,
`check_integrity`, `shutdown`. Each request goes to the replica with the fewest requests in
flight (ties to the lowest index) and stays there until it finishes; replicas share nothing
but the host, so one replica's prefix cache does not serve another's requests.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

logger = logging.getLogger(__name__)


class DataParallelEngine:
    """Several `AsyncEngine` replicas behind the `AsyncEngine` interface, least-loaded placement."""

    def __init__(self, replicas: list[Any]):
        if not replicas:
            raise ValueError("a data-parallel engine needs at least one replica")
        self.replicas = replicas
        first = replicas[0]
        self.tokenizer = first.tokenizer
        self.model_name = first.model_name
        self.lora_modules = first.lora_modules
        self.classifier = first.classifier
        self.prefix_cache_page_size = first.prefix_cache_page_size
        self.max_model_len = first.max_model_len
        self.sampling_defaults = first.sampling_defaults
        self.long_rope_context = first.long_rope_context
        self.sleep_mode = first.sleep_mode
        self.images = first.images
        self._in_flight = [0] * len(replicas)
        self._placed: dict[str, int] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_engine_args(cls, args: Any, loaded: Any = None, start: bool = True,
                         progress: bool = True) -> DataParallelEngine:
        """Load the model once on the host and build `args.data_parallel_size` replicas, each laid out
        over its own `tensor_parallel_size x expert_parallel_size` devices."""
        from jaxserve.engine.async_engine import AsyncEngine
        from jaxserve.engine.llm_engine import LLMEngine
        from jaxserve.engine.model_loading import load_model, shard_model
        from sharding.mesh import ParallelConfig, make_mesh, replica_meshes

        pc = ParallelConfig(args.tensor_parallel_size, args.expert_parallel_size, args.data_parallel_size)
        meshes = replica_meshes(make_mesh(pc))
        if loaded is None:
            loaded = load_model(args.replace(tensor_parallel_size=1, expert_parallel_size=1, data_parallel_size=1),
                                progress=progress)
        replicas = []
        for i, mesh in enumerate(meshes):
            placed = shard_model(loaded, args, mesh=mesh)
            logger.info("data-parallel replica %d of %d on devices %s", i, len(meshes),
                        [d.id for d in mesh.devices.flat])
            replicas.append(AsyncEngine(LLMEngine(args, loaded=placed, progress=progress), start=start))
        drafters = [r.engine.drafter for r in replicas]
        if drafters[0] is not None and drafters[0].suffix is not None:  # one cache of every replica's responses
            for d in drafters[1:]:
                d.suffix = drafters[0].suffix
        return cls(replicas)

    # -- lifecycle ---------------------------------------------------------------------------------

    @property
    def is_ready(self) -> bool:
        return all(r.is_ready for r in self.replicas)

    @property
    def dead_error(self) -> BaseException | None:
        return next((r.dead_error for r in self.replicas if r.dead_error is not None), None)

    def start(self) -> None:
        for r in self.replicas:
            r.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        for r in self.replicas:
            r.shutdown(timeout)

    # -- requests ----------------------------------------------------------------------------------

    def pick_replica(self) -> int:
        """The replica with the fewest requests in flight (lowest index on ties)."""
        with self._lock:
            return min(range(len(self.replicas)), key=lambda i: (self._in_flight[i], i))

    def in_flight(self) -> list[int]:
        with self._lock:
            return list(self._in_flight)

    async def generate(self, prompt, sampling_params, request_id: str, *, priority: int = 0,
                       cache_salt: str | None = None, **kw: Any) -> AsyncIterator[Any]:
        """As `AsyncEngine.generate`, on the least-loaded replica."""
        with self._lock:
            if request_id in self._placed:
                raise ValueError(f"request id {request_id!r} is already in use")
            i = min(range(len(self.replicas)), key=lambda j: (self._in_flight[j], j))
            self._in_flight[i] += 1
            self._placed[request_id] = i
        try:
            async for out in self.replicas[i].generate(prompt, sampling_params, request_id, priority=priority,
                                                       cache_salt=cache_salt, **kw):
                yield out
        finally:
            with self._lock:
                self._in_flight[i] -= 1
                self._placed.pop(request_id, None)

    def replica_of(self, request_id: str) -> int | None:
        with self._lock:
            return self._placed.get(request_id)

    async def abort(self, request_id: str) -> None:
        i = self.replica_of(request_id)
        if i is not None:
            await self.replicas[i].abort(request_id)

    # -- introspection -----------------------------------------------------------------------------

    def stats(self) -> Any:
        """The replicas' stats combined: counts summed, KV usage averaged, step time the slowest."""
        parts = [r.stats() for r in self.replicas]
        first = parts[0]
        counts = [f.name for f in dataclasses.fields(first) if type(getattr(first, f.name)) in (int, float)
                  and f.name not in ("kv_cache_usage", "page_size", "step_time_s", "max_lora")]
        summed = {name: sum(getattr(p, name) for p in parts) for name in counts}
        # Names (the LoRA adapters in use): those of any replica; counts by position, summed.
        per_pos = "spec_num_accepted_tokens_per_pos"
        unions = {f.name: tuple(sorted({x for p in parts for x in getattr(p, f.name)}))
                  for f in dataclasses.fields(first) if isinstance(getattr(first, f.name), tuple) and f.name != per_pos}
        unions[per_pos] = tuple(map(sum, itertools.zip_longest(*(getattr(p, per_pos) for p in parts), fillvalue=0)))
        return dataclasses.replace(first, **summed, **unions,
                                   kv_cache_usage=sum(p.kv_cache_usage for p in parts) / len(parts),
                                   step_time_s=max(p.step_time_s for p in parts))

    def check_integrity(self) -> None:
        for r in self.replicas:
            r.check_integrity()

    def call_on_engine(self, fn: Callable[[Any], Any], timeout: float = 60.0) -> list[Any]:
        """Run `fn(engine)` on every replica's engine thread; returns their results in replica order."""
        return [r.call_on_engine(fn, timeout) for r in self.replicas]
