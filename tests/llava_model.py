"""Tiny random LLaVA models (a CLIP or SigLIP tower, a Llama decoder) saved as HF directories, for the image-text
tests: weights, a word-level tokenizer with an `<image>` token, the image processor's config and a chat template
that puts each image part's placeholder where it stands."""

from __future__ import annotations

import json
import os

import numpy as np
import tokenizers

from jaxserve.tokenizer import Tokenizer
from tests.fake_model import EOS, VOCAB

IMAGE_TOKEN = VOCAB - 1
VIDEO_TOKEN = VOCAB - 2  # LLaVA-OneVision's `<video>` (a word of the tokenizer's otherwise)
IMAGE_SIZE = 32
PATCH = 8
PINPOINTS = [[32, 64], [64, 32], [64, 64], [96, 32]]  # LLaVA-NeXT's crop grids: 1x2, 2x1, 2x2, 3x1
TEMPLATE = ("{% for m in messages %}{{ m.role }} : {% if m.content is string %}{{ m.content }}{% else %}"
            "{% for c in m.content %}{% if c.type == 'image' %}<image> {% else %}{{ c.text }} {% endif %}{% endfor %}"
            "{% endif %}<eos> {% endfor %}{% if add_generation_prompt %}assistant :{% endif %}")
# Tower configs: (transformers class, its fields, the processor's config).
TOWERS = {
    "clip": ("CLIPVisionConfig", dict(hidden_act="quick_gelu", layer_norm_eps=1e-5),
             dict(image_processor_type="CLIPImageProcessor", size={"shortest_edge": IMAGE_SIZE},
                  crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, do_center_crop=True, resample=3)),
    "siglip": ("SiglipVisionConfig", dict(hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6),
               dict(image_processor_type="SiglipImageProcessor", size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
                    resample=2, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])),
}


def image_tokenizer() -> Tokenizer:
    """The fake model's word-level vocabulary with `<image>` as its last token."""
    vocab = {"<pad>": 0, "<eos>": EOS} | {f"t{i}": i for i in range(2, VOCAB - 1)} | {"<image>": IMAGE_TOKEN}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens([tokenizers.AddedToken("<eos>", special=True),
                                tokenizers.AddedToken("<image>", special=True)])
    return Tokenizer(backend, bos_token_id=None, eos_token_ids=[EOS], pad_token_id=0)


def randomize(model, gemma_norms: bool = False) -> None:
    """Every weight of a torch model random, so that a slip shows (transformers zeroes or fills some): norm weights
    around 1 (Gemma's RMSNorm, applied as 1 + w, around 0 with `gemma_norms`), other vectors small, matrices
    N(0, 0.15^2)."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            layer_norm = "layernorm" in name or "layer_norm" in name
            if p.ndim == 1 and gemma_norms and "norm" in name and not layer_norm:
                p.copy_(0.3 * torch.randn_like(p))
            elif p.ndim == 1 and "norm" in name and (not gemma_norms or name.endswith("weight")):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif p.ndim == 1:
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)


def save_tiny_llava(path, tower: str = "clip", feature_layer=-2, strategy: str = "default", seed: int = 0,
                    anyres: bool = False, onevision: str | None = None):
    """A random LLaVA model (LLaVA-NeXT with `anyres`; LLaVA-OneVision with `onevision`, its vision_aspect_ratio)
    saved to `path` with its tokenizer, processor config and chat template; returns the float32 torch model holding
    the saved weights."""
    import torch
    import transformers

    from tests.test_model_families import TINY

    torch.manual_seed(seed)
    cls, fields, processor = TOWERS[tower]
    vision = getattr(transformers, cls)(hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                        num_attention_heads=4, image_size=IMAGE_SIZE, patch_size=PATCH, **fields)
    kind = "LlavaOnevision" if onevision else "LlavaNext" if anyres else "Llava"
    extra = {"image_grid_pinpoints": PINPOINTS} if anyres or onevision else {}
    extra |= {"vision_aspect_ratio": onevision, "video_token_index": VIDEO_TOKEN} if onevision else {}
    config = getattr(transformers, f"{kind}Config")(
        vision_config=vision, text_config=transformers.LlamaConfig(**{**TINY, "vocab_size": VOCAB}),
        image_token_index=IMAGE_TOKEN, vision_feature_layer=feature_layer, vision_feature_select_strategy=strategy,
        projector_hidden_act="gelu", **extra)
    model = getattr(transformers, f"{kind}ForConditionalGeneration")(config).eval()
    if anyres or onevision:
        processor = {**processor, "image_processor_type": f"{kind}ImageProcessor", "image_grid_pinpoints": PINPOINTS}
    randomize(model)
    model.save_pretrained(path, safe_serialization=True)
    tok = image_tokenizer()
    tok._backend.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<eos>", "pad_token": "<pad>", "chat_template": TEMPLATE}, f)
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump(processor, f)
    return model


def random_image(seed: int, size: tuple[int, int] = (45, 37), mode: str = "RGB"):
    """A PIL image of random pixels (not square, so resizing and cropping do something)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4}[mode]
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], channels), dtype=np.uint8), mode)
