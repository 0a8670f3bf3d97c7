"""A model-free engine with `AsyncEngine`'s interface whose outputs can be worked out by hand.

The fake "model" knows a small vocabulary of number words. Completion `j` of a greedy request emits
`WORDS[j], WORDS[j + 1], ...` (so "one two three ..." for the first completion), then the EOS token
after `len(WORDS)` words unless `ignore_eos`. A sampled request (temperature > 0) starts at an offset
drawn from its seed. Each generated token has logprob -0.25 at rank 1; the i-th next most likely
token is the following word, with logprob -0.25 - i.

A test can script replies instead: `scripted_reply(prompt_text)` returns the text a request's
completions write (each step adds `SCRIPT_PIECE` characters of it, as one token, and the reply ends
with "stop"), or None for the number words.

Like the real engine it runs its loop in its own thread and hands each step's cumulative
`RequestOutput` to the asyncio side through a queue, so the server is exercised as it will be in
production: outputs are pushed, never polled.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence

import tokenizers
from tokenizers import AddedToken, models, pre_tokenizers

from jaxserve.engine.request_state import EngineStats
from jaxserve.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestMetrics,
    RequestOutput,
    TokenLogprobs,
    token_logprobs,
)
from jaxserve.pooling_params import PoolingParams
from jaxserve.sampling_params import SamplingParams
from jaxserve.tokenizer import Tokenizer

WORDS = ("one two three four five six seven eight nine ten "
         "eleven twelve thirteen fourteen fifteen sixteen").split()
SPECIALS = ("<unk>", "<|im_start|>", "<|im_end|>")
EXTRA_WORDS = ("user", "assistant", "system", "hello", "world", "explode")
FIRST_WORD_ID = len(SPECIALS)
EOS_ID = 2
FAIL_WORD = "explode"
"""A prompt containing this word fails inside the fake engine after two tokens."""
SCRIPT_PIECE = 3
"""Characters of a scripted reply added per step."""

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def fake_tokenizer() -> Tokenizer:
    """A whitespace word-level tokenizer over the fake vocabulary, with a ChatML chat template."""
    vocab = {t: i for i, t in enumerate((*SPECIALS, *WORDS, *EXTRA_WORDS))}
    backend = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    return Tokenizer(backend, bos_token_id=1, eos_token_ids=[EOS_ID], unk_token_id=0,
                     chat_templates={"default": CHATML})


def _engine_error(message: str) -> RuntimeError:
    try:
        from jaxserve.engine.errors import EngineError
    except ImportError:  # the real engine's error type is not there yet
        return RuntimeError(message)
    return EngineError(message)


def zero_engine_stats(*, num_pages: int = 0, page_size: int = 0) -> EngineStats:
    """The real engine's `EngineStats` with every counter at zero, for a pool of `num_pages` pages."""
    # Every field named: a new EngineStats field without a default must be given its fake value here.
    return EngineStats(
        num_running=0,
        num_waiting=0,
        kv_cache_usage=0.0,
        num_pages=num_pages,
        page_size=page_size,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
        num_preemptions=0,
        prompt_tokens=0,
        generation_tokens=0,
        compilations_after_warmup=0,
        step_time_s=0.0,
        num_steps=0,
    )



@dataclasses.dataclass
class _Seq:
    index: int
    offset: int
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Req:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    seqs: list[_Seq]
    metrics: RequestMetrics
    fail: bool
    script: str | None = None


def replies_by_last_word(replies: Mapping[str, str]) -> Callable[[str], str | None]:
    """A `scripted_reply` that answers `replies[w]` to a prompt whose last word (the chat template's role words
    left out) is `w`, and generates words otherwise."""
    def reply(prompt: str) -> str | None:
        words = [w for w in prompt.split() if w not in ("system", "assistant")]
        return replies.get(words[-1]) if words else None
    return reply


def _word_logprobs(tid: int, start: int, n: int) -> TokenLogprobs:
    """A generated token's logprobs: itself at -0.25 (rank 1), and the `n` words from WORDS[start] on at
    -0.25 - i."""
    top = [FIRST_WORD_ID + (start + i) % len(WORDS) for i in range(n)]
    return token_logprobs(tid, -0.25, 1, top, [-0.25 - i for i in range(n)])


