"""The Pixtral image side (Mistral 3's and LLaVA-over-Pixtral's) against transformers: the config's fields and
refusals, the image processor's pixels, the tower and projector's embeddings (alone, and several images in one
bucket), that the rotary positions, the merger's order and the per-image attention matter, the prompt's layout and
the weights under each of their names."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.numpy import load_file  # noqa: E402

from jaxserve.errors import UnsupportedModelError  # noqa: E402
from jaxserve.images import ImageError  # noqa: E402
from jaxserve.images_pixtral import PixtralImageProcessor  # noqa: E402
from jaxserve.models import vision_blocks, vision_pixtral  # noqa: E402
from jaxserve.models.vision_pixtral import (  # noqa: E402
    PixtralVisionConfig,
    is_pixtral_vision_tensor,
    load_pixtral_vision_params,
    pixtral_encode,
    pixtral_encode_many,
    pixtral_grid,
    pixtral_prompt_tokens,
    pixtral_vision_tensors,
    random_pixtral_vision_params,
)
from tests.llava_model import random_image  # noqa: E402
from tests.pixtral_model import IMAGE_BREAK, IMAGE_END, IMAGE_TOKEN, KINDS, PROCESSOR, save_tiny_pixtral  # noqa: E402

# mistralai/Mistral-Small-3.1-24B-Instruct-2503's and mistral-community/pixtral-12b's config.json, as the Hub has
# them (cut to what matters here).
HUB_MISTRAL3 = {
    "architectures": ["Mistral3ForConditionalGeneration"], "model_type": "mistral3", "image_token_index": 10,
    "multimodal_projector_bias": False, "projector_hidden_act": "gelu", "spatial_merge_size": 2,
    "vision_feature_layer": -1,
    "text_config": {"hidden_size": 5120, "model_type": "mistral", "rms_norm_eps": 1e-05},
    "vision_config": {"head_dim": 64, "hidden_act": "silu", "hidden_size": 1024, "image_size": 1540,
                      "intermediate_size": 4096, "model_type": "pixtral", "num_attention_heads": 16,
                      "num_channels": 3, "num_hidden_layers": 24, "patch_size": 14, "rope_theta": 10000.0},
}
HUB_PIXTRAL = {
    "architectures": ["LlavaForConditionalGeneration"], "model_type": "llava", "image_token_index": 10,
    "projector_hidden_act": "gelu", "vision_feature_layer": -1, "vision_feature_select_strategy": "full",
    "text_config": {"hidden_size": 5120, "model_type": "mistral", "rms_norm_eps": 1e-05},
    "vision_config": {"head_dim": 64, "hidden_act": "silu", "image_size": 1024, "model_type": "pixtral",
                      "num_hidden_layers": 24, "patch_size": 16, "rope_theta": 10000.0},
}
# (width, height) in pixels: sides not multiples of the patch, one scaled down to fit 64 pixels.
ENCODER_IMAGES = ((45, 37), (100, 30), (16, 24))


@pytest.fixture(scope="module")
def pixtral(tmp_path_factory):
    """Each kind's torch model, config, our float32 weights read from its saved checkpoint, and the tensors."""
    out = {}
    for kind in KINDS:
        path = tmp_path_factory.mktemp(kind)
        model = save_tiny_pixtral(path, kind)
        with open(os.path.join(path, "config.json")) as f:
            cfg = PixtralVisionConfig.from_hf(json.load(f))
        tensors = load_file(os.path.join(path, "model.safetensors"))
        out[kind] = model, cfg, load_pixtral_vision_params(cfg, tensors.items(), jnp.float32), tensors
    return out


@pytest.fixture(scope="module")
def processed(pixtral):
    """Each kind's processed pixels [C, H, W] of ENCODER_IMAGES."""
    images = [random_image(i, size) for i, size in enumerate(ENCODER_IMAGES)]
    out = {}
    for kind in KINDS:
        processor = PixtralImageProcessor.from_dict(PROCESSOR, pixtral[kind][1].spatial_merge_size)
        out[kind] = [processor(im) for im in images]
    return out


