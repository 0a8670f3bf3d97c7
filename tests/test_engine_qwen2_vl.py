"""Qwen2-VL and Qwen2.5-VL through the engine: tiny random models' greedy tokens and logprobs against transformers',
images of several sizes cut across prefill chunks, batched against alone, the prefix cache reused; M-RoPE's
positions (an image's tokens by their place in it, the text after it drawn back) make the difference."""

from __future__ import annotations

import dataclasses
import functools
import types

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxserve.engine.image_prompt import ImagePrompt  # noqa: E402
from jaxserve.engine_args import EngineArgs  # noqa: E402
from jaxserve.sampling_params import SamplingParams  # noqa: E402
from tests.llava_model import random_image  # noqa: E402
from tests.modelrun import assert_same_greedy, image_engine, run_images, torch_greedy  # noqa: E402
from tests.qwen2_vl_model import (  # noqa: E402
    IMAGE_TOKEN,
    PROCESSOR,
    VISION_END,
    VISION_START,
    saved_tiny_qwen,
)

NEW_TOKENS = 6
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)


def image_part() -> list[int]:
    return [VISION_START, IMAGE_TOKEN, VISION_END]


def text(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 280, n).tolist()


# Images of 4 x 10, 6 x 4 and 8 x 8 tokens (two in one prompt, text between and after them).
PROMPTS = [text(1, 5) + image_part() + text(2, 3) + image_part() + text(3, 4), image_part() + text(4, 6)]
IMAGES = [[random_image(1, (80, 30)), random_image(2, (31, 50))], [random_image(3, (64, 64))]]


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5"])
def qwen(request, tmp_path_factory):
    return saved_tiny_qwen(tmp_path_factory.mktemp(request.param), request.param)


