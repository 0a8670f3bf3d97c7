"""DeepSeek-V2 and -V3's multi-head latent attention (MLA) and experts: their ModelConfig fields from an HF config,
and back (`ModelConfig.from_hf`, `config_hf.config_to_hf`).

An MLA layer projects each token to one latent of `kv_lora_rank` dims (normed) plus one rotary key of
`qk_rope_head_dim` dims shared by every head; the pages hold just those (`ModelConfig.kv_cache_dims`). In the
config, `head_dim` is a query's (and an expanded key's) dims, `qk_nope_head_dim + qk_rope_head_dim`, the last
`rotary_dim` of them turned by position; `v_head_dim` is a value's.
"""

from __future__ import annotations

import math
from typing import Any

from jaxserve.config_fields import leading_dense_layers, moe_fields
from jaxserve.errors import UnsupportedModelError

DSA_FAMILIES: tuple[str, ...] = ("deepseek_v32", "glm_moe_dsa")
"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): an indexer picks the `index_topk` keys each token's MLA attends
(`models.sparse_mla`); its one key per token rides in the token's page entry after the latent and rotary key."""
MLA_FAMILIES: tuple[str, ...] = ("deepseek_v2", "deepseek_v3", "mistral4", "glm4_moe_lite", *DSA_FAMILIES)  # (Mistral
# 4: Mistral Small 4's language model, DeepSeek-V3's attention with Llama 4's query scaling, softmax-routed experts in
# groups; GLM-4.7-Flash: DeepSeek-V3's attention and experts, its dense layers named by `mlp_layer_types`)
LATENT_NORM_EPS = 1e-6  # the queries' bottleneck's and the latent's norms (transformers': fixed, whatever rms_norm_eps)


def mla_fields(family: str, d: dict[str, Any]) -> dict[str, Any]:
    """The MLA fields of a DeepSeek-V2 / -V3 HF config (`head_dim` and `rotary_dim` included), refusing the options
    jaxserve does not implement by name."""
    if d.get("attention_bias"):
        raise UnsupportedModelError(f"{family} with attention_bias is not supported")
    if family != "deepseek_v2" and d.get("rope_interleave", True) is False:
        raise UnsupportedModelError(f"{family} with rope_interleave false is not supported (its released "
                                    "checkpoints interleave the rotary pairs)")
    nope, rope, rank = int(d["qk_nope_head_dim"]), int(d["qk_rope_head_dim"]), int(d["kv_lora_rank"])
    if min(nope, rope, rank, int(d["v_head_dim"])) <= 0:
        raise UnsupportedModelError(f"{family} needs positive qk_nope_head_dim ({nope}), qk_rope_head_dim ({rope}), "
                                    f"kv_lora_rank ({rank}) and v_head_dim ({d['v_head_dim']})")
    fields = dict(kv_lora_rank=rank, q_lora_rank=int(d.get("q_lora_rank") or 0), v_head_dim=int(d["v_head_dim"]),
                  head_dim=nope + rope, rotary_dim=rope)
    return fields | (_dsa_fields(family, d) if family in DSA_FAMILIES else {})


