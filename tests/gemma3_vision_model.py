"""A tiny random Gemma 3 image-text model (a SigLIP tower, Gemma 3's pooling projector, a Gemma 3 decoder with
windowed and global layers) saved as an HF directory, for the image-text tests: weights, a word-level tokenizer
holding Gemma 3's special tokens, the image processor's config and a chat template that writes `<start_of_image>`
for each image part, as Gemma 3's does.

As in Gemma's vocabulary, runs of one to four newlines are single tokens, so the text transformers' processor makes
around an image ("\n\n" before `<start_of_image>`) merges with a newline before it: "user\n" then "\n\n" is
one "\n\n\n" token."""

from __future__ import annotations

import json
import os

import tokenizers

from jaxserve.tokenizer import Tokenizer
from tests.llava_model import randomize

IMAGE_SIZE = 32
PATCH = 4  # 8 x 8 patches, pooled 2 x 2 into 16 tokens
TOKENS_PER_IMAGE = 16
WORDS_END = 64  # t{i} for i from FIRST_WORD up to 63
# The words of the processor's sentence around an image cut by pan and scan, after them.
PAN_AND_SCAN_WORDS = "Here is the original image and here are some crops to help you see better".split()
VOCAB = WORDS_END + len(PAN_AND_SCAN_WORDS) + 1
SPECIAL = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>",
           "<image_soft_token>"]
NEWLINES = ["\n", "\n\n", "\n\n\n", "\n\n\n\n"]
WORDS = ["user", "model", "system"]
PAD, EOS, BOS, SOT, EOT, BOI, EOI, IMAGE = range(len(SPECIAL))
NEWLINE, DOUBLE_NEWLINE, TRIPLE_NEWLINE, QUADRUPLE_NEWLINE = range(len(SPECIAL), len(SPECIAL) + len(NEWLINES))
FIRST_WORD = len(SPECIAL) + len(NEWLINES) + len(WORDS)  # t{i} for i from here up to WORDS_END - 1
# Gemma 3's template, its system turn left out: each image part is `<start_of_image>`, text parts trimmed.
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}\n"
            "{% if m.content is string %}{{ m.content | trim }}{% else %}{% for c in m.content %}"
            "{% if c.type == 'image' %}<start_of_image>{% else %}{{ c.text | trim }}{% endif %}{% endfor %}{% endif %}"
            "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=8,
            query_pre_attn_scalar=24, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                             "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 10000.0}},
            pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS)
VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, image_size=IMAGE_SIZE,
              patch_size=PATCH, vision_use_head=False)
PROCESSOR = dict(image_processor_type="Gemma3ImageProcessor", processor_class="Gemma3Processor",
                 size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, resample=2, image_mean=[0.5, 0.5, 0.5],
                 image_std=[0.5, 0.5, 0.5], rescale_factor=1 / 255, do_convert_rgb=None, do_pan_and_scan=None,
                 pan_and_scan_min_crop_size=None, pan_and_scan_max_num_crops=None,
                 pan_and_scan_min_ratio_to_activate=None, image_seq_length=TOKENS_PER_IMAGE)


def gemma3_tokenizer() -> Tokenizer:
    """The tiny vocabulary: Gemma 3's special tokens, runs of newlines (the longest run matched first), a few
    words, t{i}, then the words of pan and scan's sentence."""
    vocab = ({s: i for i, s in enumerate(SPECIAL + NEWLINES + WORDS)} | {f"t{i}": i for i in range(FIRST_WORD, WORDS_END)}
             | {w: WORDS_END + i for i, w in enumerate(PAN_AND_SCAN_WORDS)})
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens([tokenizers.AddedToken(s, special=True) for s in SPECIAL[1:]])
    backend.add_tokens([tokenizers.AddedToken(s, normalized=False) for s in NEWLINES])
    return Tokenizer(backend, bos_token_id=BOS, eos_token_ids=[EOS, EOT], pad_token_id=PAD)


def gemma3_config():
    """transformers' Gemma3Config of the tiny model, its image tokens the tiny vocabulary's."""
    import transformers

    return transformers.Gemma3Config(
        text_config=transformers.Gemma3TextConfig(**TEXT), vision_config=transformers.SiglipVisionConfig(**VISION),
        mm_tokens_per_image=TOKENS_PER_IMAGE, boi_token_index=BOI, eoi_token_index=EOI, image_token_index=IMAGE)


def save_tiny_gemma3(path, seed: int = 0):
    """A random Gemma 3 image-text model saved to `path` (float32) with its tokenizer, processor config, chat
    template and generation config; returns the float32 torch model holding the saved weights."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(gemma3_config()).eval()
    randomize(model, gemma_norms=True)  # transformers zeroes Gemma's norms (applied as 1 + w) and the projection
    model.save_pretrained(path, safe_serialization=True)
    tok = gemma3_tokenizer()
    tok._backend.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
                   "pad_token": "<pad>", "unk_token": "<pad>",
                   "add_bos_token": False,
                   "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                   "image_token": "<image_soft_token>", "chat_template": TEMPLATE}, f)
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump(PROCESSOR, f)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": BOS, "eos_token_id": [EOS, EOT], "pad_token_id": PAD}, f)
    return model