def hf_greedy(model, ids: list[int], images, fields=None) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and their logprobs (a full forward per token), its processor (of `fields`, by
    default the models') expanding each image's `<|image_pad|>` to the image's tokens."""
    fields = fields or {k: v for k, v in PROCESSOR.items() if k != "image_processor_type"}
    processed = transformers.Qwen2VLImageProcessorPil(**fields)(images, return_tensors="pt")
    grids = processed["image_grid_thw"].tolist()
    counts = iter(t * h * w // 4 for t, h, w in grids)
    expanded = [x for i in ids for x in ([i] * next(counts) if i == IMAGE_TOKEN else [i])]
    def forward(ids: list[int]):
        ids_t = torch.tensor([ids])
        return model(input_ids=ids_t, pixel_values=processed["pixel_values"], image_grid_thw=processed["image_grid_thw"],
                     mm_token_type_ids=(ids_t == IMAGE_TOKEN).int()).logits[0, -1]

    return torch_greedy(forward, expanded, NEW_TOKENS)


engine = image_engine
run = functools.partial(run_images, params=GREEDY)


def test_qwen2_vl_engine_equals_transformers(qwen):
    """Both prompts in one batch, their images cut across 32-token prefill chunks; then each alone, the second time
    from the prefix cache."""
    path, model = qwen
    expected = [hf_greedy(model, p, ims) for p, ims in zip(PROMPTS, IMAGES, strict=True)]
    eng = engine(path)
    assert eng.runner.cfg.mrope
    counts = [eng.images.num_tokens(eng.images.prepare(im)) for im in IMAGES[0] + IMAGES[1]]
    assert counts == [4 * 10, 6 * 4, 8 * 8]

    assert_same_greedy(run(eng, PROMPTS, IMAGES), expected)
    hits = eng.scheduler.cache.hit_tokens
    assert_same_greedy(run(eng, PROMPTS[:1], IMAGES[:1], ["a"]) + run(eng, PROMPTS[1:], IMAGES[1:], ["b"]), expected)
    assert eng.scheduler.cache.hit_tokens - hits >= 72 + 64  # all full pages but each prompt's last token's
    eng.check_integrity()


@pytest.mark.parametrize("qwen", ["qwen2_5_vl"], indirect=True)  # one variant suffices
def test_mrope_positions_make_the_difference(qwen, monkeypatch):
    """With every token turned by its position alone (no M-RoPE offsets), the logprobs leave transformers'."""
    path, model = qwen
    _, want = hf_greedy(model, PROMPTS[0], IMAGES[0])
    monkeypatch.setattr(ImagePrompt, "rope_offsets", lambda self, start, count, out: None)
    (_, got), = run(engine(path), PROMPTS[:1], IMAGES[:1])
    assert np.max(np.abs(np.asarray(got) - np.asarray(want))) > 1e-3


@pytest.mark.parametrize("qwen", ["qwen3_vl"], indirect=True)
def test_qwen3_vl_deepstack_and_interleaved_sections_make_the_difference(qwen, monkeypatch):
    """Qwen3-VL with its deepstack embeddings zero, or with its M-RoPE sections in order instead of interleaved,
    leaves transformers' logprobs: the equality above can fail on either."""
    from jaxserve.models import rotary

    path, model = qwen
    _, want = hf_greedy(model, PROMPTS[0], IMAGES[0])
    eng = engine(path)
    cfg = eng.model.config
    assert (cfg.family, cfg.mrope_interleaved, cfg.deepstack_layers) == ("qwen3", True, 2)
    params = eng.images.params
    eng.images.use_params(dataclasses.replace(params, deep={**params.deep, "w2": params.deep["w2"] * 0,
                                                            "b2": params.deep["b2"] * 0}))
    (_, got), = run(eng, PROMPTS[:1], IMAGES[:1])
    assert np.max(np.abs(np.asarray(got) - np.asarray(want))) > 1e-3
    monkeypatch.setattr(rotary, "mrope_axes", lambda cfg: np.repeat(np.arange(3), cfg.mrope_section))
    jax.clear_caches()  # (the steps traced before hold the interleaved axes)
    (_, got), = run(engine(path), PROMPTS[:1], IMAGES[:1])
    assert np.max(np.abs(np.asarray(got) - np.asarray(want))) > 1e-3


@pytest.mark.parametrize("qwen", ["exaone4_5"], indirect=True)
def test_exaone4_5_engine_equals_transformers(qwen, tmp_path):
    """EXAONE 4.5: Qwen2.5-VL's tower with grouped KV heads, EXAONE 4's language model turning every token by its
    position alone: both prompts in one batch, then the first again from the prefix cache, transformers' tokens and
    logprobs; `jaxserve convert` writes the whole model back under its own names."""
    from safetensors import safe_open

    from tests.test_convert import convert

    path, model = qwen
    expected = [hf_greedy(model, p, ims) for p, ims in zip(PROMPTS, IMAGES, strict=True)]
    eng = engine(path)
    cfg, vcfg = eng.model.config, eng.images.cfg
    assert (cfg.family, cfg.mrope_section, eng.runner.cfg.mrope) == ("exaone4", None, False)
    assert (vcfg.variant, vcfg.kv_heads, vcfg.num_heads, vcfg.nested) == ("qwen2_5_vl", 1, 2, True)
    assert_same_greedy(run(eng, PROMPTS, IMAGES), expected)
    assert_same_greedy(run(eng, PROMPTS[:1], IMAGES[:1], ["a"]), expected[:1])
    eng.check_integrity()
    convert(path, tmp_path / "out")
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "numpy") as f, \
            safe_open(f"{path}/model.safetensors", "numpy") as g:
        assert sorted(f.keys()) == sorted(g.keys()) and "model.visual.blocks.0.attn.qkv.weight" in g.keys()
        assert f.get_tensor("model.visual.blocks.0.attn.qkv.weight").shape == (2 * 16 + 2 * 16, 32)
        for key in g.keys():
            np.testing.assert_array_equal(f.get_tensor(key), g.get_tensor(key), err_msg=key)


def test_mrope_axes_as_transformers_interleaves_them():
    """Each rotary pair's axis, as transformers' Qwen3-VL recomposes its frequencies (Qwen3-VL's sections, the tiny
    model's, whose last axis runs out of pairs, and Qwen3.5's default sections over a tiny head's 2 pairs), and
    Qwen2-VL's sections in order."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    from jaxserve.config import ModelConfig
    from jaxserve.models.rotary import mrope_axes
    from tests.qwen2_vl_model import TEXT3, TEXT3_MOE

    for section, pairs in (([24, 20, 20], 64), ([2, 3, 3], 8), ([11, 11, 10], 2)):
        rotary = types.SimpleNamespace(mrope_section=section)
        freq = torch.arange(3.0)[:, None, None, None].expand(3, 1, 1, pairs).clone()  # each axis its own id
        want = Qwen3VLTextRotaryEmbedding.recomposition_frequencies(rotary, freq)[0, 0, :pairs]
        cfg = types.SimpleNamespace(mrope_section=section, mrope_interleaved=True, rotary_dims=2 * pairs)
        np.testing.assert_array_equal(mrope_axes(cfg), want.numpy())
    cfg = ModelConfig.from_hf({"architectures": ["Qwen3VLForConditionalGeneration"], "text_config": TEXT3,
                               "vision_config": {"deepstack_visual_indexes": [2, 0]}})
    assert (cfg.mrope_section, cfg.mrope_interleaved, cfg.deepstack_layers) == ((2, 3, 3), True, 2)
    assert mrope_axes(dataclasses.replace(cfg, mrope_interleaved=False)).tolist() == [0, 0, 1, 1, 1, 2, 2, 2]
    # Qwen3-VL-MoE's language model: Qwen3-MoE's, its routing weights renormalized whatever the config says.
    moe = ModelConfig.from_hf({"architectures": ["Qwen3VLMoeForConditionalGeneration"],
                               "text_config": {**TEXT3_MOE, "norm_topk_prob": False}})
    assert (moe.family, moe.num_experts, moe.norm_topk_prob, moe.deepstack_layers) == ("qwen3_moe", 4, True, 3)


def test_convert_writes_the_whole_qwen2_vl_model(qwen, tmp_path):
    """`jaxserve convert`: transformers reads every weight back and computes the source's logits over an image; the
    written model serves as the source does."""
    from jaxserve.engine.model_loading import load_model
    from jaxserve.loader.export import export_hf

    path, source = qwen
    loaded = load_model(EngineArgs(model=path, dtype="float32"), progress=False)
    out = tmp_path / "out"
    export_hf(str(out), loaded.config, loaded.params, loaded.tokenizer, vision=loaded.vision)
    back, info = type(source).from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    fields = {k: v for k, v in PROCESSOR.items() if k != "image_processor_type"}
    processed = transformers.Qwen2VLImageProcessorPil(**fields)(IMAGES[1], return_tensors="pt")
    ids = torch.tensor([[5, VISION_START] + [IMAGE_TOKEN] * 64 + [VISION_END, 7]])
    kw = dict(input_ids=ids, pixel_values=processed["pixel_values"], image_grid_thw=processed["image_grid_thw"],
              mm_token_type_ids=(ids == IMAGE_TOKEN).int())
    with torch.no_grad():
        np.testing.assert_allclose(back.eval()(**kw).logits.numpy(), source(**kw).logits.numpy(), atol=1e-5)
    assert run(engine(str(out)), PROMPTS[1:], IMAGES[1:]) == run(engine(path), PROMPTS[1:], IMAGES[1:])


@pytest.mark.parametrize("qwen", ["qwen2_vl"], indirect=True)  # one variant suffices
def test_chat_with_an_image(qwen):
    """`LLM.chat` with an image part: the chat template writes `<|vision_start|><|image_pad|><|vision_end|>`, which
    the image's tokens fill; the reply is the engine's for that prompt."""
    from jaxserve.llm import LLM

    path, _ = qwen
    llm = LLM(model=path, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=512, page_size=8,
              kv_cache_memory_bytes=2**21, dtype="float32", warmup=False, compile_cache_dir=None)
    image = IMAGES[0][1]
    message = {"role": "user", "content": [{"type": "text", "text": "t5 t6"},
                                           {"type": "image_pil", "image_pil": image}, {"type": "text", "text": "t7"}]}
    reply = llm.chat([message], GREEDY)[0]
    words = "user : t5 t6 <|vision_start|> <|image_pad|> <|vision_end|> t7 <eos> assistant :".split()
    ids = [llm.engine.tokenizer.encode(w, add_special_tokens=False)[0] for w in words]
    assert reply.prompt_token_ids == ids[:4] + [VISION_START] + [IMAGE_TOKEN] * 24 + [VISION_END] + ids[7:]
    assert list(reply.outputs[0].token_ids) == run(engine(path), [ids], [[image]])[0][0]


@pytest.mark.parametrize("qwen", ["qwen2_5_vl"], indirect=True)  # one variant suffices
def test_disaggregated_prefill_with_images(qwen):
    """Prefill/decode disaggregation (`tests.pd_images`): the decode worker imports the prompt's pages, encodes no
    image, and turns its tokens by the M-RoPE offset the images left: its reply and logprobs are the aggregated
    worker's."""
    from tests.pd_images import pd_chat_with_images

    path, _ = qwen
    args = EngineArgs(model=path, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=512, page_size=8,
                      kv_cache_memory_bytes=2**21, dtype="float32", warmup=False, compile_cache_dir=None)
    pd_chat_with_images(args, IMAGES[0], 4 * 10 + 6 * 4, NEW_TOKENS)


@pytest.mark.parametrize("qwen", ["qwen2_vl"], indirect=True)  # one variant suffices
def test_speculative_decoding_with_images_equals_plain(qwen):
    """N-gram drafts verified after a prompt with images: each draft row turns by the offset the images left."""
    path, _ = qwen
    plain = run(engine(path), PROMPTS, IMAGES)
    for verify in ("rows", "chunks"):
        spec = engine(path, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                "prompt_lookup_min": 1, "draft_verification": verify})
        got = run(spec, PROMPTS, IMAGES)
        assert [t for t, _ in got] == [t for t, _ in plain]
        for (_, a), (_, b) in zip(got, plain, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-4)
        assert spec.stats().spec_num_drafts > 0


