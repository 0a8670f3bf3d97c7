"""SmolVLM and Idefics3 (`SmolVLMForConditionalGeneration`, `Idefics3ForConditionalGeneration`) through the engine:
tiny random models (a SigLIP tower, the pixel-shuffle connector, a Llama language model) against transformers: the
processor's tiles and global view, each image's layout (transformers' prompt string tokenized), the tower's
features, greedy tokens and logprobs of prompts with images of several tile grids in one batch across prefill chunks
and again from the prefix cache, and `jaxserve convert` read back whole."""

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

IMAGE, FAKE, GLOBAL = 280, 281, 282
MARKS = {"<image>": IMAGE, "<fake_token_around_image>": FAKE, "<global-img>": GLOBAL, "\n": 292, "\n\n": 293} | {
    f"<row_{r}_col_{c}>": 283 + 3 * (r - 1) + (c - 1) for r in (1, 2, 3) for c in (1, 2, 3)}
NEW_TOKENS = 6
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
TEXT = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2)
# 32-pixel tiles of 8-pixel patches, folded 2 x 2: 4 tokens a tile; images resized to a longest side of 64 first.
VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, image_size=32,
              patch_size=8)
PROCESSOR = {"size": {"longest_edge": 64}, "max_image_size": {"longest_edge": 32}}


def text(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 270, n).tolist()


# Images of 90 x 31 (1 x 2 tiles and the global view), 20 x 20 (resized to 64: 2 x 2 and the global view) and
# 31 x 90 (2 x 1), two in one prompt.
PROMPTS = [text(1, 5) + [IMAGE] + text(2, 3) + [IMAGE] + text(3, 4), [IMAGE] + text(4, 6)]
IMAGES = [[random_image(1, (90, 31)), random_image(2, (31, 90))], [random_image(3, (20, 20))]]


@pytest.fixture(scope="module", params=["SmolVLM", "Idefics3"])
def idefics(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    config = getattr(transformers, f"{request.param}Config")(vision_config=VISION, text_config=TEXT,
                                                               image_token_id=IMAGE, scale_factor=2)
    model = getattr(transformers, f"{request.param}ForConditionalGeneration")(config).eval()
    randomize(model)
    with torch.no_grad():  # logits of 0 for the image marks: never sampled
        model.lm_head.weight[IMAGE:] = 0.0
    model.save_pretrained(path, safe_serialization=True)
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump({"image_processor_type": f"{request.param}ImageProcessor", **PROCESSOR}, f)
    save_word_tokenizer(path, MARKS, "<image>")
    return str(path), model, request.param


def processed(kind: str, images):
    cls = getattr(transformers, f"{kind}ImageProcessorPil")
    return cls(**PROCESSOR)([images], return_row_col_info=True, return_tensors="pt")


def hf_expanded(path: str, kind: str, ids: list[int], images) -> tuple[list[int], dict]:
    """The prompt as transformers' processor writes it (each `<image>` its image's prompt string, tokenized), and
    the model's image inputs."""
    from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

    out = processed(kind, images)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=os.path.join(path, "tokenizer.json"))
    grids = iter(zip(out["rows"][0], out["cols"][0], strict=True))
    expanded: list[int] = []
    for i in ids:
        if i != IMAGE:
            expanded.append(i)
            continue
        rows, cols = next(grids)
        expanded += tok.encode(get_image_prompt_string(rows, cols, 4, "<fake_token_around_image>", "<image>",
                                                       "<global-img>"), add_special_tokens=False)
    return expanded, {"pixel_values": out["pixel_values"], "pixel_attention_mask": out["pixel_attention_mask"]}


def test_tiles_layout_and_features_equal_transformers(idefics):
    from jaxserve.engine.model_loading import load_model
    from jaxserve.engine_args import EngineArgs

    path, model, kind = idefics
    encoder = load_model(EngineArgs(model=path, dtype="float32"), progress=False).vision
    images = IMAGES[0] + IMAGES[1]
    want = processed(kind, images)
    got = [encoder.prepare(im) for im in images]
    assert [encoder.processor.grid(g.size) for g in got] == list(zip(want["rows"][0], want["cols"][0], strict=True))
    assert [g.pixels.shape[0] for g in got] == [3, 3, 5]
    np.testing.assert_allclose(np.concatenate([g.pixels for g in got]), want["pixel_values"][0].numpy(), atol=1e-5)
    with torch.no_grad():
        ref = model.model.get_image_features(pixel_values=want["pixel_values"],
                                             pixel_attention_mask=want["pixel_attention_mask"])
    ref = getattr(ref, "pooler_output", ref)
    ref = torch.cat([r.reshape(-1, r.shape[-1]) for r in ref]) if isinstance(ref, (list, tuple)) else ref
    feats = np.concatenate([encoder._encode_pixels(g) for g in got])
    np.testing.assert_allclose(feats, ref.reshape(-1, ref.shape[-1]).numpy(), atol=2e-5)
    expanded, _ = hf_expanded(path, kind, PROMPTS[0], IMAGES[0])
    assert encoder.layout(PROMPTS[0], got[:2])[0] == expanded


def test_idefics3_engine_equals_transformers(idefics):
    path, model, kind = idefics
    expected = []
    for p, ims in zip(PROMPTS, IMAGES, strict=True):
        ids, kw = hf_expanded(path, kind, p, ims)
        expected.append(torch_greedy(lambda x, kw=kw: model(input_ids=torch.tensor([x]), **kw).logits[0, -1],
                                     ids, NEW_TOKENS))
    eng = image_engine(path)
    assert_batched_then_cached(eng, PROMPTS, IMAGES, expected, 48, params=GREEDY)


@pytest.mark.parametrize("idefics", ["SmolVLM"], indirect=True)
def test_convert_writes_the_whole_model(idefics, tmp_path):
    from jaxserve.engine.model_loading import load_model
    from jaxserve.engine_args import EngineArgs
    from jaxserve.loader.export import export_hf

    path, source, kind = idefics
    loaded = load_model(EngineArgs(model=path, dtype="float32"), progress=False)
    out = tmp_path / "out"
    export_hf(str(out), loaded.config, loaded.params, loaded.tokenizer, vision=loaded.vision)
    back, info = type(source).from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    pixels = processed(kind, IMAGES[1])
    ids = torch.tensor([[5, FAKE, GLOBAL] + [IMAGE] * 4 + [FAKE, 7]])
    kw = dict(input_ids=ids, pixel_values=pixels["pixel_values"][:, -1:],
              pixel_attention_mask=pixels["pixel_attention_mask"][:, -1:])
    with torch.no_grad():
        np.testing.assert_allclose(back.eval()(**kw).logits.numpy(), source(**kw).logits.numpy(), atol=1e-5)
