"""InternVL (`InternVLForConditionalGeneration`) through the engine: tiny random models (InternViT-300M's form:
LayerNorm, biased attention, no final norm, a Qwen2 language model; and InternViT-6B's: RMSNorm, q and k normed, a
final norm, a Qwen3 language model) against transformers: the processor's tiles, the tower's features, greedy tokens
and logprobs of prompts with images of several tile grids in one batch across prefill chunks and again from the
prefix cache, `LLM.chat`, and `jaxserve convert` read back by transformers."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxserve.sampling_params import SamplingParams  # noqa: E402
from tests.llava_model import random_image, randomize  # noqa: E402
from tests.modelrun import assert_batched_then_cached, image_engine, torch_greedy  # noqa: E402
from tests.qwen2_vl_model import save_word_tokenizer  # noqa: E402

CONTEXT, START, END, VIDEO = 290, 291, 292, 293  # <IMG_CONTEXT>, <img>, </img>, <video>
WORDS = {"<IMG_CONTEXT>": CONTEXT, "<img>": START, "</img>": END, "<video>": VIDEO, "Frame1:": 294, "Frame2:": 295,
         "Frame3:": 296}
NEW_TOKENS = 6
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
TEXT = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
# 16-pixel tiles of 4-pixel patches: a 4 x 4 grid, folded 2 x 2 into 4 tokens a tile.
VISION = {"base": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=48,
                       image_size=16, patch_size=4, attention_bias=True, norm_type="layer_norm", use_mean_pooling=True),
          "6b": dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=48, image_size=16,
                     patch_size=4, attention_bias=False, norm_type="rms_norm", use_qk_norm=True,
                     use_mean_pooling=False)}
PROCESSOR = {"image_processor_type": "GotOcr2ImageProcessor", "size": {"height": 16, "width": 16}, "min_patches": 1,
             "max_patches": 6, "image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]}


def text(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 280, n).tolist()


# Images of 40 x 20 (2 x 1 tiles and the thumbnail), 16 x 16 (one tile) and 50 x 30 (3 x 2 and the thumbnail).
PROMPTS = [text(1, 5) + [CONTEXT] + text(2, 3) + [CONTEXT] + text(3, 4), [CONTEXT] + text(4, 6)]
IMAGES = [[random_image(1, (40, 20)), random_image(2, (16, 16))], [random_image(3, (50, 30))]]


@pytest.fixture(scope="module", params=["base", "6b"])
def internvl(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"internvl_{request.param}")
    torch.manual_seed(0)
    text_config = {**TEXT, "model_type": "qwen2"} if request.param == "base" else \
        {**TEXT, "model_type": "qwen3", "head_dim": 16}
    config = transformers.InternVLConfig(vision_config=VISION[request.param], text_config=text_config,
                                         image_token_id=CONTEXT, tie_word_embeddings=request.param == "base")
    model = transformers.InternVLForConditionalGeneration(config).eval()
    randomize(model)
    with torch.no_grad():  # logits of 0 for the image tokens: never sampled
        model.lm_head.weight[CONTEXT:] = 0.0
    model.save_pretrained(path, safe_serialization=True)
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump(PROCESSOR, f)
    save_word_tokenizer(path, WORDS, "<IMG_CONTEXT>", video_text="<video>")
    return str(path), model


def processed(images):
    fields = {k: v for k, v in PROCESSOR.items() if k != "image_processor_type"}
    return transformers.GotOcr2ImageProcessorPil(**fields)(images, crop_to_patches=True, return_tensors="pt")


def hf_greedy(model, ids: list[int], images) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and logprobs, each `<IMG_CONTEXT>` written as InternVL's processor writes it."""
    out = processed(images)
    counts = iter(4 * n for n in out["num_patches"].tolist())
    expanded = [x for i in ids for x in ([START] + [CONTEXT] * next(counts) + [END] if i == CONTEXT else [i])]

    def forward(ids: list[int]):
        return model(input_ids=torch.tensor([ids]), pixel_values=out["pixel_values"]).logits[0, -1]

    return torch_greedy(forward, expanded, NEW_TOKENS)


def test_tiles_and_features_equal_transformers(internvl):
    """The tiles of each image (grid, order, thumbnail, pixels) and the tower's embeddings of them."""
    from jaxserve.engine.model_loading import load_model
    from jaxserve.engine_args import EngineArgs

    path, model = internvl
    loaded = load_model(EngineArgs(model=path, dtype="float32"), progress=False)
    encoder = loaded.vision
    images = IMAGES[0] + IMAGES[1]
    want = processed(images)
    got = [encoder.prepare(im) for im in images]
    assert [g.pixels.shape[0] for g in got] == want["num_patches"].tolist() == [3, 1, 7]
    np.testing.assert_allclose(np.concatenate([g.pixels for g in got]), want["pixel_values"].numpy(), atol=1e-5)
    with torch.no_grad():
        ref = model.model.get_image_features(pixel_values=want["pixel_values"], vision_feature_layer=-1,
                                             vision_feature_select_strategy="default").pooler_output
    feats = np.concatenate([encoder._encode_pixels(g) for g in got])
    np.testing.assert_allclose(feats, ref.reshape(-1, ref.shape[-1]).numpy(), atol=2e-5)


def test_internvl_engine_equals_transformers(internvl):
    """Both prompts in one batch, their images cut across 32-token prefill chunks; then each alone, the second time
    from the prefix cache."""
    path, model = internvl
    expected = [hf_greedy(model, p, ims) for p, ims in zip(PROMPTS, IMAGES, strict=True)]
    eng = image_engine(path)
    assert [eng.images.num_tokens(eng.images.prepare(im)) for im in IMAGES[0] + IMAGES[1]] == [12, 4, 28]
    assert_batched_then_cached(eng, PROMPTS, IMAGES, expected, 24 + 24, params=GREEDY)


