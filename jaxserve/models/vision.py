"""The image side of LLaVA-style and Gemma 3 image-text models: a CLIP or SigLIP vision tower and the projector
into the language model's embedding space, as pure functions.

An image of `image_size` pixels square is cut into `patch_size` patches; the tower's encoder layers (pre-norm
transformer blocks, every patch attending to every other) run over them, and the hidden states of the chosen
layers (`vision_feature_layer`) go through LLaVA's two-layer projector, or the last one (after the tower's final
norm) through Gemma 3's pooling projector (`models.vision_gemma3`). What comes out is one language-model embedding
per image token, which the decoder takes in place of the embeddings of the image's placeholder tokens.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.errors import UnsupportedModelError
from jaxserve.models.ops import layer_norm
from jaxserve.models.vision_blocks import pixel_shuffle
from jaxserve.models.vision_gemma3 import PROJECTION, SOFT_NORM, gemma3_fields, gemma3_project
from jaxserve.models.vision_idefics3 import CONNECTOR, idefics3_fields

VISION_ARCHITECTURES = {"LlavaForConditionalGeneration": "llava", "LlavaNextForConditionalGeneration": "llava_next",
                        "LlavaOnevisionForConditionalGeneration": "llava_onevision",
                        "Gemma3ForConditionalGeneration": "gemma3", "Idefics3ForConditionalGeneration": "idefics3",
                        "SmolVLMForConditionalGeneration": "smolvlm"}
NEXT_PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))  # transformers' defaults
ONEVISION_PINPOINTS = tuple((384 * i, 384 * j) for i in range(1, 7) for j in range(1, 7))
_TOWERS = {"clip_vision_model": "clip", "siglip_vision_model": "siglip", "idefics3_vision": "siglip",
           "smolvlm_vision": "siglip"}  # (Idefics3's and SmolVLM's towers are SigLIP's)
# transformers' defaults: LlavaConfig's tower when its config names none, and each tower config's own.
_LLAVA_TOWER = dict(model_type="clip_vision_model", hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                    num_attention_heads=16, image_size=336, patch_size=14)
_TOWER_DEFAULTS = {
    "clip": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                 image_size=224, patch_size=32, num_channels=3, layer_norm_eps=1e-5, hidden_act="quick_gelu"),
    "siglip": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                   image_size=224, patch_size=16, num_channels=3, layer_norm_eps=1e-6,
                   hidden_act="gelu_pytorch_tanh"),
}


@dataclass(frozen=True)
class VisionConfig:
    """A vision tower, the layers its features come from and the projector after it."""

    tower: str  # "clip" (a class token, a norm before the encoder) or "siglip"
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str
    feature_layers: tuple[int, ...]  # indices into the hidden states (0: the embeddings, i: after layer i)
    drop_first: bool  # the "default" feature strategy: the first token (CLIP's class token) is dropped
    projector_act: str
    projector_bias: bool
    text_hidden_size: int
    image_token_id: int
    grid_pinpoints: tuple[tuple[int, int], ...] | None = None
    """LLaVA-NeXT's resolutions (height, width): an image is the whole of it in one crop and crops of it at the
    pinpoint that fits it best, their features unpadded and each row ended by a learned newline embedding."""
    projector: Literal["mlp", "gemma3", "shuffle"] = "mlp"  # LLaVA's two layers, Gemma 3's pool, norm and matrix, or
    # Idefics3's and SmolVLM's pixel shuffle (`shuffle` x `shuffle` features a token) and one matrix
    shuffle: int = 1
    post_norm: bool = False  # the tower's `post_layernorm` on its last layer's output (Gemma 3 reads it after)
    pooled_tokens: int | None = None  # Gemma 3's mm_tokens_per_image: the patch grid pooled to these tokens
    boi_token_id: int | None = None  # Gemma 3's `<start_of_image>`, before an image's tokens in a prompt
    eoi_token_id: int | None = None  # Gemma 3's `<end_of_image>`, after them
    bidirectional: bool = False  # the language model's attention within an image's tokens: both ways (Gemma 3)
    max_crops: int | None = None  # LLaVA-OneVision's anyres_max_N: its crop features shrunk to about N crops'

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_positions(self) -> int:
        return self.num_patches + (self.tower == "clip")

    @property
    def tokens_per_image(self) -> int:
        """Placeholder tokens (and embeddings) per image."""
        if self.pooled_tokens is not None:
            return self.pooled_tokens
        return (self.num_positions - self.drop_first) // self.shuffle**2

    @property
    def feature_width(self) -> int:
        """The projector's input: the features read, side by side (Idefics3's: of a square of patches)."""
        return self.hidden_size * len(self.feature_layers) * self.shuffle**2

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> VisionConfig | None:
        """The vision side of an HF `config.json` (None for a text model); refuses what it cannot run, by name."""
        archs = d.get("architectures") or []
        kind = next((VISION_ARCHITECTURES[a] for a in archs if a in VISION_ARCHITECTURES), d.get("model_type"))
        if kind not in VISION_ARCHITECTURES.values():
            return None
        gemma3, idefics = kind == "gemma3", kind in ("idefics3", "smolvlm")
        v = d.get("vision_config") or ({} if gemma3 or idefics else _LLAVA_TOWER)
        tower = _TOWERS.get(v.get("model_type", "siglip_vision_model" if gemma3 or idefics else "clip_vision_model"))
        if tower is None or (gemma3 and tower != "siglip"):
            raise UnsupportedModelError(f"vision tower {v.get('model_type')!r} is not supported (supported: "
                                        f"{'siglip_vision_model' if gemma3 else ', '.join(_TOWERS)})")
        v = {**_TOWER_DEFAULTS[tower], **{k: x for k, x in v.items() if x is not None}}
        tower_fields = dict(
            tower=tower, hidden_size=v["hidden_size"], intermediate_size=v["intermediate_size"],
            num_layers=v["num_hidden_layers"], num_heads=v["num_attention_heads"], image_size=v["image_size"],
            patch_size=v["patch_size"], num_channels=v["num_channels"], layer_norm_eps=v["layer_norm_eps"],
            hidden_act=v["hidden_act"])
        if gemma3:
            return cls(**tower_fields, **gemma3_fields(d, v))
        if idefics:
            return cls(**tower_fields, **idefics3_fields(d, v, kind))
        layers = d.get("vision_feature_layer", -2)
        layers = [layers] if isinstance(layers, int) else list(layers)
        n = v["num_hidden_layers"]
        if any(not -(n + 1) <= i <= n for i in layers):
            raise UnsupportedModelError(f"vision_feature_layer {layers} is outside the tower's {n + 1} hidden states")
        strategy = d.get("vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise UnsupportedModelError(f"vision_feature_select_strategy {strategy!r} is not supported")
        text = d.get("text_config") or {}
        aspect = d.get("vision_aspect_ratio", "anyres_max_9") if kind == "llava_onevision" else None
        if aspect is not None and not re.fullmatch(r"anyres_max_[1-9]\d*", aspect):
            raise UnsupportedModelError(f"vision_aspect_ratio {aspect!r} is not supported (anyres_max_N)")
        pinpoints = d.get("image_grid_pinpoints", NEXT_PINPOINTS if kind == "llava_next" else ONEVISION_PINPOINTS)
        return cls(
            **tower_fields, feature_layers=tuple(i % (n + 1) for i in layers), drop_first=strategy == "default",
            projector_act=d.get("projector_hidden_act", "gelu"),
            projector_bias=d.get("multimodal_projector_bias", True),
            text_hidden_size=text.get("hidden_size", 4096),
            image_token_id=d.get("image_token_index", d.get("image_token_id", 32000)),
            grid_pinpoints=tuple(tuple(p) for p in pinpoints) if aspect or kind == "llava_next" else None,
            max_crops=int(aspect.removeprefix("anyres_max_")) if aspect else None,
        )


@jax.tree_util.register_dataclass
@dataclass
class VisionParams:
    """The tower's and the projector's weights, matrices stored [in, out]; layers stacked on a leading axis."""

    patch: jax.Array  # [C * p * p, Hv]: the patch convolution, over (channel, row, column) of a patch
    patch_bias: jax.Array | None
    class_embedding: jax.Array | None  # [Hv] (CLIP)
    positions: jax.Array  # [num_positions, Hv]
    pre_norm: tuple[jax.Array, jax.Array] | None  # CLIP's norm before the encoder
    layers: dict[str, jax.Array]  # each [L, ...]: see `_LAYER_TENSORS`
    proj1: jax.Array  # [Hv * len(feature_layers), E]; Gemma 3's `mm_input_projection_weight`
    proj1_bias: jax.Array | None
    proj2: jax.Array | None  # [E, E] (LLaVA)
    proj2_bias: jax.Array | None
    newline: jax.Array | None = None  # [E]: LLaVA-NeXT's end of a row of crop features
    post_norm: tuple[jax.Array, jax.Array] | None = None  # the tower's final norm (Gemma 3 reads after it)
    soft_norm: jax.Array | None = None  # [Hv]: Gemma 3's RMSNorm of the pooled features (applied as 1 + w)


# HF tensor (under `encoder.layers.N.`) -> our layer key; matrices are transposed to [in, out].
_LAYER_TENSORS = {
    "layer_norm1.weight": "ln1", "layer_norm1.bias": "ln1_b", "layer_norm2.weight": "ln2", "layer_norm2.bias": "ln2_b",
    "self_attn.q_proj.weight": "wq", "self_attn.q_proj.bias": "bq", "self_attn.k_proj.weight": "wk",
    "self_attn.k_proj.bias": "bk", "self_attn.v_proj.weight": "wv", "self_attn.v_proj.bias": "bv",
    "self_attn.out_proj.weight": "wo", "self_attn.out_proj.bias": "bo", "mlp.fc1.weight": "fc1",
    "mlp.fc1.bias": "fc1_b", "mlp.fc2.weight": "fc2", "mlp.fc2.bias": "fc2_b",
}
# The Hub's names (`vision_tower.vision_model.`), and transformers 5's as it saves them (with `model.` or not).
_VISION_RE = re.compile(r"^(model\.)?(vision_tower\.(vision_model\.)?|vision_model\.|multi_modal_projector\.|connector\."
                        r"|image_newline$)")
_UNUSED_RE = re.compile(r"^(post_layernorm|head)\.")  # the tower's pooled output, which LLaVA does not read
_PROJECTOR = {"mlp": ("linear_1.weight", "linear_2.weight"), "gemma3": (PROJECTION, SOFT_NORM), "shuffle": (CONNECTOR,)}


def is_vision_tensor(name: str) -> bool:
    """Whether an HF tensor belongs to the vision tower or the projector."""
    return _VISION_RE.match(name) is not None


def load_vision_params(cfg: VisionConfig, tensors: Iterable[tuple[str, np.ndarray]], dtype: Any,
                       unused: dict[str, np.ndarray] | None = None) -> VisionParams:
    """The vision weights from (HF name, array) pairs, converted to `dtype` on the default device; every tensor the
    tower and projector need must be there. The tower's tensors the model does not read (its pooled output's) go
    into `unused`, under the Hub's names, for `jaxserve convert` to write back."""
    L = cfg.num_layers
    layers: dict[str, list] = {k: [None] * L for k in _LAYER_TENSORS.values()}
    top: dict[str, np.ndarray] = {}
    for name, array in tensors:
        m = _VISION_RE.match(name)
        if m is None:
            continue
        rest = name[m.end():]
        if m.group(2) == "image_newline":
            top["image_newline"] = array
            continue
        if m.group(2).startswith(("multi_modal_projector", "connector")):
            top["projector." + rest] = array
            continue
        layer = re.match(r"encoder\.layers\.(\d+)\.(.+)$", rest)
        if layer is None:
            if not _UNUSED_RE.match(rest) or cfg.post_norm and rest.startswith("post_layernorm."):
                top[rest] = array
            elif unused is not None:
                unused["vision_tower.vision_model." + rest] = array
            continue
        i, key = int(layer.group(1)), _LAYER_TENSORS.get(layer.group(2))
        if key is None or i >= L:
            raise UnsupportedModelError(f"unexpected vision tensor {name!r}")
        layers[key][i] = array.T if array.ndim == 2 else array
    missing = [f"encoder.layers.{i}.{hf}" for hf, k in _LAYER_TENSORS.items() for i in range(L) if layers[k][i] is None]
    need = ["embeddings.patch_embedding.weight", "embeddings.position_embedding.weight",
            *(f"projector.{n}" for n in _PROJECTOR[cfg.projector])]
    need += ["post_layernorm.weight", "post_layernorm.bias"] if cfg.post_norm else []
    if cfg.tower == "clip":
        need += ["embeddings.class_embedding", "pre_layrnorm.weight", "pre_layrnorm.bias"]
    if cfg.grid_pinpoints is not None:
        need.append("image_newline")
    missing += [n for n in need if n not in top]
    if missing:
        raise UnsupportedModelError(f"the checkpoint lacks vision tensors: {', '.join(missing[:6])}"
                                    + (f" and {len(missing) - 6} more" if len(missing) > 6 else ""))

    def put(a: np.ndarray | None) -> jax.Array | None:
        return None if a is None else jnp.asarray(np.asarray(a, np.float32), dtype)

    conv = top["embeddings.patch_embedding.weight"]  # [Hv, C, p, p]
    if conv.shape != (cfg.hidden_size, cfg.num_channels, cfg.patch_size, cfg.patch_size):
        raise UnsupportedModelError(f"patch_embedding has shape {conv.shape}, the vision config says "
                                    f"{(cfg.hidden_size, cfg.num_channels, cfg.patch_size, cfg.patch_size)}")
    pos = top["embeddings.position_embedding.weight"]
    if pos.shape[0] != cfg.num_positions:
        raise UnsupportedModelError(f"position_embedding has {pos.shape[0]} rows, the vision config {cfg.num_positions}")
    bias = lambda name: put(top.get(name))  # noqa: E731
    if cfg.projector == "gemma3":  # stored [in, out]: as LLaVA's [out, in], read transposed
        top["projector.linear_1.weight"] = top["projector." + PROJECTION].T
    if cfg.projector == "shuffle":
        top["projector.linear_1.weight"] = top["projector." + CONNECTOR]
    if top["projector.linear_1.weight"].shape != (cfg.text_hidden_size, cfg.feature_width):
        raise UnsupportedModelError(f"the projector's first matrix is {top['projector.linear_1.weight'].shape} "
                                    "([out, in]), the config's widths do not match it")
    return VisionParams(
        patch=put(conv.reshape(cfg.hidden_size, -1).T), patch_bias=bias("embeddings.patch_embedding.bias"),
        class_embedding=bias("embeddings.class_embedding"), positions=put(pos),
        pre_norm=(put(top["pre_layrnorm.weight"]), put(top["pre_layrnorm.bias"])) if cfg.tower == "clip" else None,
        layers={k: put(np.stack(v)) for k, v in layers.items()},
        proj1=put(top["projector.linear_1.weight"].T), proj1_bias=bias("projector.linear_1.bias"),
        proj2=put(top["projector.linear_2.weight"].T) if cfg.projector == "mlp" else None,
        proj2_bias=bias("projector.linear_2.bias"), newline=bias("image_newline"),
        post_norm=(put(top["post_layernorm.weight"]), put(top["post_layernorm.bias"])) if cfg.post_norm else None,
        soft_norm=bias("projector." + SOFT_NORM),
    )


