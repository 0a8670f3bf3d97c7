"""Gemma 4's vision side (`Gemma4ForConditionalGeneration`), as pure functions.

An image comes as its patches ([N, P * P * 3] in [0, 1], row by row, each patch's values over (row, column, channel):
`jaxserve.images_gemma4`), padded to the processor's most patches with positions (-1, -1). The tower maps each
patch's 2 (x - 1/2) by a matrix, adds its column's and its row's learned embeddings, then runs blocks of Gemma's
kind: an RMSNorm before and after attention and the MLP (weights applied as they are), attention over the image's own
patches, unscaled, with q and k normed per head and turned by a 2D rotary embedding (a head's first half by the
patch's column, its second half by its row), values normed without weight; projections maybe clamped in and out
(`use_clipped_linears`). The patches' states are averaged over each 3 x 3 square (`pooling_kernel_size`) into one
soft token per square, row by row, times sqrt(width), maybe standardized (`std_bias`, `std_scale`); then RMSNormed
without weight and projected to the language model's width (`embed_vision`)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.errors import UnsupportedModelError

_TOWER, _EMBED = "model.vision_tower.", "model.embed_vision."
_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
            "mlp.up_proj", "mlp.down_proj")
_CLIPS = ("input_min", "input_max", "output_min", "output_max")
_NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attn_norm",
          "pre_feedforward_layernorm": "mlp_norm", "post_feedforward_layernorm": "post_mlp_norm"}


@dataclass(frozen=True)
class Gemma4VisionConfig:
    """Gemma 4's vision tower and its projection, and the tokens that lay an image out in a prompt."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    patch_size: int
    position_embedding_size: int
    pooling: int
    eps: float
    rope_theta: float
    clipped: bool
    standardize: bool
    text_hidden_size: int
    image_token_id: int
    boi_token_id: int
    eoi_token_id: int
    bidirectional: bool  # the language model's windowed layers attend an image's tokens to each other both ways

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> Gemma4VisionConfig | None:
        """The vision config of a Gemma 4 image-text config; None for any other (or one without a vision tower)."""
        if "Gemma4ForConditionalGeneration" not in (d.get("architectures") or []) and d.get("model_type") != "gemma4":
            return None
        v, text = d.get("vision_config"), d.get("text_config") or {}
        if not v:
            return None
        rope = v.get("rope_parameters") or {"rope_type": "axial", "rope_theta": 100.0}
        if rope.get("rope_type", "axial") != "axial" or v.get("attention_bias"):
            raise UnsupportedModelError(f"Gemma 4 vision tower with rope {rope} or attention_bias is not supported")
        if v.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise UnsupportedModelError(f"Gemma 4 vision hidden_activation {v.get('hidden_activation')!r} is not "
                                        "supported (gelu_pytorch_tanh)")
        heads = int(v.get("num_attention_heads", 12))
        return cls(
            hidden_size=int(v.get("hidden_size", 768)), intermediate_size=int(v.get("intermediate_size", 3072)),
            num_layers=int(v.get("num_hidden_layers", 16)), num_heads=heads,
            num_kv_heads=int(v.get("num_key_value_heads") or heads), head_dim=int(v.get("head_dim", 64)),
            patch_size=int(v.get("patch_size", 16)), position_embedding_size=int(v.get("position_embedding_size",
                                                                                       10240)),
            pooling=int(v.get("pooling_kernel_size", 3)), eps=float(v.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", 100.0)), clipped=bool(v.get("use_clipped_linears", False)),
            standardize=bool(v.get("standardize", False)), text_hidden_size=int(text.get("hidden_size", 2304)),
            image_token_id=int(d.get("image_token_id", 258_880)), boi_token_id=int(d.get("boi_token_id", 255_999)),
            eoi_token_id=int(d.get("eoi_token_id", 258_882)),
            bidirectional=text.get("use_bidirectional_attention") == "vision")

    @property
    def patch_dim(self) -> int:
        return 3 * self.patch_size ** 2


@jax.tree_util.register_dataclass
@dataclass
class Gemma4VisionParams:
    """The tower's and projection's weights, matrices stored [in, out]; the blocks' stacked on a leading axis."""

    patch: jax.Array  # [P * P * 3, H]
    positions: jax.Array  # [2, S, H]: the columns' and the rows' embeddings
    layers: dict[str, jax.Array]  # each [L, ...]: see `_layer_tensors`; "clips" [L, 7, 4] with clamped projections
    proj: jax.Array  # [H, E]: to the language model's width
    std: jax.Array | None = None  # [2, H]: the standardization's bias and scale


def _layer_tensors(cfg: Gemma4VisionConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """A block's tensors: HF name (under `encoder.layers.N.`) -> (our key, HF shape)."""
    H, F, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * D, cfg.num_kv_heads * D
    shapes = dict(zip(_LINEARS, ((q, H), (kv, H), (kv, H), (H, q), (F, H), (F, H), (H, F)), strict=True))
    t = {f"{n}.linear.weight": (n.split(".")[1], s) for n, s in shapes.items()}
    t |= {f"{n}.weight": (key, (H,)) for n, key in _NORMS.items()}
    t |= {"self_attn.q_norm.weight": ("q_norm", (D,)), "self_attn.k_norm.weight": ("k_norm", (D,))}
    if cfg.clipped:
        t |= {f"{n}.{c}": (f"clip {i} {j}", ()) for i, n in enumerate(_LINEARS) for j, c in enumerate(_CLIPS)}
    return t


def _expected(cfg: Gemma4VisionConfig) -> dict[str, tuple[int, ...]]:
    H = cfg.hidden_size
    names = {_TOWER + "patch_embedder.input_proj.weight": (H, cfg.patch_dim),
             _TOWER + "patch_embedder.position_embedding_table": (2, cfg.position_embedding_size, H),
             _EMBED + "embedding_projection.weight": (cfg.text_hidden_size, H)}
    if cfg.standardize:
        names |= {_TOWER + "std_bias": (H,), _TOWER + "std_scale": (H,)}
    return names | {f"{_TOWER}encoder.layers.{i}.{n}": s for i in range(cfg.num_layers)
                    for n, (_, s) in _layer_tensors(cfg).items()}


def is_gemma4_vision_tensor(name: str) -> bool:
    return name.startswith((_TOWER, _EMBED))


def load_gemma4_vision_params(cfg: Gemma4VisionConfig, tensors: Iterable[tuple[str, np.ndarray]],
                              dtype: Any) -> Gemma4VisionParams:
    """The vision weights from (HF name, array) pairs (others skipped), in `dtype` (the clamps and the
    standardization in float32); refuses a missing, duplicate, unknown or misshapen tensor by its name."""
    want, found = _expected(cfg), {}
    for name, array in tensors:
        if not is_gemma4_vision_tensor(name):
            continue
        if name not in want:
            raise UnsupportedModelError(f"vision tensor {name!r} is not one of a Gemma 4 vision tower's")
        if name in found or tuple(np.shape(array)) != want[name]:
            raise UnsupportedModelError(f"vision tensor {name!r}: {'twice' if name in found else np.shape(array)}, "
                                        f"expected once, {want[name]}")
        found[name] = np.asarray(array, np.float32)
    missing = sorted(set(want) - set(found))
    if missing:
        raise UnsupportedModelError(f"the checkpoint lacks {len(missing)} vision tensor(s): {', '.join(missing[:6])}")
    put = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    layers: dict[str, Any] = {}
    clips = np.zeros((cfg.num_layers, len(_LINEARS), 4), np.float32) if cfg.clipped else None
    for n, (key, shape) in _layer_tensors(cfg).items():
        rows = [found[f"{_TOWER}encoder.layers.{i}.{n}"] for i in range(cfg.num_layers)]
        if key.startswith("clip"):
            _, i, j = key.split()
            clips[:, int(i), int(j)] = rows
        else:
            layers[key] = put(np.stack([r.T for r in rows]) if len(shape) == 2 else np.stack(rows))
    if clips is not None:
        layers["clips"] = jnp.asarray(clips)
    std = np.stack([found[_TOWER + "std_bias"], found[_TOWER + "std_scale"]]) if cfg.standardize else None
    return Gemma4VisionParams(patch=put(found[_TOWER + "patch_embedder.input_proj.weight"].T),
                              positions=put(found[_TOWER + "patch_embedder.position_embedding_table"]),
                              layers=layers, proj=put(found[_EMBED + "embedding_projection.weight"].T),
                              std=None if std is None else jnp.asarray(std))


def gemma4_vision_tensors(params: Gemma4VisionParams, cfg: Gemma4VisionConfig) -> Iterator[tuple[str, np.ndarray]]:
    """The weights back under the Hub's names, float32, HF shapes (for `jaxserve convert`)."""
    host = lambda a: np.asarray(jnp.asarray(a, jnp.float32))  # noqa: E731
    yield _TOWER + "patch_embedder.input_proj.weight", host(params.patch).T
    yield _TOWER + "patch_embedder.position_embedding_table", host(params.positions)
    if params.std is not None:
        yield from ((_TOWER + "std_bias", host(params.std[0])), (_TOWER + "std_scale", host(params.std[1])))
    for n, (key, shape) in _layer_tensors(cfg).items():
        for i in range(cfg.num_layers):
            if key.startswith("clip"):
                _, a, b = key.split()
                value = host(params.layers["clips"][i, int(a), int(b)])
            else:
                value = host(params.layers[key][i])
                value = value.T if len(shape) == 2 else value
            yield f"{_TOWER}encoder.layers.{i}.{n}", value
    yield _EMBED + "embedding_projection.weight", host(params.proj).T


def random_gemma4_vision_params(cfg: Gemma4VisionConfig, dtype: Any, seed: int = 0) -> Gemma4VisionParams:
    """Random weights of the config's shapes (`--load-format dummy`): norms and clamps open, the rest N(0, 0.02^2)."""
    rng = np.random.default_rng(seed)

    def value(n: str, shape: tuple[int, ...]) -> np.ndarray:
        if n.endswith(("_min", "_max")):
            return np.full(shape, -np.inf if n.endswith("_min") else np.inf, np.float32)
        return np.ones(shape, np.float32) if "norm" in n or "std_scale" in n else \
            rng.normal(0.0, 0.02, shape).astype(np.float32)

    return load_gemma4_vision_params(cfg, ((n, value(n, s)) for n, s in _expected(cfg).items()), dtype)


def _norm(x: jax.Array, w: jax.Array | None, eps: float) -> jax.Array:
    """Gemma 4's RMSNorm: in float32, times the weight (none: unit), back in x's dtype."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf if w is None else xf * w.astype(jnp.float32)).astype(x.dtype)


def _linear(x: jax.Array, w: jax.Array, clips: jax.Array | None, i: int) -> jax.Array:
    if clips is not None:
        x = jnp.clip(x, clips[i, 0].astype(x.dtype), clips[i, 1].astype(x.dtype))
    y = x @ w
    return y if clips is None else jnp.clip(y, clips[i, 2].astype(y.dtype), clips[i, 3].astype(y.dtype))


def _rotary(cfg: Gemma4VisionConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin [N, D]: a head's first half turned by each patch's column, its second half by its row, each half
    rotated in halves of its own (rotate_half) by `head_dim / 4` frequencies over `head_dim / 2`."""
    half = cfg.head_dim // 2
    inv = 1.0 / cfg.rope_theta ** (jnp.arange(0, half, 2, dtype=jnp.float32) / half)  # [D / 4]
    angles = positions.astype(jnp.float32)[:, :, None] * inv  # [N, 2, D / 4]
    col, row = angles[:, 0], angles[:, 1]
    both = jnp.concatenate([col, col, row, row], axis=-1)  # [N, D]
    return jnp.cos(both), jnp.sin(both)


def _turn(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [N, heads, D] rotated: each half of each head by its own angles (rotate_half within the half)."""
    out = []
    for part in range(2):
        h = x.shape[-1] // 2
        xp, c, s = x[..., part * h:(part + 1) * h], cos[:, None, part * h:(part + 1) * h], sin[:, None, part * h:
                                                                                               (part + 1) * h]
        x1, x2 = xp[..., :h // 2], xp[..., h // 2:]
        out.append(xp * c.astype(x.dtype) + jnp.concatenate([-x2, x1], axis=-1) * s.astype(x.dtype))
    return jnp.concatenate(out, axis=-1)


def gemma4_encode(params: Gemma4VisionParams, cfg: Gemma4VisionConfig, patches: jax.Array,
                  positions: jax.Array) -> jax.Array:
    """An image's soft tokens in the language model's width [N / pooling^2, E] (the rows past its own, from its
    padding patches, to be cut off) from its patches [N, P * P * 3] and their (column, row) positions [N, 2] (-1:
    padding)."""
    dtype = params.patch.dtype
    N, H, D = patches.shape[0], cfg.hidden_size, cfg.head_dim
    valid = jnp.all(positions >= 0, axis=-1)  # [N]
    at = jnp.maximum(positions, 0)
    x = (2.0 * (patches.astype(jnp.float32) - 0.5)).astype(dtype) @ params.patch
    x = x + jnp.where(valid[:, None], params.positions[0][at[:, 0]] + params.positions[1][at[:, 1]], 0).astype(dtype)
    cos, sin = _rotary(cfg, positions)
    group = cfg.num_heads // cfg.num_kv_heads

    def block(x: jax.Array, lp: dict[str, jax.Array]) -> tuple[jax.Array, None]:
        clips = lp.get("clips")
        h = _norm(x, lp["attn_norm"], cfg.eps)
        q = _norm(_linear(h, lp["q_proj"], clips, 0).reshape(N, cfg.num_heads, D), lp["q_norm"], cfg.eps)
        k = _norm(_linear(h, lp["k_proj"], clips, 1).reshape(N, cfg.num_kv_heads, D), lp["k_norm"], cfg.eps)
        v = _norm(_linear(h, lp["v_proj"], clips, 2).reshape(N, cfg.num_kv_heads, D), None, cfg.eps)
        q, k = _turn(q, cos, sin), _turn(k, cos, sin)
        k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
        s = jnp.einsum("qhd,khd->hqk", q, k, preferred_element_type=jnp.float32)  # (unscaled)
        p = jax.nn.softmax(jnp.where(valid[None, None, :], s, -jnp.inf), axis=-1).astype(dtype)
        attn = jnp.einsum("hqk,khd->qhd", p, v).reshape(N, -1)
        x = x + _norm(_linear(attn, lp["o_proj"], clips, 3), lp["post_attn_norm"], cfg.eps)
        h = _norm(x, lp["mlp_norm"], cfg.eps)
        gate = jax.nn.gelu(_linear(h, lp["gate_proj"], clips, 4), approximate=True)
        mlp = _linear(gate * _linear(h, lp["up_proj"], clips, 5), lp["down_proj"], clips, 6)
        return x + _norm(mlp, lp["post_mlp_norm"], cfg.eps), None

    x, _ = jax.lax.scan(block, x, params.layers)
    # Each k x k square of patches (by position) averaged into one soft token, row by row of squares.
    k = cfg.pooling
    cols = (jnp.max(at[:, 0]) + 1) // k
    square = at[:, 0] // k + cols * (at[:, 1] // k)
    x = jnp.where(valid[:, None], x, 0).astype(jnp.float32)
    pooled = jax.ops.segment_sum(x / (k * k), square, num_segments=N // (k * k)) * (H ** 0.5)
    if params.std is not None:
        pooled = (pooled - params.std[0]) * params.std[1]
    return _norm(pooled.astype(dtype), None, cfg.eps) @ params.proj
