"""`ModelConfig.from_hf`: an HF `config.json` dict as the model configuration, every family's fields read (their own
modules normalize the configs read as another family's: `config_fields`, `config_llama4`, `config_mamba`, ...)."""

from __future__ import annotations

from typing import Any

from jaxserve import config_fields as fields
from jaxserve.config import (
    _HF_MODEL_TYPES,
    COHERE_FAMILIES,
    ERNIE_FAMILIES,
    GEMMA_FAMILIES,
    GLM_FAMILIES,
    GRANITE_FAMILIES,
    MOE_FAMILIES,
    OLMO_FAMILIES,
    ModelConfig,
)
from jaxserve.config_afmoe import afmoe_layer_fields, afmoe_moe_fields, afmoe_no_rope_layers
from jaxserve.config_cohere2_moe import cohere2_moe_fields
from jaxserve.config_exaone_moe import exaone_moe_fields
from jaxserve.config_falcon_h1 import falcon_fields
from jaxserve.config_families import BIASED_NORM_FAMILIES, HF_ARCHITECTURES, Family
from jaxserve.config_gemma4 import FAMILY as GEMMA4
from jaxserve.config_gemma4 import gemma4_fields, gemma4_text
from jaxserve.config_gpt2 import bloom_config, falcon_config, gpt2_config, mpt_config, neox_config
from jaxserve.config_granite_swa import GRANITE_SWA_FAMILIES, granite_swa, granite_swa_fields
from jaxserve.config_hunyuan import HUNYUAN_FAMILIES, hunyuan_config, hunyuan_moe_fields
from jaxserve.config_jamba import jamba_moe_fields
from jaxserve.config_lfm2 import lfm3_fields
from jaxserve.config_llama4 import llama4_fields, llama4_moe_fields, llama4_text
from jaxserve.config_mamba import HYBRID_FAMILIES, hybrid_config, mamba_config
from jaxserve.config_mimo import FAMILY as MIMO
from jaxserve.config_mimo import mimo_hub_config, mimo_kv_heads, mimo_layer_fields, mimo_moe_fields
from jaxserve.config_mla import MLA_FAMILIES, mla_fields, mla_moe_fields
from jaxserve.config_qwen3_next import GATED_DELTA_FAMILIES
from jaxserve.config_text import language_model
from jaxserve.errors import UnsupportedModelError
from jaxserve.quantization import parse_quantization
from jaxserve.rope import RopeScaling


