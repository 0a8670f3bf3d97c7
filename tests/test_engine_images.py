"""Images through the engine: a tiny LLaVA model's greedy tokens against transformers', with the prompt's images cut
across prefill chunks, batched against alone, and the prefix cache keyed by image content."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from jaxserve.engine.llm_engine import LLMEngine  # noqa: E402
from jaxserve.engine_args import EngineArgs  # noqa: E402
from jaxserve.images import ImageProcessor  # noqa: E402
from jaxserve.sampling_params import SamplingParams  # noqa: E402
from tests.llava_model import IMAGE_TOKEN, random_image, save_tiny_llava  # noqa: E402
from tests.modelrun import drain  # noqa: E402

NEW_TOKENS = 8
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def text(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(2, IMAGE_TOKEN, n).tolist()


# Prompts with one placeholder per image (the engine expands each to the image's 16 tokens).
PROMPTS = [text(1, 5) + [IMAGE_TOKEN] + text(2, 3) + [IMAGE_TOKEN] + text(3, 4), [IMAGE_TOKEN] + text(4, 6)]
IMAGES = [[random_image(1), random_image(2, (60, 20))], [random_image(3, (33, 33))]]


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    path = tmp_path_factory.mktemp("llava")
    model = save_tiny_llava(path)
    return str(path), model


def hf_greedy(path: str, model, ids: list[int], images) -> list[int]:
    """transformers' greedy tokens (a full forward per token) for a prompt whose placeholders are expanded."""
    n = 16  # tokens per image: 4 x 4 patches of 8 pixels, CLIP's class token dropped
    expanded = [t for i in ids for t in ([i] * n if i == IMAGE_TOKEN else [i])]
    pixels = torch.tensor(np.stack([ImageProcessor.from_dir(path)(im) for im in images]))
    out: list[int] = []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = model(input_ids=torch.tensor([expanded + out]), pixel_values=pixels).logits[0, -1]
            out.append(int(logits.argmax()))
    return out


def engine(path: str, **kw) -> LLMEngine:
    args = EngineArgs(model=path, **{**dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=96, page_size=8,
                                            kv_cache_memory_bytes=2**20, dtype="float32", warmup=False,
                                            compile_cache_dir=None), **kw})
    return LLMEngine(args, progress=False)


def run(eng: LLMEngine, prompts, images, ids=None) -> list[list[int]]:
    ids = ids or [f"r{i}" for i in range(len(prompts))]
    for rid, prompt, ims in zip(ids, prompts, images, strict=True):
        eng.add_request(rid, prompt, GREEDY, multi_modal_data={"image": ims})
    final = drain(eng)
    return [list(final[rid].outputs[0].token_ids) for rid in ids]


def test_engine_images_equal_transformers(llava):
    """Both prompts in one batch, their images cut across 16-token prefill chunks; then each alone."""
    path, model = llava
    expected = [hf_greedy(path, model, p, ims) for p, ims in zip(PROMPTS, IMAGES, strict=True)]
    eng = engine(path, enable_prefix_caching=False)
    assert run(eng, PROMPTS, IMAGES) == expected
    assert run(eng, PROMPTS[1:], IMAGES[1:]) == expected[1:]
    eng.check_integrity()


def test_llava_next_engine_equals_transformers(tmp_path):
    """LLaVA-NeXT: each image's tokens by its size (crops at the best grid, unpadded), two prompts batched and
    chunked, against transformers' greedy tokens."""
    from tests.llava_model import PINPOINTS, TOWERS

    model = save_tiny_llava(tmp_path, anyres=True)
    fields = {k: v for k, v in TOWERS["clip"][2].items() if k != "image_processor_type"}
    hf = __import__("transformers").LlavaNextImageProcessorPil(**fields, image_grid_pinpoints=PINPOINTS)
    eng = engine(str(tmp_path))
    prompts = [[5, IMAGE_TOKEN, 6, 7], [IMAGE_TOKEN, 9, 8]]
    images = [random_image(21, (90, 31)), random_image(22, (30, 64))]
    counts = [eng.images.num_tokens(eng.images.prepare(im)) for im in images]
    # The whole image's 16, then a 1x2 grid's 4 x 8 features unpadded to 2 rows, a 2x1 grid's 8 x 4 to 8 rows of 4,
    # each row and its newline.
    assert counts == [16 + 2 * 9, 16 + 8 * 5]
    expected = []
    for prompt, image, n in zip(prompts, images, counts, strict=True):
        ids = [t for i in prompt for t in ([i] * n if i == IMAGE_TOKEN else [i])]
        pixels = hf(image, return_tensors="pt")
        out: list[int] = []
        with torch.no_grad():
            for _ in range(NEW_TOKENS):
                logits = model(input_ids=torch.tensor([ids + out]), pixel_values=pixels["pixel_values"],
                               image_sizes=pixels["image_sizes"]).logits[0, -1]
                out.append(int(logits.argmax()))
        expected.append(out)
    assert run(eng, prompts, [[im] for im in images]) == expected
    eng.check_integrity()


