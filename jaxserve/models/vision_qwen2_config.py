"""A Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5 or EXAONE 4.5 vision tower's configuration (`QwenVisionConfig`), read
from the whole model's HF config; the tower itself is `models.vision_qwen2`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from jaxserve.errors import UnsupportedModelError
from jaxserve.models import vision_qwen3 as qwen3
from jaxserve.models.vision_blocks import ACTIVATIONS

EXAONE = "Exaone4_5_ForConditionalGeneration"
# (Qwen3-VL-MoE's tower is Qwen3-VL's; Qwen3.5's too, without its deepstack mergers; EXAONE 4.5's is Qwen2.5-VL's
# with its KV heads grouped)
QWEN_VISION_ARCHITECTURES = {"Qwen2VLForConditionalGeneration": "qwen2_vl", "Qwen2_5_VLForConditionalGeneration":
                             "qwen2_5_vl", EXAONE: "qwen2_5_vl", **dict.fromkeys(("Qwen3VLForConditionalGeneration",
                                                             "Qwen3VLMoeForConditionalGeneration",
                                                             "Qwen3_5ForConditionalGeneration",
                                                             "Qwen3_5MoeForConditionalGeneration"), "qwen3_vl")}
# transformers' Qwen2VLVisionConfig and Qwen2_5_VLVisionConfig defaults (Qwen2-VL's `hidden_size` is the merger's
# output width; its blocks' width is `embed_dim`), then the top-level config's token ids.
_DEFAULTS = {
    "qwen2_vl": dict(depth=32, embed_dim=1280, hidden_size=3584, hidden_act="quick_gelu", mlp_ratio=4, num_heads=16,
                     in_channels=3, patch_size=14, spatial_merge_size=2, temporal_patch_size=2),
    "qwen2_5_vl": dict(depth=32, hidden_size=3584, hidden_act="silu", intermediate_size=3420, num_heads=16,
                       in_channels=3, patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                       out_hidden_size=3584, fullatt_block_indexes=(7, 15, 23, 31)),
    "qwen3_vl": dict(depth=27, hidden_size=1152, hidden_act="gelu_pytorch_tanh", intermediate_size=4304, num_heads=16,
                     in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=3584,
                     num_position_embeddings=2304, deepstack_visual_indexes=(8, 16, 24)),
}
_TOKENS = dict(image_token_id=151655, vision_start_token_id=151652, vision_end_token_id=151653)
_PREFIXES = ("model.visual.", "visual.")  # transformers 5's model tree, the Hub's (and transformers 5's files)


@dataclass(frozen=True)
class QwenVisionConfig:
    """A Qwen2-VL, Qwen2.5-VL or Qwen3-VL vision tower and merger, and the token ids that stand for an image in a
    prompt."""

    variant: Literal["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
    depth: int
    embed_dim: int  # the blocks' width
    num_heads: int
    intermediate_size: int
    hidden_act: str
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    in_channels: int
    out_hidden_size: int  # the merger's output: the language model's width
    window_size: int | None  # Qwen2.5-VL's windows, in pixels
    fullatt_block_indexes: tuple[int, ...]  # the layers attending over whole frames (every layer in Qwen2-VL)
    image_token_id: int  # `<|image_pad|>`, one per merged patch
    vision_start_token_id: int  # `<|vision_start|>`, before an image's pads
    vision_end_token_id: int  # `<|vision_end|>`, after them
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6  # transformers fixes it for every norm of the tower and merger
    num_position_embeddings: int = 0  # Qwen3-VL: a learned square grid of position embeddings (0: none)
    deepstack_visual_indexes: tuple[int, ...] = ()  # Qwen3-VL: the blocks whose outputs feed the early decoder layers
    num_kv_heads: int = 0  # EXAONE 4.5's: its heads' keys and values grouped, q, k, v in one projection; 0: num_heads
    nested: bool = False  # the language model's tensors under `model.language_model.`, the tower's `model.visual.`
    bidirectional = False  # (not a field) the language model attends causally over an image's tokens
    boi_token_id = None  # (not a field) no start-of-image token: the image token is the placeholder

    head_dim = property(lambda self: self.embed_dim // self.num_heads)
    kv_heads = property(lambda self: self.num_kv_heads or self.num_heads)

    @property
    def patch_dim(self) -> int:
        """Pixels per flattened patch: channels x frames x rows x columns."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    merge_unit = property(lambda self: self.spatial_merge_size**2)

    @property
    def layer_norm(self) -> bool:
        """LayerNorms with biases and an ungated MLP (Qwen2-VL, Qwen3-VL); Qwen2.5-VL's are RMSNorms and gated."""
        return self.variant != "qwen2_5_vl"

    @property
    def embed_width(self) -> int:
        """Each image token's embeddings: the merger's, then each deepstack merger's (Qwen3-VL), side by side."""
        return self.out_hidden_size * (1 + len(self.deepstack_visual_indexes))

    @property
    def window_merged(self) -> int:
        """A window's side in merged patches (Qwen2.5-VL)."""
        return self.window_size // self.spatial_merge_size // self.patch_size if self.window_size else 0

    @property
    def full_layers(self) -> tuple[bool, ...]:
        return tuple(i in self.fullatt_block_indexes for i in range(self.depth))

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> QwenVisionConfig | None:
        """The vision side of a whole HF `config.json` (None when it is not Qwen2-VL or Qwen2.5-VL); transformers'
        defaults for what it leaves out; refuses what is not implemented, by name."""
        archs = d.get("architectures") or []
        variant = next((QWEN_VISION_ARCHITECTURES[a] for a in archs if a in QWEN_VISION_ARCHITECTURES), None)
        if variant is None:
            return None
        v = {**_DEFAULTS[variant], **{k: x for k, x in (d.get("vision_config") or {}).items() if x is not None}}
        v = {**v, "deepstack_visual_indexes": ()} if any(a.startswith("Qwen3_5") for a in archs) else v
        qwen2, is3 = variant == "qwen2_vl", variant == "qwen3_vl"
        sizes = {}
        for name in ("patch_size", "temporal_patch_size"):
            x = v[name]
            if isinstance(x, (list, tuple)):
                if len(set(x)) != 1:
                    raise UnsupportedModelError(f"vision_config {name} {list(x)}: only square patches are supported")
                x = x[0]
            sizes[name] = int(x)
        embed = int(v["embed_dim"] if qwen2 else v["hidden_size"])
        heads = int(v["num_heads"])
        if embed % heads or (embed // heads) % 4:
            raise UnsupportedModelError(f"vision width {embed} over {heads} heads: the 2D rotary embedding needs a "
                                        "head size divisible by 4")
        if v.get("head_dim") not in (None, embed // heads):
            raise UnsupportedModelError(f"vision_config head_dim {v['head_dim']} differs from width / heads")
        kv = int(v.get("num_key_value_heads") or (8 if EXAONE in archs else heads))  # (transformers' default)
        if heads % kv:
            raise UnsupportedModelError(f"vision num_key_value_heads {kv} does not divide its {heads} heads")
        if v["hidden_act"] not in ACTIVATIONS:
            raise UnsupportedModelError(f"vision hidden_act {v['hidden_act']!r} is not supported "
                                        f"(supported: {', '.join(ACTIVATIONS)})")
        rope = v.get("rope_parameters") or {}
        if rope.get("rope_type", rope.get("type", "axial")) not in ("axial", "default"):
            raise UnsupportedModelError(f"vision rope_type {rope.get('rope_type')!r}: only the axial 2D rotary "
                                        "embedding is supported")
        depth, out = int(v["depth"]), int(v["hidden_size"] if qwen2 else v["out_hidden_size"])
        text_hidden = (d.get("text_config") or {}).get("hidden_size", d.get("hidden_size"))
        if text_hidden is not None and int(text_hidden) != out:
            raise UnsupportedModelError(f"the vision merger's output width {out} differs from the language model's "
                                        f"hidden_size {text_hidden}")
        window, merge = None if qwen2 or is3 else int(v["window_size"]), int(v["spatial_merge_size"])
        if window is not None and window // merge // sizes["patch_size"] < 1:
            raise UnsupportedModelError(f"vision window_size {window} is smaller than one merged patch "
                                        f"({merge} x {sizes['patch_size']} pixels)")
        return cls(
            **(qwen3.qwen3_fields(v, depth) if is3 else {}),
            variant=variant, depth=depth, embed_dim=embed, num_heads=heads, num_kv_heads=0 if kv == heads else kv,
            nested=variant == "qwen3_vl" or EXAONE in archs,
            intermediate_size=int(embed * v["mlp_ratio"]) if qwen2 else int(v["intermediate_size"]),
            hidden_act=v["hidden_act"], spatial_merge_size=merge, in_channels=int(v["in_channels"]),
            out_hidden_size=out, window_size=window,
            fullatt_block_indexes=tuple(range(depth)) if window is None else tuple(int(i) for i in v["fullatt_block_indexes"]),
            rope_theta=float(rope.get("rope_theta", v.get("rope_theta", 10000.0))),
            **sizes, **{k: int(d.get(k, default)) for k, default in _TOKENS.items()})
