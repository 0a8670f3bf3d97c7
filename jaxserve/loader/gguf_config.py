"""A model configuration from llama.cpp GGUF metadata (`general.architecture`, `{arch}.*` keys).

The Llama-family architectures (Granite's scalars included) map onto `ModelConfig` directly. Gemma 2, Gemma 3,
OLMo 2, EXAONE 4, Cohere's, ERNIE 4.5, the hybrids (Granite 4.0-H, Nemotron-H, Falcon-H1: `gguf_hybrid`) and the
mixture-of-experts files (Mixtral, which llama.cpp writes as "llama" with experts, Qwen2-MoE, Qwen3-MoE, OLMoE,
GLM-4.5, gpt-oss, DeepSeek's "deepseek2": `gguf_deepseek`) become the HF
config their converter read, and go through `ModelConfig.from_hf`, so both sources give one config: llama.cpp
keeps out of the file what it fixes per architecture (the layers' sliding pattern, Gemma 3's local rotary base,
gpt-oss's SwiGLU clamp at 7 and alternating window) or per size (the attention scale: the 27B models scale
queries by hidden_size / num_heads, the others by head_dim), and those are restored here as llama.cpp applies
them (gpt-oss's YaRN as the model defines it, its correction range unrounded).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from jaxserve.config import Family, ModelConfig
from jaxserve.errors import UnsupportedModelError
from jaxserve.loader.gguf_afmoe import afmoe_gguf_hf
from jaxserve.loader.gguf_deepseek import deepseek2_hf
from jaxserve.loader.gguf_file import prediction_blocks
from jaxserve.loader.gguf_gemma4 import gemma4_gguf_hf
from jaxserve.loader.gguf_hybrid import (
    falcon_h1_gguf_hf,
    granite_hybrid_hf,
    granite_scalars,
    jamba_gguf_hf,
    lfm2_gguf_hf,
    mamba_gguf_hf,
    nemotron_h_hf,
)
from jaxserve.loader.gguf_mimo2 import mimo2_gguf_hf
from jaxserve.loader.gguf_qwen3_next import QWEN3_NEXT_GGUF, qwen3_next_gguf_hf
from jaxserve.rope import RopeScaling

# Phi-3 is Mistral's architecture with fused projections (split at load), EXAONE 3 Llama's (rows not permuted).
_LLAMA_FAMILIES: dict[str, Family] = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "mistral",
                                      "phi3": "mistral", "granite": "granite", "smollm3": "smollm3",
                                      "exaone": "llama"}
# llama.cpp's SmolLM3 leaves every 4th layer unrotated (a number in its code, not in the file).
_SMOLLM3_NO_ROPE_STEP = 4
# Granite's scalars: GGUF key (after the architecture) to ModelConfig field.
_GRANITE_SCALES = {"embedding_scale": "embedding_multiplier", "attention.scale": "attention_multiplier",
                   "residual_scale": "residual_multiplier", "logit_scale": "logits_scaling"}
_GEMMA = ("gemma", "gemma2", "gemma3")
# Architectures read through the HF config their converter read (`ModelConfig.from_hf`); llama's with
# experts is Mixtral.
_HF_FORM = {"gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
            "qwen2moe": "Qwen2MoeForCausalLM",
            "qwen3moe": "Qwen3MoeForCausalLM", "gpt-oss": "GptOssForCausalLM", "olmo2": "Olmo2ForCausalLM",
            "olmoe": "OlmoeForCausalLM", "glm4moe": "Glm4MoeForCausalLM", "deepseek2": "DeepseekV2ForCausalLM",
            "glm-dsa": "GlmMoeDsaForCausalLM", "minimax-m2": "MiniMaxM2ForCausalLM",
            "hunyuan-moe": "HunYuanMoEV1ForCausalLM", "hunyuan-dense": "HunYuanDenseV1ForCausalLM",
            "exaone4": "Exaone4ForCausalLM", "command-r": "CohereForCausalLM", "cohere2": "Cohere2ForCausalLM",
            "ernie4_5": "Ernie4_5ForCausalLM", "ernie4_5-moe": "Ernie4_5_MoeForCausalLM",
            "granitehybrid": "GraniteMoeHybridForCausalLM", "nemotron_h": "NemotronHForCausalLM",
            "nemotron_h_moe": "NemotronHForCausalLM", "lfm2": "Lfm2ForCausalLM", "lfm2moe": "Lfm2MoeForCausalLM",
            "granitemoe": "GraniteMoeForCausalLM", "falcon-h1": "FalconH1ForCausalLM", "jais2": "Jais2ForCausalLM",
            "starcoder2": "Starcoder2ForCausalLM", "phi2": "PhiForCausalLM", "stablelm": "StableLmForCausalLM",
            "nemotron": "NemotronForCausalLM", "gpt2": "GPT2LMHeadModel", "starcoder": "GPTBigCodeForCausalLM",
            "olmo": "OlmoForCausalLM", "gptneox": "GPTNeoXForCausalLM", "falcon": "FalconForCausalLM",
            "mpt": "MptForCausalLM", "bloom": "BloomForCausalLM",
            "afmoe": "AfmoeForCausalLM",
            "jamba": "JambaForCausalLM", "gemma4": "Gemma4ForCausalLM", "mimo2": "MiMoV2FlashForCausalLM",
            "mamba": "MambaForCausalLM", "mamba2": "Mamba2ForCausalLM",
            **{a: hf for a, (hf, _) in QWEN3_NEXT_GGUF.items()}}
# Architectures whose routing weights llama.cpp leaves unrenormalized unless the file says otherwise.
_UNNORMALIZED_TOPK = ("qwen2moe", "olmoe")
# Layer counts of the 27B models, whose queries llama.cpp scales by hidden_size / num_heads.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
SUPPORTED_ARCHITECTURES = (*_LLAMA_FAMILIES, *_HF_FORM)


def config_from_gguf(meta: dict[str, Any], vocab_size: int, has_output_weight: bool,
                     rope_tensors: Mapping[str, Sequence[float]] | None = None,
                     tensor_names: Mapping[str, Any] | frozenset[str] = frozenset()) -> ModelConfig:
    """The configuration GGUF metadata `meta` describes; `rope_tensors` are the file's rope tensors
    (`rope_freqs`, `rope_factors_short`, `rope_factors_long`) by name, if it has any; `tensor_names` all of its
    tensors' (GLM-4.5's multi-token prediction blocks follow the model's, which they do not count in), mapped to their
    shapes (HF order) where the caller has them."""
    arch = meta.get("general.architecture") or ""
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise UnsupportedModelError(f"GGUF metadata is missing {arch}.{key}")
        return value

    if arch in ("mamba", "mamba2"):  # (no attention: no heads)
        return ModelConfig.from_hf(mamba_gguf_hf(meta, arch, get, vocab_size, has_output_weight,
                                                 frozenset(tensor_names)))

    hidden = int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    kv_heads = get("attention.head_count_kv", num_heads)  # (per layer in a hybrid's file: 0 in a Mamba layer)
    num_kv = int(max(kv_heads) if isinstance(kv_heads, (list, tuple)) else kv_heads)
    kv_heads = list(kv_heads) if isinstance(kv_heads, (list, tuple)) else [num_kv] * int(get("block_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length_mla") or meta.get(f"{arch}.attention.key_length")
                   or hidden // num_heads)  # (DeepSeek's key_length is its latent's page entry: the _mla one)
    max_pos = int(get("context_length", 4096))
    num_layers = int(get("block_count"))
    prediction = prediction_blocks(tensor_names)
    if prediction:
        if prediction != set(range(num_layers - len(prediction), num_layers)):
            raise UnsupportedModelError(f"GGUF multi-token prediction blocks {sorted(prediction)} are not the last "
                                        f"of its {num_layers} blocks")
        num_layers -= len(prediction)
    rotary = int(meta.get(f"{arch}.rope.dimension_count") or head_dim)  # fewer: a partial rotary embedding
    scaling = RopeScaling.from_gguf(meta, arch, max_pos, rope_tensors)
    sliding = meta.get(f"{arch}.attention.sliding_window")
    experts = int(meta.get(f"{arch}.expert_count") or 0)
    hf_arch = _HF_FORM.get(arch) or ("MixtralForCausalLM" if arch == "llama" and experts else None)
    ffn = meta.get(f"{arch}.feed_forward_length")  # (per block in Nemotron-H's file: 0 but in an MLP block)
    ffn = list(ffn) if isinstance(ffn, (list, tuple)) else [ffn] * num_layers
    if hf_arch is not None:
        d: dict[str, Any] = dict(
            architectures=[hf_arch], vocab_size=vocab_size, hidden_size=hidden,
            intermediate_size=int(max(ffn) if ffn[0] is not None else get("expert_feed_forward_length")),
            num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv,
            head_dim=head_dim, rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6 if arch in _GEMMA
                                                      else 1e-5)),
            rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)), max_position_embeddings=max_pos,
            tie_word_embeddings=not has_output_weight, sliding_window=int(sliding) if sliding else None,
            partial_rotary_factor=rotary / head_dim)
        if arch in _GEMMA:
            d.update(hidden_activation="gelu_pytorch_tanh",
                     query_pre_attn_scalar=hidden // num_heads if num_layers == _GEMMA_27B_LAYERS.get(arch)
                     else head_dim,
                     attn_logit_softcapping=meta.get(f"{arch}.attn_logit_softcapping"),
                     final_logit_softcapping=meta.get(f"{arch}.final_logit_softcapping"))
        if experts:
            d.update(num_local_experts=experts, num_experts=experts, num_experts_per_tok=int(get("expert_used_count")),
                     norm_topk_prob=bool(meta.get(f"{arch}.expert_weights_norm", arch not in _UNNORMALIZED_TOPK)))
            if arch != "llama":  # Qwen's experts have their own width (Mixtral's are the dense MLP's)
                d["moe_intermediate_size"] = int(meta.get(f"{arch}.expert_feed_forward_length")  # (Granite's: the
                                                 or max(ffn))  # MLP width, as Mixtral's)
                d["shared_expert_intermediate_size"] = int(meta.get(f"{arch}.expert_shared_feed_forward_length") or 0)
            if arch == "glm4moe":  # DeepSeek-V3's experts: sigmoid scores chosen in groups, dense first layers
                d.update(n_routed_experts=experts, n_shared_experts=int(meta.get(f"{arch}.expert_shared_count") or 0),
                         first_k_dense_replace=int(meta.get(f"{arch}.leading_dense_block_count") or 0),
                         routed_scaling_factor=float(meta.get(f"{arch}.expert_weights_scale") or 1.0),
                         n_group=int(meta.get(f"{arch}.expert_group_count") or 1),
                         topk_group=int(meta.get(f"{arch}.expert_group_used_count") or 1),
                         use_qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
                         attention_bias="blk.0.attn_q.bias" in tensor_names)
        if scaling.rope_type in ("linear", "yarn"):  # Gemma 3 scales its global layers' frequencies only
            d["rope_scaling"] = {"rope_type": scaling.rope_type, "factor": scaling.factor,
                                 "original_max_position_embeddings": scaling.original_max_position_embeddings}
            if arch == "gpt-oss":  # its YaRN correction range unrounded (the model's own config; not in the file)
                d["rope_scaling"]["truncate"] = False
        elif scaling.rope_type not in ("default", "factors"):  # (factors: `rope_freqs`, set below)
            raise UnsupportedModelError(f"GGUF rope scaling {scaling.rope_type!r} on {arch} is not supported")
        pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
        if sliding and isinstance(pattern, (list, tuple)):  # per layer, True for a windowed one (EXAONE 4)
            d["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
        elif sliding and pattern:  # every pattern-th layer global
            d["sliding_window_pattern"] = int(pattern)
        if arch in ("deepseek2", "glm-dsa"):
            d = deepseek2_hf(meta, get, d, experts, arch)
        if arch.startswith("nemotron_h"):
            d = nemotron_h_hf(meta, arch, get, d, experts, kv_heads, ffn, tensor_names)
        if arch.startswith("lfm2"):
            d = lfm2_gguf_hf(meta, arch, get, d, kv_heads, tensor_names)
        if arch in QWEN3_NEXT_GGUF:
            d = qwen3_next_gguf_hf(meta, arch, get, d)
        if arch == "minimax-m2":  # its experts as wide as the MLP (Mixtral's names); the routing the file names
            gating = {1: "softmax", 2: "sigmoid"}.get(int(meta.get(f"{arch}.expert_gating_func") or 2), "other")
            d.update(scoring_func=gating, use_routing_bias="blk.0.exp_probs_b.bias" in tensor_names,
                     intermediate_size=d["moe_intermediate_size"])
        if arch == "granitemoe":  # Granite's scalars; a shared MLP beside the experts (GraniteMoeShared's) by its width
            shared = int(meta.get(f"{arch}.expert_shared_feed_forward_length") or 0)
            d.update(granite_scalars(meta, arch), shared_intermediate_size=shared,
                     architectures=["GraniteMoeSharedForCausalLM" if shared else "GraniteMoeForCausalLM"])
        if arch == "granitehybrid":
            d = granite_hybrid_hf(meta, get, d, experts, kv_heads, tensor_names)
        if arch == "falcon-h1":
            d = falcon_h1_gguf_hf(get, d, tensor_names)
        if arch == "jamba":
            d = jamba_gguf_hf(get, d, kv_heads, tensor_names)
        if arch == "gemma4":  # (its full-attention layers' rope_freqs are theirs alone: not the model's scaling)
            return ModelConfig.from_hf(gemma4_gguf_hf(meta, get, d, kv_heads, ffn, tensor_names, rope_tensors))
        if arch == "mimo2":
            return ModelConfig.from_hf(mimo2_gguf_hf(meta, get, d, kv_heads, tensor_names))
        if arch == "jais2":  # LayerNorms with biases, a squared-ReLU MLP (llama.cpp's for the architecture)
            d.update(layer_norm_eps=float(get("attention.layer_norm_epsilon")), hidden_act="relu2",
                     attention_bias="blk.0.attn_q.bias" in tensor_names, mlp_bias="blk.0.ffn_up.bias" in tensor_names)
        if arch == "stablelm":  # (StableLM 2 12B's q/k norms and parallel blocks refused by name, by their tensors)
            if "blk.0.attn_q_norm.weight" in tensor_names or "blk.0.ffn_norm.weight" not in tensor_names:
                raise UnsupportedModelError("StableLM GGUF files with q/k norms or parallel blocks (StableLM 2 12B) "
                                            "are not supported; its HF checkpoint is")
            d.update(layer_norm_eps=float(get("attention.layer_norm_epsilon")),
                     use_qkv_bias="blk.0.attn_q.bias" in tensor_names)
        if arch == "nemotron":  # (its norms' weights stored as 1 + w, as Gemma's)
            d.update(norm_eps=float(get("attention.layer_norm_epsilon")), attention_bias="blk.0.attn_q.bias" in
                     tensor_names, mlp_bias="blk.0.ffn_up.bias" in tensor_names)
        if arch == "gptneox":  # (q, k and v in `attn_qkv` one after another: the converter's order)
            d.update(layer_norm_eps=float(get("attention.layer_norm_epsilon")),
                     use_parallel_residual=bool(meta.get("gptneox.use_parallel_residual", True)))
        if arch == "falcon":  # (`attn_qkv` as GPT-NeoX's; blocks parallel, `attn_norm_2` the MLP's own norm)
            two = "blk.0.attn_norm_2.weight" in tensor_names
            d.update(layer_norm_epsilon=float(get("attention.layer_norm_epsilon")), num_kv_heads=num_kv,
                     new_decoder_architecture=two or num_kv not in (1, num_heads), num_ln_in_parallel_attn=1 + two,
                     multi_query=num_kv == 1, bias="blk.0.attn_qkv.bias" in tensor_names,
                     ffn_hidden_size=d["intermediate_size"])
        if arch == "bloom":  # (`attn_qkv` q, k and v one after another: the converter's order; `token_embd_norm`)
            d["layer_norm_epsilon"] = float(get("attention.layer_norm_epsilon"))
        if arch == "mpt":  # (`attn_qkv` as MPT's `Wqkv`: q, k and v one after another)
            d.update(layer_norm_epsilon=float(get("attention.layer_norm_epsilon")),
                     expansion_ratio=d["intermediate_size"] / d["hidden_size"],
                     attn_config={"clip_qkv": meta.get("mpt.attention.clamp_kqv"),
                                  "alibi_bias_max": meta.get("mpt.attention.max_alibi_bias", 8)})
        if arch == "afmoe":
            d = afmoe_gguf_hf(meta, d)
        if arch == "olmo":  # (no norm tensors: its LayerNorms have no weights)
            d["clip_qkv"] = meta.get("olmo.attention.clamp_kqv")
        if arch == "olmoe":
            d["clip_qkv"] = meta.get("olmoe.attention.clamp_kqv")
        if arch in ("gpt2", "starcoder"):  # (their positions: `position_embd`; StarCoder's one KV head)
            d["layer_norm_epsilon"] = float(get("attention.layer_norm_epsilon"))
        if arch == "phi2":  # (its rotary dims: `rope.dimension_count`, above)
            d["layer_norm_eps"] = float(get("attention.layer_norm_epsilon"))
        if arch == "starcoder2":  # (a window only where the file has one: llama.cpp's converter writes none)
            d.update(norm_epsilon=float(get("attention.layer_norm_epsilon")),
                     use_bias="blk.0.attn_q.bias" in tensor_names)
        if arch.startswith("ernie4_5"):  # biases by their tensors; the experts under ERNIE's names
            d["use_bias"] = "blk.0.attn_q.bias" in tensor_names
            if experts:
                d.update(moe_num_experts=experts, moe_k=d["num_experts_per_tok"], moe_intermediate_size=d[
                    "moe_intermediate_size"], moe_num_shared_experts=int(meta.get(f"{arch}.expert_shared_count") or 0),
                    moe_layer_start_index=int(meta.get(f"{arch}.leading_dense_block_count") or 0),
                    moe_layer_interval=int(meta.get(f"{arch}.interleave_moe_layer_step") or 1),
                    moe_layer_end_index=num_layers - 1)
        if arch in ("command-r", "cohere2"):  # LayerNorm, scaled logits; Command R+'s q/k norms by their tensors
            d.update(layer_norm_eps=float(get("attention.layer_norm_epsilon")), logit_scale=float(get("logit_scale")),
                     use_qk_norm="blk.0.attn_q_norm.weight" in tensor_names)
        cfg = ModelConfig.from_hf(d)
        return dataclasses.replace(cfg, rope_scaling=scaling) if scaling.rope_type == "factors" else cfg
    family = _LLAMA_FAMILIES[arch]
    return ModelConfig(
        family=family,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv,
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=max_pos,
        tie_word_embeddings=not has_output_weight,
        attention_bias=family == "qwen2",
        qk_norm=family == "qwen3",
        sliding_window=int(sliding) if sliding else None,
        rotary_dim=rotary if rotary != head_dim else None,
        no_rope_layers=tuple(int((i + 1) % _SMOLLM3_NO_ROPE_STEP != 0) for i in range(num_layers))
        if family == "smollm3" else None,
        **({f: float(get(k)) for k, f in _GRANITE_SCALES.items()} if family == "granite" else {}),
    )
