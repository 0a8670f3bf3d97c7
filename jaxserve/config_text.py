"""An image-text model's config read as its language model's (`language_model`: LLaVA, Mistral 3, Gemma 3, Qwen-VL,
InternVL, Idefics3, SmolVLM, Kimi K2.5, EXAONE 4.5), for `ModelConfig.from_hf`; the vision side is `models.vision.VisionConfig`'s."""

from __future__ import annotations

from typing import Any

from jaxserve.errors import UnsupportedModelError

# transformers' Gemma3TextConfig defaults, which the text_config of Gemma 3's image-text checkpoints leaves out.
GEMMA3_TEXT_DEFAULTS: dict[str, Any] = dict(
    vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131072,
    rms_norm_eps=1e-6, rope_theta=1e6, rope_local_base_freq=10000.0, query_pre_attn_scalar=256, sliding_window=4096,
    sliding_window_pattern=6)
# transformers' LlamaConfig defaults, which the text_config of LLaVA checkpoints leaves out.
LLAMA_TEXT_DEFAULTS: dict[str, Any] = dict(
    vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
    max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)


QWEN_VL_ARCHITECTURES = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
                         "Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration")


def is_qwen_vl(d: dict[str, Any]) -> bool:
    return bool(set(QWEN_VL_ARCHITECTURES) & set(d.get("architectures") or [])) \
        or d.get("model_type") in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")


# Image-text models whose language model is their `text_config`: (model_type, the text's default type, transformers'
# default for the top-level `tie_word_embeddings`, by which they tie).
_NESTED_TEXT = {"InternVLForConditionalGeneration": ("internvl", "qwen2", True),
                "Idefics3ForConditionalGeneration": ("idefics3", "llama", False),
                "SmolVLMForConditionalGeneration": ("smolvlm", "llama", False),
                # (Qwen3.5's: its tower, Qwen3-VL's, read by `models.vision_qwen2`)
                "Qwen3_5ForConditionalGeneration": ("qwen3_5", "qwen3_5_text", False),
                "Qwen3_5MoeForConditionalGeneration": ("qwen3_5_moe", "qwen3_5_moe_text", False),
                # Kimi K2.5 (its language model Kimi K2's, DeepSeek-V3's; its MoonViT tower not read)
                "KimiK25ForConditionalGeneration": ("kimi_k25", "deepseek_v3", True),
                "Kimi_K25ForConditionalGeneration": ("kimi_k25", "deepseek_v3", True),
                # EXAONE 4.5 (its language model EXAONE 4's; its tower Qwen2.5-VL's, KV heads grouped: `vision_qwen2`)
                "Exaone4_5_ForConditionalGeneration": ("exaone4_5", "exaone4", False)}
# Language models' own model types read as another's (EXAONE 4.5's first release named its text model apart).
_TEXT_TYPES = {"kimi_k2": "deepseek_v3", "exaone4_5_text": "exaone4"}


def language_model(d: dict[str, Any]) -> dict[str, Any]:
    """An image-text model's config (LLaVA's, Mistral 3's, Gemma 3's, Qwen-VL's, InternVL's) as its language model's;
    any other config as it is."""
    if {"LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration", "Mistral3ForConditionalGeneration",
            "LlavaOnevisionForConditionalGeneration"} & set(d.get("architectures") or []) \
            or d.get("model_type") in ("llava", "llava_next", "mistral3", "llava_onevision"):
        text = d.get("text_config") or {}
        kind = text.get("model_type", "mistral" if d.get("model_type") == "mistral3" else "llama")
        tied = bool(d.get("tie_word_embeddings")) or bool(text.get("tie_word_embeddings"))
        d = {**(LLAMA_TEXT_DEFAULTS if kind == "llama" else {}), **text, "model_type": kind, "tie_word_embeddings": tied}
    if "Gemma3ForConditionalGeneration" in (d.get("architectures") or []) or d.get("model_type") == "gemma3":
        text = d.get("text_config") or {}
        d = {**GEMMA3_TEXT_DEFAULTS, "tie_word_embeddings": d.get("tie_word_embeddings", True), **text,
             "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text"}
    return internvl_text(qwen_vl_text(d) if is_qwen_vl(d) else d)


