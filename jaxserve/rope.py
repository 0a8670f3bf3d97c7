"""Rotary embeddings: HF's `rope_scaling`, and the frequencies of a model configuration."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from jaxserve.errors import UnsupportedModelError

if TYPE_CHECKING:
    from jaxserve.config import ModelConfig

RopeType = Literal["default", "linear", "llama3", "yarn", "longrope", "factors"]


@dataclass(frozen=True)
class RopeScaling:
    """Rotary embedding frequency scaling, as HF's `rope_scaling` describes it; or ("factors") a divisor
    of each rotary pair's frequency, as a llama.cpp GGUF file stores Llama 3.1's scaling (`rope_freqs`).

    LongRoPE (Phi-3's long-context models, Phi-3.5, Phi-4-mini) divides each pair's frequency by its
    `short_factor` or its `long_factor`, with one attention factor for both. Which set a token takes is
    transformers' choice for a sequence generated token by token after its prompt (`models.rotary.rope_tables`)."""

    rope_type: RopeType = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True  # YaRN: the correction range's ends rounded to whole dims (gpt-oss: not)
    freq_factors: tuple[float, ...] | None = None
    short_factor: tuple[float, ...] | None = None  # LongRoPE's
    long_factor: tuple[float, ...] | None = None

    @classmethod
    def from_hf(cls, d: dict[str, Any] | None, max_position_embeddings: int, head_dim: int = 0) -> RopeScaling:
        """HF's `rope_scaling` (or a `rope_parameters` entry); "proportional" (Gemma 4's, LFM3's: the leading
        `partial_rotary_factor` of each head's pairs turned at the frequencies of the whole `head_dim`, the rest not)
        as "factors" that divide the frequencies of the pairs left unturned by infinity."""
        if not d:
            return cls()
        rope_type = d.get("rope_type", d.get("type", "default"))
        if rope_type == "proportional" and head_dim > 0:
            return cls.proportional(int(float(d.get("partial_rotary_factor", 1.0)) * head_dim // 2), head_dim // 2,
                                    float(d.get("factor", 1.0)))
        if rope_type not in ("default", "linear", "llama3", "yarn", "longrope"):
            raise UnsupportedModelError(
                f"rope_scaling type {rope_type!r} is not supported (supported: default, linear, llama3, yarn, longrope)"
            )
        if rope_type == "default":
            # One canonical form, so equal models give equal (jit-static) configs whichever way HF wrote them.
            return cls()
        fields = {f.name for f in dataclasses.fields(cls)}
        # (`partial_rotary_factor` is the model's: `ModelConfig.rotary_dim`.)
        kwargs = {k: v for k, v in d.items() if k in fields and k != "rope_type" and v is not None}
        kwargs.setdefault("original_max_position_embeddings", max_position_embeddings)
        if rope_type == "longrope":
            original = kwargs["original_max_position_embeddings"]
            kwargs["short_factor"], kwargs["long_factor"] = tuple(map(float, d["short_factor"])), tuple(
                map(float, d["long_factor"]))
            # transformers' default: the factor from the two context lengths, the attention factor from it.
            factor = float(d.get("factor") or max_position_embeddings / original)
            kwargs["factor"] = factor
            kwargs.setdefault("attention_factor",
                              1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original)))
        return cls(rope_type=rope_type, **kwargs)

    @classmethod
    def proportional(cls, turned: int, pairs: int, factor: float = 1.0) -> RopeScaling:
        """A proportional rotary embedding over a head of `pairs` pairs: the leading `turned` pairs' frequencies (of the
        whole head) divided by `factor`, the rest by infinity (left unturned)."""
        return cls(rope_type="factors", freq_factors=tuple(factor if i < turned else math.inf for i in range(pairs)))

    def to_hf(self) -> dict[str, Any]:
        """This scaling (not "default") as an HF config's `rope_scaling` (the inverse of `from_hf`); "factors" only
        where they are "proportional" ones (the same divisor for each of the leading pairs, infinity for the rest:
        a GGUF file's `rope_freqs` have no HF form)."""
        if self.rope_type == "factors":
            factors = self.freq_factors or ()
            turned = [f for f in factors if f != math.inf]
            if not turned or len(set(turned)) != 1 or math.inf in factors[:len(turned)]:
                raise UnsupportedModelError("rope frequency factors (a GGUF file's rope_freqs) have no HF config form")
            return {"rope_type": "proportional", "partial_rotary_factor": len(turned) / len(factors),
                    **({"factor": turned[0]} if turned[0] != 1.0 else {})}
        scaling: dict[str, Any] = {"rope_type": self.rope_type, "factor": self.factor}
        if self.rope_type in ("llama3", "longrope", "yarn"):
            scaling["original_max_position_embeddings"] = self.original_max_position_embeddings
        if self.rope_type == "llama3":
            scaling.update(low_freq_factor=self.low_freq_factor, high_freq_factor=self.high_freq_factor)
        if self.rope_type == "longrope":
            scaling.update(short_factor=list(self.short_factor or ()), long_factor=list(self.long_factor or ()),
                           attention_factor=self.attention_factor)
        if self.rope_type == "yarn":
            scaling.update(beta_fast=self.beta_fast, beta_slow=self.beta_slow)
            if not self.truncate:
                scaling["truncate"] = False
            scaling.update({k: getattr(self, k) for k in ("mscale", "mscale_all_dim", "attention_factor")
                            if getattr(self, k) is not None})
        return scaling

    @classmethod
    def from_gguf(cls, meta: dict[str, Any], arch: str, max_pos: int,
                  rope_tensors: Mapping[str, Sequence[float]] | None = None) -> RopeScaling:
        """The scaling a GGUF file's `{arch}.rope.scaling.*` metadata and rope tensors (`rope_freqs`: Llama
        3.1's; `rope_factors_short` and `rope_factors_long`: LongRoPE's) describe."""
        tensors = rope_tensors or {}
        rope_type = meta.get(f"{arch}.rope.scaling.type", "none")
        if "rope_factors_short" in tensors or "rope_factors_long" in tensors:
            if "rope_factors_short" not in tensors or "rope_factors_long" not in tensors:
                raise UnsupportedModelError("a GGUF file with LongRoPE factors needs both rope_factors_short and "
                                            "rope_factors_long")
            d: dict[str, Any] = {"rope_type": "longrope", "short_factor": tensors["rope_factors_short"],
                                 "long_factor": tensors["rope_factors_long"],
                                 "original_max_position_embeddings": int(meta.get(
                                     f"{arch}.rope.scaling.original_context_length", max_pos)),
                                 "attention_factor": meta.get(f"{arch}.rope.scaling.attn_factor")}
            return cls.from_hf(d, max_pos)
        if "rope_freqs" in tensors:
            if rope_type not in ("none", None):
                raise UnsupportedModelError(f"GGUF rope frequency factors (rope_freqs.weight) with rope scaling "
                                            f"type {rope_type!r} are not supported")
            return cls(rope_type="factors", freq_factors=tuple(float(f) for f in tensors["rope_freqs"]))
        if rope_type in ("none", None):
            return cls()
        if rope_type not in ("linear", "yarn"):
            raise UnsupportedModelError(f"GGUF rope scaling type {rope_type!r} is not supported")
        factor = meta.get(f"{arch}.rope.scaling.factor")
        if factor is None:
            raise UnsupportedModelError(f"GGUF metadata is missing {arch}.rope.scaling.factor")
        if rope_type == "linear":
            return cls(rope_type="linear", factor=float(factor))
        original = int(meta.get(f"{arch}.rope.scaling.original_context_length", max_pos))
        return cls(rope_type="yarn", factor=float(factor), original_max_position_embeddings=original)


