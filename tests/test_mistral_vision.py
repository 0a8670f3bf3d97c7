"""Mistral's own format with a vision encoder (params.json's `vision_encoder`, as Mistral Small 3.1 / 3.2 and
Magistral Small 1.2 ship): a tiny Mistral 3 saved by transformers, written back as Mistral writes its checkpoints
(the inverse of transformers' converter: Mistral's names, q and k rows of the language model and of the tower in
interleaved rotary pairs), reads as the HF model (config, language model and tower weights, image processing); its
chat template writes an image where the message has it, and the prompt it makes, images expanded, is the tokens
mistral_common encodes (and, for images resized, the same grid of patches)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

mistral_common = pytest.importorskip("mistral_common")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

from jaxserve.errors import UnsupportedModelError  # noqa: E402
from jaxserve.images import preprocessor_config  # noqa: E402
from jaxserve.images_pixtral import PixtralImageProcessor  # noqa: E402
from jaxserve.loader import load_params, load_vision, open_checkpoint  # noqa: E402
from tests.pixtral_model import IMAGE_BREAK, IMAGE_END, IMAGE_TOKEN, PROCESSOR, save_tiny_pixtral  # noqa: E402

_TEXT = {"self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk", "self_attn.v_proj": "attention.wv",
         "self_attn.o_proj": "attention.wo", "mlp.gate_proj": "feed_forward.w1", "mlp.down_proj": "feed_forward.w2",
         "mlp.up_proj": "feed_forward.w3", "input_layernorm": "attention_norm", "post_attention_layernorm": "ffn_norm"}
_TOWER = {"attention.q_proj": "attention.wq", "attention.k_proj": "attention.wk", "attention.v_proj": "attention.wv",
          "attention.o_proj": "attention.wo", "feed_forward.gate_proj": "feed_forward.w1",
          "feed_forward.down_proj": "feed_forward.w2", "feed_forward.up_proj": "feed_forward.w3",
          "attention_norm": "attention_norm", "ffn_norm": "ffn_norm"}
_TOP = {"vision_tower.patch_conv.weight": "vision_encoder.patch_conv.weight",
        "vision_tower.ln_pre.weight": "vision_encoder.ln_pre.weight",
        "multi_modal_projector.patch_merger.merging_layer.weight": "patch_merger.merging_layer.weight",
        "multi_modal_projector.norm.weight": "pre_mm_projector_norm.weight",
        "multi_modal_projector.linear_1.weight": "vision_language_adapter.w_in.weight",
        "multi_modal_projector.linear_2.weight": "vision_language_adapter.w_out.weight",
        "multi_modal_projector.linear_1.bias": "vision_language_adapter.w_in.bias",
        "multi_modal_projector.linear_2.bias": "vision_language_adapter.w_out.bias"}


def _interleaved(w: np.ndarray, heads: int) -> np.ndarray:
    rows, cols = w.shape
    return w.reshape(heads, 2, rows // heads // 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols)


def _mistral_name(hf: str) -> str:
    """A Mistral 3 tensor's name as Mistral writes it (the language model's under `model.language_model.` or
    `language_model.model.`, as transformers versions save it)."""
    for prefix in ("model.language_model.", "language_model.model."):
        if hf.startswith(prefix):
            hf = "model." + hf[len(prefix):]
    hf = hf.replace("model.vision_tower.", "vision_tower.").replace("model.multi_modal_projector.",
                                                                    "multi_modal_projector.")
    if hf in ("model.embed_tokens.weight", "model.norm.weight") or hf.endswith("lm_head.weight"):
        return {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight"}.get(
            hf, "output.weight")
    if hf.startswith("model.layers."):
        layer, module = hf.removeprefix("model.layers.").removesuffix(".weight").split(".", 1)
        return f"layers.{layer}.{_TEXT[module]}.weight"
    if hf.startswith("vision_tower.transformer.layers."):
        layer, module = hf.removeprefix("vision_tower.transformer.layers.").removesuffix(".weight").split(".", 1)
        return f"vision_encoder.transformer.layers.{layer}.{_TOWER[module]}.weight"
    return _TOP[hf]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """(the HF directory, the same model as a Mistral-format directory, transformers' model)."""
    root = tmp_path_factory.mktemp("mistral3")
    model = save_tiny_pixtral(root / "hf", "mistral3", multimodal_projector_bias=True)
    c, v = model.config.text_config, model.config.vision_config
    out = {}
    for hf, t in model.state_dict().items():
        name, w = _mistral_name(hf), t.float().numpy()
        if name.endswith(("attention.wq.weight", "attention.wk.weight")):
            heads = (v.num_attention_heads if name.startswith("vision") else
                     c.num_attention_heads if name.endswith("wq.weight") else c.num_key_value_heads)
            w = _interleaved(w, heads)
        out[name] = np.ascontiguousarray(w)
    path = root / "mistral"
    path.mkdir()
    save_file(out, str(path / "consolidated.safetensors"))
    params = {"dim": c.hidden_size, "n_layers": c.num_hidden_layers, "head_dim": c.head_dim,
              "hidden_dim": c.intermediate_size, "n_heads": c.num_attention_heads, "n_kv_heads": c.num_key_value_heads,
              "norm_eps": c.rms_norm_eps, "vocab_size": c.vocab_size, "rope_theta": c.rope_parameters["rope_theta"],
              "max_seq_len": c.max_position_embeddings, "sliding_window": c.sliding_window,
              "tied_embeddings": bool(model.config.tie_word_embeddings or c.tie_word_embeddings),
              "vision_encoder": {"hidden_size": v.hidden_size, "num_channels": 3, "max_image_size": v.image_size,
                                 "patch_size": v.patch_size, "rope_theta": v.rope_parameters["rope_theta"],
                                 "intermediate_size": v.intermediate_size, "num_hidden_layers": v.num_hidden_layers,
                                 "num_attention_heads": v.num_attention_heads, "image_token_id": IMAGE_TOKEN,
                                 "image_break_token_id": IMAGE_BREAK, "image_end_token_id": IMAGE_END,
                                 "adapter_bias": True, "mm_projector_id": "patch_merge", "spatial_merge_size": 2,
                                 "add_pre_mm_projector_layer_norm": True}}
    (path / "params.json").write_text(json.dumps(params))
    return root / "hf", path, model


def test_mistral_format_vision_reads_as_the_hf_model(dirs):
    hf_dir, path, _ = dirs
    hf, ours = open_checkpoint(str(hf_dir)), open_checkpoint(str(path))
    cfg = ours.config()
    assert cfg == hf.config()
    for a, b in ((load_params(ours, cfg, jnp.float32, progress=False), load_params(hf, cfg, jnp.float32,
                                                                                   progress=False)),
                 (load_vision(ours, cfg, jnp.float32)[1], load_vision(hf, cfg, jnp.float32)[1])):
        pa, pb = jax.tree_util.tree_flatten_with_path(a)[0], jax.tree_util.tree_flatten_with_path(b)[0]
        assert [k for k, _ in pa] == [k for k, _ in pb] and len(pa) > 10
        for (k, x), (_, y) in zip(pa, pb, strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(k))
    vcfg, hf_vcfg = load_vision(ours, cfg, jnp.float32)[0], load_vision(hf, cfg, jnp.float32)[0]
    assert vcfg == hf_vcfg and (vcfg.projector, vcfg.spatial_merge_size, vcfg.projector_bias) == ("mistral3", 2, True)
    # Image processing as the HF directory's processor (longest side 64, patches of 4, merged 2 x 2).
    merge = vcfg.spatial_merge_size
    settings = preprocessor_config(str(path), None, "pixtral")
    assert PixtralImageProcessor.from_dict(settings, merge) == PixtralImageProcessor.from_dict(PROCESSOR, merge)


def test_mistral_format_reads_only_the_tensors_asked_for(dirs, monkeypatch):
    """The tower's load reads the tower's tensors from disk, not the language model's (24B of them in Mistral Small),
    and the language model's load not the tower's."""
    from jaxserve.loader import HFDirectory
    from jaxserve.models.vision_towers import tower_of

    _, path, _ = dirs
    ckpt = open_checkpoint(str(path))
    read: list[str] = []
    stored = HFDirectory._stored_tensors

    def spy(self, select=None):
        for name, array in stored(self, select):
            read.append(name)
            yield name, array

    monkeypatch.setattr(HFDirectory, "_stored_tensors", spy)
    tower = tower_of(ckpt.hf_config)[0]
    names = [name for name, _ in ckpt.tensors(ckpt.config(), select=tower.is_tensor)]
    assert names and all(tower.is_tensor(n) for n in names)
    assert read and all(n.startswith(("vision_", "patch_merger.", "pre_mm_")) for n in read), read
    read.clear()
    text = [name for name, _ in ckpt.tensors(ckpt.config(), select=lambda n: not tower.is_tensor(n))]
    assert text and not any(n.startswith(("vision_", "patch_merger.", "pre_mm_")) for n in read)


def test_mistral_format_projectors_refused_by_name(dirs, tmp_path):
    _, path, _ = dirs
    params = json.loads((path / "params.json").read_text())
    (tmp_path / "consolidated.safetensors").symlink_to(path / "consolidated.safetensors")
    for change, match in (({"add_pre_mm_projector_layer_norm": False}, "no add_pre_mm_projector_layer_norm"),
                          ({"mm_projector_id": "other"}, "options {'mm_projector_id': 'other'"),):
        vision = {**params["vision_encoder"], **change}
        (tmp_path / "params.json").write_text(json.dumps({**params, "vision_encoder": vision}))
        with pytest.raises(UnsupportedModelError, match=match):
            open_checkpoint(str(tmp_path))
    # Without a merger: LLaVA over the Pixtral tower (Pixtral 12B's file), the adapter biased by default.
    vision = {k: x for k, x in params["vision_encoder"].items()
              if k not in ("mm_projector_id", "spatial_merge_size", "add_pre_mm_projector_layer_norm", "adapter_bias")}
    (tmp_path / "params.json").write_text(json.dumps({**params, "vision_encoder": vision}))
    hf_config = open_checkpoint(str(tmp_path)).hf_config
    assert hf_config["model_type"] == "llava" and hf_config["multimodal_projector_bias"] is True


def test_prompt_with_an_image_is_mistral_commons(dirs, tmp_path):
    """A user message of an image and text, through the tekken file's chat template (v7) and the image's expansion
    into rows of `[IMG]` with `[IMG_BREAK]` and `[IMG_END]`: mistral_common's tokens for the same request, and its
    pixels (an image already in whole merged patches, so neither side resizes it)."""
    from mistral_common.protocol.instruct.messages import ImageChunk, TextChunk, UserMessage
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
    from PIL import Image

    from jaxserve.engine.placeholders import expand_grids
    from jaxserve.models.vision_pixtral import pixtral_grid, pixtral_prompt_tokens
    from jaxserve.tokenizer import Tokenizer
    from tests.test_tokenizer_tekken import SPECIALS, TEKKEN

    _, path, _ = dirs
    data = json.loads(open(TEKKEN, encoding="utf-8").read())
    data["vocab"] = data["vocab"][:4000]
    data["config"] = {**data["config"], "num_vocab_tokens": 4000, "default_vocab_size": 5000, "version": "v7"}
    data["special_tokens"] = [{"rank": i, "token_str": s, "is_control": True} for i, s in enumerate(SPECIALS)]
    data["image"] = {"image_patch_size": 4, "max_image_size": 64, "spatial_merge_size": 2}
    (tmp_path / "tekken.json").write_text(json.dumps(data), encoding="utf-8")
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (24, 40, 3), dtype=np.uint8))
    ours = Tokenizer.from_tekken(str(tmp_path / "tekken.json"))
    images: list = []
    text = ours.apply_chat_template([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:,"}}, {"type": "text", "text": "What is it?"}]}],
        images=images, image_placeholder="[IMG]")
    assert text == "<s>[INST][IMG]What is it?[/INST]" and len(images) == 1
    vcfg = dataclasses.replace(load_vision(open_checkpoint(str(path)), open_checkpoint(str(path)).config(),
                                           jnp.float32)[0], image_token_id=10, image_break_token_id=12,
                               image_end_token_id=13)
    processor = PixtralImageProcessor.from_dict(preprocessor_config(str(path), None, "pixtral"), 2)
    pixels = processor(image)
    layout = pixtral_prompt_tokens(vcfg, pixtral_grid(vcfg, pixels.shape[1:]))
    expanded, _ = expand_grids(ours.encode(text), [layout], 10, 13)
    ref = MistralTokenizer.from_file(str(tmp_path / "tekken.json")).encode_chat_completion(ChatCompletionRequest(
        messages=[UserMessage(content=[ImageChunk(image=image), TextChunk(text="What is it?")])]))
    assert expanded == ref.tokens
    np.testing.assert_allclose(pixels, ref.images[0], atol=1e-5)
    # Images that are resized: the same grid as mistral_common's (the pixels differ a little: PIL's bicubic filter
    # against OpenCV's).
    from mistral_common.tokens.tokenizers.image import ImageConfig, ImageEncoder, SpecialImageIDs

    encoder = ImageEncoder(ImageConfig(image_patch_size=4, max_image_size=64, spatial_merge_size=2),
                           SpecialImageIDs(img=10, img_break=12, img_end=13))
    for size in ((30, 50), (100, 37), (200, 300), (13, 9), (65, 20)):
        resized = Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))
        ours_px, theirs = processor(resized), encoder(ImageChunk(image=resized))
        assert ours_px.shape == theirs.image.shape, size
        assert pixtral_prompt_tokens(vcfg, pixtral_grid(vcfg, ours_px.shape[1:])) == theirs.tokens, size