def test_prefix_cache_keys_images_by_content(llava):
    path, _ = llava
    eng = engine(path)
    prompt, ims = PROMPTS[0], IMAGES[0]
    first = run(eng, [prompt], [ims], ["a"])
    eng.add_request("b", prompt, GREEDY, multi_modal_data={"image": ims})
    again = drain(eng)["b"]
    assert [list(again.outputs[0].token_ids)] == first
    assert again.metrics.num_cached_tokens >= 40  # 44 prompt tokens: all full pages but the last token's
    # The same text with another second image: the cache serves only the pages before that image.
    other = [ims[0], random_image(9)]
    eng.add_request("c", prompt, GREEDY, multi_modal_data={"image": other})
    out = drain(eng)["c"]
    second_image_start = 5 + 16 + 3
    assert 0 < out.metrics.num_cached_tokens <= second_image_start
    # An image whose pages the prefix cache holds is not even looked up: "b" encoded nothing, "c" its second image.
    assert (eng.images.cache_queries, eng.images.cache_hits) == (3, 0)
    # Without the prefix cache, the images seen before come from the embeddings' cache.
    eng_embeds = engine(path, enable_prefix_caching=False)
    assert run(eng_embeds, [prompt, prompt], [ims, other]) == [first[0], list(out.outputs[0].token_ids)]
    assert (eng_embeds.images.cache_queries, eng_embeds.images.cache_hits) == (4, 1)
    eng_fresh = engine(path, enable_prefix_caching=False, mm_processor_cache_gb=0)
    assert list(out.outputs[0].token_ids) == run(eng_fresh, [prompt], [other])[0]
    assert eng_fresh.images.cache_hits == 0 and not eng_fresh.images.cache
    eng.check_integrity()


def test_image_errors(llava, tmp_path):
    path, _ = llava
    eng = engine(path, limit_mm_per_prompt={"image": 1})
    for prompt, images, message in [
        (PROMPTS[0], IMAGES[0], "exceed the limit of 1"),
        (PROMPTS[1], [], None),  # no images: the placeholder stays a token
        (text(5, 4), [random_image(1)], r"image placeholders \(0 of token"),
        ([IMAGE_TOKEN, IMAGE_TOKEN, 5], [random_image(1)], r"image placeholders \(2 of token \d+, in 1 run"),
        (PROMPTS[1], ["data:image/png;base64,AAAA"], "not an image Pillow can read"),
    ]:
        if message is None:
            eng.add_request("plain", prompt, GREEDY)
            continue
        with pytest.raises(ValueError, match=message):
            eng.add_request("x", prompt, GREEDY, multi_modal_data={"image": images})
    with pytest.raises(ValueError, match="images and videos only"):
        eng.add_request("y", PROMPTS[1], GREEDY, multi_modal_data={"audio": [1]})
    with pytest.raises(ValueError, match=r"this model \(LLaVA's vision tower\) takes images, not videos"):
        eng.add_request("y", PROMPTS[1], GREEDY, multi_modal_data={"video": np.zeros((2, 8, 8, 3), np.uint8)})
    drain(eng)
    eng.check_integrity()
    text_only = engine(path, limit_mm_per_prompt={"image": 0})
    assert text_only.images is None
    with pytest.raises(ValueError, match="takes no images: its images are turned off"):
        text_only.add_request("z", PROMPTS[1], GREEDY, multi_modal_data={"image": IMAGES[1]})


