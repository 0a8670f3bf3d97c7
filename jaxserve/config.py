"""The model configuration: one frozen dataclass for every supported Llama-family model."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

Family = Literal["llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen2_moe", "qwen3_moe"]
RopeType = Literal["default", "linear", "llama3", "yarn"]

_HF_ARCHITECTURES: dict[str, Family] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
_HF_MODEL_TYPES: dict[str, Family] = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "mistral",
                                      "mixtral": "mixtral", "qwen2_moe": "qwen2_moe", "qwen3_moe": "qwen3_moe"}
MOE_FAMILIES: tuple[str, ...] = ("mixtral", "qwen2_moe", "qwen3_moe")
_GGUF_ARCHITECTURES: dict[str, Family] = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "mistral"}


class UnsupportedModelError(ValueError):
    """The model's files describe something jaxserve does not implement."""


@dataclass(frozen=True)
class RopeScaling:
    """Rotary embedding frequency scaling, as HF's `rope_scaling` describes it."""

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

    @classmethod
    def from_hf(cls, d: dict[str, Any] | None, max_position_embeddings: int) -> RopeScaling:
        if not d:
            return cls()
        rope_type = d.get("rope_type", d.get("type", "default"))
        if rope_type not in ("default", "linear", "llama3", "yarn"):
            raise UnsupportedModelError(
                f"rope_scaling type {rope_type!r} is not supported (supported: default, linear, llama3, yarn)"
            )
        if d.get("partial_rotary_factor", 1.0) != 1.0:
            raise UnsupportedModelError(f"partial rotary embeddings (partial_rotary_factor={d['partial_rotary_factor']})"
                                        " are not supported")
        if rope_type == "yarn" and d.get("truncate", True) is False:
            raise UnsupportedModelError("yarn rope scaling with truncate=false is not supported")
        if rope_type == "default":
            # One canonical form, so equal models give equal (jit-static) configs whichever way HF wrote them.
            return cls()
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in fields and k != "rope_type" and v is not None}
        kwargs.setdefault("original_max_position_embeddings", max_position_embeddings)
        return cls(rope_type=rope_type, **kwargs)


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder; jit treats it as static (hashable)."""

    family: Family
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    hidden_act: str = "silu"
    # Mixture of experts (0 experts = a dense MLP): top-k routing over `num_experts` MLPs of width
    # `moe_intermediate_size`; `norm_topk_prob` renormalizes the k routing weights to sum to one;
    # a shared expert of width `shared_expert_intermediate_size` (0 = none) sees every token.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    # Per-layer `k_scale` / `v_scale` tensors for a float8 KV cache (a compressed-tensors `kv_cache_scheme`).
    kv_cache_scales: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise UnsupportedModelError(f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise UnsupportedModelError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.hidden_act != "silu":
            raise UnsupportedModelError(f"hidden_act {self.hidden_act!r} is not supported (only 'silu')")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise UnsupportedModelError(f"sliding_window must be positive, got {self.sliding_window}")
        if self.num_experts and not (0 < self.num_experts_per_tok <= self.num_experts
                                     and self.moe_intermediate_size > 0):
            raise UnsupportedModelError(
                f"a MoE model needs 0 < num_experts_per_tok ({self.num_experts_per_tok}) <= num_experts "
                f"({self.num_experts}) and a positive moe_intermediate_size ({self.moe_intermediate_size})"
            )

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def num_params(self) -> int:
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        mlp = 3 * h * i
        if self.num_experts:
            mlp = self.num_experts * (3 * h * self.moe_intermediate_size + h)
            mlp += 3 * h * self.shared_expert_intermediate_size + (h if self.shared_expert_intermediate_size else 0)
        per_layer = attn + mlp + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + h

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> ModelConfig:
        """Parse an HF `config.json` dict; refuses architectures and options jaxserve does not implement."""
        archs = d.get("architectures") or []
        family: Family | None = None
        for arch in archs:
            if arch in _HF_ARCHITECTURES:
                family = _HF_ARCHITECTURES[arch]
                break
        if family is None:
            family = _HF_MODEL_TYPES.get(d.get("model_type", ""))
        if family is None:
            raise UnsupportedModelError(
                f"architecture {archs or d.get('model_type')!r} is not supported "
                f"(supported: {', '.join(_HF_ARCHITECTURES)})"
            )
        num_heads = d["num_attention_heads"]
        hidden = d["hidden_size"]
        head_dim = d.get("head_dim") or hidden // num_heads
        max_pos = d.get("max_position_embeddings", 4096)
        sliding = d.get("sliding_window") if family in ("mistral", "mixtral") else None
        if family in ("qwen2_moe", "qwen3_moe"):
            if d.get("use_sliding_window"):
                raise UnsupportedModelError(f"{family} with use_sliding_window is not supported")
            if d.get("mlp_only_layers") or d.get("decoder_sparse_step", 1) != 1:
                raise UnsupportedModelError(
                    f"{family} with dense layers between the MoE layers (mlp_only_layers / decoder_sparse_step) "
                    "is not supported"
                )
        moe: dict[str, Any] = {}
        if family in MOE_FAMILIES:
            moe = dict(
                num_experts=d.get("num_local_experts") or d.get("num_experts") or 0,
                num_experts_per_tok=d.get("num_experts_per_tok", 2),
                # Mixtral's experts have the dense MLP's width; Qwen MoE declares theirs apart.
                moe_intermediate_size=d["intermediate_size"] if family == "mixtral" else d["moe_intermediate_size"],
                norm_topk_prob=True if family == "mixtral" else bool(d.get("norm_topk_prob", False)),
                shared_expert_intermediate_size=(d.get("shared_expert_intermediate_size") or 0)
                if family == "qwen2_moe" else 0,
            )
        if family in ("qwen2", "qwen3") and d.get("use_sliding_window") and d.get("sliding_window"):
            # HF Qwen windows only the layers from `max_window_layers` on (or as `layer_types` lists them).
            num_layers = d["num_hidden_layers"]
            layer_types = d.get("layer_types") or [
                "sliding_attention" if i >= d.get("max_window_layers", 28) else "full_attention"
                for i in range(num_layers)
            ]
            if set(layer_types) == {"sliding_attention"}:
                sliding = d["sliding_window"]
            elif set(layer_types) != {"full_attention"}:
                raise UnsupportedModelError(
                    "per-layer sliding windows (some layers windowed, some not: max_window_layers / layer_types) "
                    "are not supported"
                )
        quant = d.get("quantization_config") or {}
        if quant.get("config_groups") or quant.get("quant_method") not in (None, "compressed-tensors"):
            raise UnsupportedModelError(
                f"quantized weights (quantization_config quant_method {quant.get('quant_method')!r}) are not "
                "supported; only a kv_cache_scheme (float8 KV cache scales) is read")
        kv_scheme = quant.get("kv_cache_scheme") or {}
        if kv_scheme and (kv_scheme.get("strategy", "tensor"), kv_scheme.get("type", "float"),
                          kv_scheme.get("num_bits", 8)) != ("tensor", "float", 8):
            raise UnsupportedModelError(f"kv_cache_scheme {kv_scheme} is not supported (only 8-bit float, per tensor)")
        rope_params = d.get("rope_scaling") or d.get("rope_parameters")
        rope_theta = d.get("rope_theta")
        if rope_theta is None and isinstance(rope_params, dict):
            rope_theta = rope_params.get("rope_theta")
        return cls(
            family=family,
            vocab_size=d["vocab_size"],
            hidden_size=hidden,
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=RopeScaling.from_hf(rope_params, max_pos),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            # HF Qwen2 always has q/k/v biases and Mistral never does, whatever `attention_bias` says.
            attention_bias=family == "qwen2" or (family == "qwen2_moe" and bool(d.get("qkv_bias", True)))
            or (family in ("llama", "qwen3", "qwen3_moe") and bool(d.get("attention_bias"))),
            mlp_bias=family == "llama" and bool(d.get("mlp_bias")),
            qk_norm=family in ("qwen3", "qwen3_moe"),
            sliding_window=sliding,
            hidden_act=d.get("hidden_act", "silu"),
            kv_cache_scales=bool(kv_scheme),
            **moe,
        )

    def to_hf(self) -> dict[str, Any]:
        """The HF `config.json` dict describing this model (for `jaxserve convert`)."""
        arch = {v: k for k, v in _HF_ARCHITECTURES.items()}[self.family]
        d: dict[str, Any] = {
            "architectures": [arch],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": self.hidden_act,
            "torch_dtype": "float32",
        }
        if self.family in ("llama", "qwen3", "qwen3_moe"):
            d["attention_bias"] = self.attention_bias
        if self.family == "qwen2_moe":
            d["qkv_bias"] = self.attention_bias
        if self.num_experts:
            d.update(num_experts_per_tok=self.num_experts_per_tok)
            if self.family == "mixtral":
                d.update(num_local_experts=self.num_experts, intermediate_size=self.moe_intermediate_size)
            else:
                d.update(num_experts=self.num_experts, moe_intermediate_size=self.moe_intermediate_size,
                         norm_topk_prob=self.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[])
            if self.family == "qwen2_moe":
                d["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
        if self.family == "llama":
            d["mlp_bias"] = self.mlp_bias
        if self.sliding_window is not None:
            d["sliding_window"] = self.sliding_window
            if self.family not in ("mistral", "mixtral"):
                d["use_sliding_window"] = True
                d["max_window_layers"] = 0  # HF Qwen windows the layers from this index on
        if self.kv_cache_scales:
            d["quantization_config"] = {
                "quant_method": "compressed-tensors", "format": "dense", "config_groups": {},
                "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                                    "symmetric": True}}
        rs = self.rope_scaling
        if rs.rope_type != "default":
            scaling: dict[str, Any] = {"rope_type": rs.rope_type, "factor": rs.factor}
            if rs.rope_type == "llama3":
                scaling.update(low_freq_factor=rs.low_freq_factor, high_freq_factor=rs.high_freq_factor,
                               original_max_position_embeddings=rs.original_max_position_embeddings)
            if rs.rope_type == "yarn":
                scaling.update(beta_fast=rs.beta_fast, beta_slow=rs.beta_slow,
                               original_max_position_embeddings=rs.original_max_position_embeddings)
                for key in ("mscale", "mscale_all_dim", "attention_factor"):
                    if getattr(rs, key) is not None:
                        scaling[key] = getattr(rs, key)
            d["rope_scaling"] = scaling
        return d

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], vocab_size: int, has_output_weight: bool) -> ModelConfig:
        """Parse llama.cpp GGUF metadata (`general.architecture`, `{arch}.*` keys)."""
        arch = meta.get("general.architecture")
        family = _GGUF_ARCHITECTURES.get(arch or "")
        if family is None:
            raise UnsupportedModelError(
                f"GGUF architecture {arch!r} is not supported (supported: {', '.join(_GGUF_ARCHITECTURES)})"
            )

        def get(key: str, default: Any = None) -> Any:
            value = meta.get(f"{arch}.{key}", default)
            if value is None:
                raise UnsupportedModelError(f"GGUF metadata is missing {arch}.{key}")
            return value

        hidden = int(get("embedding_length"))
        num_heads = int(get("attention.head_count"))
        num_kv = int(get("attention.head_count_kv", num_heads))
        head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // num_heads))
        max_pos = int(get("context_length", 4096))
        rope_type = meta.get(f"{arch}.rope.scaling.type", "none")
        scaling = RopeScaling()
        if rope_type == "linear":
            scaling = RopeScaling(rope_type="linear", factor=float(get("rope.scaling.factor")))
        elif rope_type == "yarn":
            scaling = RopeScaling(
                rope_type="yarn",
                factor=float(get("rope.scaling.factor")),
                original_max_position_embeddings=int(get("rope.scaling.original_context_length", max_pos)),
            )
        elif rope_type not in ("none", None):
            raise UnsupportedModelError(f"GGUF rope scaling type {rope_type!r} is not supported")
        sliding = meta.get(f"{arch}.attention.sliding_window")
        return cls(
            family=family,
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_layers=int(get("block_count")),
            num_heads=num_heads,
            num_kv_heads=num_kv,
            head_dim=head_dim,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=not has_output_weight,
            attention_bias=family == "qwen2",
            qk_norm=family == "qwen3",
            sliding_window=int(sliding) if sliding else None,
        )


def rope_inv_freq_and_scale(cfg: ModelConfig) -> tuple[list[float], float]:
    """Inverse frequencies for each rotary pair and the attention scaling factor, per `cfg.rope_scaling`."""
    d = cfg.head_dim
    base = cfg.rope_theta
    inv = [1.0 / (base ** (2 * i / d)) for i in range(d // 2)]
    rs = cfg.rope_scaling
    attention_factor = 1.0
    if rs.rope_type == "linear":
        inv = [f / rs.factor for f in inv]
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

        low = max(math.floor(correction_dim(rs.beta_fast)), 0)
        high = min(math.ceil(correction_dim(rs.beta_slow)), d - 1)
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