def config_from_hf(cls: type[ModelConfig], d: dict[str, Any]) -> ModelConfig:
    """See `ModelConfig.from_hf`."""
    d = granite_swa(llama4_text(fields.hy_v3(fields.ministral3(fields.minimax_m2(fields.exaone(fields.seed_oss(fields.granite_hybrid(hybrid_config(gemma4_text(language_model(d)))))))))))
    d = bloom_config(mpt_config(falcon_config(neox_config(gpt2_config(mimo_hub_config(hunyuan_config(d)))))))
    archs = d.get("architectures") or []
    family: Family | None = next((HF_ARCHITECTURES[a] for a in archs if a in HF_ARCHITECTURES), None) \
        or _HF_MODEL_TYPES.get(d.get("model_type", ""))
    if family is None:
        raise UnsupportedModelError(f"architecture {archs or d.get('model_type')!r} is not supported "
                                    f"(supported: {', '.join(HF_ARCHITECTURES)})")
    num_heads = d["num_attention_heads"]
    hidden = d["hidden_size"]
    head_dim = d.get("head_dim") or hidden // num_heads
    max_pos = d.get("max_position_embeddings", 4096)
    sliding = d.get("sliding_window") if family in ("mistral", "mixtral", "starcoder2", "ministral") else None
    if family == "starcoder2":  # (its names for Jais 2's keys: one bias flag for attention and the MLP)
        d = {**d, "layer_norm_eps": d.get("norm_epsilon", 1e-5), "attention_bias": d.get("use_bias", True),
             "mlp_bias": d.get("use_bias", True), "hidden_act": d.get("hidden_act", "gelu_pytorch_tanh")}
    if family == "olmo":  # (its LayerNorms' fixed eps)
        d = {**d, "rms_norm_eps": 1e-5}
    if family == "nemotron":  # (its eps' own name; a squared-ReLU MLP)
        d = {**d, "layer_norm_eps": d.get("norm_eps", 1e-5), "hidden_act": d.get("hidden_act", "relu2"),
             "partial_rotary_factor": d.get("partial_rotary_factor", 0.5)}
    if family == "stablelm":  # (its q/k/v biases by `use_qkv_bias`; Llama's MLP, unbiased)
        d = {**d, "attention_bias": bool(d.get("use_qkv_bias")), "mlp_bias": False}
    if family == "phi":  # (every projection biased; its `gelu_new` the tanh GELU)
        act = d.get("hidden_act", "gelu_new")
        d = {**d, "attention_bias": True, "mlp_bias": True,
             "hidden_act": "gelu_pytorch_tanh" if act == "gelu_new" else act}
    if family in ("qwen2_moe", "qwen3_moe"):
        if d.get("use_sliding_window"):
            raise UnsupportedModelError(f"{family} with use_sliding_window is not supported")
        if d.get("mlp_only_layers") or d.get("decoder_sparse_step", 1) != 1:
            raise UnsupportedModelError(f"{family} with dense layers between the MoE layers (mlp_only_layers / "
                                        "decoder_sparse_step) is not supported")
    moe = (llama4_moe_fields(d) if family == "llama4" else hunyuan_moe_fields(d) if family == "hunyuan_v1_moe" else
           exaone_moe_fields(d) if family == "exaone_moe" else afmoe_moe_fields(d) if family == "afmoe" else
           mimo_moe_fields(d) if family == MIMO else cohere2_moe_fields(d) if family == "cohere2_moe" else
           jamba_moe_fields(d) if family == "jamba" else (
        mla_moe_fields if family in MLA_FAMILIES else fields.moe_fields)(family, d)) if family in MOE_FAMILIES else {}
    # (its own layer kinds, and its dense layers' width)
    per_layer = {k: moe.pop(k) for k in ("layer_types", "no_rope_layers", "intermediate_size") if k in moe}
    mla = mla_fields(family, d) if family in MLA_FAMILIES else {}
    head_dim = mla.pop("head_dim", head_dim)
    if family in ("qwen2", "qwen3"):
        sliding = fields.qwen_window(d)
    gemma = gemma4_fields(d) if family == GEMMA4 else fields.gemma_fields(family, d, head_dim) \
        if family in GEMMA_FAMILIES else (
        fields.PER_LAYER_FIELDS[family](d) if family in fields.PER_LAYER_FIELDS else llama4_fields(d)
        if family == "llama4" else afmoe_layer_fields(d) if family == "afmoe" else mimo_layer_fields(d)
        if family == MIMO else granite_swa_fields(d) if family in GRANITE_SWA_FAMILIES else lfm3_fields(d)
        if family == "lfm3" else {})  # (layers that differ)
    if gemma or family == "cohere2_moe":
        sliding = d.get("sliding_window")
    quant = d.get("quantization_config") or {}
    parse_quantization(quant)  # quantized weights (dequantized at load) of a form read, or refused by name
    kv_scheme = quant.get("kv_cache_scheme") or {}
    if kv_scheme and (kv_scheme.get("strategy", "tensor"), kv_scheme.get("type", "float"),
                      kv_scheme.get("num_bits", 8)) != ("tensor", "float", 8):
        raise UnsupportedModelError(f"kv_cache_scheme {kv_scheme} is not supported (only 8-bit float, per tensor)")
    rope_params = d.get("rope_scaling") or d.get("rope_parameters")
    if isinstance(rope_params, dict) and "full_attention" in rope_params:  # per layer type (Gemma 3)
        rope_params = rope_params["full_attention"]
    if isinstance(rope_params, dict) and "original_max_position_embeddings" in d:  # Phi-3 keeps it outside
        rope_params = {"original_max_position_embeddings": d["original_max_position_embeddings"], **rope_params}
    if family == GEMMA4:  # (the full-attention layers' rotary: `ModelConfig.gemma4`)
        rope_params = {"rope_theta": gemma.pop("rope_theta")}
    rope_dict = rope_params if isinstance(rope_params, dict) else {}
    proportional = rope_dict.get("rope_type") == "proportional"  # (its partial factor is not the rotary dims')
    partial = float((None if proportional else rope_dict.get("partial_rotary_factor")) or d.get("partial_rotary_factor")
                    or (0.5 if family in (*GLM_FAMILIES, "glm4_moe") else 1.0))
    if family in ERNIE_FAMILIES:
        fields.check_ernie(family, d)
    scaling = RopeScaling.from_hf(rope_params, max_pos, head_dim)
    rope_theta = d.get("rope_theta", 500000.0 if family in ERNIE_FAMILIES else None)
    if isinstance(rope_params, dict) and rope_params.get("rope_theta") is not None:  # transformers 5's form
        rope_theta = rope_params["rope_theta"]
    return cls(
        family=family,
        vocab_size=d["vocab_size"],
        hidden_size=hidden,
        intermediate_size=per_layer.get("intermediate_size", d["intermediate_size"]),
        num_layers=d["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=1 if mla else mimo_kv_heads(d) if family == MIMO else d.get("num_key_value_heads") or num_heads,  # (MLA: the one latent)
        head_dim=head_dim,
        rms_norm_eps=float(d.get("layer_norm_eps" if family in (*COHERE_FAMILIES, *BIASED_NORM_FAMILIES)
                                 else "rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
        rope_scaling=scaling,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", family in (*GEMMA_FAMILIES, *ERNIE_FAMILIES, *COHERE_FAMILIES))),
        # HF Qwen2 always has q/k/v biases and Mistral never does, whatever `attention_bias` says.
        attention_bias=family == "qwen2" or (family == "qwen2_moe" and bool(d.get("qkv_bias", True)))
        or (family in ("llama", "smollm3", "qwen3", "qwen3_moe", "glm4_moe", "dots1", "gpt_oss", "arcee", "bamba",
                       "olmo", "helium", *BIASED_NORM_FAMILIES, *OLMO_FAMILIES, *GRANITE_FAMILIES, *GLM_FAMILIES,
                       *GATED_DELTA_FAMILIES, *HUNYUAN_FAMILIES)
            and bool(d.get("attention_bias", family in (*GLM_FAMILIES, "gpt_oss", "jais2")))) or (family == "ernie4_5" and bool(d.get("use_bias"))),
        mlp_bias=(family in ("llama", "smollm3", "granite", "granite_swa", "arcee", "bamba", "nemotron_h", "helium",
                             *BIASED_NORM_FAMILIES)
                  and bool(d.get("mlp_bias", family == "jais2")))
        or (family == "ernie4_5" and bool(d.get("use_bias"))),
        qk_norm=family in ("qwen3", "qwen3_moe", "gemma3", GEMMA4, "dots1", "exaone4", "exaone_moe", "olmoe", "apertus", "lfm2", "minimax_m2", "afmoe",
                           "lfm3", *OLMO_FAMILIES, *GATED_DELTA_FAMILIES, *HUNYUAN_FAMILIES)
        or (family in ("glm4_moe", "cohere") and bool(d.get("use_qk_norm")))
        or (family in ("stablelm", "phi") and bool(d.get("qk_layernorm"))),
        clip_qkv=d.get("clip_qkv") if family in ("olmo", "olmoe", "mpt") else None,
        parallel_residual=False if family == "gpt_neox" and not d.get("use_parallel_residual", True)
        else True if family == "stablelm" and d.get("use_parallel_residual") else d["use_parallel_residual"]
        if family == "falcon" else None,
        parallel_norms=int(d.get("parallel_norms") or 1),  # (set by `neox_config`, `falcon_config`)
        rotary_dim=mla.pop("rotary_dim", None) or (int(head_dim * partial) if partial != 1.0 else None),
        sliding_window=sliding,
        kv_cache_scales=bool(kv_scheme),
        **fields.mrope_fields(d),
        no_rope_layers=afmoe_no_rope_layers(d) if family == "afmoe" else per_layer.get(
            "no_rope_layers", fields.no_rope_layers(family, d)),
        mamba=mamba_config(d) if family in HYBRID_FAMILIES else None,
        alibi_slopes=tuple(d["alibi_slopes"]) if d.get("alibi_slopes") else None,
        **moe, **mla,
        **({"hidden_act": d.get("hidden_act", "silu"), **({"layer_types": per_layer["layer_types"]} if per_layer else {}), "rope_qk_norm": family in HUNYUAN_FAMILIES, "query_scale_beta": float(d.get("query_scale_beta", 0.0)),
            "query_scale_length": int(d.get("query_scale_length", 0))} | gemma
           | (fields.granite_fields(d) if family in GRANITE_FAMILIES else falcon_fields(d) if family == "falcon_h1" else {})
           | ({"logits_scaling": 1.0 / float(d.get("logit_scale", 0.0625))} if family in COHERE_FAMILIES else {})),
    )