def test_an_image_that_fails_to_encode_fails_alone(llava):
    """A request whose image does not encode (the device out of memory, say) fails with that error; the requests
    stepping with it (another with images, one of text) go on to their tokens, and every page comes back."""
    import asyncio

    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.engine.errors import EngineError

    path, _ = llava
    eng = engine(path, enable_prefix_caching=False)
    expected = run(eng, PROMPTS, IMAGES)
    free = eng.scheduler.pool.num_free
    bad_image = random_image(7, (40, 40))
    bad, real = eng.images.prepare(bad_image).digest, eng.images._embeds

    def embeds(image, count=True):
        if image.digest == bad:
            raise RuntimeError("out of memory encoding the image")
        return real(image, count)

    eng.images._embeds = embeds
    eng.images.clear_cache()
    # The sync engine: the failed request is gone from the step (no output), its error kept for the caller.
    eng.add_request("bad", PROMPTS[1], GREEDY, multi_modal_data={"image": [bad_image]})
    assert run(eng, PROMPTS, IMAGES) == expected
    assert list(eng.take_failures()) == ["bad"] and not eng.take_failures()
    assert eng.scheduler.pool.num_free == free

    async def serve():
        async def one(rid, prompt, images):
            outs = [out async for out in served.generate(prompt, GREEDY, rid, multi_modal_data={"image": images})]
            return list(outs[-1].outputs[0].token_ids)

        jobs = [one("a", PROMPTS[0], IMAGES[0]), one("bad", PROMPTS[1], [bad_image]), one("b", PROMPTS[1], IMAGES[1])]
        return await asyncio.gather(*jobs, return_exceptions=True)

    served = AsyncEngine(eng)
    try:
        got = asyncio.run(serve())
    finally:
        served.shutdown()
    assert [got[0], got[2]] == expected
    assert isinstance(got[1], EngineError) and "request bad failed" in str(got[1]) and "out of memory" in str(got[1])
    assert eng.scheduler.pool.num_free == free
    eng.check_integrity()


def test_images_side_by_side():
    """Placeholders or expanded images side by side make one run of the image token: read in image order, so an
    expanded prompt (a beam's next step, a prompt sent back) is admitted again as it was."""
    from jaxserve.engine.placeholders import expand_placeholders

    assert expand_placeholders([5, 9, 9, 6], 9, [3, 2]) == ([5, 9, 9, 9, 9, 9, 6], [(1, 3), (4, 2)])
    assert expand_placeholders([5, 9, 9, 9, 9, 9, 6], 9, [3, 2]) == ([5, 9, 9, 9, 9, 9, 6], [(1, 3), (4, 2)])
    assert expand_placeholders([9, 9, 9, 9], 9, [3, 2]) == ([9] * 5, [(0, 3), (3, 2)])  # expanded, then one
    assert expand_placeholders([9, 5, 9, 9, 6], 9, [3, 2])[1] == [(0, 3), (4, 2)]  # one, then expanded
    for ids in ([5, 9, 9, 9, 6], [5, 9, 6], [9, 5, 9, 9, 9, 6]):
        with pytest.raises(ValueError, match="do not match 2 image"):
            expand_placeholders(ids, 9, [3, 2])


@contextlib.contextmanager
def chat_server(served, body: dict, got):
    """A server over the async engine `served` whose chat reply to `body` has `got`'s text and prompt tokens;
    yields it for more requests."""
    import httpx

    from server.config import ServerConfig
    from server.runner import serve_in_thread

    with serve_in_thread(served, ServerConfig(port=0)) as srv:
        r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == got.outputs[0].text
        assert r.json()["usage"]["prompt_tokens"] == len(got.prompt_token_ids)
        yield srv


