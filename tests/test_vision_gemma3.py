"""Gemma 3's image side against transformers: its config's fields and refusals, the image processor's pixels, the
SigLIP tower and pooling projector's embeddings, the weights under each of their names, the language model served
from the image-text checkpoint, and `jaxserve convert` writing the whole model back."""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxserve.errors import UnsupportedModelError  # noqa: E402
from jaxserve.images import ImageError, ImageProcessor  # noqa: E402
from jaxserve.loader import load_params, load_vision, open_checkpoint  # noqa: E402
from jaxserve.models.inputs import KVCache, ModelInputs  # noqa: E402
from jaxserve.models.params import param_paths  # noqa: E402
from jaxserve.models.vision import VisionConfig, encode_images, random_vision_params, vision_tensors  # noqa: E402
from tests.gemma3_vision_model import (  # noqa: E402
    BOI,
    DOUBLE_NEWLINE,
    EOI,
    FIRST_WORD,
    IMAGE,
    NEWLINE,
    PROCESSOR,
    TOKENS_PER_IMAGE,
    TRIPLE_NEWLINE,
    VOCAB,
    gemma3_tokenizer,
    save_tiny_gemma3,
)
from tests.llava_model import random_image  # noqa: E402
from tests.modelrun import bucket, jitted, pages_for, prompt_logits  # noqa: E402

# google/gemma-3-4b-it's config.json, as the Hub has it (its text_config cut to what matters here).
HUB_CONFIG = {
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "boi_token_index": 255999,
    "eoi_token_index": 256000, "image_token_index": 262144, "mm_tokens_per_image": 256, "initializer_range": 0.02,
    "text_config": {"hidden_size": 2560, "model_type": "gemma3_text", "num_hidden_layers": 34},
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                      "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                      "patch_size": 14, "vision_use_head": False},
}


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3")
    model = save_tiny_gemma3(path)
    ckpt = open_checkpoint(str(path))
    cfg = ckpt.config()
    vcfg, vparams = load_vision(ckpt, cfg, jnp.float32)
    return path, model, cfg, vcfg, vparams


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))


def test_config_fields(gemma3):
    path, model, cfg, vcfg, _ = gemma3
    assert (vcfg.tower, vcfg.projector, vcfg.post_norm, vcfg.bidirectional) == ("siglip", "gemma3", True, True)
    assert (vcfg.boi_token_id, vcfg.eoi_token_id, vcfg.image_token_id) == (BOI, EOI, IMAGE)
    assert vcfg.tokens_per_image == TOKENS_PER_IMAGE and vcfg.num_patches == 64
    assert vcfg.feature_layers == (2,) and not vcfg.drop_first
    assert (vcfg.hidden_size, vcfg.text_hidden_size, vcfg.layer_norm_eps) == (32, 64, 1e-6)
    assert cfg.family == "gemma3" and cfg.num_layers == 3 and cfg.vocab_size == VOCAB
    # The Hub's defaults for what a config leaves out, and Gemma 3 4B's pooling: 64 x 64 patches to 16 x 16.
    hub = VisionConfig.from_hf(HUB_CONFIG)
    assert (hub.boi_token_id, hub.eoi_token_id, hub.image_token_id, hub.tokens_per_image) == (
        255999, 256000, 262144, 256)
    assert (hub.num_patches, hub.text_hidden_size, hub.num_layers, hub.hidden_act) == (
        4096, 2560, 27, "gelu_pytorch_tanh")
    bare = {k: v for k, v in HUB_CONFIG.items() if not k.endswith(("_index", "_per_image"))}
    assert VisionConfig.from_hf(bare) == hub
    # transformers' `_id` spellings of the same settings.
    assert VisionConfig.from_hf({**bare, "image_token_id": 9, "boi_token_id": 8}).image_token_id == 9
    llava = VisionConfig.from_hf({"architectures": ["LlavaForConditionalGeneration"]})
    assert not llava.bidirectional and llava.boi_token_id is None and llava.projector == "mlp"


