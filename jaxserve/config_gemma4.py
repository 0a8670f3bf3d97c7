"""Gemma 4's text model (`Gemma4ForCausalLM`, and the language model of `Gemma4ForConditionalGeneration`): Gemma 3's
pattern of windowed and full-attention layers, but the full-attention layers have heads of their own width
(`global_head_dim`, 512 in the released models) and KV heads of their own count, their values the key projection's
output (`attention_k_eq_v`: no value projection), and a proportional rotary embedding (the leading quarter of each
head's pairs turned); every layer's q and k normed (weights applied as they are, not 1 + w), its values normed
without a weight, attention unscaled (q's norm sets it), its output times a learned scalar; in the MoE form
(`enable_moe_block`), experts beside the dense MLP, routed on the layer's unnormed input.

The full-attention layers' weights are stacked apart (`Params.dense_layers`, `ModelConfig.dense_layer`), and both
kinds' keys and values live in one page pool: a token's row is as wide as the wider kind's keys (`kv_pool_heads`
heads of the windowed layers' `head_dim`), each layer viewing it as heads of its own width and writing each of its KV
heads as many times as fill it (`models.gemma4`). The E2B/E4B models' per-layer input embeddings
(`hidden_size_per_layer_input`), their last layers that attend over an earlier layer's keys and values
(`num_kv_shared_layers`: no pages of their own) and those layers' MLPs of twice the width (`use_double_wide_mlp`;
every layer's held that wide, the others' halves zero) are read too."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from jaxserve.errors import UnsupportedModelError
from jaxserve.rope import RopeScaling

FAMILY = "gemma4"


@dataclass(frozen=True)
class Gemma4Layers:
    """Gemma 4's full-attention layers' attention (`ModelConfig.gemma4`; the windowed layers' is the config's own)."""

    head_dim: int
    num_kv_heads: int
    rope_theta: float
    rope_pairs: int  # the rotated pairs of a head (proportional rotary: frequencies over the whole head_dim); the rest
    # pass through unturned
    rope_factor: float = 1.0  # every rotated pair's frequency divided by it
    k_eq_v: bool = True  # values are the key projection's output (normed without weight, unrotated)
    full_layers: bool = False  # the config is the full-attention layers' own (`full_attention_config`)
    # The E2B/E4B models': each layer's input embedding of `ple_width` dims (0: none), from a table of `ple_vocab`
    # tokens and the model's input embedding; the last `shared_layers` layers attend over the keys and values of the
    # last earlier layer of their kind (holding no pages of their own); their MLPs twice as wide (`double_wide`).
    ple_width: int = 0
    ple_vocab: int = 0
    shared_layers: int = 0
    double_wide: bool = False
    images_both_ways: bool = False  # `use_bidirectional_attention` "vision" (`engine.multimodal_gemma4`)


def gemma4_text(d: dict[str, Any]) -> dict[str, Any]:
    """A Gemma 4 image-text config as its language model's (`text_config`); any other config as it is."""
    if "Gemma4ForConditionalGeneration" not in (d.get("architectures") or []) and d.get("model_type") != FAMILY:
        return d
    text = {k: v for k, v in (d.get("text_config") or {}).items() if v is not None}
    return {**text, "tie_word_embeddings": d.get("tie_word_embeddings", text.get("tie_word_embeddings", True)),
            "architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text"}


