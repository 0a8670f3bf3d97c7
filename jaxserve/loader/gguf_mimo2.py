"""MiMo-V2-Flash's llama.cpp GGUF files (architecture "mimo2") as the config its released checkpoints give
(`config_mimo.mimo_hub_config` reads it): KV heads per layer (the windowed layers' twice the full ones'), the layers'
kinds as a pattern (1: windowed), keys and values of their own widths (`key_length`, `value_length`), each kind's
rotary base, a partial rotary embedding by its dimension count, the window as the released config's
`sliding_window_size` (the keys before the query: transformers attends one more, and so does jaxserve, as for the
checkpoint), a dense layer where a block has no router, and the multi-token prediction blocks after the model's
(`nextn_predict_layers`; their tensors, where the file has them, are not read).

Files from before llama.cpp wrote `attention.value_scale` lack it; those take the model's own scale, transformers'
default (0.707), where llama.cpp ran them unscaled.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from jaxserve.errors import UnsupportedModelError

NAMES = {"attn_sinks.weight": "self_attn.sinks"}  # (the windowed layers' sinks)
_VALUE_SCALE = 0.707  # (transformers' MiMoV2FlashConfig default: the released model's)


def mimo2_gguf_hf(meta: Mapping[str, Any], get: Callable[..., Any], d: dict[str, Any], kv_heads: list[int],
                  tensors: Mapping[str, Any]) -> dict[str, Any]:
    """The released-form HF config of a "mimo2" file; `d` is the generic one (`gguf_config`), `kv_heads` per block."""
    # The prediction blocks: as many as the file counts (`nextn_predict_layers`), or those it holds (`gguf_config`
    # counted them out of `d`) where it does not count them.
    n = min(d["num_hidden_layers"], int(get("block_count")) - int(meta.get("mimo2.nextn_predict_layers") or 0))
    pattern = get("attention.sliding_window_pattern")
    if not isinstance(pattern, (list, tuple)) or len(pattern) < n:
        raise UnsupportedModelError(f"GGUF mimo2.attention.sliding_window_pattern must give each of the {n} layers "
                                    f"its kind, got {pattern!r}")
    pattern, kv = [int(p) for p in pattern[:n]], kv_heads[:n]
    kinds = {p: {kv[i] for i in range(n) if pattern[i] == p} for p in (0, 1)}
    if any(len(v) != 1 for v in kinds.values()):
        raise UnsupportedModelError(f"GGUF mimo2 KV heads {kv}: one count for the windowed layers and one for the full "
                                    "ones, with layers of both kinds")
    gating = int(meta.get("mimo2.expert_gating_func") or 2)
    if gating != 2:
        raise UnsupportedModelError(f"GGUF mimo2 expert_gating_func {gating} is not supported (2: sigmoid)")
    sinks = [i for i in range(n) if f"blk.{i}.attn_sinks.weight" in tensors]
    if sinks != [i for i in range(n) if pattern[i]]:
        raise UnsupportedModelError(f"GGUF mimo2 attention sinks on layers {sinks}: jaxserve serves them on the "
                                    "windowed layers alone, as the released model has them")
    key_dim, value_dim = int(get("attention.key_length")), int(get("attention.value_length"))
    rotary = int(meta.get("mimo2.rope.dimension_count") or key_dim)
    partial = rotary / key_dim
    if int(key_dim * partial) != rotary:  # (the config's factor must give the file's rotated dims back)
        partial = (rotary + 0.5) / key_dim
    theta = float(meta.get("mimo2.rope.freq_base", 5e6))
    scale = meta.get("mimo2.attention.value_scale")
    return dict(
        architectures=["MiMoV2FlashForCausalLM"], model_type="mimo_v2_flash", vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"], intermediate_size=int(get("feed_forward_length")),
        moe_intermediate_size=int(get("expert_feed_forward_length")), num_hidden_layers=n,
        num_attention_heads=d["num_attention_heads"], swa_num_attention_heads=d["num_attention_heads"],
        num_key_value_heads=kinds[0].pop(), swa_num_key_value_heads=kinds[1].pop(), head_dim=key_dim,
        swa_head_dim=key_dim, v_head_dim=value_dim, swa_v_head_dim=value_dim, hybrid_layer_pattern=pattern,
        moe_layer_freq=[int(f"blk.{i}.ffn_gate_inp.weight" in tensors) for i in range(n)],
        sliding_window_size=int(get("attention.sliding_window")), rope_theta=theta,
        swa_rope_theta=float(meta.get("mimo2.rope.freq_base_swa", theta)), partial_rotary_factor=partial,
        layernorm_epsilon=float(meta.get("mimo2.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=d["max_position_embeddings"], n_routed_experts=int(get("expert_count")),
        num_experts_per_tok=int(get("expert_used_count")), norm_topk_prob=True,
        n_group=int(meta.get("mimo2.expert_group_count") or 1),
        topk_group=int(meta.get("mimo2.expert_group_used_count") or 1),
        routed_scaling_factor=float(meta.get("mimo2.expert_weights_scale") or 1.0), n_shared_experts=0,
        attention_value_scale=_VALUE_SCALE if scale is None else float(scale), add_swa_attention_sink_bias=True,
        add_full_attention_sink_bias=False, tie_word_embeddings=d["tie_word_embeddings"])