def png_url(image) -> str:
    import base64
    import io

    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_chat_with_images(llava, tmp_path):
    """`LLM.chat` with image parts (objects, data URLs, local files) as the template places them, or, with a
    template that reads text only, in each image's place in the text; over HTTP the same tokens, the Responses API
    included."""
    import httpx

    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.engine.multimodal import PreparedImage
    from jaxserve.llm import LLM

    path, _ = llava
    a, b = random_image(11), random_image(12, (50, 25))
    b.save(tmp_path / "b.png")
    llm = LLM(path, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=96, page_size=8, dtype="float32",
              warmup=False, compile_cache_dir=None, kv_cache_memory_bytes=2**22, allowed_local_media_path=str(tmp_path))
    words = "t5 t6 t7"
    conversation = [{"role": "user", "content": [
        {"type": "image_pil", "image_pil": a}, {"type": "text", "text": words},
        {"type": "image_url", "image_url": {"url": f"file://{tmp_path}/b.png"}}]}]
    got = llm.chat(conversation, GREEDY, use_tqdm=False)[0]
    # The template writes "user : <image> t5 t6 t7 <image> <eos> assistant :": unknown words read as <pad> (0).
    ids = [0, 0, IMAGE_TOKEN, 5, 6, 7, IMAGE_TOKEN, 1, 0, 0]
    direct = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": [a, b]}}, GREEDY, use_tqdm=False)[0]
    assert got.prompt_token_ids == direct.prompt_token_ids == ids[:2] + [IMAGE_TOKEN] * 16 + [5, 6, 7] + \
        [IMAGE_TOKEN] * 16 + [1, 0, 0]
    assert got.outputs[0].token_ids == direct.outputs[0].token_ids
    # A template that reads text only: each image's placeholder stands in the text, parts joined by newlines.
    text_only = "{% for m in messages %}{{ m.content }} {% endfor %}"
    plain = llm.chat(conversation, GREEDY, chat_template=text_only, use_tqdm=False)[0]
    assert plain.prompt_token_ids == [IMAGE_TOKEN] * 16 + [5, 6, 7] + [IMAGE_TOKEN] * 16

    served = AsyncEngine(llm.engine)
    kinds: list[type] = []  # what reaches the engine's thread: images read and processed already
    add = llm.engine.add_request
    llm.engine.add_request = lambda *a, multi_modal_data=None, **k: (
        kinds.extend(type(im) for im in (multi_modal_data or {}).get("image", [])), add(
            *a, multi_modal_data=multi_modal_data, **k))[1]
    http_conv = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": png_url(a)}}, {"type": "text", "text": words},
        {"type": "image_url", "image_url": f"file://{tmp_path}/b.png"}]}]
    body = {"messages": http_conv, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    try:
        with chat_server(served, body, got) as srv:
            r = httpx.post(f"{srv.url}/v1/responses", timeout=60, json={
                "input": [{"role": "user", "content": [
                    {"type": "input_image", "image_url": png_url(a)}, {"type": "input_text", "text": words},
                    {"type": "input_image", "image_url": png_url(b)}]}],
                "max_output_tokens": NEW_TOKENS, "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["input_tokens"] == len(got.prompt_token_ids)
            assert r.json()["output"][-1]["content"][0]["text"] == got.outputs[0].text
            # /tokenize counts an image's tokens as a chat does, and runs no encoder for it.
            fresh = random_image(13)
            r = httpx.post(f"{srv.url}/tokenize", timeout=60, json={"messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": png_url(fresh)}}]}]})
            assert r.json()["tokens"].count(IMAGE_TOKEN) == 16
            assert llm.engine.images.prepare(fresh).digest not in llm.engine.images.cache
            for content, status, code in [
                ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}], 400, "invalid_image"),
                ([{"type": "image_url", "image_url": {"url": "/etc/passwd"}}], 400, "invalid_image"),
                ([{"type": "text", "text": "t5"}], 200, None),
            ]:
                r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=60,
                               json={**body, "messages": [{"role": "user", "content": content}]})
                assert r.status_code == status, r.text
                assert code is None or r.json()["error"]["code"] == code
    finally:
        served.shutdown()
    assert kinds and set(kinds) == {PreparedImage}
    llm.engine.check_integrity()


