"""Embeddings: how a model's hidden states become one vector (`PoolerConfig`, per model) and what one
request asks of it (`PoolingParams`), with vLLM's names.

A model runs as an embedding model with `--runner pooling`. Its pooler config comes from
`--pooler-config`, else from the sentence-transformers files of its directory (`modules.json` naming a
`Pooling` module and perhaps a `Normalize` one), else last-token pooling, L2-normalized: what
decoder-only embedding models (Qwen3-Embedding, e5-mistral, gte-Qwen2) use.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from jaxserve.json_options import json_object

PoolingType = Literal["LAST", "MEAN", "CLS"]
POOLING_TYPES = ("LAST", "MEAN", "CLS")
# sentence-transformers' Pooling config keys, to ours.
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}


@dataclass(frozen=True)
class PoolerConfig:
    """How a sequence's final hidden states (after the model's last norm) become its embedding.

    LAST: the last token's; MEAN: the mean over every token; CLS: the first token's. `normalize`
    scales the vector to unit L2 norm. None fields take the model's (or the defaults)."""

    pooling_type: PoolingType | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None:
            kind = str(self.pooling_type).upper()
            if kind not in POOLING_TYPES:
                raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")
            object.__setattr__(self, "pooling_type", kind)
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"pooler normalize must be true or false, got {self.normalize!r}")

    @classmethod
    def parse(cls, value: str | Mapping[str, Any]) -> PoolerConfig:
        """From a JSON object (the command line) or a mapping; unknown keys are named."""
        return cls(**json_object(value, "pooler config", '{"pooling_type": "LAST", "normalize": true}',
                                 {"pooling_type", "normalize"}))

    def resolve(self, model_path: str | None) -> PoolerConfig:
        """Every field set: this config's, then the model directory's sentence-transformers config's,
        then LAST and normalized."""
        found = sentence_transformers_pooler(model_path) if model_path and os.path.isdir(model_path) else PoolerConfig()
        return PoolerConfig(self.pooling_type or found.pooling_type or "LAST",
                            self.normalize if self.normalize is not None
                            else found.normalize if found.normalize is not None else True)


def sentence_transformers_pooler(path: str) -> PoolerConfig:
    """The pooling a sentence-transformers model directory declares (`modules.json`), or an empty config.

    Only the pooling modes jaxserve computes are read; a directory naming another (max, weighted
    mean, several at once) is refused by name rather than served with a different pooling."""
    modules_file = os.path.join(path, "modules.json")
    if not os.path.isfile(modules_file):
        return PoolerConfig()
    with open(modules_file, encoding="utf-8") as f:
        modules = json.load(f)
    kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
    pooling_type = None
    if "Pooling" in kinds:
        cfg_file = os.path.join(path, kinds["Pooling"].get("path", ""), "config.json")
        with open(cfg_file, encoding="utf-8") as f:
            st = json.load(f)
        modes = [k for k, v in st.items() if k.startswith("pooling_mode") and v is True]
        ours = {_ST_MODES.get(k) for k in modes}
        if len(modes) != 1 or None in ours:
            raise ValueError(f"{cfg_file} asks for pooling {', '.join(modes) or 'none'}; jaxserve pools with one of "
                             f"{', '.join(_ST_MODES)} (override with --pooler-config)")
        pooling_type = ours.pop()
    return PoolerConfig(pooling_type, "Normalize" in kinds)


@dataclass(frozen=True)
class PoolingParams:
    """One embedding request's options.

    `dimensions`: keep the first this many of the embedding's values (then normalize), for models
    trained for it (Matryoshka representations); `normalize`: override the model's pooler config;
    `truncate_prompt_tokens`: keep only the prompt's last this many tokens (-1: the model's length).
    `task`: "embed" or "classify", checked against what the model computes (None: its own task);
    `activation`: for a classification model, probabilities (the default) or, false, the head's logits."""

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None
    task: Literal["embed", "classify"] | None = None
    activation: bool | None = None

    def __post_init__(self) -> None:
        for name in ("dimensions", "truncate_prompt_tokens"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or (value < 1 and not (
                    name == "truncate_prompt_tokens" and value == -1)):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("normalize", "activation"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.task not in (None, "embed", "classify"):
            raise ValueError(f"task must be 'embed' or 'classify', got {self.task!r}")
