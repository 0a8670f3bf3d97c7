"""Pixtral-tower models through the engine (Mistral 3, and LLaVA over a Pixtral tower): tiny random models' greedy
tokens and logprobs against transformers', each image laid out as its rows of `[IMG]` tokens with row breaks and an
image end (text tokens keeping their own embeddings), cut across prefill chunks, batched, from the prefix cache."""

from __future__ import annotations

import functools

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxserve.engine_args import EngineArgs  # noqa: E402
from jaxserve.images_pixtral import PixtralImageProcessor  # noqa: E402
from jaxserve.sampling_params import SamplingParams  # noqa: E402
from tests.llava_model import random_image  # noqa: E402
from tests.modelrun import assert_same_greedy, image_engine, run_images, torch_greedy  # noqa: E402
from tests.pixtral_model import IMAGE_BREAK, IMAGE_END, IMAGE_TOKEN, PROCESSOR, save_tiny_pixtral  # noqa: E402
from tests.qwen2_vl_model import save_word_tokenizer  # noqa: E402

NEW_TOKENS = 5
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
MERGE = {"mistral3": 2, "llava": 1}


def text(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 280, n).tolist()


PROMPTS = [text(1, 5) + [IMAGE_TOKEN] + text(2, 3) + [IMAGE_TOKEN] + text(3, 4), [IMAGE_TOKEN] + text(4, 6)]
IMAGES = [[random_image(1, (40, 20)), random_image(2, (19, 36))], [random_image(3, (32, 32))]]