LONG_ROPE_SALT_PREFIX = "longrope:"


def prompt_cache_salt(long_rope_context: int | None, prompt_len: int, salt: str | None) -> str | None:
    """The prefix-cache namespace of a request: its own `salt`, or, when its prompt is longer than the original
    context of the LongRoPE model an engine serves past it (`long_rope_context`), a namespace of such prompts,
    whose every token takes the long factors (`models.rotary.rope_tables`): the same tokens after a shorter prompt hold
    other keys. Salts of that form are refused from requests."""
    if salt is not None and salt.startswith(LONG_ROPE_SALT_PREFIX):
        raise ValueError(f"cache_salt {salt!r}: salts beginning {LONG_ROPE_SALT_PREFIX!r} name the cache namespace "
                         "of prompts past a LongRoPE model's original context")
    if long_rope_context is None or prompt_len <= long_rope_context:
        return salt
    return LONG_ROPE_SALT_PREFIX if salt is None else f"{LONG_ROPE_SALT_PREFIX}|{salt}"


def rope_inv_freq_and_scale(cfg: ModelConfig, local: bool = False, long: bool = False) -> tuple[list[float], float]:
    """Inverse frequencies for each rotary pair and the attention scaling factor, per `cfg.rope_scaling`;
    with `local`, those of the sliding-window layers of a model that gives them their own base
    (`rope_local_theta`, unscaled: Gemma 3); with `long`, LongRoPE's long factors (its short ones otherwise;
    see `models.rotary.rope_tables`). A partial rotary embedding spreads its frequencies over the rotary dims
    (`cfg.rotary_dims`) alone."""
    d = cfg.rotary_dims
    if local and cfg.rope_local_theta is not None:
        return [1.0 / (cfg.rope_local_theta ** (2 * i / d)) for i in range(d // 2)], 1.0
    base = cfg.rope_theta
    inv = [1.0 / (base ** (2 * i / d)) for i in range(d // 2)]
    rs = cfg.rope_scaling
    attention_factor = 1.0
    if rs.rope_type == "linear":
        inv = [f / rs.factor for f in inv]
    elif rs.rope_type == "longrope":
        factors = rs.long_factor if long else rs.short_factor
        assert factors is not None and rs.attention_factor is not None
        inv = [f / k for f, k in zip(inv, factors, strict=True)]
        attention_factor = rs.attention_factor
    elif rs.rope_type == "factors":
        assert rs.freq_factors is not None
        inv = [f / k for f, k in zip(inv, rs.freq_factors, strict=True)]
    elif rs.rope_type == "llama3":
        old = rs.original_max_position_embeddings
        low_wavelen = old / rs.low_freq_factor
        high_wavelen = old / rs.high_freq_factor
        out = []
        for f in inv:
            wavelen = 2 * math.pi / f
            if wavelen < high_wavelen:
                out.append(f)
            elif wavelen > low_wavelen:
                out.append(f / rs.factor)
            else:
                smooth = (old / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
                out.append((1 - smooth) * f / rs.factor + smooth * f)
        inv = out
    elif rs.rope_type == "yarn":
        old = rs.original_max_position_embeddings

        def correction_dim(num_rotations: float) -> float:
            return (d * math.log(old / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(rs.beta_fast), correction_dim(rs.beta_slow)
        if rs.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        if low == high:
            high += 0.001
        out = []
        for i, f in enumerate(inv):
            ramp = min(max((i - low) / (high - low), 0.0), 1.0)
            extrapolation_factor = 1.0 - ramp
            out.append((f / rs.factor) * (1 - extrapolation_factor) + f * extrapolation_factor)
        inv = out

        def get_mscale(scale: float, mscale: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

        if rs.attention_factor is not None:
            attention_factor = rs.attention_factor
        elif rs.mscale and rs.mscale_all_dim:
            attention_factor = get_mscale(rs.factor, rs.mscale) / get_mscale(rs.factor, rs.mscale_all_dim)
        else:
            attention_factor = get_mscale(rs.factor)
    return inv, attention_factor
