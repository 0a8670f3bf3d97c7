"""Gemma 4's images (`Gemma4ForConditionalGeneration`) against transformers: a tiny random model (a vision tower of 2
blocks with clamped projections and standardized output, 4-pixel patches pooled 3 x 3; a Gemma 4 decoder whose
windowed layers attend an image's tokens both ways) saved with a word-level tokenizer. The processor's patches and
soft-token counts equal transformers' processor's; the soft tokens equal its `get_image_features`; the engine's
greedy tokens and their logprobs for prompts with images of three sizes (laid out `<|image>`, the image's tokens,
`<image|>`) equal transformers' (and not them with the images attended causally)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxserve.engine.llm_engine import LLMEngine  # noqa: E402
from jaxserve.engine_args import EngineArgs  # noqa: E402
from jaxserve.sampling_params import SamplingParams  # noqa: E402
from tests.llava_model import random_image  # noqa: E402
from tests.modelrun import drain  # noqa: E402

SPECIAL = ["<pad>", "<eos>", "<bos>", "<|image|>", "<|image>", "<image|>", "<turn|>"]
PAD, EOS, BOS, IMAGE, BOI, EOI, EOT = range(len(SPECIAL))
VOCAB = 96  # t{i} for i from len(SPECIAL) up
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=4, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
            attention_k_eq_v=True, sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2,
            hidden_size_per_layer_input=0, max_position_embeddings=512, use_bidirectional_attention="vision",
            pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS)
VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
              head_dim=16, patch_size=4, position_embedding_size=96, pooling_kernel_size=3, use_clipped_linears=True,
              standardize=True)
PROCESSOR = dict(image_processor_type="Gemma4ImageProcessor", patch_size=4, max_soft_tokens=70, pooling_kernel_size=3)
SIZES = [(45, 37), (60, 20), (24, 24)]  # (width, height)
NEW_TOKENS = 5
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    """(path, the torch model holding the saved weights)."""
    import tokenizers

    path = str(tmp_path_factory.mktemp("gemma4_images"))
    torch.manual_seed(0)
    config = transformers.Gemma4Config(text_config=TEXT, vision_config=VISION, audio_config=None,
                                       image_token_id=IMAGE, boi_token_id=BOI, eoi_token_id=EOI)
    model = transformers.Gemma4ForConditionalGeneration(config).eval()
    with torch.no_grad():  # every weight random; the clamps tight enough to clamp; the standardization set
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if p.ndim == 1 and "norm" in name else
                    0.2 * torch.randn_like(p) if p.ndim == 1 else 0.15 * torch.randn_like(p))
        for name, b in model.named_buffers():
            bound = {"input_min": -1.5, "input_max": 1.5, "output_min": -2.0, "output_max": 2.0}.get(name.split(".")[-1])
            if bound is not None:
                b.fill_(bound)
            elif name.endswith(("std_bias", "std_scale", "layer_scalar")):
                b.copy_((0.2 if name.endswith("bias") else 1.0) + 0.2 * torch.randn_like(b))
    model.save_pretrained(path)
    vocab = {s: i for i, s in enumerate(SPECIAL)} | {f"t{i}": i for i in range(len(SPECIAL), VOCAB)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens([tokenizers.AddedToken(s, special=True) for s in SPECIAL[1:]])
    backend.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
                   "pad_token": "<pad>", "unk_token": "<pad>", "add_bos_token": False}, f)
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump(PROCESSOR, f)
    return path, model


def _hf_pixels(images) -> dict:
    fields = {k: v for k, v in PROCESSOR.items() if k != "image_processor_type"}
    return transformers.Gemma4ImageProcessorPil(**fields)(images, return_tensors="pt")


def _engine(path: str, **kw) -> LLMEngine:
    return LLMEngine(EngineArgs(model=path, **{**dict(
        max_num_seqs=4, max_num_batched_tokens=96, max_model_len=256, page_size=8, kv_cache_memory_bytes=2**21,
        dtype="float32", warmup=False, compile_cache_dir=None), **kw}), progress=False)


def test_gemma4_processor_and_soft_tokens_equal_transformers(gemma4):
    path, model = gemma4
    engine = _engine(path)
    enc = engine.images
    images = [random_image(i, size) for i, size in enumerate(SIZES)]
    hf = _hf_pixels(images)
    with torch.no_grad():
        feats = model.model.get_image_features(hf["pixel_values"], hf["image_position_ids"]).pooler_output
    for i, image in enumerate(images):
        prepared = enc.prepare(image)
        n = prepared.pixels.shape[0]
        assert enc.num_tokens(prepared) == int(hf["num_soft_tokens_per_image"][i]) == n // 9
        np.testing.assert_array_equal(prepared.pixels, hf["pixel_values"][i, :n].numpy())
        np.testing.assert_array_equal(enc.processor.positions(prepared.size), hf["image_position_ids"][i, :n].numpy())
        ours, ref = enc._encode_pixels(prepared), feats[i].numpy()
        assert ours.shape == ref.shape and np.linalg.norm(ours - ref) / np.linalg.norm(ref) < 1e-5


def _hf_greedy(model, ids: list[int], images, both_ways: bool = True) -> tuple[list[int], list[float]]:
    hf = _hf_pixels(images)
    out, logprobs = [], []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            full = torch.tensor([ids + out])
            types = (full == IMAGE).long() if both_ways else None
            logits = model(input_ids=full, pixel_values=hf["pixel_values"], image_position_ids=hf["image_position_ids"],
                           mm_token_type_ids=types).logits
            lp = torch.log_softmax(logits[0, -1].double(), -1)
            out.append(int(lp.argmax()))
            logprobs.append(float(lp.max()))
    return out, logprobs


def test_gemma4_images_through_the_engine_equal_transformers(gemma4):
    """Two prompts, three images (of 36, 56 and 16 soft tokens), in one batch of 96-token steps: the prompts laid
    out as transformers' processor lays them out, the greedy tokens and logprobs transformers' with the images
    attended both ways on the windowed layers (which differ from causal attention over them)."""
    path, model = gemma4
    engine = _engine(path)
    prompts = [[BOS, 10, IMAGE, 11, 12, IMAGE, 13], [BOS, 20, 21, IMAGE, 22]]
    images = [[random_image(0, SIZES[0]), random_image(1, SIZES[1])], [random_image(2, SIZES[2])]]
    for i, (ids, ims) in enumerate(zip(prompts, images, strict=True)):
        engine.add_request(f"r{i}", ids, GREEDY, multi_modal_data={"image": ims})
    done = drain(engine)
    for i, (ids, ims) in enumerate(zip(prompts, images, strict=True)):
        counts = iter(_hf_pixels(ims)["num_soft_tokens_per_image"].tolist())
        laid = [t for x in ids for t in ([BOI] + [IMAGE] * next(counts) + [EOI] if x == IMAGE else [x])]
        assert list(done[f"r{i}"].prompt_token_ids) == laid
        tokens, logprobs = _hf_greedy(model, laid, ims)
        out = done[f"r{i}"].outputs[0]
        assert out.token_ids == tokens
        np.testing.assert_allclose([lp[t].logprob for lp, t in zip(out.logprobs, tokens, strict=True)], logprobs,
                                   atol=2e-4)
        causal = _hf_greedy(model, laid, ims, both_ways=False)
        assert causal[0] != tokens or np.max(np.abs(np.subtract(causal[1], logprobs))) > 1e-3  # (the test can tell)
    engine.check_integrity()


def test_gemma4_image_text_model_converted_reads_back(gemma4, tmp_path):
    """`jaxserve convert`: transformers reads every weight back (the language model under `model.language_model.`,
    the tower and projection beside it) and computes the source's logits over an image."""
    from jaxserve.engine.model_loading import load_model
    from jaxserve.loader.export import export_hf

    path, source = gemma4
    loaded = load_model(EngineArgs(model=path, dtype="float32"), progress=False)
    out = str(tmp_path / "out")
    export_hf(out, loaded.config, loaded.params, loaded.tokenizer, vision=loaded.vision)
    back, info = transformers.Gemma4ForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    image = random_image(5, SIZES[0])
    hf = _hf_pixels([image])
    n = int(hf["num_soft_tokens_per_image"][0])
    ids = torch.tensor([[BOS, 10, BOI] + [IMAGE] * n + [EOI, 11]])
    kw = dict(input_ids=ids, pixel_values=hf["pixel_values"], image_position_ids=hf["image_position_ids"],
              mm_token_type_ids=(ids == IMAGE).long())
    with torch.no_grad():
        np.testing.assert_allclose(back.eval()(**kw).logits.numpy(), source(**kw).logits.numpy(), atol=1e-5)
