"""The vision side of Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5 (transformers'
`Qwen2VisionTransformerPretrainedModel`, `Qwen2_5_VisionTransformerPretrainedModel`, `Qwen3VLVisionModel`: its
additions in `models.vision_qwen3`), as pure functions.

An image comes as `t * h * w` flattened patches (`jaxserve.images_qwen2.QwenImageProcessor`), ordered so that each
`merge x merge` square of neighbouring patches is consecutive. A matrix embeds each patch (the checkpoint's Conv3d,
whose stride equals its kernel); pre-norm blocks follow, each rotating q and k by the patch's row and column (2D
rotary embedding, the same frequencies for both halves) and letting a patch attend only to patches of its own
frame, or, on Qwen2.5-VL's windowed layers (those not in `fullatt_block_indexes`), of its own window of
`window_size` pixels. The merger then norms each patch, concatenates each group of `merge**2` and maps it through
Linear-GELU-Linear to the language model's width: one embedding per image token.

Compiled shapes stay bounded: the patches of one or more images are padded up to a bucket (64 patches times a power
of two), and the images' structure travels as arrays, each patch's (row, column) and a segment id per attention
kind: every layer attends within "same segment", a block of queries at a time (scores [heads, block, bucket]).
transformers reorders the patches by window before its windowed layers and back after the merger; segments over
the processor's order give the same result (windows hold whole merge groups). Padding patches have segment -1."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.errors import UnsupportedModelError
from jaxserve.models import vision_qwen3 as qwen3
from jaxserve.models.vision_blocks import ACTIVATIONS, attend, rotate
from jaxserve.models.vision_qwen2_config import (  # noqa: F401 (here too)
    _PREFIXES,
    EXAONE,
    QWEN_VISION_ARCHITECTURES,
    QwenVisionConfig,
)
from jaxserve.models.vision_qwen2_layout import (  # noqa: F401 (here too)
    BUCKET_UNIT,
    qwen_bucket,
    qwen_layout,
    qwen_token_grid,
    qwen_tokens,
)


@jax.tree_util.register_dataclass
@dataclass
class QwenVisionParams:
    """The tower's and merger's weights, matrices stored [in, out]; the blocks' stacked on a leading axis."""

    patch: jax.Array  # [C * T * P * P, E]: the patch embedding over (channel, frame, row, column)
    layers: dict[str, jax.Array]  # each [L, ...]: see `_layer_tensors`
    merger: dict[str, jax.Array]  # see `_merger_tensors`
    extra: dict[str, jax.Array] | None = None  # Qwen3-VL: the patch embedding's bias, the position embeddings
    deep: dict[str, jax.Array] | None = None  # Qwen3-VL: the deepstack mergers', each [len(indexes), ...]