def _dsa_fields(family: str, d: dict[str, Any]) -> dict[str, Any]:
    """The indexer's fields of a DeepSeek-V3.2 / GLM-5 config; GLM's layers that reuse the last full layer's choice
    (`indexer_types` "shared", as transformers derives them: GLM-5.2's IndexShare) as `index_shared_layers`."""
    L = int(d["num_hidden_layers"])
    types = d.get("indexer_types")
    if types is None and d.get("index_topk_pattern"):
        types = [{"F": "full", "S": "shared"}.get(c, c) for c in d["index_topk_pattern"]]
    elif types is None:
        freq, offset = max(int(d.get("index_topk_freq", 1)), 1), int(d.get("index_skip_topk_offset", 2))
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(L)]
    if len(types) != L or not set(types) <= {"full", "shared"} or types[0] != "full" or (
            family != "glm_moe_dsa" and "shared" in types):
        raise UnsupportedModelError(f"{family}'s indexer_types {types} must give 'full' (the layer's indexer chooses "
                                    "its keys) or, in glm_moe_dsa, 'shared' (the last full layer's choice) for each "
                                    f"of its {L} layers, the first 'full'")
    if not d.get("q_lora_rank"):
        raise UnsupportedModelError(f"{family} needs q_lora_rank: its indexer reads the queries' bottleneck")
    fields = dict(index_heads=int(d.get("index_n_heads", 64 if family == "deepseek_v32" else 32)),
                  index_head_dim=int(d.get("index_head_dim", 128)), index_topk=int(d.get("index_topk", 2048)))
    shared = tuple(i for i, t in enumerate(types) if t == "shared")
    if min(fields.values()) <= 0 or fields["index_head_dim"] < int(d["qk_rope_head_dim"]):
        raise UnsupportedModelError(f"{family} needs positive index_n_heads, index_head_dim and index_topk, and "
                                    f"index_head_dim at least qk_rope_head_dim: {fields}")
    return dict(fields, index_shared_layers=shared)


def check_mla(cfg: Any) -> None:
    """Refuses MLA settings no model could run, by name."""
    if cfg.kv_lora_rank < 0 or cfg.q_lora_rank < 0 or (cfg.kv_lora_rank == 0) != (cfg.v_head_dim == 0):
        raise UnsupportedModelError(f"an MLA model needs kv_lora_rank ({cfg.kv_lora_rank}) and v_head_dim "
                                    f"({cfg.v_head_dim}) both positive; any other model, both 0")
    if not cfg.kv_lora_rank:
        if cfg.index_topk or cfg.index_shared_layers:
            raise UnsupportedModelError("an indexer (index_topk) picks keys for an MLA model's attention only")
        return
    shared = cfg.index_shared_layers
    if shared and (cfg.family != "glm_moe_dsa" or list(shared) != sorted(set(shared)) or shared[0] < 1
                   or shared[-1] >= cfg.num_layers):
        raise UnsupportedModelError(f"index_shared_layers {shared} (layers reusing the last full layer's choice of "
                                    f"keys) must be ascending layers 1 to {cfg.num_layers - 1} of a glm_moe_dsa model")
    index = (cfg.index_heads, cfg.index_head_dim, cfg.index_topk)
    if (cfg.family in DSA_FAMILIES) != (min(index) > 0) or min(index) < 0 or (
            cfg.index_topk and (cfg.index_head_dim < cfg.rotary_dims or not cfg.q_lora_rank)):
        raise UnsupportedModelError(f"an indexer's heads, dims and top-k {index} must all be positive in "
                                    f"{DSA_FAMILIES} (dims at least the rotary {cfg.rotary_dims}, with a query "
                                    "bottleneck) and 0 elsewhere")
    if (cfg.family not in MLA_FAMILIES or not cfg.rotary_dim or cfg.rotary_dims >= cfg.head_dim
            or cfg.attention_bias or cfg.qk_norm or cfg.sliding_window):
        raise UnsupportedModelError(f"MLA (kv_lora_rank {cfg.kv_lora_rank}) needs {MLA_FAMILIES}, rotary dims "
                                    f"({cfg.rotary_dim}) short of head_dim ({cfg.head_dim}), and no attention bias, "
                                    "q/k norms or window")


