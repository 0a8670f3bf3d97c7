"""Sleep mode and weight updates (jaxserve.engine.memory): the device arrays freed and taken back, the same
tokens after waking, new weights equal to an engine started on them (with nothing recompiled), the
refusals, and the HTTP endpoints."""

from __future__ import annotations

import os

import httpx
import jax
import numpy as np
import pytest

pytest.importorskip("torch")

from jaxserve.engine.async_engine import AsyncEngine  # noqa: E402
from jaxserve.engine.errors import EngineError  # noqa: E402
from jaxserve.engine.llm_engine import LLMEngine  # noqa: E402
from jaxserve.engine.memory import EngineBusyError, EngineSleepingError, check_same_layout  # noqa: E402
from jaxserve.engine_args import EngineArgs  # noqa: E402
from jaxserve.llm import LLM  # noqa: E402
from jaxserve.sampling_params import SamplingParams  # noqa: E402
from server.config import ServerConfig  # noqa: E402
from server.runner import serve_in_thread  # noqa: E402
from tests.fake_model import save_fake_tokenizer  # noqa: E402
from tests.modelrun import drain  # noqa: E402
from tests.test_model_families import save_tiny_hf  # noqa: E402

VOCAB = 64
ARGS = dict(max_num_batched_tokens=32, max_num_seqs=4, max_model_len=96, kv_cache_memory_bytes=1 << 21,
            compile_cache_dir=None, enable_sleep_mode=True)
PROMPT = list(range(3, 40))
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)


def _checkpoint(path: str, seed: int, **overrides) -> str:
    save_tiny_hf("LlamaConfig", path, seed=seed, vocab_size=VOCAB, tie_word_embeddings=False, **overrides)
    save_fake_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """The served checkpoint, another of the same shapes (a trainer's next weights), one of other shapes."""
    root = tmp_path_factory.mktemp("sleep")
    return (_checkpoint(str(root / "a"), 0), _checkpoint(str(root / "b"), 1),
            _checkpoint(str(root / "wide"), 2, intermediate_size=128))


@pytest.fixture(scope="module")
def engine(ckpts):
    return LLMEngine(EngineArgs(model=ckpts[0], **ARGS), progress=False)


def _run(engine, prompt=PROMPT) -> tuple[list[int], list[float]]:
    engine.add_request("r", prompt, GREEDY)
    out = drain(engine)["r"].outputs[0]
    return list(out.token_ids), [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs, strict=True)]


@pytest.fixture(scope="module")
def reference(ckpts, engine):
    """Each checkpoint's tokens and logprobs, from an engine started on it."""
    other = LLMEngine(EngineArgs(model=ckpts[1], **ARGS), progress=False)
    return {"a": _run(engine), "b": _run(other)}


def _arrays(engine) -> list[jax.Array]:
    return jax.tree.leaves(engine.runner.params) + jax.tree.leaves(engine.runner.kv)


def test_sleep_frees_the_device_arrays_and_waking_serves_as_before(engine, reference):
    assert _run(engine) == reference["a"]
    assert engine.scheduler.cache.num_cached_pages > 0
    held = _arrays(engine)
    engine.memory.sleep(level=1)
    assert all(x.is_deleted() for x in held), "weights and KV pages freed on the device"
    assert engine.memory.asleep and engine.scheduler.cache.num_cached_pages == 0
    with pytest.raises(EngineSleepingError, match="sleeping"):
        engine.add_request("x", PROMPT, GREEDY)
    engine.memory.wake_up(["weights"])
    assert engine.memory.asleep, "the KV cache is still off the device"
    engine.memory.wake_up(["kv_cache"])
    assert not engine.memory.asleep
    tokens, logprobs = _run(engine)
    assert tokens == reference["a"][0] and np.allclose(logprobs, reference["a"][1], atol=1e-6)
    assert engine.runner.compilations_after_warmup == 0, "the same layouts: nothing recompiled"


def test_level_two_drops_the_weights_and_reads_them_again(engine, reference):
    engine.memory.sleep(level=2)
    assert engine.memory.weights == "discarded" and all(x.is_deleted() for x in jax.tree.leaves(engine.model.params))
    engine.memory.wake_up()
    tokens, logprobs = _run(engine)
    assert tokens == reference["a"][0] and np.allclose(logprobs, reference["a"][1], atol=1e-6)


def test_new_weights_serve_as_an_engine_started_on_them(engine, ckpts, reference):
    _run(engine)  # the prefix cache holds the old weights' KV of the prompt
    engine.memory.load_weights(ckpts[1])
    tokens, logprobs = _run(engine)
    assert tokens == reference["b"][0] and np.allclose(logprobs, reference["b"][1], atol=1e-5)
    assert engine.runner.compilations_after_warmup == 0
    # Asleep, the trainer's weights loaded in place of the dropped ones, then the KV cache back.
    engine.memory.sleep(level=2)
    engine.memory.load_weights(ckpts[0])
    assert engine.memory.asleep and not engine.memory.kv_on_device
    engine.memory.wake_up(["kv_cache"])
    tokens, logprobs = _run(engine)
    assert tokens == reference["a"][0] and np.allclose(logprobs, reference["a"][1], atol=1e-5)


