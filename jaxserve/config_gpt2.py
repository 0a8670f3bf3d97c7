"""GPT-2 (`GPT2LMHeadModel`: GPT-2 124M to 1.5B, DistilGPT2, and the many models of its architecture) and GPTBigCode
(`GPTBigCodeForCausalLM`: StarCoder, StarCoderBase, SantaCoder, WizardCoder, SQLCoder): learned absolute positions
(`Params.pos_embed`) in place of rotary embeddings, LayerNorms with biases, every projection biased, an ungated
tanh-GELU MLP, the head tied to the embeddings; GPTBigCode's attention multi-query (one KV head) where `multi_query`
says. GPT-J (`GPTJForCausalLM`) under the same keys: rotary embeddings over `rotary_dim`, attention unbiased, the
head untied. And GPT-NeoX's (`neox_config`), Falcon's, MPT's and BLOOM's (`falcon_config`...), with the ALiBi
slopes of BLOOM and Falcon-RW (`alibi_slopes`) and MPT (`mpt_alibi_slopes`). Their configs' own keys (`n_embd`,
`n_layer`, ...) are read as the fields every family has; their checkpoints' names and layouts are read and written by
`loader.gpt2_keys`."""

from __future__ import annotations

import math
from typing import Any

from jaxserve.errors import UnsupportedModelError

ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "gpt_bigcode": "GPTBigCodeForCausalLM", "gptj": "GPTJForCausalLM"}
NAMES = {"gpt2": "GPT-2", "gpt_bigcode": "GPTBigCode", "gptj": "GPT-J"}
# Their activations, as the ungated MLP takes them (`gelu_new` is the tanh GELU)
_ACTS = {"gelu_new": "gelu_pytorch_tanh", "gelu_pytorch_tanh": "gelu_pytorch_tanh", "gelu_fast": "gelu_pytorch_tanh",
         "relu2": "relu2"}


def gpt2_config(d: dict[str, Any]) -> dict[str, Any]:
    """A GPT-2, GPTBigCode or GPT-J config as the keys every family reads (any other config as it is); what it cannot
    serve refused by name."""
    archs = d.get("architectures") or []
    family = next((f for f, a in ARCHITECTURES.items() if d.get("model_type") == f or a in archs), None)
    if family is None:
        return d
    name = NAMES[family]
    for key, bad in (("scale_attn_by_inverse_layer_idx", True), ("add_cross_attention", True),
                     ("scale_attn_weights", False)):
        if d.get(key, not bad) == bad:
            raise UnsupportedModelError(f"{name} with {key} {bad} is not supported")
    act = d.get("activation_function", "gelu_new" if family == "gpt2" else "gelu_pytorch_tanh")
    if act not in _ACTS:
        raise UnsupportedModelError(f"{name} with activation_function {act!r} is not supported ({', '.join(_ACTS)})")

    def get(key: str, ours: str, default: Any) -> Any:  # (GPT-2's key, or the common one a GGUF file's config has)
        return d.get(key, d.get(ours, default))

    E, heads = get("n_embd", "hidden_size", 768), get("n_head", "num_attention_heads", 12)
    multi_query = family == "gpt_bigcode" and d.get("multi_query", d.get("num_key_value_heads", 1) == 1)
    gptj = {"attention_bias": False, "tie_word_embeddings": d.get("tie_word_embeddings", False),
            "partial_rotary_factor": d.get("rotary_dim", 64) * heads / E} if family == "gptj" else {}
    return gptj | {**d, "architectures": [ARCHITECTURES[family]], "model_type": family, "hidden_size": E,
            "num_attention_heads": heads, "num_key_value_heads": 1 if multi_query else heads, "head_dim": None,
            "num_hidden_layers": get("n_layer", "num_hidden_layers", 12),
            "intermediate_size": get("n_inner", "intermediate_size", None) or 4 * E,
            "max_position_embeddings": get("n_positions", "max_position_embeddings", 1024),
            "layer_norm_eps": d.get("layer_norm_epsilon", 1e-5), "hidden_act": _ACTS[act],
            "tie_word_embeddings": d.get("tie_word_embeddings", True), "attention_bias": True, "mlp_bias": True} | gptj