def internvl_text(d: dict[str, Any]) -> dict[str, Any]:
    """InternVL's, Idefics3's and SmolVLM's language model: its `text_config` (Qwen2's or Llama's unless it says
    otherwise: Qwen3's for InternVL3.5), its embeddings tied by the top-level config's flag (as transformers ties)."""
    archs = d.get("architectures") or []
    found = next((v for a, v in _NESTED_TEXT.items() if a in archs or d.get("model_type") == v[0]), None)
    if found is None:
        return d
    text = {k: v for k, v in (d.get("text_config") or {}).items() if v is not None}
    kind = text.get("model_type", found[1])
    return {**text, "architectures": [], "model_type": _TEXT_TYPES.get(kind, kind),
            "tie_word_embeddings": bool(d.get("tie_word_embeddings", found[2]))}


def qwen_vl_text(d: dict[str, Any]) -> dict[str, Any]:
    """A Qwen2-VL or Qwen2.5-VL config's language model as a Qwen2 config, Qwen3-VL's as a Qwen3 config (Qwen3-VL-MoE's
    as a Qwen3-MoE config, its top-k routing weights normalized), with its multimodal rotary sections
    (`mrope_section`: how many rotary pairs turn by each token's temporal, height and width position; Qwen3-VL's
    interleaved) and Qwen3-VL's deepstack layers (`deepstack_layers`: as many as its vision config's
    `deepstack_visual_indexes`). transformers 5 nests it in `text_config` (M-RoPE in `rope_parameters`); the
    published checkpoints of Qwen2-VL keep it at the top (in `rope_scaling`, type "mrope")."""
    archs = set(d.get("architectures") or [])
    moe = "Qwen3VLMoeForConditionalGeneration" in archs or d.get("model_type") == "qwen3_vl_moe"
    qwen3 = moe or "Qwen3VLForConditionalGeneration" in archs or d.get("model_type") == "qwen3_vl"
    outer = {k: v for k, v in d.items() if k not in ("text_config", "vision_config")}
    text = {**outer, **(d.get("text_config") or {})}
    if "tie_word_embeddings" in d:
        text["tie_word_embeddings"] = d["tie_word_embeddings"]
    rope = dict(text.get("rope_scaling") or text.get("rope_parameters") or {})
    if rope.pop("mrope_interleaved", qwen3) != qwen3:  # (transformers interleaves Qwen3-VL's, whatever it says)
        raise UnsupportedModelError(f"mrope_interleaved {not qwen3}: only Qwen3-VL's sections are interleaved")
    section = rope.pop("mrope_section", None) or ([24, 20, 20] if qwen3 else [16, 24, 24])  # transformers' defaults
    if rope.pop("type", None) == "mrope" or rope.get("rope_type") == "mrope":
        rope["rope_type"] = "default"
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    if sum(section) != head_dim // 2:
        raise UnsupportedModelError(f"mrope_section {section} must split the {head_dim // 2} rotary pairs of a head")
    if "rope_theta" in rope:
        text["rope_theta"] = rope.pop("rope_theta")
    deep = ((d.get("vision_config") or {}).get("deepstack_visual_indexes", (8, 16, 24)) if qwen3 else ()) or ()
    if len(deep) > int(text.get("num_hidden_layers", 32)):
        raise UnsupportedModelError(f"{len(deep)} deepstack vision blocks for {text['num_hidden_layers']} layers")
    kind = "qwen3_moe" if moe else "qwen3" if qwen3 else "qwen2"
    arch = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen3": "Qwen3ForCausalLM"}.get(kind, "Qwen2ForCausalLM")
    return {**text, **({"norm_topk_prob": True} if moe else {}), "architectures": [arch],
            "model_type": kind, "rope_scaling": rope or None, "rope_parameters": None,
            "mrope_section": [int(n) for n in section], "mrope_interleaved": qwen3, "deepstack_layers": len(deep)}