def _layer_tensors(cfg: QwenVisionConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The one declaration of a block's tensors: HF name (under `blocks.N.`) -> (our key, HF shape)."""
    E, inner, qkv = cfg.embed_dim, cfg.intermediate_size, (cfg.num_heads + 2 * cfg.kv_heads) * cfg.head_dim
    names = {"norm1.weight": ("norm1", (E,)), "norm2.weight": ("norm2", (E,)),
             "attn.qkv.weight": ("wqkv", (qkv, E)), "attn.qkv.bias": ("bqkv", (qkv,)),
             "attn.proj.weight": ("wo", (E, E)), "attn.proj.bias": ("bo", (E,))}
    if cfg.layer_norm:  # LayerNorm and a two-matrix MLP
        fc = ("mlp.linear_fc1", "mlp.linear_fc2") if cfg.variant == "qwen3_vl" else ("mlp.fc1", "mlp.fc2")
        return {**names, "norm1.bias": ("norm1_b", (E,)), "norm2.bias": ("norm2_b", (E,)),
                f"{fc[0]}.weight": ("fc1", (inner, E)), f"{fc[0]}.bias": ("fc1_b", (inner,)),
                f"{fc[1]}.weight": ("fc2", (E, inner)), f"{fc[1]}.bias": ("fc2_b", (E,))}
    return {**names, "mlp.gate_proj.weight": ("gate", (inner, E)), "mlp.gate_proj.bias": ("gate_b", (inner,)),
            "mlp.up_proj.weight": ("up", (inner, E)), "mlp.up_proj.bias": ("up_b", (inner,)),
            "mlp.down_proj.weight": ("down", (E, inner)), "mlp.down_proj.bias": ("down_b", (E,))}


def _merger_tensors(cfg: QwenVisionConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The merger's tensors: HF name (under `merger.`) -> (our key, HF shape)."""
    E, wide = cfg.embed_dim, cfg.embed_dim * cfg.merge_unit
    if cfg.variant == "qwen3_vl":
        return qwen3.merger_tensors(E, wide, cfg.out_hidden_size)
    names = {"ln_q.weight": ("norm", (E,)), "mlp.0.weight": ("w1", (wide, wide)), "mlp.0.bias": ("b1", (wide,)),
             "mlp.2.weight": ("w2", (cfg.out_hidden_size, wide)), "mlp.2.bias": ("b2", (cfg.out_hidden_size,))}
    return {**names, "ln_q.bias": ("norm_b", (E,))} if cfg.variant == "qwen2_vl" else names


def _patch_shape(cfg: QwenVisionConfig) -> tuple[int, ...]:
    return (cfg.embed_dim, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)


def is_qwen_vision_tensor(name: str) -> bool:
    """Whether an HF tensor belongs to the Qwen2-VL / Qwen2.5-VL vision tower or merger."""
    return name.startswith(_PREFIXES)


def load_qwen_vision_params(cfg: QwenVisionConfig, tensors: Iterable[tuple[str, np.ndarray]],
                            dtype: Any) -> QwenVisionParams:
    """The vision weights from (HF name, array) pairs under `visual.` or `model.visual.` (others are skipped),
    converted to `dtype`; refuses a missing, duplicate, unknown or misshapen tensor by its name."""
    layer_names, merger_names = _layer_tensors(cfg), _merger_tensors(cfg)
    found: dict[str, np.ndarray] = {}
    for name, array in tensors:
        prefix = next((p for p in _PREFIXES if name.startswith(p)), None)
        if prefix is None:
            continue
        rest = name[len(prefix):]
        if rest in found:
            raise UnsupportedModelError(f"vision tensor {rest!r} appears twice in the checkpoint")
        found[rest] = np.asarray(array)
    expected = {"patch_embed.proj.weight": _patch_shape(cfg)}
    expected |= {f"blocks.{i}.{n}": shape for i in range(cfg.depth) for n, (_, shape) in layer_names.items()}
    expected |= {f"merger.{n}": shape for n, (_, shape) in merger_names.items()}
    if cfg.variant == "qwen3_vl":
        expected |= qwen3.expected_qwen3(cfg)
    missing = [n for n in expected if n not in found]
    if missing:
        raise UnsupportedModelError(f"the checkpoint lacks vision tensors: visual.{', visual.'.join(missing[:6])}"
                                    + (f" and {len(missing) - 6} more" if len(missing) > 6 else ""))
    unknown = sorted(set(found) - set(expected))
    if unknown:
        raise UnsupportedModelError(f"unexpected vision tensors: visual.{', visual.'.join(unknown[:6])}")
    for n, shape in expected.items():
        if found[n].shape != shape:
            raise UnsupportedModelError(f"vision tensor visual.{n} has shape {found[n].shape}, the config says {shape}")

    def stored(a: np.ndarray, shape: tuple[int, ...]) -> jax.Array:  # an HF matrix [out, in] is stored [in, out]
        return jnp.asarray(np.swapaxes(a, -1, -2) if len(shape) == 2 else a, dtype)

    return QwenVisionParams(
        patch=jnp.asarray(found["patch_embed.proj.weight"].astype(np.float32).reshape(cfg.embed_dim, -1).T, dtype),
        layers={key: stored(np.stack([found[f"blocks.{i}.{n}"] for i in range(cfg.depth)]), shape)
                for n, (key, shape) in layer_names.items()},
        merger={key: stored(found[f"merger.{n}"], shape) for n, (key, shape) in merger_names.items()},
        **(qwen3.load_qwen3_extras(cfg, found, dtype) if cfg.variant == "qwen3_vl" else {}))


def qwen_vision_tensors(params: QwenVisionParams, cfg: QwenVisionConfig,
                        prefix: str = "model.visual.") -> Iterator[tuple[str, np.ndarray]]:
    """The weights back under HF names (`prefix` then transformers' names), float32, for a checkpoint writer."""
    host = lambda a: np.asarray(jnp.asarray(a, jnp.float32))  # noqa: E731
    yield prefix + "patch_embed.proj.weight", host(params.patch).T.reshape(_patch_shape(cfg))
    for n, (key, shape) in _layer_tensors(cfg).items():
        stacked = host(params.layers[key])
        for i in range(cfg.depth):
            yield f"{prefix}blocks.{i}.{n}", stacked[i].T if len(shape) == 2 else stacked[i]
    for n, (key, shape) in _merger_tensors(cfg).items():
        yield f"{prefix}merger.{n}", host(params.merger[key]).T if len(shape) == 2 else host(params.merger[key])
    if cfg.variant == "qwen3_vl":
        yield from qwen3.qwen3_extra_tensors(params, cfg, prefix, host)


def random_qwen_vision_params(cfg: QwenVisionConfig, dtype: Any, seed: int = 0) -> QwenVisionParams:
    """Random weights of the config's shapes (`--load-format dummy`): norms 1, the rest N(0, 0.02^2)."""
    rng = np.random.default_rng(seed)

    def make(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if "norm" in name or "ln_q" in name:  # weights 1, biases 0
            return np.full(shape, float(name.endswith("weight")), np.float32)
        return rng.normal(0.0, 0.02, shape).astype(np.float32)

    named = [("patch_embed.proj.weight", make("patch", _patch_shape(cfg)))]
    named += [(f"blocks.{i}.{n}", make(n, shape)) for i in range(cfg.depth) for n, (_, shape) in
              _layer_tensors(cfg).items()]
    named += [(f"merger.{n}", make(n, shape)) for n, (_, shape) in _merger_tensors(cfg).items()]
    if cfg.variant == "qwen3_vl":
        named += [(n, make(n, shape)) for n, shape in qwen3.expected_qwen3(cfg).items()]
    return load_qwen_vision_params(cfg, (("visual." + n, a) for n, a in named), dtype)


def _norm(cfg: QwenVisionConfig, x: jax.Array, w: jax.Array, b: jax.Array | None) -> jax.Array:
    """Qwen2-VL's and Qwen3-VL's LayerNorm (with `b`) or Qwen2.5-VL's RMSNorm, in float32."""
    xf = x.astype(jnp.float32)
    if cfg.layer_norm:
        xf = xf - xf.mean(-1, keepdims=True)
        return (xf * jax.lax.rsqrt(jnp.square(xf).mean(-1, keepdims=True) + cfg.norm_eps) * w.astype(jnp.float32)
                + b.astype(jnp.float32)).astype(x.dtype)
    return w * (xf * jax.lax.rsqrt(jnp.square(xf).mean(-1, keepdims=True) + cfg.norm_eps)).astype(x.dtype)


def _rotary(cfg: QwenVisionConfig, pos: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos and sin [N, D] (float32) of patches at pos [N, 2] (row, column): D / 4 frequencies, turned by the row in
    the first quarter and by the column in the second, the half repeated over the head's other half."""
    half = cfg.head_dim // 2
    inv_freq = 1.0 / cfg.rope_theta ** (jnp.arange(0, half, 2, dtype=jnp.float32) / half)  # [D / 4]
    angles = (pos[:, :, None].astype(jnp.float32) * inv_freq).reshape(pos.shape[0], half)  # [N, D / 2]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def _block(cfg: QwenVisionConfig, x: jax.Array, lp: dict[str, jax.Array], rope: tuple[jax.Array, jax.Array],
           seg: jax.Array) -> jax.Array:
    """One pre-norm block over the patches x [N, E]; a patch attends to the patches of its segment (seg [N])."""
    N, E = x.shape
    with jax.named_scope("qwen_vision_attention"):
        h = _norm(cfg, x, lp["norm1"], lp.get("norm1_b"))
        H, Hkv, D = cfg.num_heads, cfg.kv_heads, cfg.head_dim
        qkv = (h @ lp["wqkv"] + lp["bqkv"]).reshape(N, H + 2 * Hkv, D)  # q [N, H, D], then k and v [N, Hkv, D]
        # (grouped KV heads repeated to the query heads: the tower's attention is small beside the decoder's)
        k, v = (jnp.repeat(a, H // Hkv, axis=1) for a in (qkv[:, H:H + Hkv], qkv[:, H + Hkv:]))
        q, k = rotate(qkv[:, :H], *rope), rotate(k, *rope)
        x = x + attend(q, k, v, seg).reshape(N, E) @ lp["wo"] + lp["bo"]
    with jax.named_scope("qwen_vision_mlp"):
        h = _norm(cfg, x, lp["norm2"], lp.get("norm2_b"))
        act = ACTIVATIONS[cfg.hidden_act]
        if cfg.layer_norm:
            return x + act(h @ lp["fc1"] + lp["fc1_b"]) @ lp["fc2"] + lp["fc2_b"]
        return x + (act(h @ lp["gate"] + lp["gate_b"]) * (h @ lp["up"] + lp["up_b"])) @ lp["down"] + lp["down_b"]


def _merge(cfg: QwenVisionConfig, x: jax.Array, m: dict[str, jax.Array], after: bool = False) -> jax.Array:
    """Patches x [B, E] merged into image tokens [B / merge**2, out]: each normed (or, `after`, each merge group's
    concatenation: Qwen3-VL's deepstack mergers), a group's concatenated, then Linear-GELU-Linear."""
    h = _norm(cfg, x.reshape(x.shape[0] // cfg.merge_unit, -1) if after else x, m["norm"], m.get("norm_b"))
    h = h.reshape(x.shape[0] // cfg.merge_unit, -1)
    return jax.nn.gelu(h @ m["w1"] + m["b1"], approximate=False) @ m["w2"] + m["b2"]


def _encode_padded(params: QwenVisionParams, cfg: QwenVisionConfig, patches: jax.Array, pos: jax.Array,
                   frames: jax.Array, windows: jax.Array, taps: jax.Array | None = None,
                   tap_weights: jax.Array | None = None) -> jax.Array:
    """A bucket of patches [B, C * T * P * P] with their (row, column) pos [B, 2] and segment ids (frames [B] for
    full attention, windows [B] for windowed; -1 for padding) as embeddings [B / merge**2, embed_width]; Qwen3-VL's
    position embeddings read through `taps` and `tap_weights` [B, 4] (`vision_qwen3.position_taps`)."""
    x = patches.astype(params.patch.dtype) @ params.patch  # [B, E]
    if params.extra is not None:
        x = qwen3.embed_positions(params, x, taps, tap_weights)
    rope = _rotary(cfg, pos)

    def step(x, layer):
        lp, full = layer
        return _block(cfg, x, lp, rope, jnp.where(full, frames, windows)), None

    deep, start = [], 0  # the blocks in runs, each ending at a deepstack block (whose output is kept)
    for end in (*sorted(cfg.deepstack_visual_indexes), cfg.depth - 1):
        run = jax.tree.map(lambda a, s=start, e=end: a[s:e + 1], (params.layers, jnp.asarray(cfg.full_layers)))
        with jax.named_scope("qwen_vision_blocks"):
            x, _ = jax.lax.scan(step, x, run)
        deep.append(x)
        start = end + 1
    with jax.named_scope("qwen_vision_merger"):  # deepstack: in block order, each block by its own merger
        out = [_merge(cfg, x, params.merger)]
        for kept, block in zip(deep[:-1], sorted(cfg.deepstack_visual_indexes), strict=True):
            i = cfg.deepstack_visual_indexes.index(block)
            out.append(_merge(cfg, kept, jax.tree.map(lambda a, i=i: a[i], params.deep), after=True))
        return jnp.concatenate(out, axis=-1)


_encode_jit = jax.jit(_encode_padded, static_argnums=1)


def qwen_encode_many(params: QwenVisionParams, cfg: QwenVisionConfig,
                     images: Sequence[tuple[np.ndarray, tuple[int, int, int]]]) -> list[np.ndarray]:
    """Several images' patches [t * h * w, C * T * P * P] with their grids (t, h, w), encoded in one call (one
    bucket holding them all): each image's embeddings [qwen_tokens(grid), embed_width], in the params' dtype."""
    if not images:
        raise ValueError("no images to encode")
    grids = [tuple(int(n) for n in grid) for _, grid in images]
    for (patches, _), (t, h, w) in zip(images, grids, strict=True):
        if patches.shape != (t * h * w, cfg.patch_dim):
            raise ValueError(f"patches of shape {patches.shape} for grid {(t, h, w)}: expected "
                             f"{(t * h * w, cfg.patch_dim)}")
    pos, frames, windows = qwen_layout(cfg, grids)
    pad = qwen_bucket(pos.shape[0]) - pos.shape[0]
    flat = np.concatenate([np.asarray(p, np.float32) for p, _ in images])
    taps = qwen3.position_taps(cfg, pos, grids) if cfg.num_position_embeddings else (None, None)
    taps = [None if a is None else np.pad(a, ((0, pad), (0, 0))) for a in taps]  # (padding: cell 0, weight 0)
    out = _encode_jit(params, cfg, np.pad(flat, ((0, pad), (0, 0))), np.pad(pos, ((0, pad), (0, 0))),
                      np.pad(frames, (0, pad), constant_values=-1), np.pad(windows, (0, pad), constant_values=-1),
                      *taps)
    out = np.asarray(out)
    ends = np.cumsum([qwen_tokens(g, cfg) for g in grids])
    return np.split(out[:ends[-1]], ends[:-1])


def qwen_encode(params: QwenVisionParams, cfg: QwenVisionConfig, patches: np.ndarray,
                grid: tuple[int, int, int]) -> np.ndarray:
    """One image's patches [t * h * w, C * T * P * P] (`QwenImageProcessor`'s) as language-model embeddings
    [t * h * w / merge**2, embed_width], in the params' dtype."""
    return qwen_encode_many(params, cfg, [(patches, grid)])[0]
