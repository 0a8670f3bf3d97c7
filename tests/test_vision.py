"""LLaVA-style image-text models against transformers: the image processors' pixels, the vision tower and
projector's embeddings, and the decoder's logits over a prompt holding images."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxserve.images import ImageError, ImageProcessor, load_image  # noqa: E402
from jaxserve.loader import load_params, load_vision, open_checkpoint  # noqa: E402
from jaxserve.models.inputs import KVCache, ModelInputs  # noqa: E402
from jaxserve.models.vision import encode_images  # noqa: E402
from tests.llava_model import IMAGE_TOKEN, PINPOINTS, TOWERS, random_image, save_tiny_llava  # noqa: E402
from tests.modelrun import bucket, jitted, pages_for  # noqa: E402

# The tower's variants: which hidden states it reads and whether the first token is dropped.
VARIANTS = {"clip": ("clip", -2, "default"), "siglip": ("siglip", -1, "full"),
            "clip_layers": ("clip", [-3, -1], "full")}


@pytest.fixture(scope="module", params=list(VARIANTS))
def llava(request, tmp_path_factory):
    tower, layer, strategy = VARIANTS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    model = save_tiny_llava(path, tower, layer, strategy)
    ckpt = open_checkpoint(str(path))
    cfg = ckpt.config()
    params = load_params(ckpt, cfg, jnp.float32, progress=False)
    vcfg, vparams = load_vision(ckpt, cfg, jnp.float32)
    return path, model, cfg, params, vcfg, vparams


def hf_processor(tower: str):
    cls = {"clip": transformers.CLIPImageProcessorPil, "siglip": transformers.SiglipImageProcessorPil}[tower]
    fields = {k: v for k, v in TOWERS[tower][2].items() if k != "image_processor_type"}
    return cls(**fields)


@pytest.mark.parametrize("tower", ["clip", "siglip"])
@pytest.mark.parametrize("size,mode", [((45, 37), "RGB"), ((20, 64), "RGBA"), ((32, 32), "RGB"), ((9, 50), "RGB")])
def test_processor_equals_transformers(tower, size, mode):
    image = random_image(3, size, mode)
    ours = ImageProcessor.from_dict(TOWERS[tower][2])(image)
    ref = hf_processor(tower)(image, return_tensors="np")["pixel_values"][0]
    assert ours.shape == ref.shape == (3, 32, 32)
    np.testing.assert_allclose(ours, ref, atol=1e-6)


def _hf_pixels(tower: str, images) -> torch.Tensor:
    return torch.tensor(np.stack([hf_processor(tower)(im, return_tensors="np")["pixel_values"][0] for im in images]))


def test_image_embeddings_equal_transformers(llava):
    path, model, cfg, params, vcfg, vparams = llava
    images = [random_image(1), random_image(2, (30, 70))]
    pixels = np.stack([ImageProcessor.from_dir(str(path))(im) for im in images])
    ours = np.asarray(encode_images(vparams, vcfg, jnp.asarray(pixels)))
    with torch.no_grad():
        ref = model.model.get_image_features(pixel_values=torch.tensor(pixels), return_dict=True).pooler_output
    ref = np.stack([r.numpy() for r in ref])
    assert ours.shape == ref.shape == (2, vcfg.tokens_per_image, cfg.hidden_size)
    np.testing.assert_allclose(ours, ref, atol=2e-5, rtol=1e-4)


def test_logits_with_images_equal_transformers(llava):
    """Two images inside a prompt, through the decoder: every position's logits equal transformers'."""
    path, model, cfg, params, vcfg, vparams = llava
    n = vcfg.tokens_per_image
    rng = np.random.default_rng(5)
    text = lambda k: rng.integers(2, IMAGE_TOKEN, k).tolist()  # noqa: E731
    ids = text(5) + [IMAGE_TOKEN] * n + text(3) + [IMAGE_TOKEN] * n + text(4)
    images = [random_image(7), random_image(8, (60, 20))]
    pixels = np.stack([ImageProcessor.from_dir(str(path))(im) for im in images])
    embeds = np.asarray(encode_images(vparams, vcfg, jnp.asarray(pixels))).reshape(-1, cfg.hidden_size)
    T = bucket(len(ids))
    table = np.zeros((T, cfg.hidden_size), np.float32)
    mask = np.zeros(T, np.bool_)
    where = np.flatnonzero(np.asarray(ids) == IMAGE_TOKEN)
    table[where], mask[where] = embeds, True
    page_size = 16
    pages = pages_for(0, len(ids), page_size, stride=3)
    inputs = ModelInputs.build([(ids, 0, pages)], page_size, num_tokens=T, num_seqs=1, pages_per_seq=16,
                               all_logits=True)
    inputs = dataclasses.replace(inputs, image_embeds=jnp.asarray(table), image_mask=jnp.asarray(mask))
    kv = KVCache.allocate(cfg, 64, page_size, jnp.float32)
    logits, _ = jitted("xla")(params, kv, inputs, cfg, "xla")
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids]), pixel_values=torch.tensor(pixels)).logits[0].numpy()
    ours = np.asarray(logits)[: len(ids)]
    assert np.linalg.norm(ours - ref) / np.linalg.norm(ref) < 1e-4
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.parametrize("size", [(45, 37), (20, 64), (90, 31), (32, 32), (200, 13)])
def test_anyres_crops_equal_transformers(size):
    """LLaVA-NeXT's crops: the whole image, then the best grid's crops of it resized and padded."""
    image = random_image(6, size)
    config = {**TOWERS["clip"][2], "image_processor_type": "LlavaNextImageProcessor", "image_grid_pinpoints": PINPOINTS}
    ours = ImageProcessor.from_dict(config)(image)
    fields = {k: v for k, v in config.items() if k != "image_processor_type"}
    ref = transformers.LlavaNextImageProcessorPil(**fields)(image, return_tensors="np")["pixel_values"][0]
    assert ours.shape == ref.shape and ours.shape[0] in (3, 5, 4)
    np.testing.assert_allclose(ours, ref, atol=1e-6)


@pytest.mark.parametrize("size", [(45, 37), (90, 31), (30, 64)])
def test_anyres_logits_equal_transformers(tmp_path, size):
    """A LLaVA-NeXT image (its token count by its size: the whole image's, the grid's unpadded rows, a newline
    each) through the decoder: logits equal transformers'."""
    from jaxserve.engine.multimodal import ImageEncoder

    model = save_tiny_llava(tmp_path, anyres=True)
    ckpt = open_checkpoint(str(tmp_path))
    cfg = ckpt.config()
    params = load_params(ckpt, cfg, jnp.float32, progress=False)
    encoder = ImageEncoder(*load_vision(ckpt, cfg, jnp.float32), ImageProcessor.from_dir(str(tmp_path)))
    image = random_image(9, size)
    ids, prompt = encoder.prompt([5, 6, IMAGE_TOKEN, 7, 8], [image])
    (start, n), = prompt.spans
    assert n == encoder.num_tokens(encoder.prepare(image)) > encoder.cfg.tokens_per_image
    T = bucket(len(ids), 16)
    table = np.zeros((T, cfg.hidden_size), np.float32)
    mask = np.zeros(T, np.bool_)
    table[start:start + n], mask[start:start + n] = prompt.embeds(0), True
    inputs = ModelInputs.build([(ids, 0, pages_for(0, len(ids), 16, stride=2))], 16, num_tokens=T, num_seqs=1,
                               pages_per_seq=16, all_logits=True)
    inputs = dataclasses.replace(inputs, image_embeds=jnp.asarray(table), image_mask=jnp.asarray(mask))
    logits, _ = jitted("xla")(params, KVCache.allocate(cfg, 64, 16, jnp.float32), inputs, cfg, "xla")
    hf = transformers.LlavaNextImageProcessorPil(**{k: v for k, v in TOWERS["clip"][2].items()
                                                    if k != "image_processor_type"}, image_grid_pinpoints=PINPOINTS)
    pixels = hf(image, return_tensors="pt")
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids]), pixel_values=pixels["pixel_values"],
                    image_sizes=pixels["image_sizes"]).logits[0].numpy()
    ours = np.asarray(logits)[: len(ids)]
    assert np.linalg.norm(ours - ref) / np.linalg.norm(ref) < 1e-4
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_load_image_sources(tmp_path):
    import base64
    import io

    image = random_image(4)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    png = buf.getvalue()
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    assert np.array_equal(np.array(load_image(url)), np.array(image))
    assert np.array_equal(np.array(load_image(png)), np.array(image))
    (tmp_path / "a.png").write_bytes(png)
    assert np.array_equal(np.array(load_image(f"file://{tmp_path}/a.png", allowed_local_path=str(tmp_path))),
                          np.array(image))
    for source, allowed, message in [
        (str(tmp_path / "a.png"), None, "--allowed-local-media-path"),
        (str(tmp_path / "a.png"), str(tmp_path / "sub"), "outside the allowed directory"),
        ("data:image/png;base64,@@@", None, "not valid base64"),
        ("data:text/plain;base64,aGk=", None, "data:image/<type>;base64"),
        ("data:image/png;base64," + base64.b64encode(b"not a png").decode(), None, "not an image Pillow can read"),
        ("ftp://host/a.png", None, "scheme 'ftp'"),
        (42, None, "got int"),
    ]:
        with pytest.raises(ImageError, match=message):
            load_image(source, allowed_local_path=allowed)