def gemma4_fields(d: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields of a Gemma 4 text config (transformers' defaults where it leaves one out)."""
    if d.get("use_bidirectional_attention") == "all":
        raise UnsupportedModelError("Gemma 4 with use_bidirectional_attention 'all' is not supported")
    num_layers = d["num_hidden_layers"]
    types = list(d.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention"
                                         for i in range(num_layers)])
    types[-1] = "full_attention"  # (transformers forces the last layer's)
    rope = d.get("rope_parameters") or {}
    local = rope.get("sliding_attention") or {"rope_type": "default", "rope_theta": 10_000.0}
    full = rope.get("full_attention") or {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                          "rope_theta": 1_000_000.0}
    if local.get("rope_type", "default") != "default" or full.get("rope_type", "default") not in ("default",
                                                                                                   "proportional"):
        raise UnsupportedModelError(f"Gemma 4 rotary embeddings {local} / {full} are not supported (default on the "
                                    "windowed layers, default or proportional on the full-attention ones)")
    k_eq_v = bool(d.get("attention_k_eq_v", False))
    head_dim, kv_heads = _full_layer_shapes(d, types, k_eq_v)
    proportion = float(full.get("partial_rotary_factor", 1.0)) if full.get("rope_type") == "proportional" else 1.0
    moe = {}
    if d.get("enable_moe_block"):
        moe = dict(num_experts=int(d["num_experts"]), num_experts_per_tok=int(d["top_k_experts"]),
                   moe_intermediate_size=int(d["moe_intermediate_size"]), norm_topk_prob=True)
    return dict(
        layer_types=tuple(types),
        hidden_act=d.get("hidden_activation") or "gelu_pytorch_tanh",
        query_pre_attn_scalar=1.0,  # (attention unscaled)
        final_logit_softcap=d.get("final_logit_softcapping"),
        rope_theta=float(full.get("rope_theta", 1_000_000.0)),  # (`config_parse` takes it out)
        rope_local_theta=float(local.get("rope_theta", 10_000.0)),
        gemma4=Gemma4Layers(
            head_dim=head_dim, num_kv_heads=kv_heads,
            rope_theta=float(full.get("rope_theta", 1_000_000.0)), rope_pairs=int(proportion * head_dim // 2),
            rope_factor=float(full.get("factor", 1.0)), k_eq_v=k_eq_v,
            ple_width=int(d.get("hidden_size_per_layer_input", 256) or 0),
            ple_vocab=int(d.get("vocab_size_per_layer_input") or 262_144),
            shared_layers=int(d.get("num_kv_shared_layers") or 0),
            double_wide=bool(d.get("use_double_wide_mlp")) and bool(d.get("num_kv_shared_layers")),
            images_both_ways=d.get("use_bidirectional_attention") == "vision"),
        **moe,
    )


def _full_layer_shapes(d: dict[str, Any], types: list[str], k_eq_v: bool) -> tuple[int, int]:
    """The full-attention layers' head width and KV heads: as a released config gives them (`global_head_dim`,
    `num_global_key_value_heads` where `attention_k_eq_v`), or as transformers writes them (`per_layer_config`: each
    full-attention layer's own, all alike; none for a windowed layer)."""
    kv_heads = int(d.get("num_key_value_heads") or d["num_attention_heads"])
    per_layer = d.get("per_layer_config")
    if not per_layer:
        return int(d.get("global_head_dim") or 512), int(d.get("num_global_key_value_heads") or kv_heads) \
            if k_eq_v else kv_heads
    shapes = {(int(v.get("head_dim", d.get("head_dim"))), int(v.get("num_key_value_heads", kv_heads)))
              for i, v in per_layer.items() if types[int(i)] == "full_attention"}
    if len(shapes) != 1 or any(types[int(i)] != "full_attention" and v for i, v in per_layer.items()):
        raise UnsupportedModelError(f"Gemma 4 per_layer_config {per_layer}: only the full-attention layers may "
                                    "differ, all alike")
    return shapes.pop()


def full_attention_config(cfg: Any) -> Any:
    """`cfg` (a Gemma 4 `ModelConfig`) as its full-attention layers attend: their head width, KV heads and
    rotary embedding (unturned pairs as frequencies divided by infinity)."""
    g = cfg.gemma4
    return dataclasses.replace(cfg, head_dim=g.head_dim, num_kv_heads=g.num_kv_heads, rope_theta=g.rope_theta,
                               rope_local_theta=None, gemma4=dataclasses.replace(g, full_layers=True),
                               rope_scaling=RopeScaling.proportional(g.rope_pairs, g.head_dim // 2, g.rope_factor))


def check_gemma4(cfg: Any) -> None:
    """Refuse, naming the numbers, a Gemma 4 whose full-attention layers' keys do not fill the windowed layers' page
    rows a whole number of times, or whose query heads do not split evenly over the KV heads so written."""
    g = cfg.gemma4
    if g.full_layers:
        return
    if cfg.sliding_window is None:
        raise UnsupportedModelError("Gemma 4 needs its sliding_window")
    windowed, full = cfg.num_kv_heads * cfg.head_dim, g.num_kv_heads * g.head_dim
    row = max(windowed, full)
    for heads, dim in ((cfg.num_kv_heads, cfg.head_dim), (g.num_kv_heads, g.head_dim)):
        if row % dim or (row // dim) % heads or cfg.num_heads % (row // dim):
            raise UnsupportedModelError(
                f"Gemma 4's page rows ({row} wide: windowed layers' keys {cfg.num_kv_heads} x {cfg.head_dim}, "
                f"full-attention layers' {g.num_kv_heads} x {g.head_dim}) must hold each kind's keys a whole number "
                f"of times, as heads its {cfg.num_heads} query heads divide by")
    if g.shared_layers and cfg.kv_cache_scales:
        raise UnsupportedModelError("Gemma 4 with layers that share keys takes no float8 KV scales (a kv_cache_scheme, "
                                    "--calculate-kv-scales): they read pages written at another layer's scale")
    first = cfg.num_layers - g.shared_layers
    if g.shared_layers and (first <= 0 or set(cfg.layer_types[:first]) != set(cfg.layer_types)):
        raise UnsupportedModelError(f"Gemma 4's {g.shared_layers} layers sharing keys need an earlier layer of each "
                                    f"kind among the first {first}")


def gemma4_hf(cfg: Any) -> dict[str, Any]:
    """The HF `config.json` dict of a Gemma 4 text model (`config_hf`)."""
    g = cfg.gemma4
    full = {"rope_type": "proportional", "partial_rotary_factor": 2 * g.rope_pairs / g.head_dim,
            "rope_theta": g.rope_theta, **({"factor": g.rope_factor} if g.rope_factor != 1.0 else {})}
    moe = dict(enable_moe_block=bool(cfg.num_experts), **(dict(
        num_experts=cfg.num_experts, top_k_experts=cfg.num_experts_per_tok,
        moe_intermediate_size=cfg.moe_intermediate_size) if cfg.num_experts else {}))
    return dict(
        architectures=["Gemma4ForCausalLM"], model_type="gemma4_text", vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        global_head_dim=g.head_dim, attention_k_eq_v=g.k_eq_v,
        num_global_key_value_heads=g.num_kv_heads if g.k_eq_v else None,
        rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings, hidden_activation=cfg.hidden_act,
        sliding_window=cfg.sliding_window, layer_types=list(cfg.layer_types),
        final_logit_softcapping=cfg.final_logit_softcap, attention_bias=False,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_local_theta},
                         "full_attention": full},
        hidden_size_per_layer_input=g.ple_width, vocab_size_per_layer_input=g.ple_vocab,
        num_kv_shared_layers=g.shared_layers, use_double_wide_mlp=g.double_wide, torch_dtype="float32",
        use_bidirectional_attention="vision" if g.images_both_ways else None, **moe)
