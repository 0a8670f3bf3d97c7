"""A `ModelConfig` as the HF `config.json` dict that describes it (the inverse of `ModelConfig.from_hf`)."""

from __future__ import annotations

from typing import Any

from jaxserve import config_fields as fields
from jaxserve.config import (
    COHERE_FAMILIES,
    ERNIE_FAMILIES,
    GEMMA_FAMILIES,
    GLM_FAMILIES,
    GRANITE_FAMILIES,
    OLMO_FAMILIES,
    ModelConfig,
)
from jaxserve.config_afmoe import afmoe_hf
from jaxserve.config_cohere2_moe import cohere2_moe_hf
from jaxserve.config_exaone_moe import exaone_moe_hf
from jaxserve.config_falcon_h1 import falcon_hf
from jaxserve.config_families import HF_ARCHITECTURES
from jaxserve.config_gemma4 import gemma4_hf
from jaxserve.config_gpt2 import bloom_own_hf, falcon_own_hf, gpt2_hf, mpt_own_hf, neox_hf
from jaxserve.config_granite_swa import GRANITE_SWA_FAMILIES, granite_swa_hf
from jaxserve.config_hunyuan import HUNYUAN_FAMILIES, hunyuan_hf
from jaxserve.config_jamba import jamba_hf
from jaxserve.config_lfm2 import lfm2_hf
from jaxserve.config_llama4 import llama4_hf
from jaxserve.config_mamba import mamba_hf
from jaxserve.config_mamba_lm import MAMBA_LM_FAMILIES, mamba_lm_hf
from jaxserve.config_mimo import mimo_hf
from jaxserve.config_mla import mla_hf
from jaxserve.config_nemotron import nemotron_hf
from jaxserve.config_olmo_hybrid import olmo_hybrid_hf
from jaxserve.config_qwen3_next import GATED_DELTA_FAMILIES, qwen3_next_hf


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The HF `config.json` dict describing `cfg` (for `jaxserve convert`)."""
    if cfg.family == "gemma4":
        return gemma4_hf(cfg)
    if cfg.family in MAMBA_LM_FAMILIES:
        return mamba_lm_hf(cfg)
    if cfg.family in ("gpt2", "gpt_bigcode", "gptj"):
        return gpt2_hf(cfg)
    arch = next(k for k, v in HF_ARCHITECTURES.items() if v == cfg.family)
    d: dict[str, Any] = {
        "architectures": [arch],
        "model_type": cfg.family,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "hidden_act": cfg.hidden_act,
        "torch_dtype": "float32",
    }
    if cfg.family in ("llama", "smollm3", "qwen3", "qwen3_moe", "glm4_moe", "dots1", "gpt_oss", "arcee", "bamba", "jais2",
                      "helium", *OLMO_FAMILIES, *GRANITE_FAMILIES, *GLM_FAMILIES, *GATED_DELTA_FAMILIES,
                      *HUNYUAN_FAMILIES):
        d["attention_bias"] = cfg.attention_bias
    if cfg.family == "qwen2_moe":
        d["qkv_bias"] = cfg.attention_bias
    if cfg.num_experts and not cfg.kv_lora_rank:
        d.update(hunyuan_hf(cfg) if cfg.family in HUNYUAN_FAMILIES else exaone_moe_hf(cfg) if cfg.family == "exaone_moe"
                 else afmoe_hf(cfg) if cfg.family == "afmoe" else mimo_hf(cfg) if cfg.family == "mimo_v2_flash"
                 else cohere2_moe_hf(cfg) if cfg.family == "cohere2_moe" else fields.moe_hf(cfg))
    if cfg.family in ("llama", "smollm3", "granite", "granite_swa", "arcee", "bamba", "jais2", "helium"):
        d["mlp_bias"] = cfg.mlp_bias
    if cfg.family in ("jais2", "phi", "stablelm"):
        d["layer_norm_eps"] = d.pop("rms_norm_eps")
    if cfg.family == "phi":
        d["qk_layernorm"] = cfg.qk_norm
    if cfg.family == "stablelm":
        d.update(use_qkv_bias=cfg.attention_bias, qk_layernorm=cfg.qk_norm, use_parallel_residual=cfg.parallel_block)
    if cfg.family == "ministral" and cfg.layer_types is not None:  # (each layer windowed or global)
        d["layer_types"] = list(cfg.layer_types)
    if cfg.family == "gpt_neox":
        d = {k: v for k, v in d.items() if k not in ("rms_norm_eps", "partial_rotary_factor")} | neox_hf(cfg)
    if cfg.family == "falcon":  # (its own names; its heads' width and KV heads by the architecture)
        d = {k: v for k, v in d.items() if k not in ("rms_norm_eps", "num_key_value_heads", "head_dim",
                                                     "intermediate_size", "hidden_act")} | falcon_own_hf(cfg)
    if cfg.family in ("mpt", "bloom"):  # (their own names; transformers' models fix the rest)
        d = {k: v for k, v in d.items() if k not in ("rms_norm_eps", "num_key_value_heads", "head_dim", "hidden_size",
                                                     "intermediate_size", "hidden_act", "num_attention_heads",
                                                     "num_hidden_layers", "max_position_embeddings", "layer_norm_eps",
                                                     "attention_bias", "mlp_bias")} | (
            mpt_own_hf if cfg.family == "mpt" else bloom_own_hf)(cfg)
    if cfg.family == "olmoe" and cfg.clip_qkv is not None:
        d["clip_qkv"] = cfg.clip_qkv
    if cfg.family == "olmo":  # (its LayerNorms' eps fixed)
        d.update(clip_qkv=cfg.clip_qkv, attention_bias=cfg.attention_bias)
        del d["rms_norm_eps"]
    if cfg.family == "nemotron":
        d.update(norm_eps=d.pop("rms_norm_eps"), attention_bias=cfg.attention_bias, mlp_bias=cfg.mlp_bias)
    if cfg.family == "starcoder2":  # (one bias flag for attention and the MLP; its eps' own name)
        d.update(norm_epsilon=d.pop("rms_norm_eps"), use_bias=cfg.attention_bias)
    if cfg.family == "bamba":
        d.update(mamba_hf(cfg.mamba, cfg.num_layers, cfg.hidden_size, cfg.family))
    if cfg.family in ERNIE_FAMILIES:
        d["use_bias"] = cfg.attention_bias
    if cfg.family in GRANITE_FAMILIES:
        d.update(fields.granite_hf(cfg))
    elif cfg.no_rope_layers is not None:
        d["no_rope_layers"] = list(cfg.no_rope_layers)
    if cfg.sliding_window is not None:
        d["sliding_window"] = cfg.sliding_window
        if cfg.family not in ("mistral", "mixtral", "starcoder2", "ministral"):
            d["use_sliding_window"] = True
            d["max_window_layers"] = 0  # HF Qwen windows the layers from this index on
    if cfg.family in ("afmoe", "mimo_v2_flash"):  # (AFMoE's NoPE layers its global ones; windows as layer_types says)
        d = {k: v for k, v in d.items() if k not in ("no_rope_layers", "use_sliding_window", "max_window_layers") and (
            cfg.family == "afmoe" or k not in ("rope_theta", "partial_rotary_factor"))}  # (MiMo's: rope_parameters)
    if cfg.family == "olmo3":
        d.update(fields.olmo3_hf(cfg))
    if cfg.family == "gpt_oss":
        d.update(fields.gpt_oss_hf(cfg))
        del d["use_sliding_window"], d["max_window_layers"]
    if cfg.family in COHERE_FAMILIES:
        d.update(layer_norm_eps=d.pop("rms_norm_eps"), logit_scale=1.0 / cfg.logits_scaling)
        if cfg.family == "cohere":
            d["use_qk_norm"] = cfg.qk_norm
    if cfg.family in ("exaone4", "cohere2", "exaone_moe", "cohere2_moe"):  # (NoPE: its global layers, by layer_types)
        d.pop("no_rope_layers", None)
        # (None written, and layer_types always: transformers' default is a window)
        d.update(sliding_window=cfg.sliding_window, layer_types=list(cfg.layer_types or ["full_attention"] * cfg.num_layers))
        if cfg.sliding_window is not None:
            del d["use_sliding_window"], d["max_window_layers"]
    if cfg.family in GEMMA_FAMILIES and cfg.output_norms:  # (Gemma's own keys: Llama's)
        d.update(model_type="gemma3_text" if cfg.family == "gemma3" else "gemma2",
                 hidden_activation=cfg.hidden_act,
                 query_pre_attn_scalar=fields.int_if_whole(cfg.query_pre_attn_scalar),
                 attn_logit_softcapping=cfg.attn_logit_softcap,
                 final_logit_softcapping=cfg.final_logit_softcap, layer_types=list(cfg.layer_types or ()))
        for key in ("use_sliding_window", "max_window_layers"):  # Qwen's keys: Gemma lists layer_types
            d.pop(key, None)
        if cfg.rope_local_theta is not None:
            d["rope_local_base_freq"] = cfg.rope_local_theta
    if cfg.kv_cache_scales:
        d["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "dense", "config_groups": {},
            "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                                "symmetric": True}}
    if cfg.rotary_dim is not None:
        d["partial_rotary_factor"] = cfg.rotary_dim / cfg.head_dim
    if cfg.rope_scaling.rope_type != "default":
        d["rope_scaling"] = cfg.rope_scaling.to_hf()
    if cfg.kv_lora_rank:  # (its rotary dims are its own key)
        del d["partial_rotary_factor"]
        d.update(mla_hf(cfg))
    if cfg.mrope_section is not None:  # (no model has both)
        d["rope_scaling"] = {"rope_type": "default", "mrope_section": list(cfg.mrope_section),
                             **({"mrope_interleaved": True} if cfg.mrope_interleaved else {})}
    if cfg.family in ("lfm2", "lfm3"):  # (LFM3's rotary embeddings by layer kind: `rope_parameters`)
        drop = ("decoder_sparse_step", "mlp_only_layers") + (("rope_scaling", "rope_theta") if cfg.family == "lfm3"
                                                             else ())
        d = {k: v for k, v in d.items() if k not in drop} | lfm2_hf(cfg)
    if cfg.family in GATED_DELTA_FAMILIES:
        d = {k: v for k, v in d.items() if k not in ("decoder_sparse_step", "mlp_only_layers") or cfg.family == "qwen3_next"
             } | qwen3_next_hf(cfg)
    if cfg.family in GRANITE_SWA_FAMILIES:  # (its windows and bases by layer; no Qwen window keys)
        d = {k: v for k, v in d.items() if k not in ("use_sliding_window", "max_window_layers")} | granite_swa_hf(cfg)
    if cfg.family == "jamba":  # (NoPE: no rotary keys; its experts' own keys)
        d = {k: v for k, v in d.items() if k not in ("no_rope_layers", "moe_intermediate_size", "norm_topk_prob",
                                                     "shared_expert_intermediate_size", "decoder_sparse_step",
                                                     "mlp_only_layers")} | jamba_hf(cfg)
    if cfg.family == "falcon_h1":
        d = {k: v for k, v in d.items() if k != "no_rope_layers"} | falcon_hf(cfg)
    if cfg.family == "olmo_hybrid":  # (NoPE: `rope_parameters` null)
        d = {k: v for k, v in d.items() if k not in ("no_rope_layers", "rope_theta")} | olmo_hybrid_hf(cfg)
    if cfg.query_scale_beta and cfg.family in ("mistral", "mistral4"):  # Ministral 3's, Mistral 4's
        rope = {"rope_type": "default", **d.pop("rope_scaling", {}), "rope_theta": cfg.rope_theta,
                "llama_4_scaling_beta": cfg.query_scale_beta, "original_max_position_embeddings": cfg.query_scale_length}
        d.update(rope_parameters=rope)
        if cfg.family == "mistral":
            d.update(architectures=["Ministral3ForCausalLM"], model_type="ministral3")
    if cfg.family == "llama4":
        d = {k: v for k, v in d.items() if k not in ("num_experts", "decoder_sparse_step", "mlp_only_layers",
                                                     "moe_intermediate_size", "norm_topk_prob", "layer_types",
                                                     "shared_expert_intermediate_size")} | llama4_hf(cfg)
        d["model_type"] = "llama4_text"
    if cfg.family == "nemotron_h":  # (no rotary embedding: no per-layer list)
        d = {k: v for k, v in d.items() if k not in ("rms_norm_eps", "hidden_act", "no_rope_layers", "num_experts",
                                                     "decoder_sparse_step", "mlp_only_layers")} | nemotron_hf(cfg)
    return d