@pytest.mark.parametrize("change,message", [
    ({"mm_tokens_per_image": 255}, "mm_tokens_per_image 255"),  # not a square
    ({"mm_tokens_per_image": 9}, "mm_tokens_per_image 9"),  # 3 x 3 blocks do not tile 64 x 64 patches
    ({"vision_config": {"model_type": "clip_vision_model"}}, "clip_vision_model"),
])
def test_config_refusals(change, message):
    with pytest.raises(UnsupportedModelError, match=message):
        VisionConfig.from_hf({**HUB_CONFIG, **change})


def hf_processor(**config):
    """transformers' PIL processor of a config; its nulls left to the defaults, as `Gemma3Processor` fills them
    (do_convert_rgb true, do_pan_and_scan false) when it serves the model."""
    fields = {k: v for k, v in config.items()
              if v is not None and k not in ("image_processor_type", "processor_class", "image_seq_length")}
    return transformers.Gemma3ImageProcessorPil(**fields)


@pytest.mark.parametrize("size,mode", [((45, 37), "RGB"), ((20, 13), "RGBA"), ((32, 32), "RGB"), ((9, 70), "RGB"),
                                       ((300, 200), "RGB")])
def test_processor_equals_transformers(size, mode):
    """Larger, smaller, square and long images: resized to 32 x 32 (bilinear), rescaled and normalized."""
    image = random_image(3, size, mode)
    ours = ImageProcessor.from_dict(PROCESSOR)(image)
    ref = hf_processor(**PROCESSOR)(image, return_tensors="np")["pixel_values"][0]
    assert ours.shape == ref.shape == (3, 32, 32)
    np.testing.assert_allclose(ours, ref, atol=1e-6)


def test_processor_defaults_equal_transformers():
    """A config naming the class alone: transformers' defaults (224 x 224, bilinear, mean and std 0.5); the Fast
    and Pil class names read alike, and a center crop (which Gemma 3's processor never does) is not made."""
    image = random_image(5, (300, 170))
    ref = hf_processor()(image, return_tensors="np")["pixel_values"][0]
    assert ref.shape == (3, 224, 224)
    for kind in ("Gemma3ImageProcessor", "Gemma3ImageProcessorFast", "Gemma3ImageProcessorPil"):
        ours = ImageProcessor.from_dict({"image_processor_type": kind, "do_center_crop": True,
                                         "crop_size": {"height": 100, "width": 100}})(image)
        np.testing.assert_allclose(ours, ref, atol=1e-6)
    # SigLIP's own default filter is bicubic: Gemma 3's bilinear is its own.
    siglip = ImageProcessor.from_dict({"image_processor_type": "SiglipImageProcessor"})
    assert (siglip.resample, ImageProcessor.from_dict(PROCESSOR).resample) == (3, 2)


PAN_AND_SCAN = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 10, "pan_and_scan_max_num_crops": 3}


@pytest.mark.parametrize("size,crops", [((95, 30), 3), ((30, 71), 2), ((200, 20), 3), ((36, 30), 0), ((51, 40), 2),
                                        ((17, 12), 0), ((64, 64), 0)])
def test_pan_and_scan_equals_transformers(size, crops):
    """Gemma 3's pan and scan: a long image also cut along its long side (about as many crops as its ratio, at most
    3 here, none under 10 pixels a side; the last crop stops at the edge), each crop processed as an image."""
    image = random_image(7, size)
    config = {**PROCESSOR, **PAN_AND_SCAN, "pan_and_scan_min_ratio_to_activate": 1.25}
    ours = ImageProcessor.from_dict(config)(image)
    ref = hf_processor(**config)(image, return_tensors="np")
    assert list(ref["num_crops"]) == [crops]
    assert ours.shape == ref["pixel_values"].shape[crops == 0:] == ((crops + 1,) if crops else ()) + (3, 32, 32)
    np.testing.assert_allclose(ours, ref["pixel_values"][0] if crops == 0 else ref["pixel_values"], atol=1e-6)


