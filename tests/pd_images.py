"""Prefill/decode disaggregation of a chat with images, for the image-text models' tests."""

from __future__ import annotations

import time
from typing import Any


def pd_chat_with_images(args: Any, images: list, min_imported: int, max_tokens: int) -> None:
    """Serve a chat whose message holds `images` through a router, one prefill and one decode worker of `args`
    (`EngineArgs`): the prefill worker's pages go under the ids its prefix cache keys them by (each image's by its
    content), the decode worker's admission of the same request finds them all (at least `min_imported` tokens), its
    engine encodes no image and its server encodes none ahead; the reply and its logprobs equal an aggregated
    worker's."""
    import httpx

    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.engine.model_loading import load_model
    from router.app import build_router_app
    from router.config import RouterConfig
    from server.config import ServerConfig
    from server.runner import ServerThread, serve_in_thread
    from tests.test_engine_images import png_url

    # Two loads: engines of one load share its embeddings cache (a data-parallel engine's replicas).
    engines = [AsyncEngine(LLMEngine(args, loaded=load_model(args, progress=False), progress=False)) for _ in range(2)]
    servers = [serve_in_thread(e, ServerConfig(port=0)) for e in engines]
    router = ServerThread(build_router_app(RouterConfig(
        port=0, prefill_workers=(servers[0].url,), decode_workers=(servers[1].url,), probe_interval_s=0.1,
        pd_min_uncached_tokens=16)), "127.0.0.1", 0).start()
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_url(a)}}
                                                      for a in images] + [{"type": "text", "text": "t40 t41"}]}],
            "max_tokens": max_tokens, "temperature": 0, "logprobs": True}
    try:
        with httpx.Client(base_url=router.url, timeout=120) as client:
            deadline = time.monotonic() + 10
            while client.get("/ready").status_code != 200 and time.monotonic() < deadline:
                time.sleep(0.05)
            split = client.post("/v1/chat/completions", json=body, headers={"x-request-id": "pd-image"})
            assert split.status_code == 200, split.text
            assert split.headers["x-jaxserve-worker"] == servers[1].url
            records = client.get("/v1/requests/pd-image/trace").json()["records"]
        imported = next(r for r in records if r["event"] == "imported")["data"]
        scheduled = next(r for r in records if r["event"] == "scheduled" and r["where"] == servers[1].url)["data"]
        assert imported["tokens"] >= min_imported and scheduled["prefix_hit_tokens"] == imported["tokens"]
        decode = engines[1].engine.images
        assert decode.cache_queries == 0 and len(decode.cache) == 0
        aggregated = httpx.post(servers[0].url + "/v1/chat/completions", json=body, timeout=120).json()
        got, want = split.json()["choices"][0], aggregated["choices"][0]
        assert got["message"] == want["message"]
        for a, b in zip(got["logprobs"]["content"], want["logprobs"]["content"], strict=True):
            assert a["token"] == b["token"] and abs(a["logprob"] - b["logprob"]) < 1e-4
        for e in engines:
            e.check_integrity()
    finally:
        router.stop()
        for s, e in zip(servers, engines, strict=True):
            s.stop()
            e.shutdown()