def test_tensors_in_memory_load_as_their_checkpoint_does(engine, ckpts, reference):
    """A trainer in the same process hands its tensors over, named as in an HF checkpoint."""
    from safetensors.numpy import load_file

    from jaxserve.loader import CheckpointError

    tensors = load_file(os.path.join(ckpts[1], "model.safetensors"))
    engine.memory.load_weights({name: jax.numpy.asarray(t) for name, t in tensors.items()})
    tokens, logprobs = _run(engine)
    assert tokens == reference["b"][0] and np.allclose(logprobs, reference["b"][1], atol=1e-5)
    assert engine.runner.compilations_after_warmup == 0
    with pytest.raises(CheckpointError, match="missing 1 tensor"):
        engine.memory.load_weights([(n, t) for n, t in tensors.items() if n != "lm_head.weight"])
    wide = load_file(os.path.join(ckpts[2], "model.safetensors"))
    with pytest.raises(CheckpointError, match="shape"):
        engine.memory.load_weights(wide)
    engine.memory.load_weights(load_file(os.path.join(ckpts[0], "model.safetensors")).items())
    assert _run(engine)[0] == reference["a"][0]


def test_refusals_name_the_problem_and_change_nothing(engine, ckpts, reference):
    with pytest.raises(ValueError, match="served model's configuration"):
        engine.memory.load_weights(ckpts[2])
    with pytest.raises(ValueError, match="level must be 1"):
        engine.memory.sleep(level=3)
    with pytest.raises(ValueError, match="unknown wake-up tags"):
        engine.memory.wake_up(["weight"])
    engine.add_request("busy", PROMPT, GREEDY)
    engine.step()
    with pytest.raises(EngineBusyError, match="1 request"):
        engine.memory.sleep()
    with pytest.raises(EngineBusyError, match="in flight"):
        engine.memory.load_weights()
    drain(engine)
    assert not engine.memory.asleep and _run(engine) == reference["a"]
    plain = LLMEngine(EngineArgs(model=ckpts[0], **{**ARGS, "enable_sleep_mode": False, "warmup": False}),
                      progress=False)
    with pytest.raises(EngineError, match="enable_sleep_mode"):
        plain.memory.sleep()


def test_the_python_api(ckpts, reference):
    llm = LLM(ckpts[0], **{**ARGS, "warmup": False}, progress=False)
    first = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    llm.sleep(level=1)
    assert llm.is_sleeping()
    llm.wake_up()
    assert not llm.is_sleeping()
    assert llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == first == reference["a"][0]
    llm.load_weights(ckpts[1])
    assert llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == reference["b"][0]
    assert llm.reset_prefix_cache() is True


def test_the_asyncio_api(engine, reference):
    import asyncio

    served = AsyncEngine(engine)

    async def run() -> list[int]:
        await served.sleep(1)
        asleep = await served.is_sleeping()
        await served.wake_up()
        assert asleep and not await served.is_sleeping() and await served.reset_prefix_cache()
        outs = [out async for out in served.generate(PROMPT, GREEDY, request_id="async")]
        return list(outs[-1].outputs[0].token_ids)

    try:
        assert asyncio.run(run()) == reference["a"][0]
    finally:
        served.shutdown()


def test_a_layout_that_differs_is_named():
    a = {"w": jax.numpy.zeros((2, 3)), "b": jax.numpy.zeros(3)}
    check_same_layout(a, a)
    with pytest.raises(ValueError, match=r"\['w'\] is float32\[2, 4\]"):
        check_same_layout({**a, "w": jax.numpy.zeros((2, 4))}, a)
    with pytest.raises(ValueError, match="not laid out as the engine's"):
        check_same_layout({"w": a["w"]}, a)


def test_sleep_and_weight_updates_over_http(engine, ckpts, reference):
    served = AsyncEngine(engine)
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}

    def complete(url):
        return httpx.post(f"{url}/v1/completions", json=body, timeout=60)

    try:
        with serve_in_thread(served, ServerConfig(port=0)) as srv:
            url = srv.url
            before = complete(url).json()["choices"][0]["token_ids"]
            assert before == reference["a"][0]
            assert httpx.post(f"{url}/sleep?level=1", timeout=60).status_code == 200
            assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": True}
            r = complete(url)
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_sleeping"
            assert httpx.post(f"{url}/sleep?level=5").status_code == 400
            assert httpx.post(f"{url}/wake_up", timeout=60).status_code == 200
            assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": False}
            assert complete(url).json()["choices"][0]["token_ids"] == before
            r = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": ckpts[1]}, timeout=120)
            assert r.status_code == 200 and r.json()["success"] is True
            assert complete(url).json()["choices"][0]["token_ids"] == reference["b"][0]
            r = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": ckpts[2]}, timeout=120)
            assert r.status_code == 400 and r.json()["error"]["param"] == "model_path"
            assert httpx.post(f"{url}/update_weights_from_disk", json={}, timeout=120).status_code == 200
            assert complete(url).json()["choices"][0]["token_ids"] == before
            assert httpx.post(f"{url}/reset_prefix_cache").status_code == 200
            complete(url)
            assert engine.scheduler.cache.num_cached_pages > 0
            assert httpx.get(f"{url}/flush_cache").status_code == 200
            assert engine.scheduler.cache.num_cached_pages == 0
    finally:
        served.shutdown()
    plain = AsyncEngine(LLMEngine(EngineArgs(model=ckpts[0], **{**ARGS, "enable_sleep_mode": False,
                                                                "warmup": False}), progress=False))
    try:
        with serve_in_thread(plain, ServerConfig(port=0)) as srv:
            r = httpx.post(f"{srv.url}/sleep")
            assert r.status_code == 404 and "--enable-sleep-mode" in r.json()["error"]["message"]
    finally:
        plain.shutdown()
