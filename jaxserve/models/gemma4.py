"""Gemma 4's layers (`config_gemma4`): each kind's keys and values in the page pool's rows viewed as heads of its own
width, the experts beside the dense MLP, each layer's learned output scale; E2B/E4B's input of each layer and their
last layers attending over an earlier layer's pages."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.models.moe import moe_mlp
from jaxserve.models.ops import model_norm, rms_norm


def declare_gemma4(cfg: ModelConfig, layers: Any, L: int, moe: bool, p) -> None:
    """Gemma 4's parameters of `L` stacked layers of `cfg` (the windowed layers', or with `cfg.gemma4.full_layers`
    the full-attention layers'), added to `layers` (`params._declare_layers`'s, whose `p` makes a `ParamInfo`): the
    full-attention layers' keys are its values (no `wv`) where `k_eq_v`, their KV heads unsplit (a few, often fewer
    than the devices of a tensor-parallel mesh: each device projects them all, `attention` writes its share);
    experts (`moe`) come with the dense MLP beside them; E2B/E4B's per-layer inputs' gate, projection and norm."""
    g = cfg.gemma4
    E, F, P = cfg.hidden_size, cfg.intermediate_size * (2 if g.double_wide else 1), g.ple_width
    layers.layer_scalar = p((L,), ("layers",), "ones")
    if P:
        layers.ple_gate = p((L, E, P), ("layers", "embed", None))
        layers.ple_out = p((L, P, E), ("layers", None, "embed"))
        layers.ple_post_norm = p((L, E), ("layers", "embed"), "ones")
    if g.double_wide:  # (the layers that share keys have MLPs twice as wide; the others' are held so, half zero)
        layers.w_gate, layers.w_up = (p((L, E, F), ("layers", "embed", "mlp")) for _ in range(2))
        layers.w_down = p((L, F, E), ("layers", "mlp", "embed"))
    if cfg.gemma4.full_layers:
        Hkv, D = cfg.num_kv_heads, cfg.head_dim
        layers.wk = p((L, E, Hkv, D), ("layers", "embed", None, "head_dim"))
        layers.wv = None if cfg.gemma4.k_eq_v else p((L, E, Hkv, D), ("layers", "embed", None, "head_dim"))
    if moe:  # (the dense MLP beside the experts)
        layers.w_gate = p((L, E, F), ("layers", "embed", "mlp"))
        layers.w_up = p((L, E, F), ("layers", "embed", "mlp"))
        layers.w_down = p((L, F, E), ("layers", "mlp", "embed"))
        layers.router_scale = p((L, E), ("layers", "embed"), "ones")
        layers.expert_scale = p((L, cfg.num_experts), ("layers", None), "ones")
        layers.mlp_out_norm, layers.moe_norm, layers.moe_out_norm = (p((L, E), ("layers", "embed"), "ones")
                                                                     for _ in range(3))


def full_pool_view(pool: jax.Array, head_dim: int) -> jax.Array:
    """A page pool [N, page_size, H, D] as heads of `head_dim` ([N, page_size, H * D / head_dim, head_dim]: the same
    rows, a free reshape)."""
    *lead, h, d = pool.shape
    return pool if d == head_dim else pool.reshape(*lead, h * d // head_dim, head_dim)


def fill_rows(k: jax.Array, v: jax.Array, copies: int) -> tuple[jax.Array, jax.Array]:
    """A layer's keys and values [T, Hkv, D], each head written `copies` times to fill a pool row of Hkv * copies heads
    of D (head h as heads h * copies to h * copies + copies - 1: the query heads of head h read one of its copies, or
    the Pallas kernel, told `kv_copies`, the first only)."""
    return (k, v) if copies == 1 else (jnp.repeat(k, copies, axis=1), jnp.repeat(v, copies, axis=1))


def value_norm(v: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Gemma 4's values normed without a weight."""
    return rms_norm(v, jnp.ones((), v.dtype), cfg.rms_norm_eps)