def fresh_jit():
    """`_encode_padded` jitted anew, traced again (jax reuses a trace of the same function object): it sees what a
    test patched."""
    return jax.jit(lambda *args: vision_pixtral._encode_padded(*args), static_argnums=1)


def reference(model, images: list[np.ndarray]) -> list[np.ndarray]:
    """transformers' image features (the projector's output, split per image) for pixels [C, H, W], run as one
    batch padded to the largest (as its processor pads them)."""
    H, W = max(p.shape[1] for p in images), max(p.shape[2] for p in images)
    batch = np.stack([np.pad(p, ((0, 0), (0, H - p.shape[1]), (0, W - p.shape[2]))) for p in images])
    with torch.no_grad():
        feats = model.model.get_image_features(torch.tensor(batch), image_sizes=torch.tensor(
            [p.shape[1:] for p in images])).pooler_output
    return [f.numpy() for f in feats]


def test_config_fields(pixtral):
    _, cfg, _, _ = pixtral["mistral3"]
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.intermediate_size, cfg.head_dim) == (32, 2, 2, 48, 16)
    assert (cfg.patch_size, cfg.spatial_merge_size, cfg.text_hidden_size, cfg.projector_bias) == (4, 2, 64, False)
    assert (cfg.image_token_id, cfg.image_break_token_id, cfg.projector_norm_eps) == (IMAGE_TOKEN, None, 1e-5)
    _, llava, _, _ = pixtral["llava"]
    assert (llava.projector, llava.spatial_merge_size, llava.projector_bias, llava.layers_run) == ("llava", 1, True, 2)
    hub = PixtralVisionConfig.from_hf(HUB_MISTRAL3)
    assert (hub.hidden_size, hub.num_layers, hub.patch_size, hub.image_size, hub.hidden_act, hub.rope_theta) == (
        1024, 24, 14, 1540, "silu", 10000.0)
    assert (hub.text_hidden_size, hub.image_token_id, hub.projector_norm_eps, hub.layers_run) == (5120, 10, 1e-5, 24)
    # transformers' defaults fill what a config leaves out: Mistral3Config's own tower when there is none,
    # PixtralVisionConfig's where a vision_config is there (patches of 16, gelu).
    theta = {**HUB_MISTRAL3, "vision_config": {**HUB_MISTRAL3["vision_config"], "rope_theta": None,
                                                "rope_parameters": {"rope_type": "axial", "rope_theta": 500.0}}}
    assert PixtralVisionConfig.from_hf(theta).rope_theta == 500.0
    bare = PixtralVisionConfig.from_hf({"architectures": ["Mistral3ForConditionalGeneration"]})
    assert (bare.patch_size, bare.image_size, bare.text_hidden_size, bare.image_token_id) == (14, 1540, 5120, 10)
    pix = PixtralVisionConfig.from_hf(HUB_PIXTRAL)
    assert (pix.projector, pix.hidden_size, pix.patch_size, pix.projector_bias, pix.hidden_act) == (
        "llava", 1024, 16, True, "silu")
    assert PixtralVisionConfig.from_hf({"architectures": ["LlavaForConditionalGeneration"],
                                        "vision_config": {"model_type": "clip_vision_model"}}) is None
    assert PixtralVisionConfig.from_hf({"architectures": ["LlavaForConditionalGeneration"]}) is None
    assert PixtralVisionConfig.from_hf({"architectures": ["MistralForCausalLM"]}) is None


