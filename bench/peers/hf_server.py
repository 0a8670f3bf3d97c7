"""A plain HF transformers baseline behind a minimal OpenAI-compatible API, for `jaxserve bench serve`.

What users get with transformers alone: static batches through `model.generate`. Waiting requests are
taken together (up to `--max-batch-size`, after waiting `--batch-wait-ms` for more to arrive), left
padded, and generated in one `generate` call; a request arriving meanwhile waits for the next batch.
Tokens stream to each client as `generate` produces them (a streamer that splits the batch by row).
`ignore_eos`/`min_tokens` map to `min_new_tokens`, so output lengths can be forced as for the others.

    python bench/peers/hf_server.py --model DIR --port 8002 --threads 2 --dtype float32

DIR is an HF model directory (`jaxserve convert --to-hf DIR` writes one from the bundled GGUF).
Loopback only: it binds 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

_DONE = object()


@dataclass
class _Job:
    prompt_ids: list[int]
    max_tokens: int
    min_tokens: int
    temperature: float
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    generated: list[int] = field(default_factory=list)


class _RowStreamer:
    """A `generate` streamer that hands each row's new token to its job (the first put is the prompt)."""

    def __init__(self, jobs: list[_Job]):
        self.jobs = jobs
        self.seen_prompt = False

    def put(self, value) -> None:
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        tokens = value.reshape(len(self.jobs), -1)  # [B, k]
        for job, row in zip(self.jobs, tokens.tolist(), strict=True):
            for tok in row:
                if len(job.generated) < job.max_tokens:
                    job.generated.append(int(tok))
                    job.loop.call_soon_threadsafe(job.out.put_nowait, int(tok))

    def end(self) -> None:
        for job in self.jobs:
            job.loop.call_soon_threadsafe(job.out.put_nowait, _DONE)


class HFBatcher:
    """Runs `model.generate` over static batches of waiting jobs, in one worker thread."""

    def __init__(self, model: Any, tokenizer: Any, max_batch_size: int, batch_wait_s: float):
        self.model, self.tokenizer = model, tokenizer
        self.max_batch_size, self.batch_wait_s = max_batch_size, batch_wait_s
        self.jobs: queue.Queue[_Job] = queue.Queue()
        self.eos = tokenizer.eos_token_id
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos
        threading.Thread(target=self._run, name="hf-batcher", daemon=True).start()

    def _run(self) -> None:
        while True:
            batch = [self.jobs.get()]
            deadline = time.monotonic() + self.batch_wait_s
            while len(batch) < self.max_batch_size:
                left = deadline - time.monotonic()
                try:
                    batch.append(self.jobs.get(timeout=max(left, 0)) if left > 0 else self.jobs.get_nowait())
                except queue.Empty:
                    break
            try:
                self._generate(batch)
            except Exception as e:  # the batch fails; the server goes on
                for job in batch:
                    job.loop.call_soon_threadsafe(job.out.put_nowait, e)

    def _generate(self, batch: list[_Job]) -> None:
        import torch

        width = max(len(j.prompt_ids) for j in batch)
        ids = torch.full((len(batch), width), self.pad, dtype=torch.long)  # [B, L], left padded
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, j in enumerate(batch):
            ids[i, width - len(j.prompt_ids):] = torch.tensor(j.prompt_ids)
            mask[i, width - len(j.prompt_ids):] = 1
        greedy = all(j.temperature == 0 for j in batch)
        streamer = _RowStreamer(batch)
        with torch.inference_mode():
            self.model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=max(j.max_tokens for j in batch),
                min_new_tokens=min(j.min_tokens for j in batch), do_sample=not greedy,
                temperature=None if greedy else max(j.temperature for j in batch), top_p=None, top_k=None,
                pad_token_id=self.pad, streamer=streamer,
            )
        streamer.end()