@pytest.mark.parametrize("qwen", ["qwen2_5_vl"], indirect=True)
def test_a_draft_model_for_an_image_text_target_equals_plain(qwen):
    """A draft model for an image-text target (its own language model, read from the same directory, images off):
    drafts verified after prompts with images and a text-only one; the target's tokens and logprobs, and the drafts
    of the text-only prompt (where the draft is the target exactly: M-RoPE's positions are plain without images) all
    taken."""
    path, _ = qwen
    prompts, images = PROMPTS + [text(8, 9)], IMAGES + [[]]
    plain = run(engine(path), prompts, images)
    spec = engine(path, speculative_config={"model": path, "num_speculative_tokens": 3})
    assert spec.draft.loaded.vision is None and spec.draft.cfg.num_layers == spec.model.config.num_layers
    spec.drafter.costs = None  # (every draft the step has room for)
    def same(got, want) -> None:
        assert [t for t, _ in got] == [t for t, _ in want]
        for (_, a), (_, b) in zip(got, want, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-4)

    before = spec.stats()
    same(run(spec, prompts[2:], images[2:]), plain[2:])
    alone = spec.stats()
    assert alone.spec_num_accepted_tokens - before.spec_num_accepted_tokens == \
        alone.spec_num_draft_tokens - before.spec_num_draft_tokens >= 3
    same(run(spec, prompts, images), plain)
    assert spec.stats().spec_num_draft_tokens > alone.spec_num_draft_tokens
    spec.check_integrity()


@pytest.mark.parametrize("qwen", ["qwen2_vl"], indirect=True)
def test_mm_processor_kwargs_set_the_processor(qwen):
    """`--mm-processor-kwargs '{"max_pixels": 1024}'`: an image takes fewer tokens (80 x 30 pixels: 16 x 48 instead of
    32 x 80, 12 tokens instead of 40), and its reply is transformers' for pixels processed so; a setting the
    processor does not take is refused by name."""
    path, model = qwen
    eng = engine(path, mm_processor_kwargs='{"max_pixels": 1024}')
    image = IMAGES[0][0]
    assert eng.images.num_tokens(eng.images.prepare(image)) == 12
    fields = {k: v for k, v in PROCESSOR.items() if k != "image_processor_type"}
    want = hf_greedy(model, [5, *image_part(), 7], [image], {**fields, "max_pixels": 1024})
    (tokens, lps), = run(eng, [[5, *image_part(), 7]], [[image]])
    assert tokens == want[0] and np.allclose(lps, want[1], atol=2e-4)
    with pytest.raises(ValueError, match=r"mm_processor_kwargs \['resample'\]: this model's image processor takes "
                                         "min_pixels, max_pixels, size"):
        engine(path, mm_processor_kwargs={"resample": 2})
