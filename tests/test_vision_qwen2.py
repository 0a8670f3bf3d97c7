"""Qwen2-VL's and Qwen2.5-VL's image side against transformers: the config's fields and refusals, the image
processor's patches and grids, the vision tower and merger's embeddings (alone, and several images in one bucket),
that the windows matter, and the weights under each of their names."""

from __future__ import annotations

import dataclasses
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.numpy import load_file  # noqa: E402

from jaxserve.errors import UnsupportedModelError  # noqa: E402
from jaxserve.images import ImageError  # noqa: E402
from jaxserve.images_qwen2 import QwenImageProcessor  # noqa: E402
from jaxserve.models.vision_qwen2 import (  # noqa: E402
    QwenVisionConfig,
    is_qwen_vision_tensor,
    load_qwen_vision_params,
    qwen_bucket,
    qwen_encode,
    qwen_encode_many,
    qwen_layout,
    qwen_token_grid,
    qwen_tokens,
    qwen_vision_tensors,
    random_qwen_vision_params,
)
from tests.llava_model import random_image  # noqa: E402
from tests.qwen2_vl_model import IMAGE_TOKEN, PROCESSOR, VISION_END, VISION_START, save_tiny_qwen2_vl  # noqa: E402

# Qwen/Qwen2-VL-7B-Instruct's and Qwen/Qwen2.5-VL-7B-Instruct's config.json, as the Hub has them (cut to what
# matters here).
HUB_QWEN2 = {
    "architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl", "hidden_size": 3584,
    "image_token_id": 151655, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
    "vision_config": {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16, "in_chans": 3,
                      "hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2, "spatial_patch_size": 14,
                      "temporal_patch_size": 2},
}
HUB_QWEN2_5 = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl", "hidden_size": 3584,
    "image_token_id": 151655, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
    "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                      "num_heads": 16, "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14,
                      "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
                      "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2, "temporal_patch_size": 2},
}
# Qwen/Qwen3-VL-8B-Instruct's, cut the same way.
HUB_QWEN3 = {
    "architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl",
    "image_token_id": 151655, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
    "text_config": {"hidden_size": 4096, "head_dim": 128, "num_attention_heads": 32, "num_hidden_layers": 36,
                    "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"}},
    "vision_config": {"deepstack_visual_indexes": [8, 16, 24], "depth": 27, "hidden_act": "gelu_pytorch_tanh",
                      "hidden_size": 1152, "in_channels": 3, "intermediate_size": 4304, "model_type": "qwen3_vl",
                      "num_heads": 16, "num_position_embeddings": 2304, "out_hidden_size": 4096, "patch_size": 16,
                      "spatial_merge_size": 2, "temporal_patch_size": 2},
}
VARIANTS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
# (width, height) in pixels: grids of 10 x 12, 12 x 6 and 4 x 4 patches (Qwen2.5-VL: 3 x 3, 3 x 2 and 1 x 1
# windows of 2 x 2 merged patches; the last's sides are whole windows).
ENCODER_IMAGES = ((45, 37), (25, 50), (16, 16))


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """Each variant's torch model, config and our float32 weights read from its saved checkpoint."""
    out = {}
    for variant in VARIANTS:
        path = tmp_path_factory.mktemp(variant)
        model = save_tiny_qwen2_vl(path, variant)
        with open(os.path.join(path, "config.json")) as f:
            cfg = QwenVisionConfig.from_hf(json.load(f))
        tensors = load_file(os.path.join(path, "model.safetensors"))
        out[variant] = model, cfg, load_qwen_vision_params(cfg, tensors.items(), jnp.float32), tensors
    return out


@pytest.fixture(scope="module")
def processed():
    processor = QwenImageProcessor.from_dict(PROCESSOR)
    images = [random_image(i, size) for i, size in enumerate(ENCODER_IMAGES)]
    return [(processor(im), processor.grid((im.height, im.width))) for im in images]


def reference(model, images) -> list[np.ndarray]:
    """transformers' image features (the merger's output, split per image; Qwen3-VL's deepstack features beside
    them) for (patches, grid) pairs."""
    with torch.no_grad():
        out = model.model.get_image_features(torch.tensor(np.concatenate([p for p, _ in images])),
                                             torch.tensor([g for _, g in images]))
    deep = getattr(out, "deepstack_features", None) or []  # (each: per image)
    return [torch.cat([f, *(d[i] for d in deep)], dim=-1).numpy() for i, f in enumerate(out.pooler_output)]