@pytest.mark.parametrize("anyres", [False, True])
def test_convert_writes_the_whole_image_text_model(tmp_path, anyres):
    """`jaxserve convert` of a LLaVA (-NeXT) model: transformers reads every weight back and computes the source's
    logits over an image."""
    from jaxserve.engine.model_loading import load_model
    from jaxserve.engine_args import EngineArgs
    from jaxserve.loader.export import export_hf

    source = save_tiny_llava(tmp_path / "src", anyres=anyres)
    loaded = load_model(EngineArgs(model=str(tmp_path / "src"), dtype="float32"), progress=False)
    export_hf(str(tmp_path / "out"), loaded.config, loaded.params, loaded.tokenizer, vision=loaded.vision)
    cls = type(source)
    back, info = cls.from_pretrained(str(tmp_path / "out"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    image = random_image(4, (40, 70))
    processor = (transformers.LlavaNextImageProcessorPil(image_grid_pinpoints=PINPOINTS, **{
        k: v for k, v in TOWERS["clip"][2].items() if k != "image_processor_type"}) if anyres else hf_processor("clip"))
    pixels = processor(image, return_tensors="pt")
    n = loaded.vision.num_tokens(loaded.vision.prepare(image))
    ids = torch.tensor([[5, 6] + [IMAGE_TOKEN] * n + [7]])
    extra = {"image_sizes": pixels["image_sizes"]} if anyres else {}
    with torch.no_grad():
        want = source(input_ids=ids, pixel_values=pixels["pixel_values"], **extra).logits
        got = back.eval()(input_ids=ids, pixel_values=pixels["pixel_values"], **extra).logits
    np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-5)
