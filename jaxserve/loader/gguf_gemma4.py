"""Gemma 4's llama.cpp GGUF files (architecture "gemma4"): the text model's config and tensors.

llama.cpp's converter writes the windowed layers' head width and rotary base beside the full-attention layers'
(`key_length_swa`, `rope.freq_base_swa`; `key_length`, `rope.freq_base`), the layers' kinds as a pattern of booleans,
KV heads per layer where the two kinds differ, MLP widths per layer where the shared layers' are doubled, and the full
layers' proportional rotary embedding as a tensor of frequency divisors (`rope_freqs`: 1 for a turned pair, 1e30 for
one left unturned) that those layers alone use. It keeps no value projection on a full-attention layer whose keys are
its values (`attention_k_eq_v`) and stores the norms' weights as they are (Gemma 4 scales by w, not 1 + w). Here that
becomes the HF config `config_gemma4` reads, and the tensors their HF names, so one loader serves both.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jaxserve.errors import UnsupportedModelError

# A rope_freqs entry at least this large leaves its pair unturned (the converter writes 1e30).
_UNTURNED = 1e29

# Block tensors beyond Gemma's (`gguf_file._GEMMA_NAMES`): each layer's output scale, the per-layer input's gate,
# projection and norm (E2B/E4B), the router with its input scale and per-expert scales, the packed experts and the
# norms around them (the MoE form).
BLOCK_NAMES = {
    "layer_output_scale.weight": "layer_scalar",
    "inp_gate.weight": "per_layer_input_gate.weight",
    "proj.weight": "per_layer_projection.weight",
    "post_norm.weight": "post_per_layer_input_norm.weight",
    "ffn_gate_inp.weight": "router.proj.weight",
    "ffn_gate_inp.scale": "router.scale",
    "ffn_down_exps.scale": "router.per_expert_scale",
    "ffn_gate_up_exps.weight": "experts.gate_up_proj",
    "ffn_down_exps.weight": "experts.down_proj",
    "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
    "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight",
    "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight",
}
# The per-layer inputs' table, projection and norm outside the blocks (E2B/E4B).
TOP_NAMES = {
    "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
    "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight",
}


def gemma4_tensor(name: str, layer: str | None, rest: str | None, arr: np.ndarray) -> tuple[str, np.ndarray] | None:
    """The HF name and array of Gemma 4 tensor `name` (`layer` and `rest` its block's parts, if in one), or None for
    a tensor Gemma's names cover."""
    if name in TOP_NAMES:
        return TOP_NAMES[name], arr
    if layer is not None and rest in BLOCK_NAMES:
        return f"model.layers.{layer}.{BLOCK_NAMES[rest]}", arr
    if layer is not None and rest in ("ffn_gate_exps.weight", "ffn_up_exps.weight"):
        raise UnsupportedModelError(f"GGUF tensor {name!r}: Gemma 4's experts are read packed (ffn_gate_up_exps), "
                                    "as llama.cpp's converter writes them, not as separate gate and up tensors")
    return None


def gemma4_gguf_hf(meta: Mapping[str, Any], get: Callable[..., Any], d: dict[str, Any], kv_heads: list[int],
                   ffn: list[Any], tensors: Mapping[str, Any],
                   rope_tensors: Mapping[str, Sequence[float]] | None) -> dict[str, Any]:
    """The HF text config (`Gemma4ForCausalLM`) of a "gemma4" file: `d` is the generic one (`gguf_config`), `kv_heads`
    and `ffn` per layer, `tensors` the file's tensor names (mapped to their shapes in HF order where known)."""
    n = d["num_hidden_layers"]
    pattern = get("attention.sliding_window_pattern")
    if not isinstance(pattern, (list, tuple)) or len(pattern) != n:
        raise UnsupportedModelError(f"GGUF gemma4.attention.sliding_window_pattern must give each of the {n} layers "
                                    f"its kind, got {pattern!r}")
    shared = int(meta.get("gemma4.attention.shared_kv_layers") or 0)
    windowed = [i for i in range(n) if pattern[i]]
    full = [i for i in range(n) if not pattern[i]]
    if not windowed or not full:
        raise UnsupportedModelError("a Gemma 4 GGUF needs windowed and full-attention layers both")
    head_dim, full_dim = int(get("attention.key_length_swa")), int(get("attention.key_length"))
    for key, want in (("attention.value_length_swa", head_dim), ("attention.value_length", full_dim),
                      ("rope.dimension_count_swa", head_dim), ("rope.dimension_count", full_dim)):
        if int(meta.get(f"gemma4.{key}", want)) != want:
            raise UnsupportedModelError(f"GGUF gemma4.{key} {meta[f'gemma4.{key}']} is not the heads' width {want}: "
                                        "not supported")
    own = [i for i in full if i < n - shared]  # (the full layers with keys of their own)
    if not own:
        raise UnsupportedModelError(f"a Gemma 4 GGUF needs a full-attention layer before its {shared} sharing keys")
    k_eq_v = f"blk.{own[0]}.attn_v.weight" not in tensors  # (values: the key projection's output)
    kv, full_kv = kv_heads[windowed[0]], kv_heads[full[0]]
    if any(kv_heads[i] != (kv if pattern[i] else full_kv) for i in range(n)) or (full_kv != kv and not k_eq_v):
        raise UnsupportedModelError(f"GGUF gemma4 KV heads {kv_heads}: one count for the windowed layers and one for "
                                    "the full-attention layers (their own only where their keys are their values)")
    width = int(ffn[0])
    double = any(int(f) != width for f in ffn)
    if double and [int(f) for f in ffn] != [width] * (n - shared) + [2 * width] * shared:
        raise UnsupportedModelError(f"GGUF gemma4 MLP widths {ffn}: per layer only as the last {shared} layers' "
                                    "(sharing keys) twice the others'")
    ple = int(meta.get("gemma4.embedding_length_per_layer_input") or 0)
    experts = int(meta.get("gemma4.expert_count") or 0)
    if experts and any(f"blk.{i}.ffn_gate_inp.weight" not in tensors for i in range(n)):
        raise UnsupportedModelError("a Gemma 4 GGUF with experts needs them in every layer (blk.N.ffn_gate_inp)")
    theta = float(meta.get("gemma4.rope.freq_base", 1_000_000.0))
    vocab = _rows(tensors, "token_embd.weight") or d["vocab_size"]
    return dict(
        architectures=["Gemma4ForCausalLM"], model_type="gemma4_text", vocab_size=vocab, hidden_size=d["hidden_size"],
        intermediate_size=width, num_hidden_layers=n, num_attention_heads=d["num_attention_heads"],
        num_key_value_heads=kv, head_dim=head_dim, global_head_dim=full_dim, attention_k_eq_v=k_eq_v,
        num_global_key_value_heads=full_kv if k_eq_v else None,
        rms_norm_eps=float(meta.get("gemma4.attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=d["max_position_embeddings"], tie_word_embeddings=d["tie_word_embeddings"],
        hidden_activation="gelu_pytorch_tanh", sliding_window=int(get("attention.sliding_window")),
        layer_types=["sliding_attention" if p else "full_attention" for p in pattern],
        final_logit_softcapping=meta.get("gemma4.final_logit_softcapping"),
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": float(meta.get(
                             "gemma4.rope.freq_base_swa", theta))},  # (absent: llama.cpp's base for both kinds)
                         "full_attention": _full_rope(rope_tensors, full_dim, theta)},
        hidden_size_per_layer_input=ple, vocab_size_per_layer_input=_rows(tensors, "per_layer_token_embd.weight"),
        num_kv_shared_layers=shared, use_double_wide_mlp=double,
        **(dict(enable_moe_block=True, num_experts=experts, top_k_experts=int(get("expert_used_count")),
                moe_intermediate_size=int(get("expert_feed_forward_length"))) if experts else {}))


