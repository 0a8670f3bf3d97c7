"""The vision towers jaxserve reads, each with how its config is found in an HF `config.json`, which tensors are
its, and how its weights load: LLaVA's and Gemma 3's CLIP/SigLIP (`models.vision`), Qwen2-VL's
(`models.vision_qwen2`), Pixtral's (`models.vision_pixtral`), InternVL's (`models.vision_internvl`) and Gemma 4's
(`models.vision_gemma4`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxserve.models.vision import VisionConfig, is_vision_tensor, load_vision_params, random_vision_params
from jaxserve.models.vision_gemma4 import (
    Gemma4VisionConfig,
    is_gemma4_vision_tensor,
    load_gemma4_vision_params,
    random_gemma4_vision_params,
)
from jaxserve.models.vision_internvl import (
    InternVisionConfig,
    is_internvl_vision_tensor,
    load_internvl_vision_params,
    random_internvl_vision_params,
)
from jaxserve.models.vision_pixtral import (
    PixtralVisionConfig,
    is_pixtral_vision_tensor,
    load_pixtral_vision_params,
    random_pixtral_vision_params,
)
from jaxserve.models.vision_qwen2 import (
    QwenVisionConfig,
    is_qwen_vision_tensor,
    load_qwen_vision_params,
    random_qwen_vision_params,
)


@dataclass(frozen=True)
class Tower:
    name: str
    config_type: type
    is_tensor: Callable[[str], bool]  # an HF tensor name of the tower or its projector
    load: Callable[[Any, Iterable[tuple[str, np.ndarray]], Any, dict | None], Any]  # (cfg, tensors, dtype, unused)
    random: Callable[[Any, Any, int], Any]  # (cfg, dtype, seed): `--load-format dummy`

    def read_config(self, hf_config: dict[str, Any]) -> Any:
        return self.config_type.from_hf(hf_config)


# In the order they are tried: a LLaVA config with a Pixtral tower is Pixtral's.
TOWERS = (
    Tower("gemma4", Gemma4VisionConfig, is_gemma4_vision_tensor,
          lambda cfg, tensors, dtype, unused: load_gemma4_vision_params(cfg, tensors, dtype),
          random_gemma4_vision_params),
    Tower("pixtral", PixtralVisionConfig, is_pixtral_vision_tensor,
          lambda cfg, tensors, dtype, unused: load_pixtral_vision_params(cfg, tensors, dtype),
          random_pixtral_vision_params),
    Tower("qwen2_vl", QwenVisionConfig, is_qwen_vision_tensor,
          lambda cfg, tensors, dtype, unused: load_qwen_vision_params(cfg, tensors, dtype), random_qwen_vision_params),
    Tower("internvl", InternVisionConfig, is_internvl_vision_tensor,
          lambda cfg, tensors, dtype, unused: load_internvl_vision_params(cfg, tensors, dtype),
          random_internvl_vision_params),
    Tower("llava", VisionConfig, is_vision_tensor, load_vision_params, random_vision_params),
)


def tower_of(hf_config: dict[str, Any]) -> tuple[Tower, Any] | None:
    """The tower an HF config describes and its vision config; None for a text model."""
    for tower in TOWERS:
        cfg = tower.read_config(hf_config)
        if cfg is not None:
            return tower, cfg
    return None


def tower_for(cfg: Any) -> Tower:
    """The tower of a vision config."""
    return next(t for t in TOWERS if isinstance(cfg, t.config_type))
