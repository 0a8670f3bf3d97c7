"""Images through the engine: a tiny LLaVA model's greedy tokens against transformers', with the prompt's images cut
across prefill chunks, batched against alone, and the prefix cache keyed by image content."""

from __future__ import annotations

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
    args = EngineArgs(model=path, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=96, page_size=8,
                      kv_cache_memory_bytes=64 * 2**20 // 64, dtype="float32", warmup=False, compile_cache_dir=None,
                      **kw)
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
    eng_fresh = engine(path, enable_prefix_caching=False)
    assert list(out.outputs[0].token_ids) == run(eng_fresh, [prompt], [other])[0]
    eng.check_integrity()


def test_image_errors(llava, tmp_path):
    path, _ = llava
    eng = engine(path, limit_mm_per_prompt={"image": 1})
    for prompt, images, message in [
        (PROMPTS[0], IMAGES[0], "exceed the limit of 1"),
        (PROMPTS[1], [], None),  # no images: the placeholder stays a token
        (text(5, 4), [random_image(1)], "0 image placeholder"),
        ([IMAGE_TOKEN, IMAGE_TOKEN, 5], [random_image(1)], "placeholder run of 2 tokens"),
        (PROMPTS[1], ["data:image/png;base64,AAAA"], "not an image Pillow can read"),
    ]:
        if message is None:
            eng.add_request("plain", prompt, GREEDY)
            continue
        with pytest.raises(ValueError, match=message):
            eng.add_request("x", prompt, GREEDY, multi_modal_data={"image": images})
    with pytest.raises(ValueError, match="images only"):
        eng.add_request("y", PROMPTS[1], GREEDY, multi_modal_data={"video": [1]})
    drain(eng)
    eng.check_integrity()
    text_only = engine(path, limit_mm_per_prompt={"image": 0})
    assert text_only.images is None
    with pytest.raises(ValueError, match="takes no images: its images are turned off"):
        text_only.add_request("z", PROMPTS[1], GREEDY, multi_modal_data={"image": IMAGES[1]})
