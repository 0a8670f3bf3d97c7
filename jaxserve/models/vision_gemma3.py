"""Gemma 3's image side past its SigLIP tower (transformers' `Gemma3MultiModalProjector`), as pure functions.

The tower's last hidden state (after its `post_layernorm`) is a square grid of patches; the projector averages it
in square blocks down to `mm_tokens_per_image` tokens, applies Gemma's RMSNorm (weights as 1 + w) and one matrix
into the language model's width. The embeddings are not scaled by sqrt(hidden) as Gemma scales its text
embeddings: transformers scatters them into the already scaled inputs.

In a prompt an image stands as "\\n\\n", `<start_of_image>`, its `mm_tokens_per_image` soft tokens,
`<end_of_image>`, "\\n\\n" (transformers' processor puts that text in place of the `<start_of_image>` the chat
template writes, and tokenizes it with the text around it: Gemma's runs of newlines are single tokens, so a "\\n"
before it and the first "\\n\\n" make one "\\n\\n\\n"); the language model lets an image's soft tokens attend to
each other both ways.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from jaxserve.errors import UnsupportedModelError

if TYPE_CHECKING:
    from jaxserve.models.vision import VisionConfig

# transformers' Gemma3Config defaults for the image's tokens, and Gemma3TextConfig's width.
_DEFAULTS = dict(mm_tokens_per_image=256, boi_token_index=255_999, eoi_token_index=256_000,
                 image_token_index=262_144)
_TEXT_HIDDEN = 2304
# The projector's HF tensors (under `multi_modal_projector.`): the matrix is stored [vision hidden, text hidden].
PROJECTION = "mm_input_projection_weight"
SOFT_NORM = "mm_soft_emb_norm.weight"


def gemma3_fields(d: dict[str, Any], tower: dict[str, Any]) -> dict[str, Any]:
    """The `VisionConfig` fields particular to a Gemma 3 config.json `d` whose SigLIP tower is `tower` (its
    defaults filled in); refuses a token count the projector's pooling cannot make."""
    given = {k: v for k, v in d.items() if v is not None}

    def setting(name: str) -> int:  # transformers reads `image_token_id` etc. as `image_token_index`
        return int(given.get(name, given.get(name.replace("_index", "_id"), _DEFAULTS[name])))

    tokens = setting("mm_tokens_per_image")
    side = int(tokens**0.5)  # as transformers rounds it
    patches = tower["image_size"] // tower["patch_size"]
    if side * side != tokens or side == 0 or patches % side:
        raise UnsupportedModelError(f"Gemma 3 with mm_tokens_per_image {tokens}: the projector pools the tower's "
                                    f"{patches}x{patches} patches in square blocks, so it must be the square of a "
                                    f"divisor of {patches}")
    text = given.get("text_config") or {}
    return dict(
        feature_layers=(tower["num_hidden_layers"],), drop_first=False, post_norm=True, projector="gemma3",
        projector_act="none", projector_bias=False, pooled_tokens=tokens, bidirectional=True,
        text_hidden_size=text.get("hidden_size", _TEXT_HIDDEN), image_token_id=setting("image_token_index"),
        boi_token_id=setting("boi_token_index"), eoi_token_id=setting("eoi_token_index"))


def gemma3_project(cfg: VisionConfig, feats: jax.Array, soft_norm: jax.Array, projection: jax.Array) -> jax.Array:
    """The tower's last hidden state feats [B, P * P, Hv] as language-model embeddings [B, tokens, E]: averaged
    in k x k blocks of the P x P patch grid, RMS-normed (Gemma's 1 + w, in float32) and projected."""
    B, N, Hv = feats.shape
    P = cfg.image_size // cfg.patch_size
    side = int(cfg.tokens_per_image**0.5)
    k = P // side
    with jax.named_scope("gemma3_projector"):
        blocks = feats.astype(jnp.float32).reshape(B, side, k, side, k, Hv)  # patch (r * k + i, c * k + j)
        pooled = blocks.mean(axis=(2, 4)).astype(feats.dtype).reshape(B, side * side, Hv)
        x = pooled.astype(jnp.float32)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + cfg.layer_norm_eps)
        x = (x * (1.0 + soft_norm.astype(jnp.float32))).astype(feats.dtype)
        return (x @ projection).astype(feats.dtype)  # [B, tokens, E]