def vision_tensors(params: VisionParams, cfg: VisionConfig) -> Iterator[tuple[str, np.ndarray]]:
    """The weights under the Hub's LLaVA or Gemma 3 names (`vision_tower.vision_model.`, `multi_modal_projector.`,
    `image_newline`) or Idefics3's and SmolVLM's (`model.vision_model.`, `model.connector.`), float32, as
    `jaxserve convert` writes them."""
    host = lambda a: np.asarray(jnp.asarray(a, jnp.float32))  # noqa: E731
    tower = "model.vision_model." if cfg.projector == "shuffle" else "vision_tower.vision_model."
    conv = host(params.patch).T.reshape(cfg.hidden_size, cfg.num_channels, cfg.patch_size, cfg.patch_size)
    named = {"embeddings.patch_embedding.weight": conv, "embeddings.patch_embedding.bias": params.patch_bias,
             "embeddings.class_embedding": params.class_embedding,
             "embeddings.position_embedding.weight": params.positions,
             "pre_layrnorm.weight": params.pre_norm[0] if params.pre_norm else None,
             "pre_layrnorm.bias": params.pre_norm[1] if params.pre_norm else None,
             "post_layernorm.weight": params.post_norm[0] if params.post_norm else None,
             "post_layernorm.bias": params.post_norm[1] if params.post_norm else None}
    for name, value in named.items():
        if value is not None:
            yield tower + name, host(value)
    for hf, key in _LAYER_TENSORS.items():
        stacked = host(params.layers[key])
        for i in range(cfg.num_layers):
            yield f"{tower}encoder.layers.{i}.{hf}", stacked[i].T if stacked.ndim == 3 else stacked[i]
    if cfg.projector == "gemma3":
        yield f"multi_modal_projector.{PROJECTION}", host(params.proj1)
        yield f"multi_modal_projector.{SOFT_NORM}", host(params.soft_norm)
        return
    if cfg.projector == "shuffle":
        yield f"model.connector.{CONNECTOR}", host(params.proj1).T
        return
    for i, (w, b) in enumerate(((params.proj1, params.proj1_bias), (params.proj2, params.proj2_bias)), 1):
        yield f"multi_modal_projector.linear_{i}.weight", host(w).T
        if b is not None:
            yield f"multi_modal_projector.linear_{i}.bias", host(b)
    if params.newline is not None:
        yield "image_newline", host(params.newline)


