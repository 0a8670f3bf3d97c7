"""InternVL's vision side (`InternVLForConditionalGeneration`: InternVL3 and InternVL3.5 in transformers' layout): the
InternViT tower over square tiles, its features' 2 x 2 neighbours folded into one token (pixel shuffle) and the
projector (LayerNorm, Linear, GELU, Linear) to the language model's width.

InternViT is a ViT: a biased patch convolution, a class token, learned absolute positions, then blocks that norm
(LayerNorm or RMSNorm) before attention and before the MLP, each branch scaled per channel (LayerScale: `lambda_1`,
`lambda_2`) before its residual add; q and k optionally RMS-normed over all heads (InternViT-6B). Every patch of a
tile attends to every other. The features of `vision_feature_layer` (the class token dropped) are a g x g grid; pixel
shuffle makes each 2 x 2 square one token of 4x the width, channels over (row in square, column in square, channel).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.errors import UnsupportedModelError
from jaxserve.models.vision_blocks import ACTIVATIONS, pixel_shuffle

ARCHITECTURES = ("InternVLForConditionalGeneration",)
_RE = re.compile(r"^(model\.)?(vision_tower|multi_modal_projector)\.")
# HF tensor (under `vision_tower.encoder.layer.N.`) -> our layer key; matrices transposed to [in, out].
_LAYER = {"layernorm_before.weight": "ln1", "layernorm_before.bias": "ln1_b", "layernorm_after.weight": "ln2",
          "layernorm_after.bias": "ln2_b", "attention.q_proj.weight": "wq", "attention.q_proj.bias": "bq",
          "attention.k_proj.weight": "wk", "attention.k_proj.bias": "bk", "attention.v_proj.weight": "wv",
          "attention.v_proj.bias": "bv", "attention.q_norm.weight": "q_norm", "attention.k_norm.weight": "k_norm",
          "attention.projection_layer.weight": "wo", "attention.projection_layer.bias": "bo", "lambda_1": "scale1",
          "lambda_2": "scale2", "mlp.fc1.weight": "fc1", "mlp.fc1.bias": "fc1_b", "mlp.fc2.weight": "fc2",
          "mlp.fc2.bias": "fc2_b"}
_PROJECTOR = ("layer_norm.weight", "layer_norm.bias", "linear_1.weight", "linear_1.bias", "linear_2.weight",
              "linear_2.bias")


@dataclass(frozen=True)
class InternVisionConfig:
    """InternViT and InternVL's projector, and the token that stands for an image's features in a prompt."""

    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    hidden_act: str
    image_size: int  # a tile's side in pixels (square)
    patch_size: int
    num_channels: int
    rms_norm: bool  # the blocks' norms: RMSNorm (InternViT-6B) or LayerNorm (InternViT-300M)
    norm_eps: float
    qk_norm: bool
    attention_bias: bool
    final_norm: bool  # a LayerNorm after the last block (`use_mean_pooling` off)
    feature_layer: int  # which hidden state is read: 0 the embeddings, i after block i
    read_last: bool  # `vision_feature_layer` -1: the tower's output, after its final norm (if it has one)
    drop_cls: bool  # `vision_feature_select_strategy` "default"
    shuffle: int  # the side of the square of features folded into one token (1 / downsample_ratio)
    projector_act: str
    text_hidden_size: int
    image_token_id: int  # `<IMG_CONTEXT>`: one per token of a tile
    bidirectional = False  # (not a field) the language model attends causally over an image's tokens
    boi_token_id = None  # (not a field) the image token is the placeholder

    @property
    def grid(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens_per_tile(self) -> int:
        return (self.grid // self.shuffle) ** 2

    @property
    def feature_width(self) -> int:
        return self.hidden_size * self.shuffle**2

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> InternVisionConfig | None:
        """The vision side of an HF `config.json` (None when it is not InternVL's); refuses what it cannot run."""
        if not set(ARCHITECTURES) & set(d.get("architectures") or []) and d.get("model_type") != "internvl":
            return None
        v = {k: x for k, x in (d.get("vision_config") or {}).items() if x is not None}
        size, patch = v.get("image_size", 448), v.get("patch_size", 14)
        size = size if isinstance(size, int) else tuple(size)
        patch = patch if isinstance(patch, int) else tuple(patch)
        if not isinstance(size, int) and len(set(size)) != 1 or not isinstance(patch, int) and len(set(patch)) != 1:
            raise UnsupportedModelError(f"InternViT image_size {size} and patch_size {patch} must be square")
        size, patch = (x if isinstance(x, int) else x[0] for x in (size, patch))
        ratio = float(d.get("downsample_ratio", 0.5))
        shuffle = round(1 / ratio)
        if abs(shuffle * ratio - 1) > 1e-9 or (size // patch) % shuffle:
            raise UnsupportedModelError(f"downsample_ratio {ratio} must be 1 / n for an n dividing the tile's "
                                        f"{size // patch} patches a side")
        norm = v.get("norm_type", "layer_norm")
        if norm not in ("layer_norm", "rms_norm"):
            raise UnsupportedModelError(f"InternViT norm_type {norm!r} is not supported (layer_norm, rms_norm)")
        if not v.get("use_absolute_position_embeddings", True):
            raise UnsupportedModelError("InternViT without absolute position embeddings is not supported")
        layers = int(v.get("num_hidden_layers", 24))
        feature = d.get("vision_feature_layer", -1)
        if not isinstance(feature, int) or not -(layers + 1) <= feature <= layers:
            raise UnsupportedModelError(f"vision_feature_layer {feature!r}: one layer of the tower's {layers + 1} "
                                        "hidden states is supported")
        strategy = d.get("vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise UnsupportedModelError(f"vision_feature_select_strategy {strategy!r} is not supported")
        for act in (v.get("hidden_act", "gelu"), d.get("projector_hidden_act", "gelu")):
            if act not in ACTIVATIONS:
                raise UnsupportedModelError(f"activation {act!r} is not supported in InternVL's vision side")
        return cls(
            hidden_size=int(v.get("hidden_size", 1024)), num_layers=layers, num_heads=int(v.get("num_attention_heads", 16)),
            intermediate_size=int(v.get("intermediate_size", 4096)), hidden_act=v.get("hidden_act", "gelu"),
            image_size=size, patch_size=patch, num_channels=int(v.get("num_channels", 3)), rms_norm=norm == "rms_norm",
            norm_eps=float(v.get("layer_norm_eps", 1e-6)), qk_norm=bool(v.get("use_qk_norm", False)),
            attention_bias=bool(v.get("attention_bias", False)), final_norm=not v.get("use_mean_pooling", True),
            feature_layer=feature % (layers + 1), read_last=feature == -1, drop_cls=strategy == "default", shuffle=shuffle,
            projector_act=d.get("projector_hidden_act", "gelu"),
            text_hidden_size=int((d.get("text_config") or {}).get("hidden_size", 896)),
            image_token_id=int(d.get("image_token_id", 151667)))


@jax.tree_util.register_dataclass
@dataclass
class InternVisionParams:
    """The tower's and projector's weights, matrices [in, out], layers stacked on a leading axis."""

    patch: jax.Array  # [C * p * p, Hv] over (channel, row, column) of a patch
    patch_bias: jax.Array
    cls: jax.Array  # [Hv]
    positions: jax.Array  # [1 + grid**2, Hv]
    layers: dict[str, jax.Array]
    final_norm: tuple[jax.Array, jax.Array] | None
    projector: dict[str, jax.Array]  # norm, norm_b [4 Hv]; w1 [4 Hv, E], b1; w2 [E, E], b2


def is_internvl_vision_tensor(name: str) -> bool:
    return _RE.match(name) is not None


def _layer_keys(cfg: InternVisionConfig) -> dict[str, str]:
    skip = set() if cfg.qk_norm else {"q_norm", "k_norm"}
    skip |= set() if cfg.attention_bias else {"bq", "bk", "bv"}
    skip |= {"ln1_b", "ln2_b"} if cfg.rms_norm else set()
    return {hf: k for hf, k in _LAYER.items() if k not in skip}


def load_internvl_vision_params(cfg: InternVisionConfig, tensors: Iterable[tuple[str, np.ndarray]],
                                dtype: Any) -> InternVisionParams:
    """The vision weights from (HF name, array) pairs, on the default device in `dtype`; all must be there."""
    keys, L = _layer_keys(cfg), cfg.num_layers
    layers: dict[str, list] = {k: [None] * L for k in keys.values()}
    top: dict[str, np.ndarray] = {}
    for name, array in tensors:
        m = _RE.match(name)
        if m is None:
            continue
        rest = name[m.end():]
        layer = re.match(r"encoder\.layer\.(\d+)\.(.+)$", rest) if m.group(2) == "vision_tower" else None
        if layer is None:
            top[f"{m.group(2)}.{rest}"] = array
            continue
        i, key = int(layer.group(1)), keys.get(layer.group(2))
        if key is None or i >= L:
            raise UnsupportedModelError(f"unexpected InternVL vision tensor {name!r}")
        layers[key][i] = array.T if array.ndim == 2 else array
    need = ["vision_tower.embeddings.cls_token", "vision_tower.embeddings.position_embeddings",
            "vision_tower.embeddings.patch_embeddings.projection.weight",
            "vision_tower.embeddings.patch_embeddings.projection.bias",
            *(f"multi_modal_projector.{n}" for n in _PROJECTOR)]
    need += ["vision_tower.layernorm.weight", "vision_tower.layernorm.bias"] if cfg.final_norm else []
    missing = [n for n in need if n not in top]
    missing += [f"encoder.layer.{i}.{hf}" for hf, k in keys.items() for i in range(L) if layers[k][i] is None]
    if missing:
        raise UnsupportedModelError(f"the checkpoint lacks InternVL vision tensors: {', '.join(missing[:6])}"
                                    + (f" and {len(missing) - 6} more" if len(missing) > 6 else ""))
    put = lambda a: jnp.asarray(np.asarray(a, np.float32), dtype)  # noqa: E731
    conv = top["vision_tower.embeddings.patch_embeddings.projection.weight"]
    want = (cfg.hidden_size, cfg.num_channels, cfg.patch_size, cfg.patch_size)
    if conv.shape != want:
        raise UnsupportedModelError(f"InternViT's patch convolution is {conv.shape}, its config says {want}")
    pos = top["vision_tower.embeddings.position_embeddings"].reshape(-1, cfg.hidden_size)
    if pos.shape[0] != 1 + cfg.grid**2:
        raise UnsupportedModelError(f"InternViT has {pos.shape[0]} positions, a {cfg.image_size}-pixel tile "
                                    f"{1 + cfg.grid**2}")
    p = {n: top[f"multi_modal_projector.{n}"] for n in _PROJECTOR}
    if p["linear_1.weight"].shape != (cfg.text_hidden_size, cfg.feature_width):
        raise UnsupportedModelError(f"InternVL's projector is {p['linear_1.weight'].shape} ([out, in]); the config's "
                                    f"widths say {(cfg.text_hidden_size, cfg.feature_width)}")
    return InternVisionParams(
        patch=put(conv.reshape(cfg.hidden_size, -1).T), patch_bias=put(top[need[3]]),
        cls=put(top[need[0]].reshape(-1)), positions=put(pos),
        layers={k: put(np.stack(v)) for k, v in layers.items()},
        final_norm=(put(top["vision_tower.layernorm.weight"]), put(top["vision_tower.layernorm.bias"]))
        if cfg.final_norm else None,
        projector={"norm": put(p["layer_norm.weight"]), "norm_b": put(p["layer_norm.bias"]),
                   "w1": put(p["linear_1.weight"].T), "b1": put(p["linear_1.bias"]),
                   "w2": put(p["linear_2.weight"].T), "b2": put(p["linear_2.bias"])})


def internvl_vision_tensors(params: InternVisionParams, cfg: InternVisionConfig,
                            prefix: str = "model.") -> Iterator[tuple[str, np.ndarray]]:
    """The weights under transformers' names (`model.vision_tower.`, `model.multi_modal_projector.`), float32."""
    host = lambda a: np.asarray(jnp.asarray(a, jnp.float32))  # noqa: E731
    tower = f"{prefix}vision_tower."
    yield f"{tower}embeddings.cls_token", host(params.cls).reshape(1, 1, -1)
    yield f"{tower}embeddings.position_embeddings", host(params.positions)[None]
    yield f"{tower}embeddings.patch_embeddings.projection.weight", host(params.patch).T.reshape(
        cfg.hidden_size, cfg.num_channels, cfg.patch_size, cfg.patch_size)
    yield f"{tower}embeddings.patch_embeddings.projection.bias", host(params.patch_bias)
    for hf, key in _layer_keys(cfg).items():
        stacked = host(params.layers[key])
        for i in range(cfg.num_layers):
            yield f"{tower}encoder.layer.{i}.{hf}", stacked[i].T if stacked.ndim == 3 else stacked[i]
    if params.final_norm is not None:
        yield f"{tower}layernorm.weight", host(params.final_norm[0])
        yield f"{tower}layernorm.bias", host(params.final_norm[1])
    p = params.projector
    for hf, value in zip(_PROJECTOR, (p["norm"], p["norm_b"], p["w1"].T, p["b1"], p["w2"].T, p["b2"]), strict=True):
        yield f"{prefix}multi_modal_projector.{hf}", host(value)


def random_internvl_vision_params(cfg: InternVisionConfig, dtype: Any, seed: int = 0) -> InternVisionParams:
    """Random weights of the config's shapes (`--load-format dummy`)."""
    rng = np.random.default_rng(seed)
    Hv, E, F, L = cfg.hidden_size, cfg.text_hidden_size, cfg.intermediate_size, cfg.num_layers
    shapes = {"ln1": (Hv,), "ln1_b": (Hv,), "ln2": (Hv,), "ln2_b": (Hv,), "wq": (Hv, Hv), "bq": (Hv,),
              "wk": (Hv, Hv), "bk": (Hv,), "wv": (Hv, Hv), "bv": (Hv,), "q_norm": (Hv,), "k_norm": (Hv,),
              "wo": (Hv, Hv), "bo": (Hv,), "scale1": (Hv,), "scale2": (Hv,), "fc1": (Hv, F), "fc1_b": (F,),
              "fc2": (F, Hv), "fc2_b": (Hv,)}
    tower = "model.vision_tower."
    named = [(f"{tower}encoder.layer.{i}.{hf}", rng.normal(0, 0.02, shapes[k][::-1]).astype(np.float32))
             for hf, k in _layer_keys(cfg).items() for i in range(L)]
    W = cfg.feature_width
    named += [(f"{tower}embeddings.cls_token", rng.normal(0, 0.02, (1, 1, Hv))),
              (f"{tower}embeddings.position_embeddings", rng.normal(0, 0.02, (1, 1 + cfg.grid**2, Hv))),
              (f"{tower}embeddings.patch_embeddings.projection.weight",
               rng.normal(0, 0.02, (Hv, cfg.num_channels, cfg.patch_size, cfg.patch_size))),
              (f"{tower}embeddings.patch_embeddings.projection.bias", np.zeros(Hv)),
              (f"{tower}layernorm.weight", np.ones(Hv)), (f"{tower}layernorm.bias", np.zeros(Hv)),
              ("model.multi_modal_projector.layer_norm.weight", np.ones(W)),
              ("model.multi_modal_projector.layer_norm.bias", np.zeros(W)),
              ("model.multi_modal_projector.linear_1.weight", rng.normal(0, 0.02, (E, W))),
              ("model.multi_modal_projector.linear_1.bias", np.zeros(E)),
              ("model.multi_modal_projector.linear_2.weight", rng.normal(0, 0.02, (E, E))),
              ("model.multi_modal_projector.linear_2.bias", np.zeros(E))]
    return load_internvl_vision_params(cfg, named, dtype)


def _norm(x: jax.Array, w: jax.Array, b: jax.Array | None, eps: float) -> jax.Array:
    """LayerNorm (with `b`) or RMSNorm (without), in float32; RMSNorm's weight applied in x's dtype, as
    transformers' InternViT applies it."""
    xf = x.astype(jnp.float32)
    if b is None:
        return w * (xf * jax.lax.rsqrt(jnp.square(xf).mean(-1, keepdims=True) + eps)).astype(x.dtype)
    xf = xf - xf.mean(-1, keepdims=True)
    return (xf * jax.lax.rsqrt(jnp.square(xf).mean(-1, keepdims=True) + eps) * w.astype(jnp.float32)
            + b.astype(jnp.float32)).astype(x.dtype)


def _block(cfg: InternVisionConfig, x: jax.Array, lp: dict[str, jax.Array]) -> jax.Array:
    """One block over tiles x [B, N, Hv]."""
    B, N, Hv = x.shape
    H, act = cfg.num_heads, ACTIVATIONS[cfg.hidden_act]
    bias = lambda name: lp.get(name, 0)  # noqa: E731
    h = _norm(x, lp["ln1"], lp.get("ln1_b"), cfg.norm_eps)
    q, k, v = (h @ lp[w] + bias(b) for w, b in (("wq", "bq"), ("wk", "bk"), ("wv", "bv")))
    if cfg.qk_norm:  # over all heads at once, its own eps (transformers' default)
        q, k = _norm(q, lp["q_norm"], None, 1e-6), _norm(k, lp["k_norm"], None, 1e-6)
    q, k, v = (a.reshape(B, N, H, -1) for a in (q, k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * (Hv // H) ** -0.5
    attn = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1).astype(v.dtype), v).reshape(B, N, Hv)
    x = x + lp["scale1"] * (attn @ lp["wo"] + lp["bo"])
    h = _norm(x, lp["ln2"], lp.get("ln2_b"), cfg.norm_eps)
    return x + lp["scale2"] * (act(h @ lp["fc1"] + lp["fc1_b"]) @ lp["fc2"] + lp["fc2_b"])


def encode_internvl(params: InternVisionParams, cfg: InternVisionConfig, pixels: jax.Array) -> jax.Array:
    """Tiles `pixels` [B, C, S, S] (normalized, `images_internvl`'s) as language-model embeddings
    [B, tokens_per_tile, E]."""
    B = pixels.shape[0]
    p, g, s = cfg.patch_size, cfg.grid, cfg.shuffle
    dtype = params.patch.dtype
    patches = pixels.astype(dtype).reshape(B, cfg.num_channels, g, p, g, p).transpose(0, 2, 4, 1, 3, 5)
    x = patches.reshape(B, g * g, -1) @ params.patch + params.patch_bias
    x = jnp.concatenate([jnp.broadcast_to(params.cls, (B, 1, x.shape[-1])), x], axis=1) + params.positions
    layers = jax.tree.map(lambda a: a[:cfg.feature_layer], params.layers)  # blocks past the one read never run
    if cfg.feature_layer:
        x, _ = jax.lax.scan(lambda x, lp: (_block(cfg, x, lp), None), x, layers)
    if params.final_norm is not None and cfg.read_last:
        x = _norm(x, *params.final_norm, cfg.norm_eps)
    feats = x[:, 1:] if cfg.drop_cls else x
    if feats.shape[1] != g * g:
        raise UnsupportedModelError("vision_feature_select_strategy 'full' keeps the class token: its features are "
                                    "not a square grid to fold")
    feats = pixel_shuffle(feats, s)
    pr = params.projector
    h = _norm(feats, pr["norm"], pr["norm_b"], 1e-5)  # (the projector's LayerNorm: torch's default eps)
    return ACTIVATIONS[cfg.projector_act](h @ pr["w1"] + pr["b1"]) @ pr["w2"] + pr["b2"]