def gpt2_hf(cfg: Any) -> dict[str, Any]:
    """`cfg` as its GPT-2, GPTBigCode or GPT-J config.json (the inverse of `gpt2_config`)."""
    act = {"gelu_pytorch_tanh": "gelu_new"}.get(cfg.hidden_act, cfg.hidden_act) if cfg.family != "gpt_bigcode" \
        else cfg.hidden_act
    return {"architectures": [ARCHITECTURES[cfg.family]], "model_type": cfg.family, "vocab_size": cfg.vocab_size,
            "n_embd": cfg.hidden_size, "n_layer": cfg.num_layers, "n_head": cfg.num_heads,
            "n_inner": cfg.intermediate_size, "n_positions": cfg.max_position_embeddings,
            "layer_norm_epsilon": cfg.rms_norm_eps, "activation_function": act,
            "tie_word_embeddings": cfg.tie_word_embeddings, "torch_dtype": "float32",
            **({"multi_query": cfg.num_kv_heads == 1} if cfg.family == "gpt_bigcode" else {}),
            **({"rotary_dim": cfg.rotary_dims} if cfg.family == "gptj" else {})}


def neox_config(d: dict[str, Any]) -> dict[str, Any]:
    """A GPT-NeoX config (`GPTNeoXForCausalLM`: Pythia, GPT-NeoX-20B, Dolly v2, RedPajama-INCITE) as the keys every
    family reads: attention and the MLP side by side, each on its own LayerNorm with a bias, a quarter of each head
    rotated (`rotary_pct`), the exact GELU; or, with `use_parallel_residual` false, the MLP after attention."""
    if d.get("model_type") != "gpt_neox" and "GPTNeoXForCausalLM" not in (d.get("architectures") or []):
        return d
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    act = d.get("hidden_act", "gelu")
    partial = rope.get("partial_rotary_factor") or d.get("rotary_pct") or d.get("partial_rotary_factor", 0.25)
    theta = rope.get("rope_theta") or d.get("rotary_emb_base") or d.get("rope_theta", 10000.0)
    return {**d, "architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox",
            "num_key_value_heads": d["num_attention_heads"], "attention_bias": d.get("attention_bias", True),
            "mlp_bias": True, "layer_norm_eps": d.get("layer_norm_eps", 1e-5), "hidden_act": _ACTS.get(act, act),
            "tie_word_embeddings": d.get("tie_word_embeddings", False), "partial_rotary_factor": partial,
            "rope_theta": theta, "parallel_norms": 2}


def neox_hf(cfg: Any) -> dict[str, Any]:
    """GPT-NeoX's own keys of `cfg` (beside those every family writes)."""
    return {"layer_norm_eps": cfg.rms_norm_eps, "use_parallel_residual": cfg.parallel_block,
            "attention_bias": cfg.attention_bias,
            "rotary_pct": cfg.rotary_dims / cfg.head_dim, "rotary_emb_base": cfg.rope_theta}


_FALCON = ("falcon", "RefinedWeb", "RefinedWebModel")  # (its model types: the last two the first checkpoints')