def _act(name: str, x: jax.Array) -> jax.Array:
    if name == "quick_gelu":
        return x * jax.nn.sigmoid(1.702 * x)
    if name in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
        return jax.nn.gelu(x, approximate=True)
    if name == "gelu":
        return jax.nn.gelu(x, approximate=False)
    if name == "silu":
        return jax.nn.silu(x)
    raise UnsupportedModelError(f"activation {name!r} is not supported in the vision tower")


def _encoder_layer(cfg: VisionConfig, x: jax.Array, lp: dict[str, jax.Array]) -> jax.Array:
    """One pre-norm block over x [B, N, Hv]: every token attends to every other."""
    B, N, Hv = x.shape
    H = cfg.num_heads
    h = layer_norm(x, lp["ln1"], lp["ln1_b"], cfg.layer_norm_eps)
    q = (h @ lp["wq"] + lp["bq"]).reshape(B, N, H, -1)
    k = (h @ lp["wk"] + lp["bk"]).reshape(B, N, H, -1)
    v = (h @ lp["wv"] + lp["bv"]).reshape(B, N, H, -1)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * (Hv // H) ** -0.5
    attn = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1).astype(v.dtype), v).reshape(B, N, Hv)
    x = x + attn @ lp["wo"] + lp["bo"]
    h = layer_norm(x, lp["ln2"], lp["ln2_b"], cfg.layer_norm_eps)
    return x + _act(cfg.hidden_act, h @ lp["fc1"] + lp["fc1_b"]) @ lp["fc2"] + lp["fc2_b"]


