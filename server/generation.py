"""One HTTP request's engine requests: submitted, merged, measured, and aborted if left unfinished.

A completions request with several prompts becomes several engine requests; each is pumped by its
own task into one asyncio queue, so the handler reads a single stream of `(prompt index, output)`.
The engine pushes outputs from its own thread; nothing here polls or touches the device.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

from jaxserve.beam_search import BeamSearchParams
from jaxserve.engine.multimodal import media_data
from jaxserve.engine.prompt_embeds import is_embeds
from jaxserve.outputs import RequestOutput
from jaxserve.pooling_params import PoolingParams
from jaxserve.sampling_params import SamplingParams
from server.beam import beam_search_output
from server.responses import usage
from server.state import ServerState

logger = logging.getLogger("jaxserve.server")
requests_logger = logging.getLogger("jaxserve.server.requests")  # (`--enable-log-requests`, `--enable-log-outputs`)


def _cut(value: Any, limit: int | None) -> Any:
    """Text or token ids, at most `limit` long (None: all)."""
    return value if limit is None or value is None else value[:limit]


def log_request(job: Job, limit: int | None, lora: str | None) -> None:
    """One engine request's submission, as vLLM logs it: its prompt's text and token ids, its parameters."""
    ids = None if is_embeds(job.prompt_ids) else _cut(list(job.prompt_ids), limit)
    embeds = f", prompt_embeds shape: {tuple(job.prompt_ids.shape)}" if is_embeds(job.prompt_ids) else ""
    requests_logger.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s%s, lora_request: %s.",
                         job.engine_id, _cut(job.prompt_text, limit), job.params, ids, embeds, lora)


def log_outputs(job: Job, out: Any, limit: int | None) -> None:
    """A finished engine request's outputs: each completion's text, token ids and finish reason."""
    if not isinstance(out, RequestOutput):  # (an embedding's output: nothing to show)
        requests_logger.info("Finished request %s.", job.engine_id)
        return
    for c in out.outputs:
        requests_logger.info("Generated response %s (completion %d): output: %r, output_token_ids: %s, "
                             "finish_reason: %s", job.engine_id, c.index, _cut(c.text, limit),
                             _cut(list(c.token_ids), limit), c.finish_reason)


@dataclasses.dataclass(frozen=True)
class Job:
    """One engine request: its id, prompt ids (or embeddings [N, E], `prompt_embeds`), prompt text (for echo) and
    sampling parameters; with `beam`, a beam search (server/beam.py) whose engine requests are the beams' steps."""

    engine_id: str
    prompt_ids: Any
    prompt_text: str | None
    params: SamplingParams | PoolingParams
    beam: BeamSearchParams | None = None
    images: list[Any] | None = None  # its images, read (`multimodal.ImageSpec.load`), for an image-text engine

    @property
    def token_ids(self) -> list[int]:
        """Its prompt's token ids, as a response reports them (a prompt of embeddings has none)."""
        return [] if is_embeds(self.prompt_ids) else list(self.prompt_ids)


def generated_tokens(out: Any) -> int:
    """Tokens an output's completions hold; an embedding's output holds none."""
    return sum(len(c.token_ids) for c in out.outputs) if isinstance(out, RequestOutput) else 0


class ClientDisconnected(Exception):
    """The client went away before its response was complete."""


async def wait_disconnect(receive: Any) -> None:
    """Return when the ASGI server reports that the client disconnected."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def race_disconnect(receive: Any, awaitable: Any) -> Any:
    """Await `awaitable`, or cancel it and raise `ClientDisconnected` if the client goes first."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(wait_disconnect(receive))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientDisconnected()