class FakeAsyncEngine:
    """`AsyncEngine`'s interface over the fake word model (see the module docstring)."""

    def __init__(self, *, max_model_len: int = 256, max_num_seqs: int = 64, step_delay: float = 0.002,
                 num_pages: int = 256, page_size: int = 16, ready: bool = True,
                 model_name: str = "fake-model", scripted_reply: Callable[[str], str | None] | None = None):
        self.tokenizer = fake_tokenizer()
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.is_ready = ready
        self.max_num_seqs = max_num_seqs
        self.scripted_reply = scripted_reply
        self.step_delay = step_delay
        self.aborted: list[str] = []
        self.submitted: list[tuple[str, list[int], SamplingParams, int, str | None]] = []
        self._num_pages, self._page_size = num_pages, page_size
        self._cond = threading.Condition()
        self._waiting: list[_Req] = []
        self._running: list[_Req] = []
        self._paused = False
        self._stop = False
        self._seen_prompts: set[tuple[int, ...]] = set()
        self._stats = zero_engine_stats(num_pages=num_pages, page_size=page_size)
        self._thread = threading.Thread(target=self._loop, name="fake-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, args: object, start: bool = True) -> FakeAsyncEngine:
        """Build a fake engine; `args.max_model_len` is honoured when set."""
        max_len = getattr(args, "max_model_len", None)
        return cls(max_model_len=max_len or 256)

    # ----- test controls -----

    def pause(self) -> None:
        """Stop scheduling: new requests stay waiting until `resume`."""
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        """Undo `pause`."""
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    # ----- the engine interface -----

    async def generate(self, prompt: str | list[int], sampling_params: SamplingParams, request_id: str, *,
                       priority: int = 0, cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield cumulative outputs of `request_id`; the last has `finished=True`. `PoolingParams` get one
        output: an 8-value embedding that is a function of the prompt's ids."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        if isinstance(sampling_params, PoolingParams):
            self.submitted.append((request_id, ids, sampling_params, priority, cache_salt))
            vec = [math.sin(sum(ids) * (k + 1)) for k in range(8)]
            yield EmbeddingRequestOutput(request_id, None, ids, EmbeddingOutput(vec), True,
                                         RequestMetrics(arrival_time=time.time()))
            return
        max_tokens = sampling_params.max_tokens
        if max_tokens is None:
            max_tokens = self.max_model_len - len(ids)
        if len(ids) + max_tokens > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens; the request has "
                f"{len(ids)} prompt tokens and asks for {max_tokens} more")
        self.submitted.append((request_id, ids, sampling_params, priority, cache_salt))
        if sampling_params.is_greedy:
            start = 0
        else:
            start = random.Random(sampling_params.seed).randrange(len(WORDS))
        req = _Req(request_id, ids, dataclasses.replace(sampling_params, max_tokens=max_tokens), priority,
                   asyncio.get_running_loop(), asyncio.Queue(),
                   [_Seq(j, start + j) for j in range(sampling_params.n)],
                   RequestMetrics(arrival_time=time.time()),
                   fail=self.tokenizer.token_to_id(FAIL_WORD) in ids,
                   script=self.scripted_reply(self.tokenizer.decode(ids, False)) if self.scripted_reply else None)
        with self._cond:
            self._waiting.append(req)
            self._cond.notify_all()
        finished = False
        try:
            while True:
                item = await req.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        """Drop `request_id` wherever it is; its pages are freed at once."""
        with self._cond:
            for queue in (self._waiting, self._running):
                for req in list(queue):
                    if req.request_id == request_id:
                        queue.remove(req)
                        self.aborted.append(request_id)

    def stats(self) -> EngineStats:
        """A snapshot of the counters."""
        with self._cond:
            used = sum(self._pages(r) for r in self._running)
            return dataclasses.replace(
                self._stats,
                num_running=len(self._running),
                num_waiting=len(self._waiting),
                kv_cache_usage=used / self._num_pages,
            )

    def shutdown(self) -> None:
        """Stop the loop thread."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=5)

    # ----- the loop thread -----

    def _pages(self, req: _Req) -> int:
        return sum(math.ceil((len(req.prompt_ids) + len(s.token_ids)) / self._page_size) for s in req.seqs)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stop and (self._paused or not (self._waiting or self._running)):
                    self._cond.wait()
                if self._stop:
                    return
                self._admit()
                batch = list(self._running)
            t0 = time.perf_counter()
            for req in batch:
                self._step(req)
            with self._cond:
                for req in batch:
                    if req.metrics.finished_time is not None and req in self._running:
                        self._running.remove(req)
                self._stats.num_steps += 1
                self._stats.step_time_s = time.perf_counter() - t0
            time.sleep(self.step_delay)

    def _admit(self) -> None:
        self._waiting.sort(key=lambda r: r.priority)  # stable: FCFS within a priority
        while self._waiting and len(self._running) < self.max_num_seqs:
            req = self._waiting.pop(0)
            key = tuple(req.prompt_ids)
            cached = ((len(key) - 1) // self._page_size) * self._page_size if key in self._seen_prompts else 0
            self._seen_prompts.add(key)
            req.metrics.num_cached_tokens = cached
            req.metrics.first_scheduled_time = time.time()
            self._stats.prefix_cache_queries += len(key)
            self._stats.prefix_cache_hits += cached
            self._stats.prompt_tokens += len(key)
            self._running.append(req)

    def _step(self, req: _Req) -> None:
        p = req.params
        for seq in req.seqs:
            if seq.finish_reason is not None:
                continue
            k = len(seq.token_ids)
            if req.script is not None:
                self._script_step(seq, req.script, p)
                continue
            word = WORDS[(seq.offset + k) % len(WORDS)]
            tid = FIRST_WORD_ID + WORDS.index(word)
            if k == len(WORDS) and not p.ignore_eos and k >= p.min_tokens:
                tid = EOS_ID
            seq.token_ids.append(tid)
            if p.logprobs is not None:
                seq.logprobs.append(_word_logprobs(tid, seq.offset + k, p.logprobs))
            self._stats.generation_tokens += 1
            if tid == EOS_ID:
                seq.finish_reason = "stop"
            elif tid in p.stop_token_ids and k + 1 >= p.min_tokens:
                seq.finish_reason, seq.stop_reason = "stop", tid
            full = self.tokenizer.decode(
                [t for t in seq.token_ids if not (seq.stop_reason == t and not p.include_stop_str_in_output)],
                p.skip_special_tokens)
            seq.text = self._apply_stop(seq, full, p)
            if seq.finish_reason is None and len(seq.token_ids) >= p.max_tokens:
                seq.finish_reason = "length"
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = time.time()
        if req.fail and len(req.seqs[0].token_ids) >= 2:
            self._push(req, _engine_error(f"request {req.request_id} failed inside the fake engine"))
            req.metrics.finished_time = time.time()
            return
        done = all(s.finish_reason is not None for s in req.seqs)
        if done:
            req.metrics.finished_time = time.time()
        self._push(req, RequestOutput(
            request_id=req.request_id, prompt=None, prompt_token_ids=list(req.prompt_ids),
            outputs=[CompletionOutput(s.index, s.text, list(s.token_ids), -0.25 * len(s.token_ids),
                                      list(s.logprobs) if p.logprobs is not None else None,
                                      s.finish_reason, s.stop_reason) for s in req.seqs],
            finished=done, metrics=dataclasses.replace(req.metrics)))

    def _script_step(self, seq: _Seq, script: str, p: SamplingParams) -> None:
        k = len(seq.token_ids)
        seq.token_ids.append(FIRST_WORD_ID + k % len(WORDS))
        if p.logprobs is not None:
            seq.logprobs.append(_word_logprobs(seq.token_ids[-1], k, p.logprobs))
        seq.text = script[: (k + 1) * SCRIPT_PIECE]
        self._stats.generation_tokens += 1
        if len(seq.text) == len(script):
            seq.finish_reason = "stop"
        elif len(seq.token_ids) >= p.max_tokens:
            seq.finish_reason = "length"

    @staticmethod
    def _apply_stop(seq: _Seq, full: str, p: SamplingParams) -> str:
        """Cut `full` at the first stop string, or hold back a tail that may become one."""
        stops: Sequence[str] = p.stop
        hits = [(full.find(s), s) for s in stops if s in full]
        if hits:
            at, s = min(hits)
            seq.finish_reason, seq.stop_reason = "stop", s
            return full[: at + len(s)] if p.include_stop_str_in_output else full[:at]
        hold = 0
        for s in stops:
            for n in range(min(len(s) - 1, len(full)), 0, -1):
                if full.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        return full[: len(full) - hold] if hold and seq.finish_reason is None else full

    def _push(self, req: _Req, item: object) -> None:
        try:
            req.loop.call_soon_threadsafe(req.queue.put_nowait, item)
        except RuntimeError:  # the client's event loop is gone
            pass