def encode_images(params: VisionParams, cfg: VisionConfig, pixels: jax.Array) -> jax.Array:
    """Images [B, C, S, S] (normalized, as `jaxserve.images.ImageProcessor` makes them) as language-model
    embeddings [B, tokens_per_image, E]."""
    B, C, S, _ = pixels.shape
    p, g = cfg.patch_size, cfg.image_size // cfg.patch_size
    dtype = params.patch.dtype
    patches = pixels.astype(dtype).reshape(B, C, g, p, g, p).transpose(0, 2, 4, 1, 3, 5).reshape(B, g * g, C * p * p)
    x = patches @ params.patch
    if params.patch_bias is not None:
        x = x + params.patch_bias
    if params.class_embedding is not None:
        x = jnp.concatenate([jnp.broadcast_to(params.class_embedding, (B, 1, x.shape[-1])), x], axis=1)
    x = x + params.positions
    if params.pre_norm is not None:
        x = layer_norm(x, *params.pre_norm, cfg.layer_norm_eps)

    def step(x, lp):
        x = _encoder_layer(cfg, x, lp)
        return x, x

    last = max(cfg.feature_layers)  # layers past the last one read are never run
    layers = jax.tree.map(lambda a: a[:last], params.layers)
    _, outs = jax.lax.scan(step, x, layers) if last else (x, x[None, :0])
    hidden = [x if i == 0 else outs[i - 1] for i in cfg.feature_layers]
    feats = jnp.concatenate(hidden, axis=-1)
    if cfg.post_norm:  # on the last layer's output, the only one read
        feats = layer_norm(feats, *params.post_norm, cfg.layer_norm_eps)
    if cfg.projector == "gemma3":
        return gemma3_project(cfg, feats, params.soft_norm, params.proj1)
    if cfg.projector == "shuffle":
        return pixel_shuffle(feats, cfg.shuffle) @ params.proj1
    if cfg.drop_first:
        feats = feats[:, 1:]
    h = feats @ params.proj1
    if params.proj1_bias is not None:
        h = h + params.proj1_bias
    h = _act(cfg.projector_act, h) @ params.proj2
    if params.proj2_bias is not None:
        h = h + params.proj2_bias
    return h


