"""DeepSeek's multi-head latent attention tensors (`config_mla`) in the key map: their targets, the split of
`kv_b_proj` into the keys' and the values' up-projections, and the way back for `jaxserve convert`.

DeepSeek interleaves each rotary pair (dims 2i and 2i + 1 turn together, as the complex form of DeepSeek-V2
writes it and `rope_interleave` of V3 says); the rotary rows of the query projection and of the rotary key are
read into the half-split order the model turns (the scores are unchanged), and written back interleaved.
DeepSeek-V3.2's indexer turns its first `qk_rope_head_dim` dims half-split, GLM-5's interleaved (read as V3.2's:
its query rows, key rows and the key's LayerNorm alike).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from jaxserve.config import ModelConfig

KV_B_RE = re.compile(r"^(model\.layers\.\d+\.self_attn\.kv_b_proj)\.weight$")
_KV_B_PARTS = ("self_attn.kv_b_proj.k.weight", "self_attn.kv_b_proj.v.weight")
MLA_FIELDS = ("wq", "wo", "wq_a", "q_a_norm", "wkv_a", "kv_a_norm", "w_uk", "w_uv", "idx_wq", "idx_wk", "idx_k_norm",
              "idx_k_norm_b", "idx_w")

Spec = tuple[str, Callable[[np.ndarray], np.ndarray], tuple[int, ...]]


def _rotary_order(width: int, rotary: int) -> np.ndarray:
    """Within `width` rows whose last `rotary` are interleaved pairs: those in half-split order, the rest kept."""
    first = width - rotary
    return np.concatenate([np.arange(first), first + np.arange(0, rotary, 2), first + np.arange(1, rotary, 2)])


def q_rows(w: np.ndarray, cfg: ModelConfig, back: bool = False) -> np.ndarray:
    """A query projection [Hq * D, in] with each head's rotary rows half-split (`back`: interleaved again)."""
    order = _rotary_order(cfg.head_dim, cfg.rotary_dims)
    order = np.argsort(order) if back else order
    return w.reshape(cfg.num_heads, cfg.head_dim, -1)[:, order].reshape(w.shape)


def kv_rows(w: np.ndarray, cfg: ModelConfig, back: bool = False) -> np.ndarray:
    """`kv_a_proj_with_mqa` [R + Dr, E] with its rotary key's rows half-split (`back`: interleaved again)."""
    order = _rotary_order(w.shape[0], cfg.rotary_dims)
    return w[np.argsort(order) if back else order]


def _index_order(cfg: ModelConfig, back: bool = False) -> np.ndarray:
    """An indexer head's dims in the order the model reads them: GLM-5's leading rotary pairs half-split."""
    Di, Dr = cfg.index_head_dim, cfg.rotary_dims
    if cfg.family != "glm_moe_dsa":
        return np.arange(Di)
    order = np.concatenate([np.arange(0, Dr, 2), np.arange(1, Dr, 2), np.arange(Dr, Di)])
    return np.argsort(order) if back else order


def _indexer_targets(cfg: ModelConfig) -> dict[str, Spec]:
    """DeepSeek Sparse Attention's indexer tensors (after `model.layers.{i}.self_attn.indexer.`)."""
    E, Rq, Hi, Di, order = cfg.hidden_size, cfg.q_lora_rank, cfg.index_heads, cfg.index_head_dim, _index_order(cfg)
    return {
        "wq_b.weight": ("layers.idx_wq", lambda w: w.reshape(Hi, Di, Rq)[:, order].transpose(2, 0, 1), (Hi * Di, Rq)),
        "wk.weight": ("layers.idx_wk", lambda w: w[order].T, (Di, E)),
        "k_norm.weight": ("layers.idx_k_norm", lambda w: w[order], (Di,)),
        "k_norm.bias": ("layers.idx_k_norm_b", lambda w: w[order], (Di,)),
        "weights_proj.weight": ("layers.idx_w", lambda w: w.T, (Hi, E)),
    }