def test_sleep_and_new_weights_take_the_vision_side_too(llava, tmp_path):
    """Sleep frees the vision tower with the decoder and wakes it; new weights (from disk, or tensors in memory)
    replace both and forget the embeddings of the old ones."""
    import jax
    from safetensors.numpy import load_file

    path, _ = llava
    other = tmp_path / "other"
    save_tiny_llava(other, seed=1)
    eng = engine(path, enable_sleep_mode=True, warmup=True)
    prompts, images = PROMPTS[:1], IMAGES[:1]
    ref = run(eng, prompts, images)
    for level in (1, 2):
        eng.memory.sleep(level)
        assert all(x.is_deleted() for x in jax.tree.leaves(eng.images.params))
        late = eng.images.prepare(random_image(40 + level))
        eng.images.encode_ahead(late)  # a server's, meanwhile: nothing (and no error)
        assert late.digest not in eng.images.cache
        eng.memory.wake_up()
        assert run(eng, prompts, images) == ref
    eng.memory.load_weights(str(other))
    new = run(engine(str(other)), prompts, images)
    assert new != ref and run(eng, prompts, images) == new
    tensors = load_file(f"{path}/model.safetensors")
    with pytest.raises(ValueError, match="vision tower's and projector's tensors too"):
        eng.memory.load_weights({k: v for k, v in tensors.items() if "language_model" in k})
    eng.memory.load_weights(iter(tensors.items()))  # pairs read once, as a trainer may yield them
    assert run(eng, prompts, images) == ref
    assert eng.runner.compilations_after_warmup == 0


def test_bench_serve_sends_image_requests(llava):
    """`jaxserve bench serve --random-images`: every request served, the server counting each image's tokens."""
    import asyncio
    import re

    import httpx

    from bench.serve import LoadConfig, reset_server_caches, run_load
    from bench.workloads import WorkloadSpec
    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.loader import bundled_model_path
    from jaxserve.tokenizer import Tokenizer
    from server.config import ServerConfig
    from server.runner import serve_in_thread

    path, _ = llava
    words = Tokenizer.from_gguf(bundled_model_path())  # real words for the text; the model reads them as it can
    spec = WorkloadSpec(name="random", num_prompts=4, random_input_len=6, output_len=4, random_images=1,
                        random_image_size=(48, 40))
    served = AsyncEngine(engine(path))
    try:
        with serve_in_thread(served, ServerConfig(port=0)) as srv:
            res, _ = asyncio.run(run_load(srv.url, spec.build(words), LoadConfig(max_concurrency=4)))
            # Each image was encoded as it arrived, off the engine's thread: the engine's thread found it cached.
            images = served.engine.images
            assert images.cache_queries == images.cache_hits == 4
            metrics = httpx.get(f"{srv.url}/metrics", timeout=30).text  # vLLM's names, counted in images
            for name in ("vllm:mm_cache_queries_total", "vllm:mm_cache_hits_total"):
                assert re.search(rf"^{name}(\{{[^}}]*\}})? 4\.0$", metrics, re.M), name
            # Between a sweep's runs the bench empties the server's caches: the images are forgotten.
            assert len(images.cache) == 4
            assert reset_server_caches(srv.url)
            assert not served.engine.images.cache and served.engine.scheduler.cache.num_cached_pages == 0
    finally:
        served.shutdown()
    assert all(r.success for r in res.records), [r.error for r in res.records]
    assert all(r.output_len == 4 and r.prompt_len > 16 for r in res.records)  # an image is 16 tokens


def test_images_with_speculative_decoding_equal_plain(llava):
    """N-gram drafts over a prompt with images (an image's cache ids are never drafted) change no token."""
    from jaxserve.engine.speculative import NgramIndex

    index = NgramIndex(1, 2)
    index.extend([5, 6, 9, -7, -7, 8, 5, 6])
    assert index.propose(3).tolist() == [9]  # what followed "5 6", up to the image
    index.extend([9])
    assert index.propose(3).tolist() == []  # "5 6 9" was followed by the image
    path, _ = llava
    plain = run(engine(path), PROMPTS, IMAGES)
    spec = engine(path, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                            "prompt_lookup_min": 1})
    assert run(spec, PROMPTS, IMAGES) == plain
    assert spec.stats().spec_num_drafts > 0
    spec.check_integrity()


