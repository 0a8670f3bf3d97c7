"""Tiny random Pixtral-tower models saved as HF directories, for the vision tests: Mistral 3 (a Pixtral tower, the
patch merger and projector, a Mistral decoder) and LLaVA with a Pixtral tower; weights (every one random),
config.json and the image processor's preprocessor_config.json.

Patches are 4 pixels and Mistral 3 merges 2 x 2, so its images' sides are multiples of 8 pixels (LLaVA's of 4);
the processor scales an image down until its longest side is 64 pixels (16 patches)."""

from __future__ import annotations

import json
import os

IMAGE_TOKEN, IMAGE_BREAK, IMAGE_END = 290, 291, 292
VOCAB = 300
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
            rms_norm_eps=1e-5)
VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, patch_size=4,
              image_size=64, hidden_act="silu")
PROCESSOR = dict(image_processor_type="PixtralImageProcessor", size={"longest_edge": 64}, patch_size=4, resample=3)
KINDS = ("mistral3", "llava")


def save_tiny_pixtral(path, kind: str = "mistral3", seed: int = 0, **top):
    """A random Mistral 3 (or LLaVA over Pixtral) model saved to `path` with its processor config; `top` overrides
    fields of the top-level config. Returns the float32 torch model holding the saved weights."""
    import torch
    import transformers

    from tests.llava_model import randomize

    torch.manual_seed(seed)
    vision = transformers.PixtralVisionConfig(**VISION)
    text = transformers.MistralConfig(**TEXT)
    if kind == "mistral3":
        config = transformers.Mistral3Config(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN,
                                             **{"spatial_merge_size": 2, "projector_hidden_act": "gelu", **top})
        model = transformers.Mistral3ForConditionalGeneration(config).eval()
    else:
        config = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN,
                                          **{"vision_feature_layer": -1, "vision_feature_select_strategy": "full",
                                             "projector_hidden_act": "gelu", **top})
        model = transformers.LlavaForConditionalGeneration(config).eval()
    randomize(model)
    model.save_pretrained(path, safe_serialization=True)
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump(PROCESSOR, f)
    return model