def mla_moe_fields(family: str, d: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek's experts: V3's as GLM-4.5's (sigmoid scores, a bias for choosing, groups by their two best); V2's
    softmax scores, the k best ("greedy") or the best of the `topk_group` groups with the highest single score
    ("group_limited_greedy"), never renormalized (as transformers' DeepSeek-V2 does). Both: shared experts, dense
    first layers, weights times `routed_scaling_factor`."""
    fields: dict[str, Any] = dict(
        moe_fields(family, d),
        shared_expert_intermediate_size=int(d.get("n_shared_experts") or 0) * d["moe_intermediate_size"],
        first_dense_layers=leading_dense_layers(d, family, 1 if family == "glm4_moe_lite" else 0),
        routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)))
    if family == "mistral4":  # softmax scores, chosen in the groups with the best two-score sums, renormalized
        return dict(fields, expert_groups=int(d.get("n_group") or 1), expert_topk_groups=int(d.get("topk_group") or 1),
                    norm_topk_prob=bool(d.get("norm_topk_prob", True)))
    if family != "deepseek_v2":
        return dict(fields, router_scoring="sigmoid", router_bias=True, expert_groups=int(d.get("n_group") or 1),
                    expert_topk_groups=int(d.get("topk_group") or 1), norm_topk_prob=bool(d.get("norm_topk_prob", True)))
    method = d.get("topk_method", "greedy")
    if method not in ("greedy", "group_limited_greedy"):
        raise UnsupportedModelError(f"deepseek_v2 topk_method {method!r} is not supported (greedy, "
                                    "group_limited_greedy)")
    grouped = method == "group_limited_greedy"
    return dict(fields, norm_topk_prob=False, expert_groups=int(d.get("n_group") or 1) if grouped else 1,
                expert_topk_groups=int(d.get("topk_group") or 1) if grouped else 1)


def mla_hf(cfg: Any) -> dict[str, Any]:
    """An MLA model's HF config keys (the inverse of `mla_fields` and `mla_moe_fields`)."""
    d: dict[str, Any] = dict(
        num_key_value_heads=cfg.num_heads,  # (transformers expands the latent to every head)
        kv_lora_rank=cfg.kv_lora_rank, q_lora_rank=cfg.q_lora_rank or None, v_head_dim=cfg.v_head_dim,
        qk_nope_head_dim=cfg.head_dim - cfg.rotary_dims, qk_rope_head_dim=cfg.rotary_dims, head_dim=cfg.rotary_dims,
        attention_bias=False, n_routed_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
        moe_intermediate_size=cfg.moe_intermediate_size, first_k_dense_replace=cfg.first_dense_layers,
        routed_scaling_factor=cfg.routed_scaling_factor, n_group=cfg.expert_groups, topk_group=cfg.expert_topk_groups,
        norm_topk_prob=cfg.norm_topk_prob)
    shared, rest = divmod(cfg.shared_expert_intermediate_size, cfg.moe_intermediate_size or 1)
    if rest:
        raise UnsupportedModelError(f"a shared expert {cfg.shared_expert_intermediate_size} wide is no whole number "
                                    f"of {cfg.moe_intermediate_size}-wide experts (the config counts them)")
    d["n_shared_experts"] = shared
    if cfg.family == "deepseek_v2":
        d["topk_method"] = "group_limited_greedy" if cfg.expert_groups > 1 else "greedy"
    elif cfg.family == "deepseek_v3":
        d.update(rope_interleave=True, num_nextn_predict_layers=0)
    elif cfg.family == "mistral4":
        d.update(rope_interleave=True)
    elif cfg.family == "glm4_moe_lite":
        d.update(rope_interleave=True, mlp_layer_types=["dense"] * cfg.first_dense_layers
                 + ["sparse"] * (cfg.num_layers - cfg.first_dense_layers))
        del d["first_k_dense_replace"]
    else:
        d.update(index_n_heads=cfg.index_heads, index_head_dim=cfg.index_head_dim, index_topk=cfg.index_topk)
        if cfg.family == "glm_moe_dsa":
            d["indexer_types"] = ["shared" if i in cfg.index_shared_layers else "full" for i in range(cfg.num_layers)]
    return d


def mla_softmax_scale(head_dim: int, rope_scaling: Any) -> float:
    """The attention scale of an MLA model: a query's dims to the -1/2, times YaRN's mscale(factor,
    mscale_all_dim) squared when the rotary embedding is scaled (as DeepSeek's configs ask)."""
    scale = head_dim ** -0.5
    rs = rope_scaling
    if rs.rope_type != "default" and rs.mscale_all_dim and rs.factor > 1:
        mscale = 0.1 * rs.mscale_all_dim * math.log(rs.factor) + 1.0
        scale *= mscale * mscale
    return scale