@pytest.mark.parametrize("base,change,message", [
    (HUB_MISTRAL3, {"vision_config": {"hidden_act": "relu6"}}, "relu6"),
    (HUB_MISTRAL3, {"projector_hidden_act": "tanh"}, "tanh"),
    (HUB_MISTRAL3, {"vision_config": {"patch_size": [14, 16]}}, "square"),
    (HUB_MISTRAL3, {"vision_config": {"num_attention_heads": 32, "hidden_size": 1056}}, "divisible by 4"),
    (HUB_MISTRAL3, {"vision_config": {"rope_parameters": {"rope_type": "yarn"}}}, "yarn"),
    (HUB_MISTRAL3, {"vision_feature_layer": [-1, -2]}, "vision_feature_layer"),
    (HUB_MISTRAL3, {"vision_feature_layer": 25}, "vision_feature_layer 25"),
    (HUB_MISTRAL3, {"spatial_merge_size": 3}, "spatial_merge_size 3"),
    (HUB_PIXTRAL, {"vision_feature_select_strategy": "default"}, "'default'"),
])
def test_config_refusals(base, change, message):
    vision = {**base["vision_config"], **change.pop("vision_config", {})}
    with pytest.raises(UnsupportedModelError, match=message):
        PixtralVisionConfig.from_hf({**base, "vision_config": vision, **change})


def hf_processor(config, merge):
    hf = transformers.PixtralImageProcessorPil(**{k: v for k, v in config.items() if k != "image_processor_type"})
    patch = config.get("patch_size", 16) * merge  # what PixtralProcessor passes
    return lambda image: hf(image, patch_size={"height": patch, "width": patch}, return_tensors="np")


@pytest.mark.parametrize("merge", [2, 1])
@pytest.mark.parametrize("size,mode", [
    ((45, 37), "RGB"), ((9, 13), "RGB"),  # smaller than 64: only rounded up
    ((300, 200), "RGB"), ((30, 100), "RGB"),  # scaled down to fit
    ((64, 64), "RGB"), ((23, 61), "RGBA"),
])
def test_processor_equals_transformers(size, mode, merge):
    image = random_image(7, size, mode)
    processor = PixtralImageProcessor.from_dict(PROCESSOR, spatial_merge_size=merge)
    ref = hf_processor(PROCESSOR, merge)(image)
    ours = processor(image)
    assert ours.dtype == np.float32 and (1, *ours.shape) == ref["pixel_values"].shape
    np.testing.assert_allclose(ours, ref["pixel_values"][0], atol=1e-6)
    assert processor.resized_size((image.height, image.width)) == tuple(ref["image_sizes"][0])


def test_processor_settings_equal_transformers():
    """transformers' defaults (longest edge 1024, patches of 16, bicubic, CLIP's mean and std), a height and width
    in place of the longest edge, a bilinear resize without normalization, a patch given as a dict."""
    image = random_image(11, (1300, 700))
    for config, merge in (({}, 1), ({"size": {"height": 200, "width": 100}, "patch_size": 10}, 2),
                          ({"resample": 2, "do_normalize": False, "patch_size": {"height": 14, "width": 14},
                            "size": {"longest_edge": 300}}, 2)):
        patch = config.get("patch_size", 16)
        patch = patch["height"] if isinstance(patch, dict) else patch
        ref = hf_processor({**config, "patch_size": patch}, merge)(image)
        ours = PixtralImageProcessor.from_dict(config, spatial_merge_size=merge)
        np.testing.assert_allclose(ours(image), ref["pixel_values"][0], atol=1e-6)
        assert ours.resized_size((image.height, image.width)) == tuple(ref["image_sizes"][0])


def test_processor_refusals():
    with pytest.raises(ImageError, match="CLIPImageProcessor"):
        PixtralImageProcessor.from_dict({"image_processor_type": "CLIPImageProcessor"})
    with pytest.raises(UnsupportedModelError, match="patch_size"):
        PixtralImageProcessor.from_dict({"patch_size": {"height": 16}})
    with pytest.raises(ImageError, match="multiples of 8 x 8"):
        PixtralImageProcessor.from_dict({**PROCESSOR, "do_resize": False}, 2).resized_size((30, 32))
    with pytest.raises(ImageError, match="too long"):
        PixtralImageProcessor.from_dict(PROCESSOR).resized_size((1, 500))


