"""The ModelConfig fields particular to some families, read from their HF config (`ModelConfig.from_hf`)."""

from __future__ import annotations

from typing import Any

from jaxserve.config_mamba import mamba_hf
from jaxserve.config_qwen3_next import GATED_DELTA_FAMILIES
from jaxserve.errors import UnsupportedModelError

GRANITE_SHARED_FAMILIES: tuple[str, ...] = ("granitemoeshared", "granitemoehybrid", "granitemoe_swa")  # a shared MLP, gate and up fused

def gemma_fields(family: str, d: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """The ModelConfig fields particular to Gemma's, Gemma 2's and Gemma 3's text models, from their HF config (Gemma's
    legacy `gelu` the tanh GELU, as transformers takes it; every layer global)."""
    num_layers = d["num_hidden_layers"]
    layer_types = d.get("layer_types")
    if family == "gemma":
        act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
        return dict(hidden_act="gelu_pytorch_tanh" if act == "gelu" else act, query_pre_attn_scalar=float(head_dim))
    if not layer_types:
        if family == "gemma2":  # HF Gemma 2 windows the even layers
            layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
        else:  # Gemma 3: every `sliding_window_pattern`-th layer is global
            pattern = d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6
            layer_types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                           for i in range(num_layers)]
    fields: dict[str, Any] = dict(
        layer_types=tuple(layer_types),
        hidden_act=d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh",
        query_pre_attn_scalar=float(d.get("query_pre_attn_scalar") or head_dim),
        attn_logit_softcap=d.get("attn_logit_softcapping"),
        final_logit_softcap=d.get("final_logit_softcapping"),
    )
    if family == "gemma3":
        local = (d.get("rope_parameters") or {}).get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise UnsupportedModelError(f"scaled rotary embeddings on the sliding layers ({local}) are not supported")
        fields["rope_local_theta"] = float(local.get("rope_theta") or d.get("rope_local_base_freq") or 10000.0)
    return fields


def int_if_whole(x: float | None) -> float | int | None:
    return int(x) if x is not None and float(x).is_integer() else x


def granite_fields(d: dict[str, Any]) -> dict[str, Any]:
    """Granite's scalars (transformers' defaults: 1.0 each; its attention scale is the multiplier itself)."""
    fields = {key: float(d.get(key, 1.0)) for key in ("embedding_multiplier", "attention_multiplier",
                                                     "residual_multiplier", "logits_scaling")}
    for key, value in fields.items():
        if not value > 0:
            raise UnsupportedModelError(f"granite {key} must be positive, got {value}")
    return fields