def mla_targets(cfg: ModelConfig) -> dict[str, Spec]:
    """A layer's attention tensors (after `model.layers.{i}.`) to our parameters."""
    E, Hq, D, Dr, R, Rq, Dv = (cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.rotary_dims, cfg.kv_lora_rank,
                               cfg.q_lora_rank, cfg.v_head_dim)
    Dn = D - Dr
    t: dict[str, Spec] = {
        "self_attn.kv_a_proj_with_mqa.weight": ("layers.wkv_a", lambda w: kv_rows(w, cfg).T, (R + Dr, E)),
        "self_attn.kv_a_layernorm.weight": ("layers.kv_a_norm", lambda w: w, (R,)),
        _KV_B_PARTS[0]: ("layers.w_uk", lambda w: w.reshape(Hq, Dn, R), (Hq * Dn, R)),
        _KV_B_PARTS[1]: ("layers.w_uv", lambda w: w.reshape(Hq, Dv, R).transpose(0, 2, 1), (Hq * Dv, R)),
        "self_attn.o_proj.weight": ("layers.wo", lambda w: w.T.reshape(Hq, Dv, E), (E, Hq * Dv)),
    }
    if Rq:
        t["self_attn.q_a_proj.weight"] = ("layers.wq_a", lambda w: w.T, (Rq, E))
        t["self_attn.q_a_layernorm.weight"] = ("layers.q_a_norm", lambda w: w, (Rq,))
        t["self_attn.q_b_proj.weight"] = ("layers.wq", lambda w: q_rows(w, cfg).T.reshape(Rq, Hq, D), (Hq * D, Rq))
    else:
        t["self_attn.q_proj.weight"] = ("layers.wq", lambda w: q_rows(w, cfg).T.reshape(E, Hq, D), (Hq * D, E))
    if cfg.index_topk:
        t |= {f"self_attn.indexer.{name}": spec for name, spec in _indexer_targets(cfg).items()}
    return t


def split_kv_b(name: str, tensor: np.ndarray, cfg: ModelConfig) -> list[tuple[str, np.ndarray]]:
    """`kv_b_proj` ([Hq * (Dn + Dv), R]: each head's key rows, then its value rows) as its two parts, under the
    names `mla_targets` reads."""
    Hq, Dn, Dv = cfg.num_heads, cfg.head_dim - cfg.rotary_dims, cfg.v_head_dim
    prefix = name.removesuffix("self_attn.kv_b_proj.weight")
    if tensor.ndim != 2 or tensor.shape[0] != Hq * (Dn + Dv):
        return [(name, tensor)]  # (refused by name: no target has it)
    heads = tensor.reshape(Hq, Dn + Dv, -1)
    return [(prefix + _KV_B_PARTS[0], heads[:, :Dn].reshape(Hq * Dn, -1)),
            (prefix + _KV_B_PARTS[1], heads[:, Dn:].reshape(Hq * Dv, -1))]


def mla_hf_tensor(field: str, value: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """One layer's MLA parameter (`MLA_FIELDS`) as its HF tensor (a part of `kv_b_proj` for w_uk, w_uv)."""
    if field == "wq":
        return q_rows(value.reshape(value.shape[0], -1).T, cfg, back=True)
    if field == "wkv_a":
        return kv_rows(value.T, cfg, back=True)
    if field == "wq_a":
        return value.T
    if field == "wo":
        return value.reshape(-1, value.shape[-1]).T
    if field == "w_uk":
        return value.reshape(-1, value.shape[-1])
    if field == "w_uv":
        return value.transpose(0, 2, 1).reshape(-1, value.shape[1])
    back = _index_order(cfg, back=True)
    if field == "idx_wq":
        return value.transpose(1, 2, 0)[:, back].reshape(-1, value.shape[0])
    if field == "idx_wk":
        return value.T[back]
    if field in ("idx_k_norm", "idx_k_norm_b"):
        return value[back]
    if field == "idx_w":
        return value.T
    return value  # the norms


def mla_fused(pairs: Iterable[tuple[str, np.ndarray]], cfg: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, tensor) pairs with each layer's two `kv_b_proj` parts joined back into one tensor."""
    Hq = cfg.num_heads
    k_part = None
    for name, t in pairs:
        if name.endswith(_KV_B_PARTS[0]):
            k_part = t
        elif name.endswith(_KV_B_PARTS[1]):
            joined = np.concatenate([k_part.reshape(Hq, -1, t.shape[-1]), t.reshape(Hq, -1, t.shape[-1])], axis=1)
            yield name.removesuffix(_KV_B_PARTS[1]) + "self_attn.kv_b_proj.weight", joined.reshape(-1, t.shape[-1])
        else:
            yield name, t