def random_vision_params(cfg: VisionConfig, dtype: Any, seed: int = 0) -> VisionParams:
    """Random weights of the config's shapes (`--load-format dummy`)."""
    rng = np.random.default_rng(seed)
    Hv, inner, L, E = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.text_hidden_size
    r = lambda *shape: jnp.asarray(rng.normal(0.0, 0.02, shape).astype(np.float32), dtype)  # noqa: E731
    one = lambda *shape: jnp.ones(shape, dtype)  # noqa: E731
    shapes = {"wq": (Hv, Hv), "wk": (Hv, Hv), "wv": (Hv, Hv), "wo": (Hv, Hv), "fc1": (Hv, inner), "fc2": (inner, Hv),
              "fc1_b": (inner,)}
    layers = {k: one(L, Hv) if k in ("ln1", "ln2") else r(L, *shapes.get(k, (Hv,))) for k in _LAYER_TENSORS.values()}
    clip, mlp = cfg.tower == "clip", cfg.projector == "mlp"
    return VisionParams(
        patch=r(cfg.num_channels * cfg.patch_size**2, Hv), patch_bias=None if clip else r(Hv),
        class_embedding=r(Hv) if clip else None, positions=r(cfg.num_positions, Hv),
        pre_norm=(one(Hv), r(Hv)) if clip else None, layers=layers,
        proj1=r(cfg.feature_width, E), proj1_bias=r(E) if cfg.projector_bias else None,
        proj2=r(E, E) if mlp else None, proj2_bias=r(E) if cfg.projector_bias else None,
        newline=r(E) if cfg.grid_pinpoints is not None else None,
        post_norm=(one(Hv), r(Hv)) if cfg.post_norm else None, soft_norm=r(Hv) if cfg.projector == "gemma3" else None)
