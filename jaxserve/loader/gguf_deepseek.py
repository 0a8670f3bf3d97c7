"""DeepSeek-V2 / -V3 in llama.cpp's GGUF form (architecture "deepseek2"): the HF config its converter read, and
its latent attention's tensors under HF names.

llama.cpp writes one architecture for both: the routing's gating function tells them apart (1 softmax: V2's,
2 sigmoid: V3's, Kimi K2's, Moonlight's; absent in older V2 files: softmax). Its files keep the rotary pairs
interleaved as DeepSeek's checkpoints do (no row permutation), the queries' and keys' dims under
`attention.key_length_mla` / `value_length_mla` (`key_length` / `value_length` are the latent's page entry), the
YaRN mscale as `rope.scaling.yarn_log_multiplier` (0.1 x mscale_all_dim), and `kv_b_proj` split per head into
`attn_k_b` ([H, R, Dn], transposed) and `attn_v_b` ([H, Dv, R]); older files hold `attn_kv_b` whole and give the
head dims as `key_length` / `value_length`. GLM-5 ("glm-dsa") adds DeepSeek Sparse Attention's indexer
(`attention.indexer.*` keys, `indexer.*` tensors) to the same form.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from jaxserve.errors import UnsupportedModelError

_SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID (1: softmax)

MLA_NAMES = {
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    "indexer.attn_q_b.weight": "self_attn.indexer.wq_b.weight",
    "indexer.attn_k.weight": "self_attn.indexer.wk.weight",
    "indexer.k_norm.weight": "self_attn.indexer.k_norm.weight",
    "indexer.k_norm.bias": "self_attn.indexer.k_norm.bias",
    "indexer.proj.weight": "self_attn.indexer.weights_proj.weight",
}


def deepseek2_hf(meta: dict[str, Any], get: Callable[..., Any], d: dict[str, Any], experts: int,
                 arch: str = "deepseek2") -> dict[str, Any]:
    """The HF config of a "deepseek2" (or "glm-dsa") file: `d` (the common fields `config_from_gguf` read) with the
    latent attention's, the experts' and the YaRN scale's (and the indexer's); `get(key, default=None)`: the file's
    `{arch}.{key}`, a missing one refused by name."""
    rope = int(get("rope.dimension_count"))
    rank = int(get("attention.kv_lora_rank"))
    if meta.get(f"{arch}.attention.key_length_mla") is not None:
        qk, v = int(get("attention.key_length_mla")), int(get("attention.value_length_mla"))
    else:  # (an older file: the heads' own dims)
        qk, v = int(get("attention.key_length")), int(get("attention.value_length"))
    sigmoid = int(meta.get(f"{arch}.expert_gating_func") or 1) == _SIGMOID
    groups, used = int(meta.get(f"{arch}.expert_group_count") or 1), int(meta.get(f"{arch}.expert_group_used_count") or 1)
    out = {k: val for k, val in d.items() if k not in ("head_dim", "partial_rotary_factor", "num_local_experts",
                                                        "num_experts")}
    out.update(
        architectures=["GlmMoeDsaForCausalLM" if arch == "glm-dsa" else
                       "DeepseekV3ForCausalLM" if sigmoid else "DeepseekV2ForCausalLM"],
        num_key_value_heads=d["num_attention_heads"], kv_lora_rank=rank,
        q_lora_rank=int(meta.get(f"{arch}.attention.q_lora_rank") or 0) or None,
        qk_nope_head_dim=qk - rope, qk_rope_head_dim=rope, v_head_dim=v, n_routed_experts=experts,
        n_shared_experts=int(meta.get(f"{arch}.expert_shared_count") or 0),
        first_k_dense_replace=int(meta.get(f"{arch}.leading_dense_block_count") or 0),
        routed_scaling_factor=float(meta.get(f"{arch}.expert_weights_scale") or 1.0),
        norm_topk_prob=bool(meta.get(f"{arch}.expert_weights_norm", False)), n_group=groups, topk_group=used)
    if arch == "glm-dsa":
        out.update(index_n_heads=int(get("attention.indexer.head_count")),
                   index_head_dim=int(get("attention.indexer.key_length")), index_topk=int(get("attention.indexer.top_k")))
    if not sigmoid:
        out["topk_method"] = "group_limited_greedy" if used < groups else "greedy"
        if out["norm_topk_prob"]:
            raise UnsupportedModelError("a deepseek2 GGUF with softmax routing and expert_weights_norm is not "
                                        "supported (DeepSeek-V2 does not renormalize)")
    log_mul = meta.get(f"{arch}.rope.scaling.yarn_log_multiplier")
    if "rope_scaling" in out and log_mul:  # YaRN's mscale (llama.cpp takes mscale as mscale_all_dim)
        out["rope_scaling"] = {**out["rope_scaling"], "mscale": float(log_mul) / 0.1,
                               "mscale_all_dim": float(log_mul) / 0.1}
    for key, hf in (("rope.scaling.yarn_beta_fast", "beta_fast"), ("rope.scaling.yarn_beta_slow", "beta_slow")):
        if "rope_scaling" in out and meta.get(f"{arch}.{key}") is not None:
            out["rope_scaling"][hf] = float(meta[f"{arch}.{key}"])
    return out


def mla_tensors(prefix: str, rest: str, arr: np.ndarray) -> Iterator[tuple[str, np.ndarray]] | None:
    """A block's latent attention tensor (`rest`, after `blk.N.`) under its HF name (`prefix`: `model.layers.N.`);
    the split `attn_k_b` / `attn_v_b` as the two parts of `kv_b_proj` the key map reads; None for other tensors."""
    if rest == "attn_k_b.weight":  # [H, R, Dn] -> [H * Dn, R]
        return iter([(prefix + "self_attn.kv_b_proj.k.weight", arr.transpose(0, 2, 1).reshape(-1, arr.shape[1]))])
    if rest == "attn_v_b.weight":  # [H, Dv, R] -> [H * Dv, R]
        return iter([(prefix + "self_attn.kv_b_proj.v.weight", arr.reshape(-1, arr.shape[2]))])
    if rest in MLA_NAMES:
        return iter([(prefix + MLA_NAMES[rest], arr)])
    return None
