"""The mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, Granite MoE, GLM-4.5, ERNIE 4.5, gpt-oss): top-k routing,
grouped expert matmuls.

Tokens are sorted by the expert they were routed to and each expert multiplies only its own
rows (`jax.lax.ragged_dot`), so no token is ever dropped and no capacity factor is needed.
With experts split over devices (`sharding.MeshLayout`), every device runs the same dispatch over the
experts it holds, writes their weighted outputs back into token order, and one all-reduce over
the expert and model axes combines them: activations stay replicated, expert weights never do.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxserve.config import ModelConfig
from jaxserve.models.lora import MOE_IN, expert_lora_deltas, lora_deltas
from jaxserve.models.quantized import QuantizedWeight, grouped, project
from pallas_kernels.grouped_matmul import grouped_matmul


def route(h: jax.Array, router: jax.Array, cfg: ModelConfig, bias: jax.Array | None = None,
          logit_bias: jax.Array | None = None, delta: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Top-k experts per token and their weights. Softmax scoring: a softmax over all experts (in float32), the k
    largest (ERNIE 4.5: largest with `bias` [X] added; DeepSeek-V2: among the experts of the `cfg.expert_topk_groups`
    groups with the best single scores), renormalized to sum to one when the family does so. Sigmoid
    scoring (DeepSeek-V3's, GLM-4.5's): each expert's sigmoid score, in float32; the k chosen by score plus `bias`
    among the experts of the `cfg.expert_topk_groups` groups whose two best such sums are largest; weighted by
    their scores (renormalized by `norm_topk_prob`) times `routed_scaling_factor`. `logit_bias` [X] (gpt-oss) is
    the router's own bias, added to its logits; `delta` [T, X] a LoRA adapter's, added to them too. Returns ([T, k]
    in h's dtype, [T, k] int32)."""
    if cfg.router_scoring == "sigmoid":
        return _route_sigmoid(h, router, bias, cfg, delta)
    if bias is not None:  # (ERNIE computes its router in float32)
        probs = jax.nn.softmax(_logits(h, router, delta, jnp.float32), axis=-1)
        experts = jax.lax.top_k(probs + bias.astype(jnp.float32)[None, :], cfg.num_experts_per_tok)[1]
        weights = jnp.take_along_axis(probs, experts, axis=-1)
    elif cfg.family in ("deepseek_v2", "mistral4"):  # (in float32, as DeepSeek's router; Mistral 4's groups by their
        probs = jax.nn.softmax(_logits(h, router, delta, jnp.float32), axis=-1)  # two best scores' sums)
        by = "max" if cfg.family == "deepseek_v2" else "top2"
        weights, experts = jax.lax.top_k(_best_groups(probs, cfg, by=by, fill=0.0), cfg.num_experts_per_tok)
    else:
        logits = _logits(h, router, delta)  # [T, X]
        if logit_bias is not None:
            logits = logits + logit_bias
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        weights, experts = jax.lax.top_k(probs, cfg.num_experts_per_tok)
    if cfg.norm_topk_prob:
        weights = weights / jnp.maximum(jnp.sum(weights, axis=-1, keepdims=True), 1e-12)
    return (weights * cfg.routed_scaling_factor).astype(h.dtype), experts.astype(jnp.int32)


def _logits(h: jax.Array, router: jax.Array, delta: jax.Array | None, dtype: Any = None) -> jax.Array:
    """The router's logits [T, X] (computed in `dtype`, else h's), plus `delta` when given."""
    if dtype is not None:
        h, router = h.astype(dtype), router.astype(dtype)
    logits = jnp.einsum("te,ex->tx", h, router)
    return logits if delta is None else logits + delta.astype(logits.dtype)