def test_grid_and_prompt_layout(pixtral):
    """PixtralProcessor's layout: each row of embeddings then [IMG_BREAK], the last row's break [IMG_END]."""
    _, cfg, _, _ = pixtral["mistral3"]
    assert pixtral_grid(cfg, (40, 48)) == (5, 6) and pixtral_grid(pixtral["llava"][1], (40, 48)) == (10, 12)
    with pytest.raises(ValueError, match="IMG_BREAK"):
        pixtral_prompt_tokens(cfg, (2, 3))
    cfg = dataclasses.replace(cfg, image_break_token_id=IMAGE_BREAK, image_end_token_id=IMAGE_END)
    img, brk, end = IMAGE_TOKEN, IMAGE_BREAK, IMAGE_END
    assert pixtral_prompt_tokens(cfg, (2, 3)) == [img, img, img, brk, img, img, img, end]
    assert pixtral_prompt_tokens(cfg, (1, 2)) == [img, img, end]


@pytest.mark.parametrize("kind", KINDS)
def test_encoder_equals_transformers(pixtral, processed, kind):
    """Each image alone (in its own bucket), then all three in one call, against transformers' run over all."""
    model, cfg, params, _ = pixtral[kind]
    images = processed[kind]
    refs = reference(model, images)
    for pixels, ref in zip(images, refs, strict=True):
        ours = pixtral_encode(params, cfg, pixels)
        rows, cols = pixtral_grid(cfg, pixels.shape[1:])
        assert ours.shape == ref.shape == (rows * cols, cfg.text_hidden_size)
        np.testing.assert_allclose(ours, ref, atol=1e-4)
        assert np.abs(ref).max() > 0.5  # the comparison is not of near-zero numbers
    for ours, ref in zip(pixtral_encode_many(params, cfg, images), refs, strict=True):
        np.testing.assert_allclose(ours, ref, atol=1e-4)