class Generation:
    """Runs `jobs` on the engine; `next()` yields `(job index, cumulative output)` until all finish."""

    def __init__(self, state: ServerState, jobs: list[Job], *, priority: int, cache_salt: str | None,
                 arrival: float, log: dict[str, Any], lora: str | None = None):
        self._state = state
        self._engine = state.engine
        self.jobs = jobs
        self.latest: list[RequestOutput | None] = [None] * len(jobs)
        self._finished = [False] * len(jobs)
        self._queue: asyncio.Queue = asyncio.Queue()
        self._arrival = arrival
        self._log = log
        self._tokens = [0] * len(jobs)
        self._last_time = [arrival] * len(jobs)
        self._ttft: list[float | None] = [None] * len(jobs)
        self._closed = False
        self._lora = {"lora_request": lora} if lora else {}  # a LoRA adapter's name
        config = state.config
        for job in jobs:
            state.start(job.engine_id)
            if config.enable_log_requests:
                log_request(job, config.max_log_len, lora)
        self._tasks = [asyncio.ensure_future(self._pump(i, job, priority, cache_salt))
                       for i, job in enumerate(jobs)]

    async def _pump(self, i: int, job: Job, priority: int, cache_salt: str | None) -> None:
        images = {"multi_modal_data": media_data(job.images)} if job.images else {}
        if job.beam is not None:  # each beam step's requests take the images along (encoded once, cached)
            try:
                self._queue.put_nowait((i, await beam_search_output(
                    self._engine, job.engine_id, job.prompt_ids, job.params, job.beam, priority=priority,
                    cache_salt=cache_salt, **self._lora, **images)))
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self._queue.put_nowait((i, e))
            return
        outputs = self._engine.generate(job.prompt_ids, job.params, job.engine_id, priority=priority,
                                        cache_salt=cache_salt, **self._lora, **images)
        try:
            async for out in outputs:
                self._queue.put_nowait((i, out))
                if out.finished:
                    return
            self._queue.put_nowait((i, RuntimeError(f"engine request {job.engine_id} ended unfinished")))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # handed to the reader, which decides what the client sees
            self._queue.put_nowait((i, e))
        finally:
            await outputs.aclose()

    @property
    def done(self) -> bool:
        """Whether every job has finished (or failed)."""
        return all(self._finished)

    async def next(self) -> tuple[int, RequestOutput] | None:
        """The next output of any job; None once all have finished. Re-raises a job's error."""
        if self.done:
            return None
        i, item = await self._queue.get()
        if isinstance(item, BaseException):
            self._end(i)
            raise item
        self.latest[i] = item
        self._observe(i, item)
        if item.finished:
            self._end(i)
        return i, item

    async def first(self) -> tuple[int, RequestOutput]:
        """The first output (raises the engine's ValueError for a request it refuses)."""
        item = await self.next()
        assert item is not None
        return item

    async def collect(self) -> list[RequestOutput]:
        """Run to the end; the final output of each job."""
        while await self.next() is not None:
            pass
        return [out for out in self.latest if out is not None]

    def _observe(self, i: int, out: RequestOutput) -> None:
        now = time.time()
        total = generated_tokens(out)
        new = total - self._tokens[i]
        if new > 0:
            if self._ttft[i] is None:
                self._ttft[i] = now - self._arrival
                self._log.setdefault("ttft_s", round(self._ttft[i], 4))
            else:
                self._state.metrics.observe_tokens(now - self._last_time[i], new)
            self._tokens[i], self._last_time[i] = total, now
        if out.finished:
            self._state.metrics.observe_finished(out, self._ttft[i], now - self._arrival)
            if self._state.config.enable_log_outputs:
                log_outputs(self.jobs[i], out, self._state.config.max_log_len)

    def _end(self, i: int) -> None:
        if not self._finished[i]:
            self._finished[i] = True
            self._state.finish(self.jobs[i].engine_id)

    def usage(self) -> dict[str, Any]:
        """OpenAI's `usage` object so far; with predicted outputs, `completion_tokens_details` counts the tokens
        taken from them and the rest of them."""
        counts = usage(*self.usage_counts())
        outs = [c for out in self.latest if isinstance(out, RequestOutput) for c in out.outputs
                if c.accepted_prediction_tokens is not None]
        if outs:
            counts["completion_tokens_details"] = {
                "accepted_prediction_tokens": sum(c.accepted_prediction_tokens for c in outs),
                "rejected_prediction_tokens": sum(c.rejected_prediction_tokens for c in outs)}
        return counts

    def usage_counts(self) -> tuple[int, int, int]:
        """(prompt tokens, generated tokens, cached prompt tokens) so far."""
        prompt = completion = cached = 0
        for job, out in zip(self.jobs, self.latest, strict=True):
            prompt += len(job.prompt_ids)
            if out is not None:
                completion += generated_tokens(out)
                cached += out.metrics.num_cached_tokens if out.metrics is not None else 0
        return prompt, completion, cached

    async def close(self) -> None:
        """Abort whatever has not finished and release it; safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for i, job in enumerate(self.jobs):
            if not self._finished[i]:
                self._log["aborted"] = True
                try:
                    await self._engine.abort(job.engine_id)
                except Exception:
                    logger.exception("aborting %s failed", job.engine_id)
                self._end(i)
        p, c, cached = self.usage_counts()
        self._log.update(prompt_tokens=p, completion_tokens=c, cached_tokens=cached)