def build_app(batcher: HFBatcher, model_name: str):
    """The Starlette app: /health, /v1/models, /v1/completions, /v1/chat/completions (streamed or not)."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    tok = batcher.tokenizer

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "hf"}]})

    async def complete(request: Request) -> Response:
        body = await request.json()
        chat = request.url.path.endswith("/chat/completions")
        if chat:
            ids = tok.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
        else:
            ids = tok.encode(body["prompt"], add_special_tokens=False)
        max_tokens = int(body.get("max_tokens") or 16)
        min_tokens = max_tokens if body.get("ignore_eos") else int(body.get("min_tokens") or 0)
        job = _Job(list(ids), max_tokens, min_tokens, float(body.get("temperature", 1.0)),
                   asyncio.get_running_loop(), asyncio.Queue())
        batcher.jobs.put(job)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"

        def usage() -> dict:
            n = len(job.generated)
            return {"prompt_tokens": len(job.prompt_ids), "completion_tokens": n,
                    "total_tokens": len(job.prompt_ids) + n}

        async def tokens():
            while True:
                item = await job.out.get()
                if item is _DONE:
                    return
                if isinstance(item, Exception):
                    raise item
                yield item

        if not body.get("stream"):
            async for _ in tokens():
                pass
            text = tok.decode(job.generated, skip_special_tokens=True)
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}} if chat
                      else {"index": 0, "text": text})
            choice["finish_reason"] = "length" if len(job.generated) >= max_tokens else "stop"
            return JSONResponse({"id": rid, "object": kind, "created": created, "model": model_name,
                                 "choices": [choice], "usage": usage()})

        def chunk(text: str, finish: str | None = None) -> str:
            c = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
            c["finish_reason"] = finish
            obj = {"id": rid, "object": f"{kind}.chunk" if chat else kind, "created": created,
                   "model": model_name, "choices": [c]}
            return f"data: {json.dumps(obj)}\n\n"

        async def events():
            sent = ""
            async for _ in tokens():
                # Decode the whole output each time so multi-byte characters come out whole.
                text = tok.decode(job.generated, skip_special_tokens=True)
                if text.endswith("\ufffd"):
                    continue
                delta, sent = text[len(sent):], text
                if delta:
                    yield chunk(delta)
            finish = "length" if len(job.generated) >= max_tokens else "stop"
            yield chunk("", finish)
            if (body.get("stream_options") or {}).get("include_usage"):
                obj = {"id": rid, "object": f"{kind}.chunk" if chat else kind, "created": created,
                       "model": model_name, "choices": [], "usage": usage()}
                yield f"data: {json.dumps(obj)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[
        Route("/health", health), Route("/v1/models", models),
        Route("/v1/completions", complete, methods=["POST"]),
        Route("/v1/chat/completions", complete, methods=["POST"]),
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF model directory")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--port", type=int, default=8002)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--batch-wait-ms", type=float, default=20.0,
                   help="how long the first waiting request waits for others to join its batch")
    ns = p.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if ns.threads:
        torch.set_num_threads(ns.threads)
    tokenizer = AutoTokenizer.from_pretrained(ns.model)
    model = AutoModelForCausalLM.from_pretrained(ns.model, dtype=getattr(torch, ns.dtype))
    model.eval()
    batcher = HFBatcher(model, tokenizer, ns.max_batch_size, ns.batch_wait_ms / 1000.0)
    name = ns.served_model_name or ns.model.rstrip("/").split("/")[-1]
    print(f"hf baseline: {name} ({ns.dtype}, {torch.get_num_threads()} threads, batches of up to "
          f"{ns.max_batch_size}) on http://127.0.0.1:{ns.port}", flush=True)
    from hypercorn.asyncio import serve
    from hypercorn.config import Config

    cfg = Config()
    cfg.bind = [f"127.0.0.1:{ns.port}"]
    cfg.accesslog = None
    asyncio.run(serve(build_app(batcher, name), cfg))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