def test_feature_layer_and_query_blocks(tmp_path, processed, monkeypatch):
    """LLaVA fed the first block's output (vision_feature_layer -2), and the attention run 64 queries at a time
    (of a 256-patch bucket), equal transformers too."""
    model = save_tiny_pixtral(tmp_path, "llava", seed=1, vision_feature_layer=-2)
    with open(os.path.join(tmp_path, "config.json")) as f:
        cfg = PixtralVisionConfig.from_hf(json.load(f))
    assert cfg.layers_run == 1
    params = load_pixtral_vision_params(cfg, load_file(os.path.join(tmp_path, "model.safetensors")).items(),
                                        jnp.float32)
    monkeypatch.setattr(vision_blocks, "QUERY_BLOCK", 64)
    monkeypatch.setattr(vision_pixtral, "_encode_jit", fresh_jit())
    images = processed["llava"]
    assert vision_pixtral.qwen_bucket(sum(p.shape[1] * p.shape[2] // 16 for p in images)) == 256
    for ours, ref in zip(pixtral_encode_many(params, cfg, images), reference(model, images), strict=True):
        np.testing.assert_allclose(ours, ref, atol=1e-4)


def test_mutations_fail(pixtral, processed, monkeypatch):
    """Rows and columns swapped in the rotary positions, the merger concatenating patch-major, or attention across
    images are far from transformers: the comparisons above can fail."""
    model, cfg, params, _ = pixtral["mistral3"]
    images = processed["mistral3"]
    refs = reference(model, images)
    rotary, attend = vision_pixtral._rotary, vision_pixtral.attend
    mutations = {  # name -> (module attribute, its replacement)
        "rows and columns": ("_rotary", lambda cfg, pos: rotary(cfg, pos[:, ::-1])),
        "attention across images": ("attend", lambda q, k, v, seg: attend(q, k, v, jnp.where(seg >= 0, 0, -1))),
    }
    for name, (attribute, wrong) in mutations.items():
        with monkeypatch.context() as m:
            m.setattr(vision_pixtral, attribute, wrong)
            m.setattr(vision_pixtral, "_encode_jit", fresh_jit())
            ours = pixtral_encode_many(params, cfg, images)
        worst = max(np.abs(o - r).max() for o, r in zip(ours, refs, strict=True))
        assert worst > 0.05, name
    # The merger's square taken patch-major ([patch, feature]) instead of feature-major: the same weights, the
    # vector's entries permuted.
    merge = params.projector["merge"]  # [E * 4, E], rows over (feature, patch)
    E = cfg.hidden_size
    permuted = merge.reshape(E, 4, E).transpose(1, 0, 2).reshape(4 * E, E)
    wrong = dataclasses.replace(params, projector={**params.projector, "merge": permuted})
    assert np.abs(pixtral_encode(wrong, cfg, images[0]) - refs[0]).max() > 0.05


def test_bfloat16_near_float32(pixtral, processed):
    model, cfg, _, tensors = pixtral["mistral3"]
    params = load_pixtral_vision_params(cfg, tensors.items(), jnp.bfloat16)
    pixels = processed["mistral3"][0]
    ours = pixtral_encode(params, cfg, pixels)
    ref = reference(model, [pixels])[0]
    assert ours.dtype == jnp.bfloat16
    assert np.linalg.norm(ours.astype(np.float32) - ref) / np.linalg.norm(ref) < 0.05


@pytest.mark.parametrize("kind", KINDS)
def test_weights_round_trip(pixtral, kind):
    """Our names back equal the checkpoint's (the Hub's); `model.`-prefixed names load the same; the text model's
    tensors are not the tower's."""
    _, cfg, params, tensors = pixtral[kind]
    back = dict(pixtral_vision_tensors(params, cfg))
    vision = {k: v for k, v in tensors.items() if is_pixtral_vision_tensor(k)}
    assert set(back) == set(vision) and len(vision) == len(tensors) - sum("language_model" in k for k in tensors)
    assert not is_pixtral_vision_tensor("model.language_model.norm.weight")
    for name, array in vision.items():
        np.testing.assert_array_equal(back[name], array)
    again = load_pixtral_vision_params(cfg, (("model." + k, v) for k, v in back.items()), jnp.float32)
    np.testing.assert_array_equal(again.layers["wq"], params.layers["wq"])
    np.testing.assert_array_equal(again.projector["w1"], params.projector["w1"])
    dummy = random_pixtral_vision_params(cfg, jnp.float32, seed=1)
    out = pixtral_encode(dummy, cfg, np.ones((3, 16, 8), np.float32))
    assert out.shape == (8 // cfg.spatial_merge_size**2, 64) and np.isfinite(out).all()


def test_loading_errors(pixtral):
    _, cfg, params, tensors = pixtral["mistral3"]
    name = "vision_tower.transformer.layers.1.feed_forward.up_proj.weight"
    without = {k: v for k, v in tensors.items() if k != name}
    with pytest.raises(UnsupportedModelError, match=rf"lacks vision tensors: {name}"):
        load_pixtral_vision_params(cfg, without.items(), jnp.float32)
    without = {k: v for k, v in tensors.items() if "merging_layer" not in k}
    with pytest.raises(UnsupportedModelError, match=r"multi_modal_projector\.patch_merger\.merging_layer\.weight"):
        load_pixtral_vision_params(cfg, without.items(), jnp.float32)
    misshapen = {**tensors, "multi_modal_projector.linear_2.weight": np.zeros((32, 64), np.float32)}
    with pytest.raises(UnsupportedModelError, match=r"linear_2\.weight has shape \(32, 64\)"):
        load_pixtral_vision_params(cfg, misshapen.items(), jnp.float32)
    twice = [*tensors.items(), ("model.vision_tower.ln_pre.weight", tensors["vision_tower.ln_pre.weight"])]
    with pytest.raises(UnsupportedModelError, match="vision_tower.ln_pre.weight' appears twice"):
        load_pixtral_vision_params(cfg, twice, jnp.float32)
    extra = [*tensors.items(), ("multi_modal_projector.linear_1.bias", np.zeros(64, np.float32))]
    with pytest.raises(UnsupportedModelError, match=r"unexpected vision tensors: multi_modal_projector\.linear_1"):
        load_pixtral_vision_params(cfg, extra, jnp.float32)
    with pytest.raises(ValueError, match="multiples of 8"):
        pixtral_encode(params, cfg, np.zeros((3, 12, 16), np.float32))