def test_pan_and_scan_defaults_are_the_processors():
    """Its settings left null (as the Hub's configs leave them): crops of at least 256 pixels, at most 4, for images
    whose sides differ by 1.2 times or more, as `Gemma3Processor` fills them."""
    processor = ImageProcessor.from_dict({**PROCESSOR, "do_pan_and_scan": True})
    assert (processor.pan_and_scan.min_crop, processor.pan_and_scan.max_crops,
            processor.pan_and_scan.min_ratio) == (256, 4, 1.2)
    assert processor.pan_and_scan.boxes(1200, 300) == [(0, 0, 300, 300), (300, 0, 600, 300), (600, 0, 900, 300),
                                                     (900, 0, 1200, 300)]
    assert processor.pan_and_scan.boxes(500, 300) == []  # 250-pixel crops: too small
    assert ImageProcessor.from_dict(PROCESSOR).pan_and_scan is None
    with pytest.raises(ImageError, match="pan_and_scan_min_crop_size >= 1 \\(got 0\\)"):
        ImageProcessor.from_dict({**PROCESSOR, **PAN_AND_SCAN, "pan_and_scan_min_crop_size": 0})


def test_image_embeddings_equal_transformers(gemma3):
    path, model, cfg, vcfg, vparams = gemma3
    images = [random_image(1), random_image(2, (30, 70)), random_image(4, (64, 64))]
    pixels = np.stack([ImageProcessor.from_dir(str(path))(im) for im in images])
    ours = np.asarray(encode_images(vparams, vcfg, jnp.asarray(pixels)))
    with torch.no_grad():
        ref = model.get_image_features(torch.tensor(pixels), return_dict=True).pooler_output.numpy()
    assert ours.shape == ref.shape == (3, TOKENS_PER_IMAGE, cfg.hidden_size)
    np.testing.assert_allclose(ours, ref, atol=1e-5 * np.abs(ref).max(), rtol=1e-5)


def _renamed(src, dst, rename) -> None:
    """A copy of the checkpoint directory `src` in `dst` with its tensors renamed by `rename` (None: dropped)."""
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    save_file({rename(k): v for k, v in tensors.items() if rename(k) is not None}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})


def _hub_name(name: str) -> str:
    """The Hub's names: the tower under `vision_tower.vision_model.`."""
    return name.replace("vision_tower.", "vision_tower.vision_model.", 1)


def _module_name(name: str) -> str:
    """The names of transformers 5's modules (`model.vision_tower.`, `model.language_model.`, an `lm_head`)."""
    if name.startswith("language_model.model."):
        return "model.language_model." + name.removeprefix("language_model.model.")
    return "model." + name


@pytest.mark.parametrize("rename", [_hub_name, _module_name])
def test_loads_under_each_name_form(gemma3, tmp_path, rename):
    """The Hub's names and transformers 5's module names give the weights the saved names give, the decoder's
    and the vision side's; vision tensors are never taken for decoder ones."""
    path, model, cfg, vcfg, vparams = gemma3
    _renamed(path, tmp_path / "renamed", rename)
    ckpt = open_checkpoint(str(tmp_path / "renamed"))
    names = ckpt.tensor_names()
    prefixes = {"vision_tower.vision_model.", "multi_modal_projector.", "language_model.model."}
    if rename is _module_name:
        prefixes = {"model.vision_tower.embeddings.", "model.multi_modal_projector.", "model.language_model.layers."}
    assert all(any(n.startswith(p) for n in names) for p in prefixes)
    again_cfg, again = ckpt.config(), load_params(ckpt, cfg, jnp.float32, progress=False)
    assert again_cfg == cfg
    want = param_paths(load_params(open_checkpoint(str(path)), cfg, jnp.float32, progress=False))
    for key, value in param_paths(again).items():
        np.testing.assert_array_equal(np.asarray(value), np.asarray(want[key]), err_msg=key)
    vcfg2, vparams2 = load_vision(ckpt, cfg, jnp.float32)
    assert vcfg2 == vcfg
    for (name, a), (_, b) in zip(vision_tensors(vparams2, vcfg), vision_tensors(vparams, vcfg), strict=True):
        np.testing.assert_array_equal(a, b, err_msg=name)