def test_config_fields(qwen):
    _, cfg, _, _ = qwen["qwen2_vl"]
    assert (cfg.embed_dim, cfg.num_heads, cfg.intermediate_size, cfg.out_hidden_size, cfg.hidden_act) == (
        32, 2, 64, 64, "quick_gelu")
    assert cfg.fullatt_block_indexes == (0, 1) and cfg.window_size is None
    assert (cfg.image_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id) == (
        IMAGE_TOKEN, VISION_START, VISION_END)
    _, cfg5, _, _ = qwen["qwen2_5_vl"]
    assert (cfg5.depth, cfg5.embed_dim, cfg5.intermediate_size, cfg5.hidden_act, cfg5.window_merged) == (
        3, 32, 48, "silu", 2)
    assert cfg5.full_layers == (False, True, False)
    hub = QwenVisionConfig.from_hf(HUB_QWEN2)
    assert (hub.depth, hub.embed_dim, hub.intermediate_size, hub.out_hidden_size, hub.patch_dim) == (
        32, 1280, 5120, 3584, 3 * 2 * 14 * 14)
    hub5 = QwenVisionConfig.from_hf(HUB_QWEN2_5)
    assert (hub5.embed_dim, hub5.intermediate_size, hub5.window_merged, hub5.fullatt_block_indexes) == (
        1280, 3420, 4, (7, 15, 23, 31))
    # transformers' defaults fill what a config leaves out (Qwen2_5_VLVisionConfig's width is 3584).
    bare5 = QwenVisionConfig.from_hf({"architectures": ["Qwen2_5_VLForConditionalGeneration"]})
    assert bare5 == dataclasses.replace(hub5, embed_dim=3584)
    assert QwenVisionConfig.from_hf({"architectures": ["Qwen2VLForConditionalGeneration"],
                                     "vision_config": {"embed_dim": 1280}}) == hub
    hub3 = QwenVisionConfig.from_hf(HUB_QWEN3)
    assert (hub3.variant, hub3.embed_dim, hub3.out_hidden_size, hub3.window_size, hub3.num_position_embeddings,
            hub3.deepstack_visual_indexes, hub3.embed_width, hub3.patch_dim) == (
        "qwen3_vl", 1152, 4096, None, 2304, (8, 16, 24), 4 * 4096, 3 * 2 * 16 * 16)
    assert hub3.full_layers == (True,) * 27 and hub3.layer_norm and not hub5.layer_norm
    assert QwenVisionConfig.from_hf({"architectures": ["LlavaForConditionalGeneration"]}) is None
    assert QwenVisionConfig.from_hf({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}) is None


@pytest.mark.parametrize("change,message", [
    ({"hidden_act": "relu6"}, "relu6"),
    ({"window_size": 20}, "window_size 20"),
    ({"patch_size": [14, 16]}, "square patches"),
    ({"num_heads": 3}, "divisible by 4"),
    ({"out_hidden_size": 2048}, "hidden_size 3584"),
    ({"rope_parameters": {"rope_type": "yarn"}}, "yarn"),
])
def test_config_refusals(change, message):
    with pytest.raises(UnsupportedModelError, match=message):
        QwenVisionConfig.from_hf({**HUB_QWEN2_5, "vision_config": {**HUB_QWEN2_5["vision_config"], **change}})


@pytest.mark.parametrize("change,message", [
    ({"num_position_embeddings": 2300}, "not a square grid"),
    ({"deepstack_visual_indexes": [8, 27]}, "distinct blocks of the 27"),
    ({"deepstack_visual_indexes": [8, 8]}, "distinct blocks"),
])
def test_qwen3_config_refusals(change, message):
    with pytest.raises(UnsupportedModelError, match=message):
        QwenVisionConfig.from_hf({**HUB_QWEN3, "vision_config": {**HUB_QWEN3["vision_config"], **change}})


def test_token_grid():
    cfg = QwenVisionConfig.from_hf(HUB_QWEN2_5)
    assert qwen_token_grid((1, 36, 52), cfg) == (1, 18, 26) and qwen_tokens((1, 36, 52), cfg) == 468
    assert [qwen_bucket(n) for n in (1, 64, 65, 128, 300, 1025)] == [64, 64, 128, 128, 512, 2048]


def hf_processor(**config):
    return transformers.Qwen2VLImageProcessorPil(**{k: v for k, v in config.items() if k != "image_processor_type"})


@pytest.mark.parametrize("size,mode", [
    ((45, 37), "RGB"), ((9, 13), "RGB"),  # up to the least pixels
    ((300, 200), "RGB"), ((8, 100), "RGB"),  # down to the most
    ((64, 64), "RGB"), ((23, 61), "RGBA"),
])
def test_processor_equals_transformers(size, mode):
    image = random_image(7, size, mode)
    processor = QwenImageProcessor.from_dict(PROCESSOR)
    ref = hf_processor(**PROCESSOR)(image, return_tensors="np")
    ours = processor(image)
    assert ours.dtype == np.float32 and ours.shape == ref["pixel_values"].shape
    np.testing.assert_allclose(ours, ref["pixel_values"], atol=1e-6)
    assert processor.grid((image.height, image.width)) == tuple(ref["image_grid_thw"][0])