def _rows(tensors: Mapping[str, Any], name: str) -> int | None:
    shape = tensors.get(name) if isinstance(tensors, Mapping) else None
    return int(shape[0]) if shape else None


def _full_rope(rope_tensors: Mapping[str, Sequence[float]] | None, head_dim: int, theta: float) -> dict[str, Any]:
    """The full-attention layers' rotary embedding from the file's frequency divisors: the leading pairs turned (each
    at its frequency over the whole head, divided by one factor), the rest left unturned; every pair turned without."""
    freqs = (rope_tensors or {}).get("rope_freqs")
    if freqs is None:
        return {"rope_type": "default", "rope_theta": theta}
    turned = sum(f < _UNTURNED for f in freqs)
    if len(freqs) != head_dim // 2 or turned == 0 or any(f >= _UNTURNED for f in freqs[:turned]) or \
            len({float(f) for f in freqs[:turned]}) != 1:
        raise UnsupportedModelError(f"GGUF gemma4 rope_freqs must turn the leading pairs of the full-attention "
                                    f"layers' {head_dim // 2} at one factor and leave the rest (>= 1e29), got "
                                    f"{list(freqs)}")
    factor = float(freqs[0])
    return {"rope_type": "proportional", "partial_rotary_factor": 2 * turned / head_dim, "rope_theta": theta,
            **({"factor": factor} if factor != 1.0 else {})}