def test_missing_projector_refused(gemma3, tmp_path):
    path, _, cfg, _, _ = gemma3
    _renamed(path, tmp_path / "cut", lambda n: None if "mm_soft_emb_norm" in n else n)
    ckpt = open_checkpoint(str(tmp_path / "cut"))
    with pytest.raises(UnsupportedModelError, match="mm_soft_emb_norm"):
        load_vision(ckpt, cfg, jnp.float32)


def test_text_logits_equal_transformers(gemma3):
    """The language model served from the image-text checkpoint: a prompt without images (past the sliding
    window) gives transformers' logits."""
    path, model, cfg, _, _ = gemma3
    ids = np.random.default_rng(1).integers(FIRST_WORD, VOCAB, 30).tolist()
    params = load_params(open_checkpoint(str(path)), cfg, jnp.float32, progress=False)
    ours = prompt_logits(cfg, params, ids)
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids])).logits[0].numpy()
    assert rel_err(ours, ref) < 1e-4
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_transformers_prompt_layout(gemma3):
    """What transformers' Gemma3Processor makes of the tiny model's chat template with an image, the layout the
    engine must reproduce: `<start_of_image>` becomes "\\n\\n", `<start_of_image>`, the soft tokens,
    `<end_of_image>`, "\\n\\n", tokenized with the text around it, so the template's "user\\n" and the first
    "\\n\\n" are one "\\n\\n\\n" token; token_type_ids mark the soft tokens alone."""
    path = gemma3[0]
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(path))
    processor = transformers.Gemma3Processor(image_processor=hf_processor(**PROCESSOR), tokenizer=hf_tok,
                                             image_seq_length=TOKENS_PER_IMAGE)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "t30 t31"}]}]
    text = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert gemma3_tokenizer().encode(text)[:5] == [2, 3, FIRST_WORD - 3, NEWLINE, BOI]  # bos, turn, user, \n
    out = processor(text=[text], images=[[random_image(1)]], return_tensors="np")
    ids, types = out["input_ids"][0].tolist(), out["token_type_ids"][0].tolist()
    n = TOKENS_PER_IMAGE
    assert ids[:6 + n] == [2, 3, FIRST_WORD - 3, TRIPLE_NEWLINE, BOI] + [IMAGE] * n + [EOI]
    assert ids[5 + n:9 + n] == [EOI, DOUBLE_NEWLINE, 30, 31]
    assert types == [int(i == IMAGE) for i in ids]