def test_processor_settings_equal_transformers():
    """transformers' defaults (bicubic, CLIP's mean and std, 3136 to 1003520 pixels, patches of 14) and `size`
    in place of min_pixels and max_pixels; a bilinear resize and no normalization."""
    image = random_image(11, (130, 70))
    for config in ({}, {"size": {"shortest_edge": 1000, "longest_edge": 20000}, "patch_size": 10},
                   {"resample": 2, "do_normalize": False, "min_pixels": 300, "max_pixels": 5000, "patch_size": 5}):
        ref = hf_processor(**config)(image, return_tensors="np")
        ours = QwenImageProcessor.from_dict(config)
        np.testing.assert_allclose(ours(image), ref["pixel_values"], atol=1e-6)
        assert ours.grid((image.height, image.width)) == tuple(ref["image_grid_thw"][0])


def test_processor_refusals():
    with pytest.raises(ImageError, match="CLIPImageProcessor"):
        QwenImageProcessor.from_dict({"image_processor_type": "CLIPImageProcessor"})
    with pytest.raises(UnsupportedModelError, match="height"):
        QwenImageProcessor.from_dict({"size": {"height": 224, "width": 224}})
    with pytest.raises(UnsupportedModelError, match="min_pixels 5000"):
        QwenImageProcessor.from_dict({"min_pixels": 5000, "max_pixels": 4000})
    with pytest.raises(ImageError, match="multiples of 8"):
        QwenImageProcessor.from_dict({**PROCESSOR, "do_resize": False}).grid((30, 32))
    with pytest.raises(ImageError, match="aspect"):
        QwenImageProcessor.from_dict(PROCESSOR).grid((2, 500))


@pytest.mark.parametrize("variant", VARIANTS)
def test_encoder_equals_transformers(qwen, processed, variant):
    """Each image alone (in its own bucket), then all three in one call, against transformers' run over all."""
    model, cfg, params, _ = qwen[variant]
    refs = reference(model, processed)
    for (patches, grid), ref in zip(processed, refs, strict=True):
        ours = qwen_encode(params, cfg, patches, grid)
        assert ours.shape == ref.shape == (qwen_tokens(grid, cfg), cfg.embed_width)
        np.testing.assert_allclose(ours, ref, atol=1e-4)
        assert np.abs(ref).max() > 0.5  # the comparison is not of near-zero numbers
    for ours, ref in zip(qwen_encode_many(params, cfg, processed), refs, strict=True):
        np.testing.assert_allclose(ours, ref, atol=1e-4)
    # Two frames (a video's grid): each frame attends within itself, its windows its own.
    frames = (np.random.default_rng(0).normal(size=(64, cfg.patch_dim)).astype(np.float32), (2, 4, 8))
    np.testing.assert_allclose(qwen_encode(params, cfg, *frames), reference(model, [frames])[0], atol=1e-4)


def test_attention_by_blocks_of_queries(qwen, processed, monkeypatch):
    """The attention run 64 queries at a time (of a 256-patch bucket) equals transformers' too."""
    import jax

    from jaxserve.models import vision_blocks, vision_qwen2

    monkeypatch.setattr(vision_blocks, "QUERY_BLOCK", 64)
    monkeypatch.setattr(vision_qwen2, "_encode_jit", jax.jit(vision_qwen2._encode_padded, static_argnums=1))
    model, cfg, params, _ = qwen["qwen2_5_vl"]
    assert qwen_bucket(sum(p.shape[0] for p, _ in processed)) == 256
    for ours, ref in zip(qwen_encode_many(params, cfg, processed), reference(model, processed), strict=True):
        np.testing.assert_allclose(ours, ref, atol=1e-4)


def test_windows_matter(qwen, processed):
    """Qwen2.5-VL with every block attending over the whole image, or windows of the wrong size, and Qwen2-VL with
    the patches' rows and columns wrong, are far from transformers: the comparisons above can fail."""
    model, cfg, params, _ = qwen["qwen2_5_vl"]
    patches, grid = processed[0]
    ref = reference(model, [(patches, grid)])[0]
    _, frames, windows = qwen_layout(cfg, [grid])
    assert len(set(windows)) == 9 and len(set(frames)) == 1
    for wrong in (dataclasses.replace(cfg, fullatt_block_indexes=(0, 1, 2)), dataclasses.replace(cfg, window_size=32)):
        assert np.abs(qwen_encode(params, wrong, patches, grid) - ref).max() > 0.05
    # Qwen2-VL told the wrong grid (the same patches, 12 x 10): only the rotary positions differ.
    model, cfg, params, _ = qwen["qwen2_vl"]
    assert np.abs(qwen_encode(params, cfg, patches, (1, 12, 10)) - reference(model, [(patches, grid)])[0]).max() > 0.05


