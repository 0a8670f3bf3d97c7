"""Gemma 3's images through the engine: a tiny random Gemma 3 image-text model's prompts laid out as transformers'
processor lays them out, and its greedy tokens and their logprobs equal to transformers' with `token_type_ids` (an
image's tokens attend to each other both ways), the prompt cut into prefill chunks that never end inside an image."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxserve.engine.llm_engine import LLMEngine  # noqa: E402
from jaxserve.engine_args import EngineArgs  # noqa: E402
from jaxserve.sampling_params import SamplingParams  # noqa: E402
from tests.gemma3_vision_model import PROCESSOR, TOKENS_PER_IMAGE, save_tiny_gemma3  # noqa: E402
from tests.llava_model import random_image  # noqa: E402
from tests.modelrun import drain  # noqa: E402

NEW_TOKENS = 6
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
# Text prompts as a chat template writes them, one `<start_of_image>` where each image goes; newlines beside the
# placeholders merge with the "\n\n" around the image (one token for a run of newlines).
PROMPTS = ["<bos><start_of_turn>user\n<start_of_image>t30 t31 t32<start_of_image>\nt40 t41<end_of_turn>\n"
           "<start_of_turn>model\n",
           "<bos>t20 t21 t22 t23 t24<start_of_image><start_of_image>t33"]
IMAGES = [[random_image(1), random_image(2, (60, 20))], [random_image(3, (33, 33)), random_image(4)]]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3")
    model = save_tiny_gemma3(path)
    return str(path), model


def hf_inputs(path: str, prompt: str, images, **kwargs) -> dict:
    """transformers' processor over the text and images (with its `kwargs`): input_ids, token_type_ids,
    pixel_values."""
    fields = {k: v for k, v in PROCESSOR.items()
              if v is not None and k not in ("image_processor_type", "processor_class", "image_seq_length")}
    processor = transformers.Gemma3Processor(image_processor=transformers.Gemma3ImageProcessorPil(**fields),
                                             tokenizer=transformers.AutoTokenizer.from_pretrained(path),
                                             image_seq_length=TOKENS_PER_IMAGE)
    return processor(text=[prompt], images=[images], return_tensors="pt", **kwargs)


def hf_greedy(model, inputs: dict, both_ways: bool = True) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and their logprobs (a full forward per token), the image tokens attended both
    ways (`token_type_ids`) or, without `both_ways`, causally."""
    ids, types = inputs["input_ids"], inputs["token_type_ids"]
    out, logprobs = [], []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            extra = torch.tensor([out], dtype=ids.dtype).reshape(1, -1)
            kw = {"token_type_ids": torch.cat([types, torch.zeros_like(extra)], 1)} if both_ways else {}
            logits = model(input_ids=torch.cat([ids, extra], 1), pixel_values=inputs["pixel_values"], **kw).logits
            lp = torch.log_softmax(logits[0, -1].double(), -1)
            out.append(int(lp.argmax()))
            logprobs.append(float(lp.max()))
    return out, logprobs


def engine(path: str, **kw) -> LLMEngine:
    args = EngineArgs(model=path, **{**dict(max_num_seqs=4, max_num_batched_tokens=24, max_model_len=128,
                                            page_size=8, kv_cache_memory_bytes=2**20, dtype="float32", warmup=False,
                                            compile_cache_dir=None), **kw})
    return LLMEngine(args, progress=False)


def run(eng: LLMEngine, prompts, images) -> dict:
    for i, (prompt, ims) in enumerate(zip(prompts, images, strict=True)):
        eng.add_request(f"r{i}", prompt, GREEDY, multi_modal_data={"image": ims})
    return drain(eng)


def test_gemma3_images_equal_transformers(gemma3):
    """Prompts expanded as transformers' processor expands them; both in one batch, 24-token steps (each 16-token
    image in one chunk, a chunk ending before an image that would not fit), then each alone with the prefix cache
    reused: the greedy tokens and their logprobs equal transformers' with the images attended both ways, which
    differ from the causal ones."""
    path, model = gemma3
    inputs = [hf_inputs(path, p, ims) for p, ims in zip(PROMPTS, IMAGES, strict=True)]
    expected = [hf_greedy(model, x) for x in inputs]
    causal = [hf_greedy(model, x, both_ways=False) for x in inputs]
    assert any(not np.allclose(e[1], c[1], atol=1e-3) for e, c in zip(expected, causal, strict=True))
    eng = engine(path)
    for prompts, images, want, x in ((PROMPTS, IMAGES, expected, inputs), (PROMPTS[1:], IMAGES[1:], expected[1:],
                                                                             inputs[1:])):
        final = run(eng, prompts, images)
        for i, ((tokens, logprobs), hf) in enumerate(zip(want, x, strict=True)):
            out = final[f"r{i}"]
            assert list(out.prompt_token_ids) == hf["input_ids"][0].tolist()
            assert list(out.outputs[0].token_ids) == tokens
            got = [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, tokens, strict=True)]
            np.testing.assert_allclose(got, logprobs, atol=2e-4)
    eng.check_integrity()