def falcon_config(d: dict[str, Any]) -> dict[str, Any]:
    """A Falcon config (`FalconForCausalLM`: Falcon 7B, 40B, 180B, Falcon2-11B) as the keys every family reads:
    LayerNorms with biases, an ungated MLP (`ffn_hidden_size` wide, `activation`), projections biased where `bias`
    says; attention and the MLP side by side (`parallel_attn`) on one norm, or each on its own (the new architecture's
    `ln_attn`, `ln_mlp` unless `num_ln_in_parallel_attn` is 1), or one after the other; one KV head (`multi_query`),
    one a head, or `num_kv_heads` (the new architecture's). Its first checkpoints' names (`RWForCausalLM`) too."""
    archs = d.get("architectures") or []
    if d.get("model_type") not in _FALCON and not {"FalconForCausalLM", "RWForCausalLM"} & set(archs):
        return d
    new, parallel = bool(d.get("new_decoder_architecture")), bool(d.get("parallel_attn", True))
    if new and not parallel:
        raise UnsupportedModelError("Falcon with new_decoder_architecture and parallel_attn false is not supported "
                                    "(the new architecture's blocks are parallel)")
    heads, hidden = d.get("num_attention_heads") or d["n_head"], d.get("hidden_size") or d["n_embed"]
    kv = d.get("num_kv_heads") or d.get("n_head_kv") or heads
    if not new and not d.get("multi_query", True) and kv != heads:
        raise UnsupportedModelError(f"Falcon without new_decoder_architecture or multi_query has a KV head per query "
                                    f"head; num_kv_heads {kv} of {heads} heads is not supported")
    act = d.get("activation", "gelu")
    return {**d, "architectures": ["FalconForCausalLM"], "model_type": "falcon", "hidden_size": hidden,
            "num_attention_heads": heads, "num_hidden_layers": d.get("num_hidden_layers") or d["n_layer"],
            "num_key_value_heads": kv if new or not d.get("multi_query", True) else 1, "head_dim": None,
            "intermediate_size": d.get("ffn_hidden_size") or 4 * hidden, "hidden_act": _ACTS.get(act, act),
            "max_position_embeddings": d.get("max_position_embeddings", 2048),
            "layer_norm_eps": d.get("layer_norm_epsilon", 1e-5), "attention_bias": bool(d.get("bias")),
            "mlp_bias": bool(d.get("bias")), "tie_word_embeddings": d.get("tie_word_embeddings", True),
            "use_parallel_residual": new or parallel,
            "parallel_norms": (d.get("num_ln_in_parallel_attn") or 2) if new else 1,
            # (Falcon adds its bias before scaling the scores: the slopes scaled too)
            "alibi_slopes": alibi_slopes(heads, (hidden // heads) ** -0.5) if d.get("alibi") else None}


def mpt_config(d: dict[str, Any]) -> dict[str, Any]:
    """An MPT config (`MptForCausalLM`: MPT-7B, MPT-30B and their chat and instruct models) as the keys every family
    reads, as transformers runs it: LayerNorms with weights only, no biases, an ungated exact-GELU MLP 4x wide, q, k
    and v in one `Wqkv` one after another (clamped where `clip_qkv` says), ALiBi at `alibi_bias_max` 8 (MPT's slopes),
    the head tied. What transformers does not run is refused by name."""
    if d.get("model_type") != "mpt" and "MptForCausalLM" not in (d.get("architectures") or []):
        return d
    attn = d.get("attn_config") or {}
    for key, want in (("alibi", True), ("qk_ln", False), ("prefix_lm", False), ("attn_uses_sequence_id", False),
                      ("softmax_scale", None), ("alibi_bias_max", 8)):
        if attn.get(key, want) != want:
            raise UnsupportedModelError(f"MPT with attn_config {key} {attn[key]!r} is not supported")
    for key, want in (("no_bias", True), ("expansion_ratio", 4)):
        if d.get(key, want) != want:
            raise UnsupportedModelError(f"MPT with {key} {d[key]!r} is not supported")
    hidden, heads = d.get("d_model", d.get("hidden_size", 2048)), d.get("n_heads", d.get("num_attention_heads", 16))
    return {**d, "architectures": ["MptForCausalLM"], "model_type": "mpt", "hidden_size": hidden,
            "num_attention_heads": heads, "num_key_value_heads": heads, "head_dim": None,
            "num_hidden_layers": d.get("n_layers", d.get("num_hidden_layers", 24)), "intermediate_size": 4 * hidden,
            "hidden_act": "gelu", "max_position_embeddings": d.get("max_seq_len", 2048),
            "rms_norm_eps": d.get("layer_norm_epsilon", 1e-5), "attention_bias": False, "mlp_bias": False,
            "tie_word_embeddings": True, "clip_qkv": attn.get("clip_qkv"), "alibi_slopes": mpt_alibi_slopes(heads)}


def bloom_config(d: dict[str, Any]) -> dict[str, Any]:
    """A BLOOM config (`BloomForCausalLM`: BLOOM 560M to 176B, BLOOMZ) as the keys every family reads: a LayerNorm of
    the embeddings, then sequential blocks of LayerNorms with biases, q, k and v per head in `query_key_value` (as
    GPT-NeoX's), biased projections, an ungated tanh-GELU MLP 4x wide, ALiBi (BLOOM's slopes), the head tied."""
    if d.get("model_type") != "bloom" and "BloomForCausalLM" not in (d.get("architectures") or []):
        return d
    if d.get("apply_residual_connection_post_layernorm"):
        raise UnsupportedModelError("BLOOM with apply_residual_connection_post_layernorm is not supported")
    hidden = d.get("hidden_size") or d.get("n_embed", 64)
    heads = d.get("num_attention_heads") or d.get("n_head", 8)
    return {**d, "architectures": ["BloomForCausalLM"], "model_type": "bloom", "hidden_size": hidden,
            "num_attention_heads": heads, "num_key_value_heads": heads, "head_dim": None,
            "num_hidden_layers": d.get("num_hidden_layers") or d.get("n_layer", 2), "intermediate_size": 4 * hidden,
            "hidden_act": "gelu_pytorch_tanh", "max_position_embeddings": d.get("seq_length", 2048),
            "layer_norm_eps": d.get("layer_norm_epsilon", 1e-5), "attention_bias": True, "mlp_bias": True,
            "tie_word_embeddings": d.get("tie_word_embeddings", True), "alibi_slopes": alibi_slopes(heads)}


def bloom_own_hf(cfg: Any) -> dict[str, Any]:
    """`cfg` as its BLOOM config.json's own keys (the inverse of `bloom_config`)."""
    return {"n_embed": cfg.hidden_size, "n_head": cfg.num_heads, "n_layer": cfg.num_layers,
            "layer_norm_epsilon": cfg.rms_norm_eps, "seq_length": cfg.max_position_embeddings}


def mpt_own_hf(cfg: Any) -> dict[str, Any]:
    """`cfg` as its MPT config.json's own keys (the inverse of `mpt_config`)."""
    return {"d_model": cfg.hidden_size, "n_heads": cfg.num_heads, "n_layers": cfg.num_layers, "expansion_ratio": 4,
            "max_seq_len": cfg.max_position_embeddings, "layer_norm_epsilon": cfg.rms_norm_eps, "no_bias": True,
            "attn_config": {"alibi": True, "alibi_bias_max": 8, "clip_qkv": cfg.clip_qkv}}


def mpt_alibi_slopes(num_heads: int, bias_max: int = 8) -> tuple[float, ...]:
    """MPT's ALiBi slopes: 2^(-bias_max i/n) for i = 1..n, n the heads rounded up to a power of two; with fewer heads
    than n, the odd steps first, then the even ones, as many as there are heads."""
    n = 2 ** math.ceil(math.log2(num_heads))
    slopes = [2 ** (-bias_max * i / n) for i in range(1, n + 1)]
    return tuple(slopes if n == num_heads else (slopes[1::2] + slopes[::2])[:num_heads])


def alibi_slopes(num_heads: int, scale: float = 1.0) -> tuple[float, ...]:
    """BLOOM's ALiBi slopes (Falcon-RW's too), times `scale`: 2^(-8i/n) for i = 1..n, n the largest power of two
    not above the heads, then for the heads past n the next power of two's odd steps, 2^(-4i/n) for i = 1, 3, 5..."""
    n = 2 ** math.floor(math.log2(num_heads))
    steps = [8 * i / n for i in range(1, n + 1)] + [4 * i / n for i in range(1, 2 * (num_heads - n), 2)]
    return tuple(scale * 2 ** -e for e in steps)


def falcon_own_hf(cfg: Any) -> dict[str, Any]:
    """`cfg` as its Falcon config.json's own keys (the inverse of `falcon_config`): the new architecture where its
    KV heads or two norms need it."""
    new = cfg.parallel_norms == 2 or cfg.num_kv_heads not in (1, cfg.num_heads)
    return {"num_kv_heads": cfg.num_kv_heads, "new_decoder_architecture": new, "multi_query": cfg.num_kv_heads == 1,
            "parallel_attn": cfg.parallel_block, "num_ln_in_parallel_attn": cfg.parallel_norms if new else None,
            "bias": cfg.attention_bias, "ffn_hidden_size": cfg.intermediate_size, "activation": cfg.hidden_act,
            "layer_norm_epsilon": cfg.rms_norm_eps, "alibi": cfg.alibi_slopes is not None}