@pytest.mark.parametrize("internvl", ["base"], indirect=True)
def test_chat_and_convert(internvl, tmp_path):
    """`LLM.chat` with an image part: the template's `<IMG_CONTEXT>` becomes `<img>`, the tiles' tokens, `</img>`; and
    `jaxserve convert` writes a model transformers reads back whole, with the same logits."""
    from jaxserve.engine.model_loading import load_model
    from jaxserve.engine_args import EngineArgs
    from jaxserve.llm import LLM
    from jaxserve.loader.export import export_hf

    path, source = internvl
    llm = LLM(model=path, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=512, page_size=8,
              kv_cache_memory_bytes=2**21, dtype="float32", warmup=False, compile_cache_dir=None)
    message = {"role": "user", "content": [{"type": "text", "text": "t5"},
                                           {"type": "image_pil", "image_pil": IMAGES[0][0]}]}
    reply = llm.chat([message], GREEDY)[0]
    words = "user : t5 <IMG_CONTEXT> <eos> assistant :".split()
    ids = [llm.engine.tokenizer.encode(w)[0] for w in words]
    assert reply.prompt_token_ids == ids[:3] + [START] + [CONTEXT] * 12 + [END] + ids[4:]
    assert list(reply.outputs[0].token_ids) == hf_greedy(source, ids, IMAGES[0][:1])[0]

    loaded = load_model(EngineArgs(model=path, dtype="float32"), progress=False)
    out = tmp_path / "out"
    export_hf(str(out), loaded.config, loaded.params, loaded.tokenizer, vision=loaded.vision)
    back, info = type(source).from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    pixels = processed(IMAGES[1])["pixel_values"]
    kw = dict(input_ids=torch.tensor([[5, START] + [CONTEXT] * 28 + [END, 7]]), pixel_values=pixels)
    with torch.no_grad():
        np.testing.assert_allclose(back.eval()(**kw).logits.numpy(), source(**kw).logits.numpy(), atol=1e-5)


def test_the_refusals():
    import jax.numpy as jnp

    from jaxserve.errors import UnsupportedModelError
    from jaxserve.models.vision_internvl import (
        InternVisionConfig,
        encode_internvl,
        random_internvl_vision_params,
    )

    base = {"architectures": ["InternVLForConditionalGeneration"], "vision_config": VISION["base"]}
    cfg = InternVisionConfig.from_hf(base)
    assert (cfg.tokens_per_tile, cfg.feature_width, cfg.read_last) == (4, 128, True)
    dummy = random_internvl_vision_params(cfg, jnp.float32)  # (`--load-format dummy`)
    assert encode_internvl(dummy, cfg, jnp.zeros((2, 3, 16, 16))).shape == (2, 4, cfg.text_hidden_size)
    assert InternVisionConfig.from_hf({"architectures": ["LlamaForCausalLM"]}) is None
    for change, message in [({"downsample_ratio": 0.3}, "downsample_ratio"),
                            ({"vision_config": {**VISION["base"], "norm_type": "batch_norm"}}, "norm_type"),
                            ({"vision_feature_layer": [-1, -2]}, "vision_feature_layer")]:
        with pytest.raises(UnsupportedModelError, match=message):
            InternVisionConfig.from_hf({**base, **change})


@pytest.mark.parametrize("internvl", ["base"], indirect=True)
def test_a_video_equals_transformers(internvl):
    """A video beside an image: each frame one tile, written as InternVL's processor writes a video ("Frame1: <img>
    ...</img>", a newline, "Frame2: ..."); greedy tokens and logprobs are transformers' on that prompt, with the
    image's tiles and the frames in prompt order; the prompt the engine writes is that one."""
    import types

    from transformers.models.internvl.processing_internvl import InternVLProcessor

    from tests.modelrun import assert_same_greedy, drain, run_images

    path, model = internvl
    clip = np.random.default_rng(9).integers(0, 256, (3, 20, 24, 3), dtype=np.uint8)
    media = {"image": [IMAGES[0][1]], "video": [clip]}
    prompt = text(5, 3) + [CONTEXT] + text(6, 2) + [VIDEO] + text(7, 2)
    eng = image_engine(path)
    video = eng.images.prepare_video(clip)
    assert video.pixels.shape == (3, 3, 16, 16)
    fake = types.SimpleNamespace(start_image_token="<img>", end_image_token="</img>", image_token="<IMG_CONTEXT>",
                                 image_seq_length=4)
    written = InternVLProcessor.replace_video_token(fake, {"pixel_values_videos": [torch.zeros(3, 3, 16, 16)]}, 0)
    ids = prompt[:3] + [START] + [CONTEXT] * 4 + [END] + prompt[4:6] + eng.tokenizer.encode(written) + prompt[7:]
    assert ids.count(294) == ids.count(295) == ids.count(296) == 1
    pixels = torch.cat([processed(media["image"])["pixel_values"], torch.from_numpy(video.pixels)])
    expected = torch_greedy(lambda x: model(input_ids=torch.tensor([x]), pixel_values=pixels).logits[0, -1], ids,
                            NEW_TOKENS)
    assert_same_greedy(run_images(eng, [prompt], [media], params=GREEDY), [expected])
    eng.add_request("ids", prompt, GREEDY, multi_modal_data=media)
    assert drain(eng)["ids"].prompt_token_ids == ids
    eng.check_integrity()