def test_image_embeddings_enter_the_decoder_unscaled(gemma3):
    """An image laid out as Gemma 3's processor lays it out ("\\n\\n", `<start_of_image>`, its soft tokens,
    `<end_of_image>`, "\\n\\n"): the decoder takes its embeddings as they are, not scaled by sqrt(hidden) as
    Gemma scales text embeddings. Compared with transformers without token_type_ids, whose attention is then
    causal throughout, as this decoder's is without the engine's image spans."""
    path, model, cfg, vcfg, vparams = gemma3
    tok = gemma3_tokenizer()
    assert tok.encode("\n\n") == [DOUBLE_NEWLINE]
    image_run = [DOUBLE_NEWLINE, BOI] + [IMAGE] * TOKENS_PER_IMAGE + [EOI, DOUBLE_NEWLINE]
    ids = [2, FIRST_WORD, FIRST_WORD + 3] + image_run + [FIRST_WORD + 7, FIRST_WORD + 1]
    pixels = ImageProcessor.from_dir(str(path))(random_image(6, (50, 40)))[None]
    embeds = np.asarray(encode_images(vparams, vcfg, jnp.asarray(pixels)))[0]
    T = bucket(len(ids))
    table = np.zeros((T, cfg.hidden_size), np.float32)
    mask = np.zeros(T, np.bool_)
    where = np.flatnonzero(np.asarray(ids) == IMAGE)
    table[where], mask[where] = embeds, True
    inputs = ModelInputs.build([(ids, 0, pages_for(0, len(ids), 16, stride=3))], 16, num_tokens=T, num_seqs=1,
                               pages_per_seq=16, all_logits=True)
    inputs = dataclasses.replace(inputs, image_embeds=jnp.asarray(table), image_mask=jnp.asarray(mask))
    params = load_params(open_checkpoint(str(path)), cfg, jnp.float32, progress=False)
    logits, _ = jitted("xla")(params, KVCache.allocate(cfg, 64, 16, jnp.float32), inputs, cfg, "xla")
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids]), pixel_values=torch.tensor(pixels)).logits[0].numpy()
    ours = np.asarray(logits)[: len(ids)]
    assert rel_err(ours, ref) < 1e-4
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_random_vision_params_run(gemma3):
    """`--load-format dummy`: random weights of the checkpoint's shapes, which encode images."""
    _, _, cfg, vcfg, vparams = gemma3
    params = random_vision_params(vcfg, jnp.float32, seed=3)
    shapes = lambda p: [(n, a.shape) for n, a in vision_tensors(p, vcfg)]  # noqa: E731
    assert shapes(params) == shapes(vparams)
    out = np.asarray(encode_images(params, vcfg, jnp.zeros((2, 3, 32, 32))))
    assert out.shape == (2, TOKENS_PER_IMAGE, cfg.hidden_size) and np.isfinite(out).all()


def test_convert_writes_the_whole_model(gemma3, tmp_path):
    """`jaxserve convert` of Gemma 3: the Hub's names, every weight transformers expects, the source's image
    features and text logits from what transformers reads back, and our own weights again on reading it."""
    from safetensors import safe_open

    from jaxserve.engine.model_loading import load_model
    from jaxserve.engine_args import EngineArgs
    from jaxserve.loader.export import export_hf

    path, model, cfg, vcfg, vparams = gemma3
    loaded = load_model(EngineArgs(model=str(path), dtype="float32"), progress=False)
    out = tmp_path / "out"
    export_hf(str(out), loaded.config, loaded.params, loaded.tokenizer, vision=loaded.vision)
    with safe_open(str(out / "model.safetensors"), "numpy") as f:
        names = set(f.keys())
    assert "multi_modal_projector.mm_input_projection_weight" in names
    assert "vision_tower.vision_model.post_layernorm.weight" in names
    assert "language_model.model.embed_tokens.weight" in names
    assert json.loads((out / "preprocessor_config.json").read_text())["image_processor_type"] == "Gemma3ImageProcessor"
    back, info = transformers.Gemma3ForConditionalGeneration.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    pixels = torch.tensor(ImageProcessor.from_dir(str(out))(random_image(7))[None])
    ids = torch.tensor([np.random.default_rng(2).integers(FIRST_WORD, VOCAB, 20).tolist()])
    with torch.no_grad():
        np.testing.assert_allclose(back.eval().get_image_features(pixels).pooler_output.numpy(),
                                   model.get_image_features(pixels).pooler_output.numpy(), atol=1e-6)
        np.testing.assert_allclose(back(input_ids=ids).logits.numpy(), model(input_ids=ids).logits.numpy(),
                                   atol=1e-5)
    ckpt = open_checkpoint(str(out))
    assert ckpt.config() == cfg
    vcfg2, vparams2 = load_vision(ckpt, cfg, jnp.float32)
    assert vcfg2 == vcfg
    for (name, a), (_, b) in zip(vision_tensors(vparams2, vcfg), vision_tensors(vparams, vcfg), strict=True):
        np.testing.assert_array_equal(a, b, err_msg=name)