def test_qwen3_positions_and_deepstack_matter(qwen, processed):
    """Qwen3-VL without its learned positions, or with each deepstack block merged by the other's merger, is far
    from transformers; its deepstack embeddings go in block order (0, then 2: the config lists 2, 0), which the
    first layer and the second take apart."""
    model, cfg, params, _ = qwen["qwen3_vl"]
    patches, grid = processed[0]
    ref = reference(model, [(patches, grid)])[0]
    E = cfg.out_hidden_size
    assert ref.shape[1] == 3 * E and np.abs(ref[:, E:2 * E] - ref[:, 2 * E:]).max() > 0.5
    still = dataclasses.replace(params, extra={**params.extra, "pos_embed": params.extra["pos_embed"] * 0})
    assert np.abs(qwen_encode(still, cfg, patches, grid)[:, :E] - ref[:, :E]).max() > 0.05
    swapped = dataclasses.replace(params, deep={k: v[::-1] for k, v in params.deep.items()})
    assert np.abs(qwen_encode(swapped, cfg, patches, grid)[:, E:] - ref[:, E:]).max() > 0.05

@pytest.mark.parametrize("variant", ["qwen2_5_vl", "qwen3_vl"])
def test_bfloat16_near_float32(qwen, processed, variant):
    model, cfg, _, tensors = qwen[variant]
    params = load_qwen_vision_params(cfg, tensors.items(), jnp.bfloat16)
    patches, grid = processed[0]
    ours = qwen_encode(params, cfg, patches, grid)
    ref = reference(model, [(patches, grid)])[0]
    assert ours.dtype == jnp.bfloat16
    assert np.linalg.norm(ours.astype(np.float32) - ref) / np.linalg.norm(ref) < 0.05


@pytest.mark.parametrize("variant", VARIANTS)
def test_weights_round_trip(qwen, variant):
    """Our names back equal the checkpoint's, under either prefix; the text model's tensors are not the tower's."""
    _, cfg, params, tensors = qwen[variant]
    back = dict(qwen_vision_tensors(params, cfg))
    # (transformers writes Qwen2-VL's under `visual.`, Qwen3-VL's under `model.visual.`)
    visual = {k if k.startswith("model.") else "model." + k: v for k, v in tensors.items() if is_qwen_vision_tensor(k)}
    assert set(back) == set(visual) and not is_qwen_vision_tensor("model.language_model.norm.weight")
    for name, array in visual.items():
        np.testing.assert_array_equal(back[name], array)
    again = load_qwen_vision_params(cfg, back.items(), jnp.float32)
    np.testing.assert_array_equal(again.layers["wqkv"], params.layers["wqkv"])
    dummy = random_qwen_vision_params(cfg, jnp.float32, seed=1)
    out = qwen_encode(dummy, cfg, np.ones((16, cfg.patch_dim), np.float32), (1, 4, 4))
    assert out.shape == (4, cfg.embed_width) and np.isfinite(out).all()


def test_loading_errors(qwen):
    _, cfg, _, tensors = qwen["qwen2_5_vl"]
    without = {k: v for k, v in tensors.items() if k != "visual.blocks.2.mlp.up_proj.bias"}
    with pytest.raises(UnsupportedModelError, match=r"lacks vision tensors: visual\.blocks\.2\.mlp\.up_proj\.bias"):
        load_qwen_vision_params(cfg, without.items(), jnp.float32)
    misshapen = {**tensors, "visual.merger.mlp.2.weight": np.zeros((32, 128), np.float32)}
    with pytest.raises(UnsupportedModelError, match=r"visual\.merger\.mlp\.2\.weight has shape \(32, 128\)"):
        load_qwen_vision_params(cfg, misshapen.items(), jnp.float32)
    twice = [*tensors.items(), ("model.visual.merger.ln_q.weight", tensors["visual.merger.ln_q.weight"])]
    with pytest.raises(UnsupportedModelError, match="merger.ln_q.weight' appears twice"):
        load_qwen_vision_params(cfg, twice, jnp.float32)
    with pytest.raises(UnsupportedModelError, match=r"unexpected vision tensors: visual\.blocks\.3\.norm1\.weight"):
        load_qwen_vision_params(cfg, [*tensors.items(), ("visual.blocks.3.norm1.weight", np.ones(32))], jnp.float32)
    with pytest.raises(ValueError, match="patches of shape"):
        qwen_encode(qwen["qwen2_5_vl"][2], cfg, np.zeros((15, cfg.patch_dim), np.float32), (1, 4, 4))
