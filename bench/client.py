"""A streaming OpenAI-compatible client that times every chunk, for loopback servers only."""

from __future__ import annotations

import ipaddress
import json
import socket
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import httpx

from bench.metrics import RequestRecord


class NotLoopbackError(ValueError):
    """The benchmark only loads servers on this machine."""


def check_loopback(base_url: str) -> None:
    """Raise NotLoopbackError unless every address `base_url`'s host resolves to is a loopback address."""
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"the base URL must be http(s)://host:port, got {base_url!r}")
    host = parts.hostname
    try:
        addrs = {ipaddress.ip_address(host)}
    except ValueError:
        try:
            infos = socket.getaddrinfo(host, parts.port or 80, proto=socket.IPPROTO_TCP)
        except socket.gaierror as e:
            raise NotLoopbackError(f"cannot resolve {host!r}: {e}") from e
        addrs = {ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos}
    bad = sorted(str(a) for a in addrs if not a.is_loopback)
    if bad or not addrs:
        raise NotLoopbackError(f"{base_url} is not on this machine ({', '.join(bad)}); the benchmark loads "
                               "loopback servers only (127.0.0.1, ::1, localhost)")


def make_client(base_url: str, max_connections: int, timeout_s: float, api_key: str | None = None
                ) -> httpx.AsyncClient:
    """An httpx client for `base_url` (loopback checked) that ignores proxy settings of the environment."""
    check_loopback(base_url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(
        base_url=base_url.rstrip("/"), headers=headers, trust_env=False,
        limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 30.0)),
    )


async def first_model(client: httpx.AsyncClient) -> str:
    """The first model id the server lists at /v1/models."""
    r = await client.get("/v1/models")
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def request_body(model: str, output_len: int, *, prompt: str | None = None, messages: list | None = None,
                 extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """A streaming request whose output length is forced: greedy, `ignore_eos` and `min_tokens`."""
    body: dict[str, Any] = {
        "model": model, "max_tokens": output_len, "min_tokens": output_len, "ignore_eos": True,
        "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
    }
    if messages is not None:
        body["messages"] = messages
    else:
        body["prompt"] = prompt
    body.update(extra or {})
    return body


def _chunk_text(data: dict, chat: bool) -> str:
    choices = data.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    if chat:
        delta = c.get("delta") or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return c.get("text") or ""


async def send_streaming(client: httpx.AsyncClient, body: dict[str, Any], t_zero: float, *,
                         expected_prompt_len: int = 0,
                         count_tokens: Callable[[str], int] | None = None) -> tuple[RequestRecord, str]:
    """Send one streaming request and time it; returns (record, generated text).

    TTFT is taken at the first chunk carrying text, each later text chunk adds an ITL gap, and E2EL
    ends at the last data line. Token counts come from the server's usage chunk when it sends one,
    else from `count_tokens` (or the number of text chunks) and the expected prompt length.
    """
    chat = "messages" in body
    path = "/v1/chat/completions" if chat else "/v1/completions"
    rec = RequestRecord(prompt_len=expected_prompt_len)
    text_parts: list[str] = []
    chunks = 0
    usage = None
    st = time.perf_counter()
    rec.start = st - t_zero
    last = st
    first = True
    try:
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode("utf-8", "replace")[:300]
                rec.error = f"HTTP {resp.status_code}: {detail}"
                rec.latency = time.perf_counter() - st
                return rec, ""
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                now = time.perf_counter()
                data = json.loads(payload)
                if "error" in data and not data.get("choices"):
                    raise RuntimeError(f"error event: {str(data['error'])[:300]}")
                if data.get("usage"):
                    usage = data["usage"]
                text = _chunk_text(data, chat)
                if text:
                    if first:
                        rec.ttft = now - st
                        first = False
                    else:
                        rec.itl.append(now - last)
                    last = now
                    chunks += 1
                    text_parts.append(text)
                if data.get("choices") or text:
                    last_event = now
                    rec.latency = last_event - st
        text = "".join(text_parts)
        if first:
            rec.error = "the stream carried no text"
            return rec, text
        if usage and usage.get("completion_tokens") is not None:
            rec.output_len = int(usage["completion_tokens"])
        else:
            rec.output_len = count_tokens(text) if count_tokens else chunks
        if usage and usage.get("prompt_tokens") is not None:
            rec.prompt_len = int(usage["prompt_tokens"])
        details = (usage or {}).get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            rec.cached_tokens = int(details["cached_tokens"])
        rec.latency = max(rec.latency, rec.ttft)
        rec.success = True
        return rec, text
    except Exception as e:  # every failure is recorded; the run goes on
        rec.error = f"{type(e).__name__}: {e}"[:300]
        rec.latency = time.perf_counter() - st
        return rec, ""
