"""Llama 4's language model (`Llama4ForCausalLM`, and the text of `Llama4ForConditionalGeneration`): its
`ModelConfig` fields from an HF config, and back (`ModelConfig.from_hf`, `config_hf.config_to_hf`).

Three of four layers turn queries and keys by position (complex rotary pairs, read half-split as GLM's), norm them
after the rotation with no weight (`use_qk_norm`) and attend within chunks of `attention_chunk_size` positions
(`ModelConfig.attention_chunk`); the fourth (NoPE) attends to everything, its queries scaled up by position
(temperature tuning: 1 + attn_scale * log(1 + floor((position + 1) / floor_scale))). Scout's every layer has experts,
Maverick's every second (`interleave_moe_layer_step`: `ModelConfig.moe_layer_step`), the others a dense MLP of
`intermediate_size_mlp`: the router's top-k, weighted by the sigmoid of its logit, weigh each chosen expert's input
(not its output), beside a shared expert; experts packed input-major (`gate_up_proj` [X, E, 2F]).
"""

from __future__ import annotations

from typing import Any

from jaxserve.errors import UnsupportedModelError


def is_llama4(d: dict[str, Any]) -> bool:
    return d.get("model_type") in ("llama4", "llama4_text") or "Llama4ForCausalLM" in (d.get("architectures") or [])


def llama4_text(d: dict[str, Any]) -> dict[str, Any]:
    """Llama 4's image-text config as its language model's (`text_config`; its vision tower is not read), and with
    dense layers between its MoE ones (Maverick's) `intermediate_size` the dense MLPs' (`intermediate_size_mlp`), the
    experts' kept as `expert_intermediate_size`; any other config as it is."""
    if "Llama4ForConditionalGeneration" in (d.get("architectures") or []) or d.get("model_type") == "llama4":
        d = {**(d.get("text_config") or {}), "architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text",
             "tie_word_embeddings": bool(d.get("tie_word_embeddings", False))}
    if is_llama4(d) and int(d.get("interleave_moe_layer_step", 1)) > 1 and "expert_intermediate_size" not in d:
        d = {**d, "intermediate_size": int(d.get("intermediate_size_mlp", 16384)),
             "expert_intermediate_size": int(d.get("intermediate_size", 8192))}
    return d


def no_rope_layers(d: dict[str, Any]) -> tuple[int, ...]:
    """Per layer, 1 where queries and keys are turned by position (transformers' default: all but every
    `no_rope_layer_interval`-th)."""
    n, every = int(d["num_hidden_layers"]), int(d.get("no_rope_layer_interval", 4))
    return tuple(int(x) for x in d.get("no_rope_layers") or [int((i + 1) % every != 0) for i in range(n)])


def llama4_fields(d: dict[str, Any]) -> dict[str, Any]:
    """The per-layer and Llama 4-only fields of a Llama 4 text config."""
    n = int(d["num_hidden_layers"])
    step = int(d.get("interleave_moe_layer_step", 1))
    moe = d.get("moe_layers")
    moe = list(range(step - 1, n, step)) if moe is None else list(moe)
    if step < 1 or sorted(moe) != list(range(step - 1, n, step)):
        raise UnsupportedModelError(f"Llama 4 with MoE layers {moe} is not supported: every "
                                    f"interleave_moe_layer_step-th ({step}) layer, the others dense")
    rope = no_rope_layers(d)
    chunk = d.get("attention_chunk_size")
    fields: dict[str, Any] = dict(layer_types=tuple("chunked_attention" if r and chunk else "full_attention"
                                                    for r in rope), attention_chunk=int(chunk) if chunk else None,
                                  rope_qk_norm=bool(d.get("use_qk_norm", True)), moe_layer_step=step)
    if d.get("attn_temperature_tuning", True):
        fields.update(query_scale_beta=float(d.get("attn_scale", 0.1)),
                      query_scale_length=int(d.get("floor_scale", 8192)))
    return fields


def llama4_moe_fields(d: dict[str, Any]) -> dict[str, Any]:
    """Its experts: as wide as `intermediate_size`, as is its shared expert; chosen by sigmoid scores, unnormalized."""
    width = int(d.get("expert_intermediate_size") or d.get("intermediate_size", 8192))
    return dict(num_experts=int(d.get("num_local_experts", 16)), num_experts_per_tok=int(d.get("num_experts_per_tok", 1)),
                moe_intermediate_size=width, shared_expert_intermediate_size=width, router_scoring="sigmoid",
                norm_topk_prob=False)


def llama4_hf(cfg: Any) -> dict[str, Any]:
    """A Llama 4 model's own HF config keys (the inverse of `llama4_fields` and `llama4_moe_fields`)."""
    d: dict[str, Any] = dict(
        num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
        intermediate_size=cfg.moe_intermediate_size, intermediate_size_mlp=cfg.intermediate_size,
        interleave_moe_layer_step=cfg.moe_layer_step, no_rope_layers=list(cfg.no_rope_layers or (1,) * cfg.num_layers),
        attention_chunk_size=cfg.attention_chunk, use_qk_norm=cfg.rope_qk_norm,
        attn_temperature_tuning=bool(cfg.query_scale_beta), attention_bias=False)
    if cfg.query_scale_beta:
        d.update(attn_scale=cfg.query_scale_beta, floor_scale=cfg.query_scale_length)
    return d