def experts_beside(cfg: ModelConfig, lp: Any, x: jax.Array, dense: jax.Array, layout: Any,
                   backend: str) -> jax.Array:
    """The MLP's output `dense` [T, E] (of the normed layer input) and the experts', each normed, summed: the experts
    read x [T, E] normed by `moe_norm`, and are routed on x normed without weight, times `router_scale` and
    hidden_size^-1/2 (their top-k softmax weights renormalized, then times each chosen expert's `expert_scale`)."""
    route_in = rms_norm(x, jnp.ones((), x.dtype), cfg.rms_norm_eps) * (lp.router_scale * cfg.hidden_size ** -0.5
                                                                          ).astype(x.dtype)
    out = moe_mlp(model_norm(cfg, x, lp.moe_norm), lp, cfg, layout, None, backend, router_in=route_in)
    return model_norm(cfg, dense, lp.mlp_out_norm) + model_norm(cfg, out, lp.moe_out_norm)


def per_layer_inputs(params: Any, cfg: ModelConfig, ids: jax.Array, x: jax.Array) -> jax.Array:
    """The E2B/E4B models' input of each layer [T, L, P]: each token's row of the per-layer table (times sqrt(P)) and
    the projection of its input embedding x [T, E] (times E^-1/2, normed), summed, times 2^-1/2."""
    T, L, P = x.shape[0], cfg.num_layers, cfg.gemma4.ple_width
    table = params.ple_embed[jnp.clip(ids, 0, params.ple_embed.shape[0] - 1)].reshape(T, L, P)
    table = table * jnp.asarray(P ** 0.5, table.dtype)
    proj = (x @ params.ple_proj * jnp.asarray(cfg.hidden_size ** -0.5, x.dtype)).reshape(T, L, P)
    return ((model_norm(cfg, proj, params.ple_norm) + table.astype(x.dtype)) * jnp.asarray(2 ** -0.5, x.dtype))


def add_per_layer_input(cfg: ModelConfig, lp: Any, x: jax.Array, per_layer: jax.Array, layer: jax.Array) -> jax.Array:
    """x [T, E] plus the normed projection of act(x's gate) times the layer's own input (`per_layer` [T, L, P])."""
    own = jax.lax.dynamic_index_in_dim(per_layer, layer, axis=1, keepdims=False)  # [T, P]
    h = jax.nn.gelu(x @ lp.ple_gate, approximate=True) * own
    return x + model_norm(cfg, h @ lp.ple_out, lp.ple_post_norm)


def shared_kv(cfg: ModelConfig, layer: jax.Array, local: bool, slots: jax.Array,
              pages: int) -> tuple[jax.Array, jax.Array]:
    """`layer`'s pool row and where its keys go (`slots` [T] within a row of `pages` pages): its own row, or for the
    last `shared_layers` layers the row of the last earlier layer of their kind (`local`: windowed), their keys going
    to the pool's first page, which no sequence reads (a padding token's place)."""
    kinds = [cfg.is_local(i) for i in range(cfg.num_layers)]
    first = cfg.num_layers - cfg.gemma4.shared_layers
    source = max(i for i in range(first) if kinds[i] == local)
    shared = layer >= first
    return jnp.where(shared, source, layer), jnp.where(shared, 0, slots + layer * pages)


def lora_dims(cfg: ModelConfig, layer: int | None, dims_of) -> dict[str, tuple[int, int]]:
    """LoRA targets' (in, out) features (`lora.target_dims`, passed as `dims_of`) of Gemma 4's `layer` (its kind's
    attention; a double-wide MLP where it shares keys), or with None the widest of every layer's."""
    first = cfg.num_layers - cfg.gemma4.shared_layers
    wide = lambda c, twice: dataclasses.replace(c, gemma4=None,  # noqa: E731 (a kind's own, as any model's)
                                                 intermediate_size=c.intermediate_size * (1 + twice))
    if layer is not None:
        return dims_of(wide(cfg.kind_config(cfg.is_local(layer)), cfg.gemma4.double_wide and layer >= first))
    kinds = [dims_of(wide(cfg.kind_config(local), cfg.gemma4.double_wide)) for local in (True, False)]
    return {t: (max(k[t][0] for k in kinds), max(k[t][1] for k in kinds)) for t in kinds[0]}


def kind_lora(cfg: ModelConfig, lora: Any) -> Any:
    """A layer's adapter slots (held at the widest kind's widths) cut to its kind's attention: q, k and v's B's
    outputs and o's A's inputs."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return dataclasses.replace(lora, b_q=lora.b_q[..., :q], b_k=lora.b_k[..., :kv], b_v=lora.b_v[..., :kv],
                               a_o=lora.a_o[..., :q, :])
