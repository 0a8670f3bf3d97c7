"""Idefics3's and SmolVLM's image side past its SigLIP tower (transformers' `Idefics3Connector` / `SmolVLMConnector`):
the last hidden state (after the tower's `post_layernorm`), a square grid of patches, folded `scale_factor` x
`scale_factor` into one token of that many times the width (pixel shuffle), then one matrix without bias into the
language model's width. An image is cut into square tiles and a global view (`images_idefics3`), each the tower's
input, and written in a prompt with its tiles' row and column tokens (`engine.multimodal_idefics3`).
"""

from __future__ import annotations

from typing import Any

from jaxserve.errors import UnsupportedModelError

CONNECTOR = "modality_projection.proj.weight"  # the connector's matrix (under `model.connector.`), [out, in]
_IMAGE_TOKEN = {"idefics3": 128257, "smolvlm": 49190}  # transformers' config defaults


def idefics3_fields(d: dict[str, Any], tower: dict[str, Any], kind: str) -> dict[str, Any]:
    """The `VisionConfig` fields particular to an Idefics3 or SmolVLM config.json `d` whose tower is `tower` (its
    defaults filled in); refuses a fold the patch grid cannot take."""
    s = int(d.get("scale_factor", 2))
    side = tower["image_size"] // tower["patch_size"]
    if s < 1 or side % s:
        raise UnsupportedModelError(f"scale_factor {s} must divide the tower's {side} patches a side")
    text = d.get("text_config") or {}
    return dict(feature_layers=(tower["num_hidden_layers"],), drop_first=False, projector_act="", projector_bias=False,
                text_hidden_size=int(text.get("hidden_size", 4096)), post_norm=True, projector="shuffle", shuffle=s,
                image_token_id=int(d.get("image_token_id", d.get("image_token_index", _IMAGE_TOKEN[kind]))))
