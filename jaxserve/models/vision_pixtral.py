"""The vision side of Pixtral-style image-text models, as pure functions: Mistral 3 (`Mistral3ForConditionalGeneration`,
Mistral Small 3.1 / 3.2) and LLaVA over a Pixtral tower (`LlavaForConditionalGeneration` with a `pixtral`
vision_config, Pixtral-12B in HF form).

An image comes whole, [C, H, W] pixels with sides multiples of the patch (times the merge size for Mistral 3:
`jaxserve.images_pixtral.PixtralImageProcessor`). A matrix embeds each patch (the checkpoint's Conv2d, whose stride
equals its kernel), an RMSNorm follows (`ln_pre`), then pre-norm blocks: RMSNorm, attention over the image's own
patches with q and k rotated by the patch's row and column, RMSNorm, a gated MLP. The rotary embedding gives a
head's first quarter of dimensions the even frequencies of a 1D rotary over the head turned by the row, the second
quarter the odd ones turned by the column, and repeats that half (transformers counts rows and columns from 0 in
each image; no table of `image_size / patch_size` entries is involved). The hidden state `vision_feature_layer`
picks (-1: the last block's output; there is no final norm) feeds the projector:
- Mistral 3: an RMSNorm, then the patch merger, which concatenates each `merge x merge` square of patches over
  (feature, row in the square, column in the square) and maps it by a matrix back to the tower's width, then
  Linear-act-Linear to the language model's width: (h / merge) * (w / merge) embeddings, row by row.
- LLaVA: Linear-act-Linear on every patch: h * w embeddings, row by row.

Compiled shapes stay bounded as in `vision_qwen2`: the patches of one or more images are padded up to a bucket (64
patches times a power of two), each patch carrying its (row, column) and its image's segment id (-1 for padding);
attention stays within a segment, a block of queries at a time. Patches lie in the bucket merge square by merge
square (the squares row by row, each square's patches row by row), so the merger is a reshape.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.errors import UnsupportedModelError
from jaxserve.models.vision_blocks import ACTIVATIONS, attend, rotate
from jaxserve.models.vision_qwen2_layout import qwen_bucket

# transformers' PixtralVisionConfig defaults, then those Mistral3Config gives a vision_config it leaves out whole.
_TOWER_DEFAULTS = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                       num_channels=3, image_size=1024, patch_size=16, hidden_act="gelu")
_MISTRAL3_TOWER = dict(_TOWER_DEFAULTS, patch_size=14, image_size=1540)
# The top-level configs' defaults: token, projector, feature layer; and the language model's width and norm eps.
_TOP_DEFAULTS = {
    "mistral3": dict(image_token_index=10, projector_hidden_act="gelu", vision_feature_layer=-1,
                     multimodal_projector_bias=False, spatial_merge_size=2),
    "llava": dict(image_token_index=32000, projector_hidden_act="gelu", vision_feature_layer=-2,
                  multimodal_projector_bias=True, vision_feature_select_strategy="default"),
}
_TEXT_DEFAULTS = {"mistral3": dict(hidden_size=5120, rms_norm_eps=1e-5), "llava": dict(hidden_size=4096)}
# (a text_config that is there but leaves them out: Mistral's and Llama's defaults, 4096 and 1e-6)
# The tokenizer's names for the image's tokens (PixtralProcessor's defaults): the engine looks their ids up.
IMAGE_TOKEN, IMAGE_BREAK_TOKEN, IMAGE_END_TOKEN = "[IMG]", "[IMG_BREAK]", "[IMG_END]"
_TOWER, _PROJECTOR = "vision_tower.", "multi_modal_projector."
_PREFIXES = (_TOWER, _PROJECTOR, "model." + _TOWER, "model." + _PROJECTOR)  # the Hub's, transformers 5's tree


@dataclass(frozen=True)
class PixtralVisionConfig:
    """A Pixtral vision tower with a Mistral 3 or LLaVA projector, and the token ids that lay an image out in a
    prompt (the break and end ids, absent from the HF config, come from the tokenizer: None until filled)."""

    projector: Literal["mistral3", "llava"]
    hidden_size: int  # the tower's width
    num_layers: int
    num_heads: int
    intermediate_size: int
    patch_size: int
    image_size: int  # the largest side the tower was trained for, in pixels (not enforced, as in transformers)
    num_channels: int
    hidden_act: str
    spatial_merge_size: int  # 1 for LLaVA
    projector_hidden_act: str
    projector_bias: bool
    vision_feature_layer: int  # which hidden state feeds the projector (0: ln_pre's output, -1: the last block's)
    text_hidden_size: int
    image_token_id: int  # `[IMG]`, one per embedding
    image_break_token_id: int | None = None  # `[IMG_BREAK]`, after each row of embeddings but the last
    image_end_token_id: int | None = None  # `[IMG_END]`, after the last row
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5  # transformers fixes it for the tower's norms
    projector_norm_eps: float = 1e-6  # Mistral 3's norm before the merger: the language model's rms_norm_eps
    bidirectional = False  # (not a field) the language model attends causally over an image's tokens
    boi_token_id = None  # (not a field) no start-of-image token: the image token is the placeholder

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Pixels per flattened patch: channels x rows x columns."""
        return self.num_channels * self.patch_size**2

    @property
    def layers_run(self) -> int:
        """How many blocks run before the projector: hidden state i is the output of block i (0: ln_pre's)."""
        return self.vision_feature_layer % (self.num_layers + 1)

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> PixtralVisionConfig | None:
        """The vision side of a whole HF `config.json` (None unless it is Mistral 3, or LLaVA with a Pixtral tower);
        transformers' defaults for what it leaves out; refuses what is not implemented, by name."""
        archs = d.get("architectures") or []
        vision = d.get("vision_config")
        if "Mistral3ForConditionalGeneration" in archs or d.get("model_type") == "mistral3":
            kind = "mistral3"
            v = dict(_MISTRAL3_TOWER) if vision is None else dict(_TOWER_DEFAULTS)
        elif ("LlavaForConditionalGeneration" in archs or d.get("model_type") == "llava") and (
                (vision or {}).get("model_type") == "pixtral"):
            kind, v = "llava", dict(_TOWER_DEFAULTS)
        else:
            return None
        v |= {k: x for k, x in (vision or {}).items() if x is not None}
        top = {**_TOP_DEFAULTS[kind], **{k: x for k, x in d.items() if x is not None}}
        text = d.get("text_config")
        text = _TEXT_DEFAULTS[kind] if text is None else {k: x for k, x in text.items() if x is not None}
        sizes = {}
        for name in ("patch_size", "image_size"):
            x = v[name]
            if isinstance(x, (list, tuple)):
                if len(set(x)) != 1:
                    raise UnsupportedModelError(f"vision_config {name} {list(x)}: only square patches and images "
                                                "are supported")
                x = x[0]
            sizes[name] = int(x)
        width, heads = int(v["hidden_size"]), int(v["num_attention_heads"])
        if width % heads or (width // heads) % 4:
            raise UnsupportedModelError(f"vision width {width} over {heads} heads: the 2D rotary embedding needs a "
                                        "head size divisible by 4")
        for act in (v["hidden_act"], top["projector_hidden_act"]):
            if act not in ACTIVATIONS:
                raise UnsupportedModelError(f"activation {act!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
        rope = v.get("rope_parameters") or {}
        if rope.get("rope_type", rope.get("type", "axial")) not in ("axial", "default"):
            raise UnsupportedModelError(f"vision rope_type {rope.get('rope_type', rope.get('type'))!r}: only "
                                        "Pixtral's axial 2D rotary embedding is supported")
        layers, feature = int(v["num_hidden_layers"]), top["vision_feature_layer"]
        if not isinstance(feature, int) or not -(layers + 1) <= feature <= layers:
            raise UnsupportedModelError(f"vision_feature_layer {feature!r}: only one hidden state of the "
                                        f"{layers + 1} is supported")
        if kind == "llava" and top["vision_feature_select_strategy"] != "full":
            raise UnsupportedModelError(f"vision_feature_select_strategy {top['vision_feature_select_strategy']!r} "
                                        "with a Pixtral tower (which has no class token): only 'full' is supported")
        merge = int(top["spatial_merge_size"]) if kind == "mistral3" else 1
        if merge not in (1, 2, 4, 8):
            raise UnsupportedModelError(f"spatial_merge_size {merge}: only 1, 2, 4 or 8 are supported")
        return cls(
            projector=kind, hidden_size=width, num_layers=layers, num_heads=heads,
            intermediate_size=int(v["intermediate_size"]), num_channels=int(v["num_channels"]),
            hidden_act=v["hidden_act"], spatial_merge_size=merge, projector_hidden_act=top["projector_hidden_act"],
            projector_bias=bool(top["multimodal_projector_bias"]), vision_feature_layer=feature,
            text_hidden_size=int(text.get("hidden_size", 4096)),
            image_token_id=int(top.get("image_token_id", top["image_token_index"])),
            rope_theta=float(rope.get("rope_theta", v.get("rope_theta", 10000.0))),
            projector_norm_eps=float(text.get("rms_norm_eps", 1e-6)), **sizes)


def pixtral_grid(cfg: PixtralVisionConfig, size: tuple[int, int]) -> tuple[int, int]:
    """The (rows, columns) of embeddings of an image of (height, width) pixels (after Mistral 3's merger)."""
    unit = cfg.patch_size * cfg.spatial_merge_size
    return size[0] // unit, size[1] // unit


def pixtral_prompt_tokens(cfg: PixtralVisionConfig, grid: tuple[int, int]) -> list[int]:
    """The token ids standing for an image of (rows, columns) embeddings, as PixtralProcessor writes them: each row
    `[IMG]` x columns then `[IMG_BREAK]`, the last row's break replaced by `[IMG_END]`."""
    if cfg.image_break_token_id is None or cfg.image_end_token_id is None:
        raise ValueError("the [IMG_BREAK] and [IMG_END] token ids are not set (take them from the tokenizer)")
    rows, cols = grid
    tokens = ([cfg.image_token_id] * cols + [cfg.image_break_token_id]) * rows
    tokens[-1] = cfg.image_end_token_id
    return tokens


@jax.tree_util.register_dataclass
@dataclass
class PixtralVisionParams:
    """The tower's and projector's weights, matrices stored [in, out]; the blocks' stacked on a leading axis."""

    patch: jax.Array  # [C * P * P, E]: the patch embedding over (channel, row, column)
    ln_pre: jax.Array  # [E]
    layers: dict[str, jax.Array]  # each [L, ...]: see `_layer_tensors`
    projector: dict[str, jax.Array]  # see `_projector_tensors`


def _layer_tensors(cfg: PixtralVisionConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The one declaration of a block's tensors: HF name (under `transformer.layers.N.`) -> (our key, HF shape)."""
    E, inner = cfg.hidden_size, cfg.intermediate_size
    return {"attention_norm.weight": ("attention_norm", (E,)), "ffn_norm.weight": ("ffn_norm", (E,)),
            **{f"attention.{p}_proj.weight": (f"w{p}", (E, E)) for p in "qkvo"},
            "feed_forward.gate_proj.weight": ("gate", (inner, E)), "feed_forward.up_proj.weight": ("up", (inner, E)),
            "feed_forward.down_proj.weight": ("down", (E, inner))}


def _projector_tensors(cfg: PixtralVisionConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The projector's tensors: HF name (under `multi_modal_projector.`) -> (our key, HF shape)."""
    E, T = cfg.hidden_size, cfg.text_hidden_size
    names = {"linear_1.weight": ("w1", (T, E)), "linear_2.weight": ("w2", (T, T))}
    if cfg.projector_bias:
        names |= {"linear_1.bias": ("b1", (T,)), "linear_2.bias": ("b2", (T,))}
    if cfg.projector == "mistral3":
        names |= {"norm.weight": ("norm", (E,)),
                  "patch_merger.merging_layer.weight": ("merge", (E, E * cfg.spatial_merge_size**2))}
    return names


def _expected(cfg: PixtralVisionConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor's Hub name and HF shape."""
    P = cfg.patch_size
    out = {_TOWER + "patch_conv.weight": (cfg.hidden_size, cfg.num_channels, P, P),
           _TOWER + "ln_pre.weight": (cfg.hidden_size,)}
    out |= {f"{_TOWER}transformer.layers.{i}.{n}": shape for i in range(cfg.num_layers)
            for n, (_, shape) in _layer_tensors(cfg).items()}
    return out | {_PROJECTOR + n: shape for n, (_, shape) in _projector_tensors(cfg).items()}


def is_pixtral_vision_tensor(name: str) -> bool:
    """Whether an HF tensor belongs to the Pixtral tower or its projector (Mistral 3's or LLaVA's)."""
    return name.startswith(_PREFIXES)


def _listed(names: list[str]) -> str:
    return ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")


def load_pixtral_vision_params(cfg: PixtralVisionConfig, tensors: Iterable[tuple[str, np.ndarray]],
                               dtype: Any) -> PixtralVisionParams:
    """The vision weights from (HF name, array) pairs under `vision_tower.` and `multi_modal_projector.`, each
    maybe under `model.` (others are skipped), converted to `dtype`; refuses a missing, duplicate, unknown or
    misshapen tensor by its name."""
    found: dict[str, np.ndarray] = {}
    for name, array in tensors:
        if not is_pixtral_vision_tensor(name):
            continue
        hub = name.removeprefix("model.")
        if hub in found:
            raise UnsupportedModelError(f"vision tensor {hub!r} appears twice in the checkpoint")
        found[hub] = np.asarray(array)
    expected = _expected(cfg)
    missing = [n for n in expected if n not in found]
    if missing:
        raise UnsupportedModelError(f"the checkpoint lacks vision tensors: {_listed(missing)}")
    unknown = sorted(set(found) - set(expected))
    if unknown:
        raise UnsupportedModelError(f"unexpected vision tensors: {_listed(unknown)}")
    for n, shape in expected.items():
        if found[n].shape != shape:
            raise UnsupportedModelError(f"vision tensor {n} has shape {found[n].shape}, the config says {shape}")

    def stored(a: np.ndarray, shape: tuple[int, ...]) -> jax.Array:  # an HF matrix [out, in] is stored [in, out]
        return jnp.asarray(np.swapaxes(a, -1, -2) if len(shape) == 2 else a, dtype)

    layer = lambda i, n: found[f"{_TOWER}transformer.layers.{i}.{n}"]  # noqa: E731
    return PixtralVisionParams(
        patch=jnp.asarray(found[_TOWER + "patch_conv.weight"].reshape(cfg.hidden_size, -1).T, dtype),
        ln_pre=jnp.asarray(found[_TOWER + "ln_pre.weight"], dtype),
        layers={key: stored(np.stack([layer(i, n) for i in range(cfg.num_layers)]), shape)
                for n, (key, shape) in _layer_tensors(cfg).items()},
        projector={key: stored(found[_PROJECTOR + n], shape) for n, (key, shape) in _projector_tensors(cfg).items()})


def pixtral_vision_tensors(params: PixtralVisionParams, cfg: PixtralVisionConfig) -> Iterator[tuple[str, np.ndarray]]:
    """The weights back under the Hub's names (`vision_tower.`, `multi_modal_projector.`), float32, HF shapes."""
    host = lambda a: np.asarray(jnp.asarray(a, jnp.float32))  # noqa: E731
    P = cfg.patch_size
    yield _TOWER + "patch_conv.weight", host(params.patch).T.reshape(cfg.hidden_size, cfg.num_channels, P, P)
    yield _TOWER + "ln_pre.weight", host(params.ln_pre)
    for n, (key, shape) in _layer_tensors(cfg).items():
        stacked = host(params.layers[key])
        for i in range(cfg.num_layers):
            yield f"{_TOWER}transformer.layers.{i}.{n}", stacked[i].T if len(shape) == 2 else stacked[i]
    for n, (key, shape) in _projector_tensors(cfg).items():
        yield _PROJECTOR + n, host(params.projector[key]).T if len(shape) == 2 else host(params.projector[key])


def random_pixtral_vision_params(cfg: PixtralVisionConfig, dtype: Any, seed: int = 0) -> PixtralVisionParams:
    """Random weights of the config's shapes (`--load-format dummy`): norms 1, the rest N(0, 0.02^2)."""
    rng = np.random.default_rng(seed)
    return load_pixtral_vision_params(cfg, (
        (n, np.ones(shape, np.float32) if "norm" in n or "ln_pre" in n
         else rng.normal(0.0, 0.02, shape).astype(np.float32)) for n, shape in _expected(cfg).items()), dtype)


def _rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32, scaled by `w` in x's dtype."""
    xf = x.astype(jnp.float32)
    return w * (xf * jax.lax.rsqrt(jnp.square(xf).mean(-1, keepdims=True) + eps)).astype(x.dtype)


def _rotary(cfg: PixtralVisionConfig, pos: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos and sin [N, D] (float32) of patches at pos [N, 2] (row, column): of a 1D rotary's D / 2 frequencies,
    the even ones turned by the row fill the first quarter, the odd ones turned by the column the second; the
    half is repeated over the head's other half."""
    D = cfg.head_dim
    inv_freq = 1.0 / cfg.rope_theta ** (jnp.arange(0, D, 2, dtype=jnp.float32) / D)  # [D / 2]
    pos = pos.astype(jnp.float32)
    angles = jnp.concatenate([pos[:, :1] * inv_freq[0::2], pos[:, 1:] * inv_freq[1::2]], axis=-1)  # [N, D / 2]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def _block(cfg: PixtralVisionConfig, x: jax.Array, lp: dict[str, jax.Array], rope: tuple[jax.Array, jax.Array],
           seg: jax.Array) -> jax.Array:
    """One pre-norm block over the patches x [N, E]; a patch attends to the patches of its segment (seg [N])."""
    N, E = x.shape
    heads = lambda a: a.reshape(N, cfg.num_heads, cfg.head_dim)  # noqa: E731  [N, H, D]
    with jax.named_scope("pixtral_vision_attention"):
        h = _rms_norm(x, lp["attention_norm"], cfg.norm_eps)
        q, k = rotate(heads(h @ lp["wq"]), *rope), rotate(heads(h @ lp["wk"]), *rope)
        x = x + attend(q, k, heads(h @ lp["wv"]), seg).reshape(N, E) @ lp["wo"]
    with jax.named_scope("pixtral_vision_mlp"):
        h = _rms_norm(x, lp["ffn_norm"], cfg.norm_eps)
        return x + (ACTIVATIONS[cfg.hidden_act](h @ lp["gate"]) * (h @ lp["up"])) @ lp["down"]


def _encode_padded(params: PixtralVisionParams, cfg: PixtralVisionConfig, patches: jax.Array, pos: jax.Array,
                   seg: jax.Array) -> jax.Array:
    """A bucket of patches [B, C * P * P] (merge squares consecutive) with their (row, column) pos [B, 2] and
    image ids seg [B] (-1 for padding) as embeddings [B / merge**2, text_hidden_size]."""
    B, E, m = patches.shape[0], cfg.hidden_size, cfg.spatial_merge_size
    x = _rms_norm(patches.astype(params.patch.dtype) @ params.patch, params.ln_pre, cfg.norm_eps)  # [B, E]
    rope = _rotary(cfg, pos)
    layers = jax.tree.map(lambda a: a[:cfg.layers_run], params.layers)
    with jax.named_scope("pixtral_vision_blocks"):
        x, _ = jax.lax.scan(lambda x, lp: (_block(cfg, x, lp, rope, seg), None), x, layers)
    with jax.named_scope("pixtral_vision_projector"):
        p = params.projector
        if cfg.projector == "mistral3":
            x = _rms_norm(x, p["norm"], cfg.projector_norm_eps)
            # a square's vector runs over (feature, row in the square, column in the square)
            x = x.reshape(B // m**2, m**2, E).transpose(0, 2, 1).reshape(B // m**2, E * m**2) @ p["merge"]
        act = ACTIVATIONS[cfg.projector_hidden_act]
        h = act(x @ p["w1"] + p.get("b1", 0))
        return h @ p["w2"] + p.get("b2", 0)


_encode_jit = jax.jit(_encode_padded, static_argnums=1)


def pixtral_layout(cfg: PixtralVisionConfig, pixels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """An image's pixels [C, H, W] as flattened patches [h * w, C * P * P] and their (row, column) [h * w, 2], merge
    squares consecutive (the squares row by row, each square's patches row by row)."""
    C, H, W = pixels.shape
    P, m = cfg.patch_size, cfg.spatial_merge_size
    if C != cfg.num_channels or H % (P * m) or W % (P * m) or not H or not W:
        raise ValueError(f"pixels of shape {pixels.shape}: expected {cfg.num_channels} channels and sides that are "
                         f"positive multiples of {P * m} pixels")
    h, w = H // P, W // P
    square = lambda a: a.reshape(-1, h // m, m, P, w // m, m, P)  # noqa: E731
    patches = square(pixels).transpose(1, 4, 2, 5, 0, 3, 6).reshape(h * w, C * P * P)
    rc = np.stack(np.meshgrid(np.arange(h), np.arange(w), indexing="ij"))  # [2, h, w]
    pos = rc.reshape(2, h // m, m, 1, w // m, m, 1).transpose(1, 4, 2, 5, 0, 3, 6).reshape(h * w, 2)
    return patches, pos.astype(np.int32)


def pixtral_encode_many(params: PixtralVisionParams, cfg: PixtralVisionConfig,
                        images: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Several images' pixels [C, H, W] encoded in one call (one bucket holding them all): each image's embeddings
    [rows * columns, text_hidden_size] (`pixtral_grid`), row by row, in the params' dtype."""
    if not images:
        raise ValueError("no images to encode")
    laid = [pixtral_layout(cfg, np.asarray(p, np.float32)) for p in images]
    seg = np.concatenate([np.full(len(pos), i, np.int32) for i, (_, pos) in enumerate(laid)])
    pad = qwen_bucket(len(seg)) - len(seg)
    out = _encode_jit(params, cfg, np.pad(np.concatenate([p for p, _ in laid]), ((0, pad), (0, 0))),
                      np.pad(np.concatenate([pos for _, pos in laid]), ((0, pad), (0, 0))),
                      np.pad(seg, (0, pad), constant_values=-1))
    ends = np.cumsum([len(pos) // cfg.spatial_merge_size**2 for _, pos in laid])
    return np.split(np.asarray(out)[:ends[-1]], ends[:-1])


def pixtral_encode(params: PixtralVisionParams, cfg: PixtralVisionConfig, pixels: np.ndarray) -> np.ndarray:
    """One image's pixels [C, H, W] (`PixtralImageProcessor`'s) as language-model embeddings
    [rows * columns, text_hidden_size] (`pixtral_grid`), row by row, in the params' dtype."""
    return pixtral_encode_many(params, cfg, [pixels])[0]
