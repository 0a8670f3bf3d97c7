"""A hybrid model's config directory for `jaxserve bench offline --load-format dummy` (random weights): Granite 4.0-H
Tiny's Mamba and attention shapes (hidden 1536, 48 Mamba heads of 64 channels with a state of 128, 12 query and 4 KV
heads of 128), dense (its shared MLP, 1024 wide), cut to LAYERS layers with every fourth one attention, and the
tokenizer (and its vocabulary size) of another config directory, e.g. SmolLM2's (`jaxserve convert --to-hf DIR
--config-only`). Usage: python bench/hybrid_config.py SOURCE_DIR OUT_DIR [--layers 12]"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("source")
    parser.add_argument("out")
    parser.add_argument("--layers", type=int, default=12)
    a = parser.parse_args()
    with open(os.path.join(a.source, "config.json"), encoding="utf-8") as f:
        source = json.load(f)
    os.makedirs(a.out, exist_ok=True)
    for name in TOKENIZER_FILES:
        if os.path.exists(os.path.join(a.source, name)):
            shutil.copy(os.path.join(a.source, name), os.path.join(a.out, name))
    kinds = ["attention" if i % 4 == 3 else "mamba" for i in range(a.layers)]
    config = {
        "architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid",
        "vocab_size": source["vocab_size"], "bos_token_id": source.get("bos_token_id"),
        "eos_token_id": source.get("eos_token_id"), "hidden_size": 1536, "num_hidden_layers": a.layers,
        "num_attention_heads": 12, "num_key_value_heads": 4, "num_local_experts": 0, "shared_intermediate_size": 1024,
        "layer_types": kinds, "mamba_n_heads": 48, "mamba_d_head": 64, "mamba_d_state": 128, "mamba_n_groups": 1,
        "mamba_expand": 2, "mamba_d_conv": 4, "max_position_embeddings": 131072, "position_embedding_type": "nope",
        "embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.0078125,
        "logits_scaling": 6.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16"}
    with open(os.path.join(a.out, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)
    print(f"{a.out}: {a.layers} layers ({kinds.count('attention')} attention), vocabulary {source['vocab_size']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