def test_cli_chat_and_generate_take_images(llava, tmp_path, capsys):
    """`jaxserve chat --image FILE` and `jaxserve generate --image FILE` answer as `LLM.chat` and `LLM.generate` do."""
    from jaxserve.cli import main
    from jaxserve.llm import LLM

    path, _ = llava
    image = random_image(31)
    image.save(tmp_path / "a.png")
    flags = ["--model", path, "--dtype", "float32", "--no-warmup", "--compile-cache-dir", "", "--max-model-len", "96",
             "--page-size", "8", "--kv-cache-memory-bytes", str(2**20), "--max-tokens", "8",
             "--image", str(tmp_path / "a.png")]
    assert main(["chat", *flags, "-m", "t5 t6 t7"]) == 0
    assert main(["generate", *flags, "t5 <image> t6"]) == 0
    chat, generated = capsys.readouterr().out.splitlines()[-2:]
    llm = LLM(path, dtype="float32", warmup=False, compile_cache_dir=None, max_model_len=96, page_size=8,
              kv_cache_memory_bytes=2**20)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    want = llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                                  {"type": "text", "text": "t5 t6 t7"}]}], params, use_tqdm=False)
    assert chat == want[0].outputs[0].text
    want = llm.generate({"prompt": "t5 <image> t6", "multi_modal_data": {"image": image}}, params, use_tqdm=False)
    assert generated == want[0].outputs[0].text


def test_beam_search_with_images(llava):
    """`LLM.beam_search` over a prompt with images (searched on its own, each step's requests taking its images)
    and a text prompt: the beams transformers' logprobs give; over HTTP, `use_beam_search` with an image part gives
    the same best beam."""
    import httpx

    from jaxserve.beam_search import BeamSearchParams, beam_search
    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.llm import LLM
    from jaxserve.outputs import Logprob
    from server.config import ServerConfig
    from server.runner import serve_in_thread

    path, model = llava
    llm = LLM(path, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=96, page_size=8, dtype="float32",
              warmup=False, compile_cache_dir=None, kv_cache_memory_bytes=2**22)
    params = BeamSearchParams(beam_width=3, max_tokens=4, ignore_eos=True)
    prompt, images, words = PROMPTS[0], IMAGES[0], text(9, 5)
    got = llm.beam_search([{"prompt_token_ids": prompt, "multi_modal_data": {"image": images}}, words], params)
    pixels = torch.tensor(np.stack([ImageProcessor.from_dir(path)(im) for im in images]))

    def hf_logprobs(lists, k, with_images):
        out = []
        with torch.no_grad():
            for ids in lists:
                kw = {"pixel_values": pixels} if with_images else {}
                lp = torch.log_softmax(model(input_ids=torch.tensor([ids]), **kw).logits[0, -1].double(), -1)
                top = torch.topk(lp, k)
                pairs = zip(top.indices.tolist(), top.values.tolist(), strict=True)
                out.append({t: Logprob(v, r + 1) for r, (t, v) in enumerate(pairs)})
        return out

    expanded = [t for i in prompt for t in ([i] * 16 if i == IMAGE_TOKEN else [i])]
    for g, ids, with_images in ((got[0], expanded, True), (got[1], words, False)):
        (want,) = beam_search([ids], params, max_model_len=96, eos_token_ids=llm.engine.eos_ids,
                              decode=llm.engine.tokenizer.decode,
                              next_logprobs=lambda lists, k, w=with_images: hf_logprobs(lists, k, w))
        assert [b.tokens for b in g.sequences] == [b.tokens for b in want.sequences]
        np.testing.assert_allclose([b.cum_logprob for b in g.sequences], [b.cum_logprob for b in want.sequences],
                                   atol=1e-3)

    a = random_image(11)
    chat_ids = [0, 0, IMAGE_TOKEN, 5, 6, 7, 1, 0, 0]  # "user : <image> t5 t6 t7 <eos> assistant :"
    (best,) = llm.beam_search([{"prompt_token_ids": chat_ids, "multi_modal_data": {"image": a}}], params)
    served = AsyncEngine(llm.engine)
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_url(a)}},
                                                      {"type": "text", "text": "t5 t6 t7"}]}],
            "use_beam_search": True, "n": 3, "max_tokens": 4, "ignore_eos": True}
    try:
        with serve_in_thread(served, ServerConfig(port=0)) as srv:
            r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            assert [c["message"]["content"] for c in r.json()["choices"]] == [b.text for b in best.sequences]
    finally:
        served.shutdown()
    llm.engine.check_integrity()