def _best_groups(choice: jax.Array, cfg: ModelConfig, by: str, fill: float) -> jax.Array:
    """`choice` [T, X] with the experts outside each token's `cfg.expert_topk_groups` best groups set to `fill`;
    a group's score is its best expert's (`by` "max": DeepSeek-V2's) or its two best's sum ("top2": V3's)."""
    groups, top = cfg.expert_groups, cfg.expert_topk_groups
    if top >= groups:
        return choice
    T, X = choice.shape
    by_group = choice.reshape(T, groups, X // groups)
    group_scores = jnp.max(by_group, axis=-1) if by == "max" else jnp.sum(jax.lax.top_k(by_group, 2)[0], axis=-1)
    kept = jax.lax.top_k(group_scores, top)[1]  # [T, top]
    keep = jnp.zeros((T, groups), bool).at[jnp.arange(T)[:, None], kept].set(True)
    return jnp.where(keep[:, :, None], by_group, fill).reshape(T, X)


def _route_sigmoid(h: jax.Array, router: jax.Array, bias: jax.Array, cfg: ModelConfig,
                   delta: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    scores = jax.nn.sigmoid(_logits(h, router, delta, jnp.float32))  # [T, X]
    choice = scores if bias is None else scores + bias.astype(jnp.float32)[None, :]
    # Only the experts of the best groups (by the sum of each group's two best) may be chosen.
    experts = jax.lax.top_k(_best_groups(choice, cfg, by="top2", fill=-jnp.inf), cfg.num_experts_per_tok)[1]
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return (weights * cfg.routed_scaling_factor).astype(h.dtype), experts.astype(jnp.int32)


def expert_activation(cfg: ModelConfig, gate: jax.Array | None, up: jax.Array) -> jax.Array:
    """An expert's activation: SiLU(gate) * up, gpt-oss's clamped SwiGLU (`ModelConfig.swiglu_limit`), or an
    ungated expert's squared ReLU of up (Nemotron 3's: no gate)."""
    if gate is None:
        return jnp.square(jax.nn.relu(up))
    if cfg.swiglu_limit is None:  # (Gemma 4's: GELU, tanh-approximated)
        return (jax.nn.silu(gate) if cfg.hidden_act == "silu" else jax.nn.gelu(gate, approximate=True)) * up
    limit = cfg.swiglu_limit
    gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
    return (up + 1) * gate * jax.nn.sigmoid(gate * cfg.swiglu_alpha)


def local_experts(h: jax.Array, weights: jax.Array, experts: jax.Array, we_gate: Any, we_up: Any, we_down: Any,
                  first_expert: jax.Array | int, cfg: ModelConfig, biases: tuple | None = None,
                  down_bias: jax.Array | float = 1.0, lora: tuple | None = None, matmul: Any = None) -> jax.Array:
    """The weighted output ([T, E]) of experts `first_expert .. first_expert + X_local` for every token.

    h: [T, E]; weights, experts: [T, k]; we_gate (None: ungated), we_up: [X_local, E, Fe]; we_down: [X_local, Fe, E] (float, or
    `QuantizedWeight`s); `biases` (gpt-oss): the local experts' (gate [X_local, Fe], up [X_local, Fe], down
    [X_local, E]), the down projection's times `down_bias` (0 where another device adds it). `lora`: the local
    experts' adapter slots (ae_gate_up, be_gate, be_up, ae_down, be_down of `LoraLayer`, their width sliced as the
    experts') and each token's slot [T] (`models.lora.expert_lora_deltas`). `matmul`: the grouped matmul kernel
    (`models.quantized.grouped`). The T * k (token, expert) pairs are sorted by local expert; pairs routed elsewhere
    sort last, outside every group, and get weight zero.
    """
    T, k = experts.shape
    x_local = we_up.shape[0]
    flat = experts.reshape(T * k) - first_expert  # [T * k]
    is_local = (flat >= 0) & (flat < x_local)
    key = jnp.where(is_local, flat, x_local)
    order = jnp.argsort(key, stable=True)  # [T * k]
    token = order // k  # the token of each sorted pair
    group_sizes = jnp.bincount(key, length=x_local + 1)[:x_local].astype(jnp.int32)  # [X_local]
    xs = h[token]  # [T * k, E]
    w = jnp.where(is_local, weights.reshape(T * k), 0)[order]  # [T * k]
    if cfg.family == "llama4":  # (its routing weights weigh each chosen expert's input, not its output)
        xs, w = xs * w[:, None].astype(xs.dtype), is_local[order].astype(w.dtype)
    row_expert = key[order]  # [T * k]: each sorted pair's local expert (x_local past the groups)
    gate = None if we_gate is None else grouped(xs, we_gate, group_sizes, row_expert, matmul)  # [T * k, Fe]
    up = grouped(xs, we_up, group_sizes, row_expert, matmul)
    if lora is not None:
        ae_gate_up, be_gate, be_up, ae_down, be_down, row_slot = *lora[:5], lora[5][token]
        dg, du = expert_lora_deltas(xs, ae_gate_up, [be_gate, be_up], group_sizes, row_expert, row_slot, matmul)
        gate, up = None if gate is None else gate + dg, up + du
    if biases is not None:  # (a pair routed elsewhere reads a clamped row: its weight is zero)
        gate, up = gate + biases[0][row_expert], up + biases[1][row_expert]
    act = expert_activation(cfg, gate, up)
    ys = grouped(act, we_down, group_sizes, row_expert, matmul)  # [T * k, E]
    if lora is not None:
        # (a slice of the width gives a partial sum, as the down projection does: summed over the devices)
        ys = ys + expert_lora_deltas(act, ae_down, [be_down], group_sizes, row_expert, row_slot, matmul)[0]
    if biases is not None:
        ys = ys + biases[2][row_expert] * jnp.asarray(down_bias, ys.dtype)
    return jnp.zeros_like(h).at[token].add(ys * w[:, None])


def moe_mlp(h: jax.Array, lp: Any, cfg: ModelConfig, layout: Any = None, lora: tuple | None = None,
            backend: str = "xla", router_in: jax.Array | None = None) -> jax.Array:
    """The MoE MLP of one layer on normalized activations h ([T, E]); `lp` holds that layer's
    router, experts and optional shared expert. `layout` (a `sharding.MeshLayout`) says
    which mesh axes split the experts and their width; None = every expert on this device. `lora`: (the layer's
    `LoraLayer`, each token's adapter slot), in a LoRA engine's step: its experts', router's and shared expert's.
    `backend`: the attention backend's name; with a Pallas one, the experts' matmuls run on the Pallas grouped matmul
    (`pallas_kernels/grouped_matmul.py`: XLA:GPU's ragged dot on Hopper does as many times the work as there are
    experts), else `jax.lax.ragged_dot`, unless `cfg.moe_runner` names one ("pallas" on the CPU: its interpreter).
    `router_in` [T, E]: what the router reads in h's place (Gemma 4's), whose chosen weights `lp.expert_scale` then
    scales per expert."""
    runner = cfg.moe_runner if cfg.moe_runner != "auto" else "xla" if backend == "xla" else "pallas"
    # (its interpreter under the interpreted backends, and on the CPU's xla backend: a deviceless GPU compile runs
    # with the CPU as JAX's default backend and a Pallas backend named)
    interpret = backend.endswith("_interpret") or backend == "xla" and jax.default_backend() == "cpu"
    matmul = None if runner == "xla" else functools.partial(grouped_matmul, interpret=interpret)
    slots, a = (None, None) if lora is None else (lora[1], lora[0])
    # The adapters' deltas of the projections of h (`models.lora.moe_targets`), by their B field
    bs = {} if a is None else {f: getattr(a, f) for f in MOE_IN.values() if getattr(a, f) is not None}
    d = dict(zip(bs, lora_deltas(h, a.a_moe, list(bs.values()), slots), strict=True)) if bs else {}
    weights, experts = route(h if router_in is None else router_in, lp.router, cfg, lp.router_bias, lp.b_router,
                             d.get("b_route"))
    if lp.expert_scale is not None:
        weights = weights * lp.expert_scale[experts].astype(weights.dtype)
    biases = None if lp.be_gate is None else (lp.be_gate, lp.be_up, lp.be_down)
    experts_lora = None if a is None or a.ae_gate_up is None else (a.ae_gate_up, a.be_gate, a.be_up, a.ae_down,
                                                                   a.be_down, slots)
    # (a latent MoE's experts read and write a narrower width: projected to it and back, routed on h)
    x = h if lp.we_latent_in is None else project(h, lp.we_latent_in)
    if layout is None:
        out = local_experts(x, weights, experts, lp.we_gate, lp.we_up, lp.we_down, 0, cfg, biases, lora=experts_lora,
                            matmul=matmul)
    else:
        out = _sharded_experts(x, weights, experts, lp, layout, cfg, biases, experts_lora, matmul)
    if lp.we_latent_out is not None:
        out = project(out, lp.we_latent_out)
    if lp.ws_up is not None:
        gate, up = None if lp.ws_gate is None else project(h, lp.ws_gate), project(h, lp.ws_up)
        if "bs_gate" in d:
            gate, up = gate + d["bs_gate"], up + d["bs_up"]
        act = jnp.square(jax.nn.relu(up)) if gate is None else jax.nn.silu(gate) * up
        shared = project(act, lp.ws_down)  # [T, E]
        if "bs_gate" in d:
            shared = shared + lora_deltas(act, a.as_down, [a.bs_down], slots)[0]
        if lp.ws_mix is not None:
            mix = h @ lp.ws_mix[:, None]
            shared = jax.nn.sigmoid(mix if "b_mix" not in d else mix + d["b_mix"]) * shared
        out = out + (shared if cfg.shared_expert_scale == 1.0 else shared * jnp.asarray(cfg.shared_expert_scale,
                                                                                           shared.dtype))
    return out


def _sharded_experts(h, weights, experts, lp, layout, cfg, biases, lora=None, matmul=None) -> jax.Array:
    ea, ma = layout.expert_axis, layout.model_axis
    reduce_axes = tuple(a for a in (ea, ma) if a is not None)
    nb = 0 if biases is None else 3

    gated = lp.we_gate is not None  # (an ungated model's up projection stands in for its gate: never read)

    def per_device(h, weights, experts, wg, wu, wd, *rest):
        first = jax.lax.axis_index(ea) * wu.shape[0] if ea is not None else 0
        down_bias = 1.0 if ma is None else (jax.lax.axis_index(ma) == 0)  # one slice of the width adds it
        y = local_experts(h, weights, experts, wg if gated else None, wu, wd, first, cfg, rest[:nb] or None, down_bias,
                          lora=rest[nb:] or None, matmul=matmul)
        # Each device holds some experts and a slice of their width: its output is a partial sum.
        return jax.lax.psum(y, reduce_axes) if reduce_axes else y

    up_spec, down_spec = P(ea, None, ma), P(ea, ma, None)
    if isinstance(lp.we_down, QuantizedWeight):  # the scales of the down projection: per output channel, unsplit
        down_spec = QuantizedWeight(down_spec, P(ea, None, None))
    bias_specs = () if biases is None else (P(ea, ma), P(ea, ma), P(ea, None))
    # The experts' adapter slots ([X, in, S, r] A's, [X, S, r, out] B's) split as the experts are: A's over the experts
    # (the down A's rows with the width), B's over the experts and the gate's and up's columns with the width.
    lora_specs = () if lora is None else (P(ea), P(ea, None, None, ma), P(ea, None, None, ma), P(ea, ma), P(ea), P())
    return jax.shard_map(
        per_device, mesh=layout.mesh, in_specs=(P(), P(), P(), up_spec, up_spec, down_spec, *bias_specs, *lora_specs),
        out_specs=P(), check_vma=False,
    )(h, weights, experts, lp.we_gate if gated else lp.we_up, lp.we_up, lp.we_down, *(biases or ()), *(lora or ()))