def seed_oss(d: dict[str, Any]) -> dict[str, Any]:
    """A Seed-OSS config (ByteDance's Llama with q/k/v biases) as the Qwen2 config it is (refused by name with an
    output projection's or the MLP's biases, which Qwen2 has not); any other config as it is."""
    if d.get("model_type") != "seed_oss" and "SeedOssForCausalLM" not in (d.get("architectures") or []):
        return d
    for key in ("attention_out_bias", "mlp_bias"):
        if d.get(key):
            raise UnsupportedModelError(f"Seed-OSS with {key} is not supported")
    if not d.get("attention_bias", True):
        raise UnsupportedModelError("Seed-OSS without attention_bias is not supported")
    return {**d, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": False}


def minimax_m2(d: dict[str, Any]) -> dict[str, Any]:
    """A MiniMax-M2 config with its rotary dims (the released configs' `rotary_dim`) as a partial rotary factor;
    MiniMax's lightning-attention layers (`attn_type_list` 0) and routing other than sigmoid refused by name; any
    other config as it is."""
    if d.get("model_type") != "minimax_m2" and "MiniMaxM2ForCausalLM" not in (d.get("architectures") or []):
        return d
    if 0 in (d.get("attn_type_list") or ()):
        raise UnsupportedModelError("MiniMax-M2 with lightning-attention layers (attn_type_list 0) is not supported")
    if d.get("scoring_func", "sigmoid") != "sigmoid" or d.get("use_routing_bias") is False:
        raise UnsupportedModelError(f"MiniMax-M2 with scoring_func {d.get('scoring_func')!r} or without its routing "
                                    "bias is not supported")
    if d.get("shared_intermediate_size"):
        raise UnsupportedModelError("MiniMax-M2 with shared_intermediate_size is not supported")
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if d.get("rotary_dim") and not d.get("partial_rotary_factor") and not rope.get("partial_rotary_factor"):
        d = {**d, "partial_rotary_factor": d["rotary_dim"] / (d.get("head_dim") or 128)}
    return d


def hy_v3(d: dict[str, Any]) -> dict[str, Any]:
    """A Hy3 config (Tencent's `HYV3ForCausalLM`: Qwen3's attention with q/k norms, DeepSeek-V3's sigmoid-routed
    experts in one group with a shared expert, dense first layers) as the dots.llm1 config it is (its tensors renamed
    by `keymap.canonical_name`); any other config as it is."""
    if d.get("model_type") != "hy_v3" and "HYV3ForCausalLM" not in (d.get("architectures") or []):
        return d
    dense = leading_dense_layers(d, "Hy3", 1)
    return {**d, "architectures": ["Dots1ForCausalLM"], "model_type": "dots1",
            "n_routed_experts": d.get("num_experts") or d.get("num_local_experts", 192),
            "num_experts_per_tok": d.get("num_experts_per_tok", 8), "n_shared_experts": d.get("num_shared_experts", 1),
            "routed_scaling_factor": d.get("router_scaling_factor", 2.826), "first_k_dense_replace": dense,
            "norm_topk_prob": True, "n_group": 1, "topk_group": 1,
            "moe_intermediate_size": d.get("moe_intermediate_size", 1536)}


def leading_dense_layers(d: dict[str, Any], name: str, default: int = 0) -> int:
    """How many dense layers lead a MoE model's: from its `mlp_layer_types` ("dense", "sparse"), else its
    `first_k_dense_replace`, else `default`; UnsupportedModelError naming `name` where a dense layer follows a MoE one."""
    kinds = list(d["mlp_layer_types"]) if d.get("mlp_layer_types") is not None else None
    dense = (kinds.index("sparse") if "sparse" in kinds else len(kinds)) if kinds is not None else None
    if kinds is not None and kinds != ["dense"] * dense + ["sparse"] * (len(kinds) - dense):
        raise UnsupportedModelError(f"{name} mlp_layer_types {kinds} is not supported: dense layers first, then the experts'")
    return dense if kinds is not None else int(d.get("first_k_dense_replace", default) or 0)


def ministral3(d: dict[str, Any]) -> dict[str, Any]:
    """A Ministral 3 config (Mistral's layers, its queries scaled by position as Llama 4's: `llama_4_scaling_beta`
    over the rope's `original_max_position_embeddings`) as the Mistral config it is, a Mistral 4 config as its own
    (the same scaling on its latent attention), the scaling in jaxserve's `query_scale_*` keys; any other config as
    it is."""
    mistral4 = d.get("model_type") == "mistral4" or "Mistral4ForCausalLM" in (d.get("architectures") or [])
    if d.get("model_type") != "ministral3" and "Ministral3ForCausalLM" not in (d.get("architectures") or []) \
            and not mistral4:
        return d
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    beta, length = rope.get("llama_4_scaling_beta"), rope.get("original_max_position_embeddings")
    if beta and not length:
        raise UnsupportedModelError("Ministral 3's llama_4_scaling_beta needs the rope's original_max_position_embeddings")
    scale = {"query_scale_beta": float(beta or 0.0), "query_scale_length": int(length or 0) if beta else 0}
    return {**d, **scale} if mistral4 else {**d, "architectures": ["MistralForCausalLM"], "model_type": "mistral", **scale}


def exaone(d: dict[str, Any]) -> dict[str, Any]:
    """An EXAONE 3.0 / 3.5 config (LG's `ExaoneForCausalLM`: Llama's architecture under other names, full rotary
    dims whatever its `rotary_pct`, as its own code and llama.cpp's converter read it) as the Llama config it is,
    with `ExaoneConfig`'s defaults; any other config as it is. Its tensors are renamed by `keymap.canonical_name`."""
    if d.get("model_type") != "exaone" and "ExaoneForCausalLM" not in (d.get("architectures") or []):
        return d
    if d.get("activation_function", "silu") != "silu":
        raise UnsupportedModelError(f"EXAONE with activation_function {d['activation_function']!r} is not supported")
    heads = d.get("num_attention_heads", 32)
    return {**d, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "num_hidden_layers": d.get("num_layers", 32), "rms_norm_eps": d.get("layer_norm_epsilon", 1e-6),
            "num_key_value_heads": d.get("num_key_value_heads") or heads, "num_attention_heads": heads,
            "intermediate_size": d.get("intermediate_size") or 4 * d.get("hidden_size", 2048),
            "tie_word_embeddings": d.get("tie_word_embeddings", True)}


def granite_hybrid(d: dict[str, Any]) -> dict[str, Any]:
    """A Granite 4.0 config (its layers' kinds are read by `config_mamba`) as the model it is: without experts, a
    dense model whose MLP is the shared one; any other config as it is."""
    if d.get("model_type") != "granitemoehybrid" and "GraniteMoeHybridForCausalLM" not in (d.get("architectures") or []):
        return d
    if d.get("num_local_experts"):
        return d
    return {**d, "intermediate_size": d.get("shared_intermediate_size", 1024), "shared_intermediate_size": 0}


def granite_hf(cfg: Any) -> dict[str, Any]:
    """A Granite model's own HF config keys (the inverse of `granite_fields` and `granite_hybrid`)."""
    d = {k: getattr(cfg, k) for k in ("embedding_multiplier", "attention_multiplier", "residual_multiplier",
                                      "logits_scaling")}
    if cfg.family in GRANITE_SHARED_FAMILIES:
        d["shared_intermediate_size"] = cfg.shared_expert_intermediate_size
    if cfg.family == "granitemoehybrid":
        d.update(layer_types=["attention"] * cfg.num_layers, num_local_experts=cfg.num_experts,
                 position_embedding_type=None if cfg.no_rope_layers else "rope")
        d.update(mamba_hf(cfg.mamba, cfg.num_layers, cfg.hidden_size, cfg.family) if cfg.mamba else {})
        if not cfg.num_experts:
            d["shared_intermediate_size"] = cfg.intermediate_size
    return d


def no_rope_layers(family: str, d: dict[str, Any]) -> tuple[int, ...] | None:
    """Per layer, 1 where queries and keys are rotated by position and 0 where not (None: all are): SmolLM3's,
    or none of a Granite hybrid's without `position_embedding_type` "rope"."""
    if family in ("smollm3", "granite_swa", "granitemoe_swa"):  # (Granite SWA's: from its bases, `config_granite_swa`)
        return smollm3_no_rope_layers(d)
    if family in ("granitemoehybrid", "olmo_hybrid", "jamba") and d.get("position_embedding_type") != "rope" or (
            family in ("nemotron_h", "gpt2", "gpt_bigcode")) or d.get("alibi_slopes"):  # (GPT-2's: `Params.pos_embed`)
        return (0,) * d["num_hidden_layers"]
    if family in ("exaone4", "cohere2", "exaone_moe") and d.get("sliding_window"):  # its global layers: NoPE
        return tuple(int(t == "sliding_attention") for t in exaone4_fields(d)["layer_types"])
    if family == "llama4":
        from jaxserve.config_llama4 import no_rope_layers as llama4_no_rope

        return llama4_no_rope(d)
    return None


def smollm3_no_rope_layers(d: dict[str, Any]) -> tuple[int, ...]:
    """SmolLM3's layers rotated by position (1) or not (0, NoPE): its `no_rope_layers`, else every
    `no_rope_layer_interval`-th layer without; a sliding window is refused."""
    if d.get("use_sliding_window") and d.get("sliding_window"):
        raise UnsupportedModelError("SmolLM3 with use_sliding_window is not supported")
    n, every = d["num_hidden_layers"], d.get("no_rope_layer_interval", 4)
    return tuple(int(x) for x in d.get("no_rope_layers") or [int((i + 1) % every != 0) for i in range(n)])


def moe_fields(family: str, d: dict[str, Any]) -> dict[str, Any]:
    """A MoE family's ModelConfig fields from its HF config."""
    fields: dict[str, Any] = dict(
        num_experts=d.get("num_local_experts") or d.get("num_experts") or d.get("n_routed_experts") or 0,
        num_experts_per_tok=d.get("num_experts_per_tok", 2),
        # Mixtral's and Granite's experts have the config's MLP width; the others declare theirs apart.
        moe_intermediate_size=d["intermediate_size"] if family in ("mixtral", "gpt_oss", "olmoe", "flex_olmo", "minimax_m2")
        or family.startswith("granite") else d["moe_intermediate_size"],
        # Granite, gpt-oss: a softmax over the top-k logits, which is the renormalized top-k of the softmax.
        norm_topk_prob=family in ("mixtral", "gpt_oss", "minimax_m2") or family.startswith("granite")
        or bool(d.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=d.get("shared_expert_intermediate_size" if family in (
            "qwen2_moe", *GATED_DELTA_FAMILIES) else "shared_intermediate_size") or 0,
    )
    if family == "minimax_m2":  # sigmoid scores, a bias for choosing (as DeepSeek-V3's, in one group), renormalized
        fields.update(router_scoring="sigmoid", router_bias=True)
    if family == "ernie4_5_moe":
        fields.update(num_experts=d["moe_num_experts"], num_experts_per_tok=d.get("moe_k", 6), router_bias=True,
                      norm_topk_prob=True, first_dense_layers=int(d.get("moe_layer_start_index", 1)),
                      shared_expert_intermediate_size=int(d.get("moe_num_shared_experts") or 0)
                      * d["moe_intermediate_size"])
    if family in ("glm4_moe", "dots1", "nemotron_h"):  # DeepSeek-V3's experts (Nemotron 3's ungated)
        glm = family == "glm4_moe"
        if "sliding_attention" in (d.get("layer_types") or ()):
            raise UnsupportedModelError(f"{family} with sliding-window layers is not supported")
        fields.update(router_scoring="sigmoid", router_bias=True, expert_groups=int(d.get("n_group") or 1),
                      expert_topk_groups=int(d.get("topk_group") or 1),
                      routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
                      first_dense_layers=int(d.get("first_k_dense_replace", 1 if glm else 0) or 0),
                      shared_expert_intermediate_size=int(d.get("n_shared_experts") or 0) * d["moe_intermediate_size"],
                      norm_topk_prob=bool(d.get("norm_topk_prob", glm)))
    if family == "lfm2" and fields["num_experts"]:  # LFM2-MoE: sigmoid scores, a bias to choose, dense first layers
        fields.update(router_scoring="sigmoid", router_bias=bool(d.get("use_expert_bias", True)),
                      routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
                      first_dense_layers=int(d.get("num_dense_layers", 2)), norm_topk_prob=bool(d.get("norm_topk_prob", True)))
    if family == "nemotron_h":  # (its shared expert's width its own; a dense model's `moe_*` keys unread)
        fields.update(shared_expert_intermediate_size=d.get("moe_shared_expert_intermediate_size", 7688),
                      norm_topk_prob=bool(d.get("norm_topk_prob", True)),
                      moe_latent_size=int(d.get("moe_latent_size") or 0))  # (Nemotron 3 Super's latent MoE)
        if not fields["num_experts"]:
            fields.update(moe_intermediate_size=0, shared_expert_intermediate_size=0, router_scoring="softmax",
                          router_bias=False, expert_groups=1, expert_topk_groups=1, moe_latent_size=0)
    return fields


def moe_hf(cfg: Any) -> dict[str, Any]:
    """A MoE model's HF config keys (the inverse of `moe_fields`)."""
    d: dict[str, Any] = {"num_experts_per_tok": cfg.num_experts_per_tok}
    if cfg.family in ("mixtral", "gpt_oss", "minimax_m2") or cfg.family.startswith("granite"):
        return {**d, "num_local_experts": cfg.num_experts, "intermediate_size": cfg.moe_intermediate_size}
    d.update(moe_intermediate_size=cfg.moe_intermediate_size, norm_topk_prob=cfg.norm_topk_prob)
    shared, rest = divmod(cfg.shared_expert_intermediate_size, cfg.moe_intermediate_size)
    if rest and cfg.family in ("glm4_moe", "ernie4_5_moe", "dots1"):
        raise UnsupportedModelError(f"a shared expert {cfg.shared_expert_intermediate_size} wide is no whole number "
                                    f"of {cfg.moe_intermediate_size}-wide experts (the config counts them)")
    if cfg.family == "ernie4_5_moe":
        return {"moe_num_experts": cfg.num_experts, "moe_k": cfg.num_experts_per_tok,
                "moe_intermediate_size": cfg.moe_intermediate_size, "moe_num_shared_experts": shared,
                "moe_layer_start_index": cfg.first_dense_layers, "moe_layer_end_index": cfg.num_layers - 1,
                "moe_layer_interval": 1}
    if cfg.family in ("glm4_moe", "dots1"):
        d.update(n_routed_experts=cfg.num_experts, n_shared_experts=shared, n_group=cfg.expert_groups,
                 topk_group=cfg.expert_topk_groups, routed_scaling_factor=cfg.routed_scaling_factor,
                 first_k_dense_replace=cfg.first_dense_layers)
        return {**d, "use_qk_norm": cfg.qk_norm, "num_nextn_predict_layers": 0} if cfg.family == "glm4_moe" else d
    if cfg.family in ("olmoe", "flex_olmo"):  # (their experts are as wide as `intermediate_size` says)
        return {"num_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
                "intermediate_size": cfg.moe_intermediate_size, "norm_topk_prob": cfg.norm_topk_prob}
    d.update(num_experts=cfg.num_experts, decoder_sparse_step=1, mlp_only_layers=[])
    if cfg.family == "qwen2_moe":
        d["shared_expert_intermediate_size"] = cfg.shared_expert_intermediate_size
    return d


def check_moe(cfg: Any) -> None:
    """Refuses MoE settings no model could run, by name."""
    if cfg.num_experts and not (0 < cfg.num_experts_per_tok <= cfg.num_experts and cfg.moe_intermediate_size > 0):
        raise UnsupportedModelError(f"a MoE model needs 0 < num_experts_per_tok ({cfg.num_experts_per_tok}) <= "
                                    f"num_experts ({cfg.num_experts}) and a positive moe_intermediate_size "
                                    f"({cfg.moe_intermediate_size})")
    if not 0 <= cfg.first_dense_layers < cfg.num_layers or (cfg.first_dense_layers and not cfg.num_experts):
        raise UnsupportedModelError(f"first_dense_layers ({cfg.first_dense_layers}) must leave a MoE layer of the "
                                    f"{cfg.num_layers} (and the model must have experts)")
    if cfg.moe_layer_step > 1 and (not cfg.num_experts or cfg.first_dense_layers or cfg.mamba and cfg.mamba.no_mlp):
        raise UnsupportedModelError(f"experts every {cfg.moe_layer_step} layers need a MoE model without dense first "
                                    "layers or layers of a mixer alone")
    groups, top = cfg.expert_groups, cfg.expert_topk_groups
    if cfg.router_scoring not in ("softmax", "sigmoid"):
        raise UnsupportedModelError(f"router_scoring must be 'softmax' or 'sigmoid', got {cfg.router_scoring!r}")
    if (groups, top) != (1, 1) and not (groups > 0 and cfg.num_experts % groups == 0
                                        and cfg.num_experts // groups >= 2 and 0 < top <= groups
                                        and cfg.num_experts_per_tok <= top * cfg.num_experts // groups):
        raise UnsupportedModelError(
            f"expert groups: {cfg.num_experts} experts in {groups} groups (at least 2 each), {top} of them chosen, must "
            f"hold num_experts_per_tok ({cfg.num_experts_per_tok}) experts")


def check_ernie(family: str, d: dict[str, Any]) -> None:
    """Refuses ERNIE 4.5 configs jaxserve cannot run, by name: MoE layers other than every layer from
    `moe_layer_start_index` to the last, biases in a MoE model's MLPs."""
    if family != "ernie4_5_moe":
        return
    last, end = d["num_hidden_layers"] - 1, d.get("moe_layer_end_index", -1)
    if d.get("moe_layer_interval", 1) != 1 or end not in (-1, last):
        raise UnsupportedModelError(f"ERNIE 4.5 MoE layers every {d.get('moe_layer_interval')} layers up to layer {end} "
                                    "are not supported: only every layer from moe_layer_start_index to the last")
    if d.get("use_bias"):
        raise UnsupportedModelError("ERNIE 4.5 MoE with use_bias (biased MLPs beside the experts) is not supported")


def qwen_window(d: dict[str, Any]) -> int | None:
    """A Qwen2 or Qwen3 config's sliding window, which must cover every layer or none: HF Qwen windows only the
    layers from `max_window_layers` on (or as `layer_types` lists them)."""
    if not (d.get("use_sliding_window") and d.get("sliding_window")):
        return None
    layer_types = d.get("layer_types") or [
        "sliding_attention" if i >= d.get("max_window_layers", 28) else "full_attention"
        for i in range(d["num_hidden_layers"])]
    if set(layer_types) == {"sliding_attention"}:
        return d["sliding_window"]
    if set(layer_types) != {"full_attention"}:
        raise UnsupportedModelError("per-layer sliding windows (some layers windowed, some not: max_window_layers / "
                                    "layer_types) are not supported")
    return None


def olmo3_fields(d: dict[str, Any]) -> dict[str, Any]:
    """OLMo 3's windowed and global layers (three of four windowed by default), the windowed ones on an unscaled
    rotary embedding of their own base (`rope_local_theta`)."""
    n = d["num_hidden_layers"]
    layer_types = d.get("layer_types") or ["sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(n)]
    local = (d.get("rope_parameters") or {}).get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise UnsupportedModelError(f"scaled rotary embeddings on the sliding layers ({local}) are not supported")
    theta = local.get("rope_theta") or d.get("rope_theta")
    return dict(layer_types=tuple(layer_types), rope_local_theta=None if theta is None else float(theta))


def olmo3_hf(cfg: Any) -> dict[str, Any]:
    """An OLMo 3 model's own HF config keys (the inverse of `olmo3_fields`)."""
    full = cfg.rope_scaling.to_hf() if cfg.rope_scaling.rope_type != "default" else {"rope_type": "default"}
    return {"layer_types": list(cfg.layer_types or ()), "rope_parameters": {
        "full_attention": {**full, "rope_theta": cfg.rope_theta},
        "sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_local_theta or cfg.rope_theta}}}


def gpt_oss_fields(d: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss's windowed and global layers (alternating by default) and its experts' clamped SwiGLU."""
    n = d["num_hidden_layers"]
    layer_types = d.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    return dict(layer_types=tuple(layer_types), swiglu_limit=float(d.get("swiglu_limit", 7.0)),
                swiglu_alpha=float(d.get("swiglu_alpha", 1.702)))


def gpt_oss_hf(cfg: Any) -> dict[str, Any]:
    """A gpt-oss model's own HF config keys (the inverse of `gpt_oss_fields`)."""
    return {"layer_types": list(cfg.layer_types or ()), "swiglu_limit": cfg.swiglu_limit,
            "swiglu_alpha": cfg.swiglu_alpha, "num_local_experts": cfg.num_experts}


def exaone4_fields(d: dict[str, Any]) -> dict[str, Any]:
    """EXAONE 4's windowed and global layers (none without a sliding window): its `layer_types`, else by
    `sliding_window_pattern`, a period (every fourth layer global) or a string of L (local) and G (global)."""
    if not d.get("sliding_window"):
        return {}
    n, pattern = d["num_hidden_layers"], d.get("sliding_window_pattern") or 4
    if isinstance(pattern, str):
        kinds = ["sliding_attention" if pattern[i % len(pattern)] == "L" else "full_attention" for i in range(n)]
    else:
        kinds = ["sliding_attention" if (i + 1) % int(pattern) else "full_attention" for i in range(n)]
    return dict(layer_types=tuple(d.get("layer_types") or kinds))


# Families whose layers differ (windowed or global), by the fields that say how.
PER_LAYER_FIELDS = {"olmo3": olmo3_fields, "gpt_oss": gpt_oss_fields, "exaone4": exaone4_fields,
                    "cohere2": exaone4_fields, "exaone_moe": exaone4_fields,  # (Command R7B's, K-EXAONE's: EXAONE 4's)
                    "ministral": lambda d: {"layer_types": tuple(d["layer_types"])} if d.get("layer_types") else {}}


def mrope_fields(d: dict[str, Any]) -> dict[str, Any]:
    """`ModelConfig`'s M-RoPE and deepstack fields of a config made by `qwen_vl_text` (none for other models)."""
    return dict(mrope_section=tuple(d["mrope_section"]) if d.get("mrope_section") else None,
                mrope_interleaved=bool(d.get("mrope_interleaved")), deepstack_layers=int(d.get("deepstack_layers", 0)))
