"""LLaVA-OneVision (`LlavaOnevisionForConditionalGeneration`) through the engine: a tiny random model (a SigLIP tower,
every patch's features read, anyres_max_1 so that a grid of crops is shrunk) against transformers: a prompt's one
image as its crops, unpadded and shrunk, a prompt's several images each padded to a square in one crop; greedy
tokens batched and chunked, and again from the prefix cache."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxserve.sampling_params import SamplingParams  # noqa: E402
from tests.llava_model import IMAGE_TOKEN, PINPOINTS, TOWERS, VIDEO_TOKEN, random_image, save_tiny_llava  # noqa: E402
from tests.modelrun import image_engine  # noqa: E402
from tests.test_engine_images import drain  # noqa: E402

NEW_TOKENS = 5
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
# One image (90 x 31: a 1 x 2 grid, unpadded to 2 x 8 features, small enough to keep; 60 x 60: 2 x 2, 8 x 8 features
# shrunk to 4 x 4), and two images in one prompt (each one crop and a newline).
PROMPTS = [[5, IMAGE_TOKEN, 6, 7], [IMAGE_TOKEN, 9, 8], [4, IMAGE_TOKEN, 3, IMAGE_TOKEN, 10]]
IMAGES = [[random_image(21, (90, 31))], [random_image(22, (60, 60))], [random_image(23, (40, 25)),
                                                                        random_image(24, (20, 50))]]


@pytest.fixture(scope="module")
def onevision(tmp_path_factory):
    path = tmp_path_factory.mktemp("onevision")
    model = save_tiny_llava(path, "siglip", feature_layer=-1, strategy="full", onevision="anyres_max_1")
    return str(path), model


def hf_greedy(model, ids: list[int], images) -> list[int]:
    fields = {k: v for k, v in TOWERS["siglip"][2].items() if k != "image_processor_type"}
    hf = transformers.LlavaOnevisionImageProcessorPil(**fields, image_grid_pinpoints=PINPOINTS)
    pixels = hf([images], return_tensors="pt")
    sizes = pixels["image_sizes"].tolist()
    with torch.no_grad():
        feats = model.model.get_image_features(pixel_values=pixels["pixel_values"], image_sizes=pixels["image_sizes"],
                                               batch_num_images=pixels["batch_num_images"],
                                               vision_feature_layer=-1, vision_feature_select_strategy="full")
    counts = iter(len(f) for f in (feats.pooler_output if hasattr(feats, "pooler_output") else feats))
    expanded = [t for i in ids for t in ([i] * next(counts) if i == IMAGE_TOKEN else [i])]
    out: list[int] = []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = model(input_ids=torch.tensor([expanded + out]), pixel_values=pixels["pixel_values"],
                           image_sizes=torch.tensor(sizes), batch_num_images=pixels["batch_num_images"]).logits[0, -1]
            out.append(int(logits.argmax()))
    return out


def test_onevision_engine_equals_transformers(onevision):
    path, model = onevision
    expected = [hf_greedy(model, p, ims) for p, ims in zip(PROMPTS, IMAGES, strict=True)]
    eng = image_engine(path, max_model_len=256)
    cfg = eng.images.cfg
    assert (cfg.max_crops, cfg.drop_first, cfg.tokens_per_image) == (1, False, 16)
    lens = [len(eng.images.layout(p, [eng.images.prepare(im) for im in ims])[0])
            for p, ims in zip(PROMPTS, IMAGES, strict=True)]
    # 16 whole-image tokens, then 2 rows of 8 and their newlines; 16, then 4 rows of 4 (shrunk from 8 x 8) and
    # theirs; two images of 16 and a newline each.
    assert lens == [3 + 16 + 2 * 9, 2 + 16 + 4 * 5, 3 + 2 * 17]
    for rid, p, ims in zip("abc", PROMPTS, IMAGES, strict=True):
        eng.add_request(rid, p, GREEDY, multi_modal_data={"image": ims})
    got = drain(eng)
    assert [list(got[r].outputs[0].token_ids) for r in "abc"] == expected
    hits = eng.scheduler.cache.hit_tokens
    eng.add_request("again", PROMPTS[2], GREEDY, multi_modal_data={"image": IMAGES[2]})
    assert list(drain(eng)["again"].outputs[0].token_ids) == expected[2]
    assert eng.scheduler.cache.hit_tokens - hits >= 32
    eng.check_integrity()


def test_the_shrink_is_torch_bilinear():
    from jaxserve.models.vision_anyres import bilinear

    x = np.random.default_rng(0).normal(size=(9, 7, 3)).astype(np.float32)
    want = torch.nn.functional.interpolate(torch.from_numpy(x).permute(2, 0, 1)[None], [5, 4], mode="bilinear")
    np.testing.assert_allclose(bilinear(x, 5, 4), want[0].permute(1, 2, 0).numpy(), atol=1e-6)


def test_an_image_crosses_to_a_follower_with_its_square():
    """A prepared LLaVA-OneVision image in the lock-step message (`sharding.distributed`) keeps both its forms."""
    from jaxserve.engine.multimodal_onevision import OnevisionImage
    from sharding.distributed import _image_from_message, _image_message

    image = OnevisionImage(np.ones((3, 3, 4, 4), np.float32), (9, 5), b"\x02" * 32, np.full((3, 4, 4), 2, np.float32))
    back = _image_from_message(_image_message(image))
    assert isinstance(back, OnevisionImage) and (back.size, back.digest) == (image.size, image.digest)
    np.testing.assert_array_equal(back.pixels, image.pixels)
    np.testing.assert_array_equal(back.square, image.square)


def test_convert_writes_the_whole_model(onevision, tmp_path):
    """`jaxserve convert`: transformers reads every weight back (the newline embedding too) and computes the source's
    logits over an image."""
    from jaxserve.engine.model_loading import load_model
    from jaxserve.engine_args import EngineArgs
    from jaxserve.loader.export import export_hf

    path, source = onevision
    loaded = load_model(EngineArgs(model=path, dtype="float32"), progress=False)
    out = tmp_path / "out"
    export_hf(str(out), loaded.config, loaded.params, loaded.tokenizer, vision=loaded.vision)
    back, info = type(source).from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    fields = {k: v for k, v in TOWERS["siglip"][2].items() if k != "image_processor_type"}
    pixels = transformers.LlavaOnevisionImageProcessorPil(**fields, image_grid_pinpoints=PINPOINTS)(
        [IMAGES[0]], return_tensors="pt")
    kw = dict(input_ids=torch.tensor([[5] + [IMAGE_TOKEN] * (16 + 2 * 9) + [7]]), pixel_values=pixels["pixel_values"],
              image_sizes=pixels["image_sizes"], batch_num_images=pixels["batch_num_images"])
    with torch.no_grad():
        np.testing.assert_allclose(back.eval()(**kw).logits.numpy(), source(**kw).logits.numpy(), atol=1e-5)


def test_a_video_beside_an_image_equals_transformers(onevision):
    """A video (each frame one crop, its 4 x 4 features pooled to 2 x 2, then a newline) in a prompt with an image (the
    prompt's only image: its crops); transformers' greedy tokens on the frames as ours processes them."""
    path, model = onevision
    clip = np.random.default_rng(7).integers(0, 256, (3, 40, 24, 3), dtype=np.uint8)
    prompt = [5, VIDEO_TOKEN, 6, IMAGE_TOKEN, 7]
    media = {"image": [IMAGES[0][0]], "video": [clip]}
    eng = image_engine(path, max_model_len=256)
    video = eng.images.prepare_video(clip)
    assert video.pixels.shape == (3, 3, 32, 32) and eng.images.num_tokens(video) == 3 * 4 + 1
    fields = {k: v for k, v in TOWERS["siglip"][2].items() if k != "image_processor_type"}
    image = transformers.LlavaOnevisionImageProcessorPil(**fields, image_grid_pinpoints=PINPOINTS)([media["image"]],
                                                                                                     return_tensors="pt")
    ids = [5] + [VIDEO_TOKEN] * 13 + [6] + [IMAGE_TOKEN] * (16 + 2 * 9) + [7]
    out: list[int] = []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = model(input_ids=torch.tensor([ids + out]), pixel_values=image["pixel_values"],
                           image_sizes=image["image_sizes"], batch_num_images=image["batch_num_images"],
                           pixel_values_videos=torch.from_numpy(video.pixels)[None]).logits[0, -1]
            out.append(int(logits.argmax()))
    eng.add_request("v", prompt, GREEDY, multi_modal_data=media)
    done = drain(eng)["v"]
    assert done.prompt_token_ids == ids and list(done.outputs[0].token_ids) == out
    eng.check_integrity()