@pytest.fixture(scope="module", params=["mistral3", "llava"])
def pixtral(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    model = save_tiny_pixtral(path, request.param)
    with torch.no_grad():  # logits of 0 for the image tokens: never sampled
        model.lm_head.weight[IMAGE_TOKEN:] = 0.0
    model.save_pretrained(path, safe_serialization=True)
    save_word_tokenizer(path, {"[IMG]": IMAGE_TOKEN, "[IMG_BREAK]": IMAGE_BREAK, "[IMG_END]": IMAGE_END}, "[IMG]")
    return str(path), model, request.param


def hf_greedy(model, kind: str, ids: list[int], images) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and their logprobs (a full forward per token), each image's `[IMG]` laid out as
    Mistral's processor does: rows of `[IMG]` each ended by `[IMG_BREAK]`, the last by `[IMG_END]`."""
    pixels = [PixtralImageProcessor.from_dict(PROCESSOR, MERGE[kind])(im) for im in images]
    unit = 4 * MERGE[kind]
    layouts = iter([[IMAGE_TOKEN] * (p.shape[2] // unit) + [IMAGE_BREAK] for _ in range(p.shape[1] // unit)]
                   for p in pixels)
    expanded = []
    for i in ids:
        if i == IMAGE_TOKEN:
            rows = [t for row in next(layouts) for t in row]
            expanded += rows[:-1] + [IMAGE_END]
        else:
            expanded.append(i)
    H, W = max(p.shape[1] for p in pixels), max(p.shape[2] for p in pixels)
    batch = torch.tensor(np.stack([np.pad(p, ((0, 0), (0, H - p.shape[1]), (0, W - p.shape[2]))) for p in pixels]))
    sizes = torch.tensor([p.shape[1:] for p in pixels])
    return torch_greedy(lambda ids: model(input_ids=torch.tensor([ids]), pixel_values=batch,
                                          image_sizes=sizes).logits[0, -1], expanded, NEW_TOKENS)


engine = image_engine
run = functools.partial(run_images, params=GREEDY)


def test_pixtral_engine_equals_transformers(pixtral):
    """Both prompts in one batch, their images cut across 32-token prefill chunks; then each alone, the second time
    from the prefix cache; an expanded prompt is taken as it is."""
    path, model, kind = pixtral
    expected = [hf_greedy(model, kind, p, ims) for p, ims in zip(PROMPTS, IMAGES, strict=True)]
    eng = engine(path)
    # Images processed to 24 x 40 (20 x 40 in 4-pixel patches), 40 x 24 (36 x 20) and 32 x 32 pixels: rows x
    # (columns + 1) tokens.
    want = {"mistral3": [3 * 6, 5 * 4, 4 * 5], "llava": [5 * 11, 9 * 6, 8 * 9]}[kind]
    assert [eng.images.num_tokens(eng.images.prepare(im)) for im in IMAGES[0] + IMAGES[1]] == want

    assert_same_greedy(run(eng, PROMPTS, IMAGES), expected)
    hits = eng.scheduler.cache.hit_tokens
    assert_same_greedy(run(eng, PROMPTS[:1], IMAGES[:1], ["a"]) + run(eng, PROMPTS[1:], IMAGES[1:], ["b"]), expected)
    # All full pages but each prompt's last token's: 48 + 24 of 50 and 26 tokens, 120 + 72 of 121 and 78.
    assert eng.scheduler.cache.hit_tokens - hits >= {"mistral3": 48 + 24, "llava": 120 + 72}[kind]
    expanded, _ = eng.images.layout(PROMPTS[1], [eng.images.prepare(im) for im in IMAGES[1]])
    assert_same_greedy(run(eng, [expanded], IMAGES[1:], ["c"]), expected[1:])
    with pytest.raises(ValueError, match="not that image's layout"):
        eng.add_request("d", expanded[1:], GREEDY, multi_modal_data={"image": IMAGES[1]})  # a row one short
    eng.check_integrity()


@pytest.mark.parametrize("pixtral", ["mistral3"], indirect=True)  # the layout is checked for both above
def test_pixtral_chat(pixtral):
    """`LLM.chat` with an image part: the template writes `[IMG]`, which the image's layout replaces."""
    from jaxserve.llm import LLM

    path, model, kind = pixtral
    llm = LLM(model=path, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=512, page_size=8,
              kv_cache_memory_bytes=2**21, dtype="float32", warmup=False, compile_cache_dir=None)
    image = IMAGES[0][1]
    message = {"role": "user", "content": [{"type": "text", "text": "t5"}, {"type": "image_pil", "image_pil": image},
                                           {"type": "text", "text": "t7"}]}
    reply = llm.chat([message], GREEDY)[0]
    words = "user : t5 [IMG] t7 <eos> assistant :".split()
    ids = [llm.engine.tokenizer.encode(w, add_special_tokens=False)[0] for w in words]
    want, _ = hf_greedy(model, kind, ids, [image])
    assert list(reply.outputs[0].token_ids) == want
    assert reply.prompt_token_ids.count(IMAGE_END) == 1 and reply.prompt_token_ids[-5] == IMAGE_END  # then "t7 <eos> assistant :"


def test_convert_writes_the_whole_model(pixtral, tmp_path):
    """`jaxserve convert`: transformers reads every weight back and computes the source's logits over an image; the
    written model serves as the source does."""
    from jaxserve.engine.model_loading import load_model
    from jaxserve.loader.export import export_hf

    path, source, kind = pixtral
    loaded = load_model(EngineArgs(model=path, dtype="float32"), progress=False)
    out = tmp_path / "out"
    export_hf(str(out), loaded.config, loaded.params, loaded.tokenizer, vision=loaded.vision)
    back, info = type(source).from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    pixels = PixtralImageProcessor.from_dict(PROCESSOR, MERGE[kind])(IMAGES[0][0])
    ids = torch.tensor([loaded.vision.layout([5, IMAGE_TOKEN, 7], [loaded.vision.prepare(IMAGES[0][0])])[0]])
    kw = dict(input_ids=ids, pixel_values=torch.tensor(pixels[None]), image_sizes=torch.tensor([pixels.shape[1:]]))
    with torch.no_grad():
        np.testing.assert_allclose(back.eval()(**kw).logits.numpy(), source(**kw).logits.numpy(), atol=1e-5)
    assert run(engine(str(out)), PROMPTS[1:], IMAGES[1:]) == run(engine(path), PROMPTS[1:], IMAGES[1:])