def test_pan_and_scan_equals_transformers(gemma3):
    """With pan and scan on (`--mm-processor-kwargs`), a long image becomes its processor's sentence around the image
    and its three crops, each attended both ways in its own span, and a square image beside it is not cut: the
    prompt is transformers' processor's, the greedy tokens and their logprobs its model's; again from the prefix
    cache, each crop keyed by its own pixels."""
    path, model = gemma3
    kwargs = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 10}
    prompt = ("<bos><start_of_turn>user\n<start_of_image>t30 t31<start_of_image>\n\nt40<end_of_turn>\n"
              "<start_of_turn>model\n")
    images = [random_image(8, (70, 24)), random_image(9, (40, 40))]
    x = hf_inputs(path, prompt, images, **kwargs)
    assert len(x["pixel_values"]) == 5  # the long image, its 3 crops, the square image
    tokens, logprobs = hf_greedy(model, x)
    eng = engine(path, mm_processor_kwargs=kwargs, max_model_len=192)
    for attempt in range(2):
        out = run(eng, [prompt], [images])["r0"]
        assert list(out.prompt_token_ids) == x["input_ids"][0].tolist()
        assert (out.metrics.num_cached_tokens > 4 * TOKENS_PER_IMAGE) == (attempt == 1)
        assert list(out.outputs[0].token_ids) == tokens
        got = [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, tokens, strict=True)]
        np.testing.assert_allclose(got, logprobs, atol=2e-4)
    assert eng.images.cache_queries == 5  # the image, its crops and the square image, encoded once
    eng.check_integrity()


def test_gemma3_images_on_the_pallas_kernel(gemma3):
    """The same batch on the generic Pallas kernel (interpreted): each row of a query block reads its own last key."""
    path, model = gemma3
    eng = engine(path, attention_backend="pallas_interpret")
    final = run(eng, PROMPTS, IMAGES)
    for i, (prompt, images) in enumerate(zip(PROMPTS, IMAGES, strict=True)):
        tokens, logprobs = hf_greedy(model, hf_inputs(path, prompt, images))
        out = final[f"r{i}"].outputs[0]
        assert list(out.token_ids) == tokens
        np.testing.assert_allclose([lp[t].logprob for lp, t in zip(out.logprobs, tokens, strict=True)], logprobs,
                                   atol=2e-4)
    eng.check_integrity()


def test_chunks_never_end_inside_an_image(gemma3):
    """A prompt whose image starts 6 tokens into it: with 16-token steps the first chunk stops before the image and
    the second holds the image whole; an image longer than a chunk is refused by name."""
    path, _ = gemma3
    eng = engine(path, max_num_batched_tokens=16, enable_prefix_caching=False)
    sizes = []
    step = eng.scheduler.schedule

    def record():
        plan = step()
        sizes.extend(s.num_new_tokens for s in plan.scheduled if not s.is_decode)
        return plan

    eng.scheduler.schedule = record
    final = run(eng, ["<bos>t20 t21 t22 t23<start_of_image>t33"], [[random_image(5)]])
    ids = list(final["r0"].prompt_token_ids)
    first = ids.index(7)  # the image's first token
    assert sizes[:2] == [first, 16] and sum(sizes) == len(ids)
    small = engine(path, max_num_batched_tokens=12, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="an image of 16 tokens does not fit in a prefill chunk of 12"):
        small.add_request("big", "<bos>t20<start_of_image>", GREEDY, multi_modal_data={"image": [random_image(6)]})
    small.check_integrity()


def test_gemma3_chat(gemma3):
    """`LLM.chat` with image parts, Gemma 3's chat template writing `<start_of_image>` for each: the prompt is the
    one transformers' processor makes of the rendered template, its tokens transformers' greedy ones; over HTTP
    the same text, and `/tokenize` counts the image's tokens with the newlines around them."""
    import httpx

    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.llm import LLM
    from tests.test_engine_images import chat_server, png_url

    path, model = gemma3
    a, b = random_image(11), random_image(12, (50, 25))
    llm = LLM(path, max_num_seqs=4, max_num_batched_tokens=24, max_model_len=128, page_size=8, dtype="float32",
              warmup=False, compile_cache_dir=None, kv_cache_memory_bytes=2**22)
    conversation = [{"role": "user", "content": [{"type": "image_pil", "image_pil": a}, {"type": "text", "text": "t30"},
                                                 {"type": "image_pil", "image_pil": b}]}]
    got = llm.chat(conversation, GREEDY, use_tqdm=False)[0]
    hf_tok = transformers.AutoTokenizer.from_pretrained(path)
    template_messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "t30"},
                                                      {"type": "image"}]}]
    text = hf_tok.apply_chat_template(template_messages, add_generation_prompt=True, tokenize=False)
    inputs = hf_inputs(path, text, [a, b])
    assert got.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert list(got.outputs[0].token_ids) == hf_greedy(model, inputs)[0]

    served = AsyncEngine(llm.engine)
    http_conv = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_url(a)}},
                                              {"type": "text", "text": "t30"},
                                              {"type": "image_url", "image_url": {"url": png_url(b)}}]}]
    body = {"messages": http_conv, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    try:
        with chat_server(served, body, got) as srv:
            r = httpx.post(f"{srv.url}/tokenize", timeout=60, json={"messages": http_conv})
            assert r.json()["tokens"] == got.prompt_token_ids
    finally:
        served.shutdown()
    llm.engine.check_integrity()


def test_disaggregated_prefill_with_images(gemma3):
    """Prefill/decode disaggregation of a chat with images (`tests.pd_images`): the decode worker encodes nothing;
    the reply equals an aggregated worker's."""
    from tests.pd_images import pd_chat_with_images

    path, _ = gemma3
    args = EngineArgs(model=path, max_num_seqs=4, max_num_batched_tokens=24, max_model_len=128, page_size=8,
                      kv_cache_memory_bytes=2**20, dtype="float32", warmup=False, compile_cache_dir=None)
    pd_chat_with_images(args, [random_image(21), random_image(22, (40, 70))], 2 * TOKENS_PER_IMAGE, NEW_TOKENS)
