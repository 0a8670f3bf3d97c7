"""Tiny random Qwen2-VL and Qwen2.5-VL models saved as HF directories, for the vision tests: weights (every one
random), config.json and the image processor's preprocessor_config.json.

Patches are 4 pixels and merge 2 x 2, so a resized image's sides are multiples of 8 pixels; the processor keeps
images between 256 and 4096 pixels (16 to 256 patches). Qwen2.5-VL's windows are 16 pixels (2 x 2 merged patches),
several to an image, with block 1 of its 3 attending over the whole image."""

from __future__ import annotations

import json
import os

IMAGE_TOKEN, VISION_START, VISION_END, VIDEO_TOKEN = 290, 291, 292, 293
VOCAB = 300
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
VISION = {
    "qwen2_vl": dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=4,
                     temporal_patch_size=2, spatial_merge_size=2),
    "qwen2_5_vl": dict(depth=3, hidden_size=32, out_hidden_size=64, intermediate_size=48, num_heads=2, patch_size=4,
                       temporal_patch_size=2, spatial_merge_size=2, window_size=16, fullatt_block_indexes=[1]),
    # A 5 x 5 grid of learned positions; blocks 2 and 0 feed the first two decoder layers (in that order).
    "qwen3_vl": dict(depth=3, hidden_size=32, out_hidden_size=64, intermediate_size=48, num_heads=2, patch_size=4,
                     temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=25,
                     deepstack_visual_indexes=[2, 0]),
}
# Qwen3-VL's language model is Qwen3's (q/k norms, a head size of its own), its M-RoPE sections interleaved.
TEXT3 = {**TEXT, "head_dim": 16, "num_hidden_layers": 3,
         "rope_parameters": {**TEXT["rope_parameters"], "mrope_interleaved": True}}
VISION["qwen3_vl_moe"] = VISION["qwen3_vl"]
# Qwen3-VL-MoE's: Qwen3-MoE's (4 experts, 2 a token; their gate and up projections packed in one tensor a layer).
TEXT3_MOE = {**TEXT3, "moe_intermediate_size": 24, "num_experts": 4, "num_experts_per_tok": 2}
# Qwen3.5's: Gated DeltaNet layers around a gated attention layer (a quarter of each 32-wide head rotated: 4 pairs,
# sections interleaved), Qwen3-VL's tower without deepstack mergers.
TEXT35 = {**TEXT, "head_dim": 32, "num_hidden_layers": 3, "layer_types": ["linear_attention", "full_attention",
                                                                          "linear_attention"],
          "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
          "rope_parameters": {**TEXT["rope_parameters"], "mrope_section": [2, 1, 1], "mrope_interleaved": True,
                              "partial_rotary_factor": 0.25}}
VISION["qwen3_5"] = {k: v for k, v in VISION["qwen3_vl"].items() if k != "deepstack_visual_indexes"}
# EXAONE 4.5's: EXAONE 4's language model (one position a token, no M-RoPE; three windowed layers and a global one),
# Qwen2.5-VL's tower with its two heads' keys and values in one KV head.
TEXT45 = {k: v for k, v in TEXT.items() if k != "rope_parameters"} | dict(
    model_type="exaone4", head_dim=16, num_hidden_layers=4, sliding_window=8, sliding_window_pattern=4)
VISION["exaone4_5"] = {**VISION["qwen2_5_vl"], "num_key_value_heads": 1}
CLASSES = {"qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration"),
           "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration"),
           "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration"),
           "qwen3_vl_moe": ("Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration"),
           "qwen3_5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration"),
           "exaone4_5": ("Exaone4_5_Config", "Exaone4_5_ForConditionalGeneration")}
PROCESSOR = dict(image_processor_type="Qwen2VLImageProcessor", min_pixels=256, max_pixels=4096, patch_size=4,
                 temporal_patch_size=2, merge_size=2, resample=3)


def save_tiny_qwen2_vl(path, variant: str = "qwen2_vl", seed: int = 0):
    """A random Qwen2-VL (or Qwen2.5-VL, Qwen3-VL) model saved to `path` with its processor config; returns the
    float32 torch model holding the saved weights."""
    import torch
    import transformers

    from tests.llava_model import randomize

    torch.manual_seed(seed)
    config_class, model_class = (getattr(transformers, name) for name in CLASSES[variant])
    # (EXAONE 4.5's config names no vision start and end tokens: its template writes them, by the tokenizer's ids)
    vision_ids = {} if variant == "exaone4_5" else dict(vision_start_token_id=VISION_START,
                                                         vision_end_token_id=VISION_END)
    config = config_class(
        text_config={"qwen3_vl": TEXT3, "qwen3_vl_moe": TEXT3_MOE, "qwen3_5": TEXT35, "exaone4_5": TEXT45}.get(
            variant, TEXT),
        vision_config=VISION[variant], image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN, **vision_ids)
    model = model_class(config).eval()
    randomize(model)
    model.save_pretrained(path, safe_serialization=True)
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump(PROCESSOR, f)
    return model



def saved_tiny_qwen(path, variant: str) -> tuple[str, object]:
    """A tiny random model of `variant` saved with its tokenizer, its logits for the image and video tokens 0 (never
    sampled, so every reply is text); its path and the torch model."""
    import torch

    model = save_tiny_qwen2_vl(path, variant)
    with torch.no_grad():
        model.lm_head.weight[IMAGE_TOKEN:] = 0.0
    model.save_pretrained(path, safe_serialization=True)
    save_qwen_tokenizer(path)
    return str(path), model


def chat_template(image_text: str, video_text: str = "") -> str:
    """A chat template writing `image_text` where each image part stands (`video_text` where a video part does)."""
    return ("{% for m in messages %}{{ m.role }} : {% if m.content is string %}{{ m.content }}{% else %}"
            "{% for c in m.content %}{% if c.type == 'image' %}" + image_text + " "
            "{% elif c.type == 'video' %}" + video_text + " "
            "{% else %}{{ c.text }} {% endif %}{% endfor %}{% endif %}<eos> {% endfor %}"
            "{% if add_generation_prompt %}assistant :{% endif %}")


def save_word_tokenizer(path, special: dict[str, int], image_text: str, vocab: int = VOCAB, video_text: str = "") -> None:
    """A word-level tokenizer of a tiny model's vocabulary (`t3` ..., `special` at their ids) and a chat template
    writing `image_text` where each image part stands."""
    import tokenizers

    special = {"<pad>": 0, "<bos>": 1, "<eos>": 2} | special
    words = special | {f"t{i}": i for i in range(3, vocab) if i not in special.values()}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="<pad>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in special if t != "<pad>"])
    backend.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
                   "chat_template": chat_template(image_text, video_text)}, f)


def save_qwen_tokenizer(path) -> None:
    """The tiny Qwen2-VL models' tokenizer: a chat template writing `<|vision_start|><|image_pad|><|vision_end|>`
    where each image part stands."""
    save_word_tokenizer(path, {"<|image_pad|>": IMAGE_TOKEN, "<|vision_start|>": VISION_START,
                               "<|vision_end|>": VISION_END, "<|video_pad|>": VIDEO_TOKEN},
                        "<|vision_start|> <|image_pad|> <|vision_end|>",
                        video_text="<|vision_start|> <|video_pad|> <|vision_end|>")
