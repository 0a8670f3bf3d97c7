"""The router and LoRA adapters: adapter requests hashed in their adapter's prefix-cache namespace, as
their worker caches them, and routed where their adapter already runs."""

from __future__ import annotations

import asyncio

import httpx

from jaxserve.engine.kv_events import hash_token_pages
from router.config import CostWeights, RouterConfig
from router.prefix_index import PrefixIndex
from router.workers import parse_metrics


def _router_over(cards: list[dict]):
    """A prefix-policy router over one mocked worker whose `/v1/models` lists `cards`."""
    from router.router import Router

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": cards})
        return httpx.Response(200, text="") if request.url.path in ("/ready", "/metrics") else httpx.Response(404)

    router = Router(RouterConfig(port=0, workers=("http://w0",), policy="prefix"))
    router.pool._client = httpx.AsyncClient(transport=httpx.MockTransport(handle))
    return router


def test_an_adapter_request_is_hashed_in_its_adapter_namespace():
    """A request naming a LoRA adapter (a `/v1/models` entry with a parent) is hashed under the adapter's
    cache namespace, as its worker caches it; the base model's names, and its aliases, are not."""
    from jaxserve.lora_request import lora_cache_salt

    cards = [{"id": "base"}, {"id": "alias", "parent": None}, {"id": "sql", "parent": "base"}]

    router = _router_over(cards)
    ids = list(range(40))

    async def tokens(kind, body, headers):
        return ids

    router.tokenize = tokens

    async def run():
        (worker,) = router.pool.workers.values()
        await router.pool.probe(worker)
        assert worker.healthy and worker.base_models == {"base", "alias"}
        hashes = {}
        for model, salt in (("base", None), ("alias", "t"), ("sql", None), ("sql", "t")):
            body = {"model": model, "prompt": "x", **({"cache_salt": salt} if salt else {})}
            info, _ = await router.route_request("completion", body, {}, {})
            hashes[model, salt] = info.hashes
        await router.pool.stop()
        return hashes

    hashes = asyncio.run(run())
    ps = router.config.page_size
    assert hashes["base", None] == tuple(hash_token_pages(ids[:-1], ps, None))
    assert hashes["alias", "t"] == tuple(hash_token_pages(ids[:-1], ps, "t"))
    assert hashes["sql", None] == tuple(hash_token_pages(ids[:-1], ps, lora_cache_salt("sql")))
    assert hashes["sql", "t"] == tuple(hash_token_pages(ids[:-1], ps, lora_cache_salt("sql", "t")))
    assert len({h[0] for h in hashes.values()}) == 4


def test_lora_requests_gather_where_their_adapter_runs():
    """`vllm:lora_requests_info` is read per worker; a request of an adapter goes where it runs, before an
    idle worker with a free slot, and that before one whose slots all run other adapters (a wait)."""
    from router.policy import Picker, RouteRequest
    from router.workers import Worker

    text = ('vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql,chat",waiting_lora_adapters="x"} 1.7e9\n'
            'vllm:num_requests_running{model_name="m"} 2.0\n')
    assert parse_metrics(text) == {"max_lora": 2, "running_loras": {"sql", "chat"}, "waiting_loras": {"x"},
                                   "num_running": 2.0}
    busy = Worker("http://busy", healthy=True, **parse_metrics(text))  # 2 running
    free = Worker("http://free", healthy=True, num_running=1, max_lora=2, running_loras=frozenset({"chat"}))
    full = Worker("http://full", healthy=True, num_running=0, max_lora=1, running_loras=frozenset({"chat"}))
    picker = Picker(RouterConfig(port=0, policy="prefix"), PrefixIndex())
    sql = picker.pick([full, free, busy], RouteRequest(adapter="sql"))
    assert sql.worker is busy and [c["lora"] for c in sql.candidates] == [1.0, 0.5, 0.0]
    assert picker.pick([full, free], RouteRequest(adapter="sql")).worker is free
    assert picker.pick([busy, full, free], RouteRequest()).worker is full  # the base model: load alone
    assert picker.pick([free, busy], RouteRequest(adapter="x")).worker is busy  # queued there: it will run
    lone = Picker(RouterConfig(port=0, policy="prefix", weights=CostWeights(lora=0.0)), PrefixIndex())
    assert lone.pick([full, free, busy], RouteRequest(adapter="sql")).worker is full


def test_a_long_prompt_of_a_longrope_model_is_hashed_in_its_namespace():
    """A worker serving a LongRoPE model past its original context names that context on its model card; the
    router hashes a longer prompt in the long prompts' cache namespace, as the worker caches it (an adapter's
    namespace wraps it), and a shorter one as any."""
    from jaxserve.lora_request import lora_cache_salt
    from jaxserve.rope import prompt_cache_salt

    cards = [{"id": "phi", "long_rope_context": 24}, {"id": "sql", "parent": "phi"}]

    router = _router_over(cards)
    prompts = {"short": list(range(24)), "long": list(range(40))}

    async def tokens(kind, body, headers):
        return prompts[body["prompt"]]

    router.tokenize = tokens

    async def run():
        (worker,) = router.pool.workers.values()
        await router.pool.probe(worker)
        assert worker.long_rope_context == 24
        hashes = {}
        for model, prompt in (("phi", "short"), ("phi", "long"), ("sql", "long")):
            info, _ = await router.route_request("completion", {"model": model, "prompt": prompt}, {}, {})
            hashes[model, prompt] = info.hashes
        await router.pool.stop()
        return hashes

    hashes = asyncio.run(run())
    ps = router.config.page_size
    long = prompt_cache_salt(24, 40, None)
    assert long is not None
    assert hashes["phi", "short"] == tuple(hash_token_pages(prompts["short"][:-1], ps, None))
    assert hashes["phi", "long"] == tuple(hash_token_pages(prompts["long"][:-1], ps, long))
    assert hashes["sql", "long"] == tuple(hash_token_pages(prompts["long"][:-1], ps, lora_cache_salt("sql", long)))
    assert hashes["phi", "long"][0] != hash_token_pages(prompts["long"][:-1], ps, None)[0]


def test_the_server_card_names_the_long_rope_context_the_router_reads():
    from router.router import Router
    from server.config import ServerConfig
    from server.fake_engine import FakeAsyncEngine
    from server.runner import serve_in_thread

    engine = FakeAsyncEngine(step_delay=0.001)
    engine.long_rope_context = 24
    try:
        with serve_in_thread(engine, ServerConfig(port=0)) as srv:
            card = httpx.get(srv.url + "/v1/models", timeout=10).json()["data"][0]
            assert card["long_rope_context"] == 24
            router = Router(RouterConfig(port=0, workers=(srv.url,), policy="prefix"))

            async def probe():
                (worker,) = router.pool.workers.values()
                await router.pool.probe(worker)
                await router.pool.stop()
                return worker.long_rope_context

            assert asyncio.run(probe()) == 24
    finally:
        engine.shutdown()
