"""The Mamba-2 layers of a hybrid model (Granite 4.0-H, Bamba, Nemotron-H; Falcon-H1's beside attention), its Mamba
layers of the first form (Jamba), its short convolutions (LFM2) or its Gated DeltaNet layers (Qwen3-Next, Qwen3.5,
OLMo Hybrid): their shapes, read from its HF config (`ModelConfig.mamba`), and which layers lack a mixer or an MLP."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from jaxserve.config_falcon_h1 import falcon_h1
from jaxserve.config_jamba import jamba
from jaxserve.config_lfm2 import lfm2
from jaxserve.config_mamba_lm import MAMBA_LM_FAMILIES, mamba_lm
from jaxserve.config_nemotron import nemotron_h
from jaxserve.config_olmo_hybrid import olmo_hybrid
from jaxserve.config_qwen3_next import GATED_DELTA_FAMILIES, qwen3_next
from jaxserve.errors import UnsupportedModelError

HYBRID_FAMILIES: tuple[str, ...] = ("granitemoehybrid", "bamba", "nemotron_h", "lfm2", "lfm3", *GATED_DELTA_FAMILIES,
                                    "olmo_hybrid", "falcon_h1", "jamba", *MAMBA_LM_FAMILIES)

# A hybrid config's layer kinds as transformers reads them ("mamba" and "attention" are the checkpoints' names;
# "mlp": a layer of an MLP alone, Nemotron-H's).
MAMBA_KINDS = ("mamba", "linear_attention")
ATTENTION_KINDS = ("attention", "full_attention")
MLP_KINDS = ("mlp",)


@dataclass(frozen=True)
class MambaConfig:
    """The Mamba-2 (SSD) mixer that takes attention's place in `layers`: an input projection into the gate z, the
    convolved x, B and C and the step dt per head; a causal depthwise convolution of `conv_kernel` taps over (x, B,
    C); the selective scan of `num_heads` heads of `head_dim` channels, each with a state of `state_size` per channel
    (B and C shared by the heads of each of `n_groups` groups); a norm of the output gated by z, per group; the output
    projection. Per sequence it keeps a convolution state (the last `conv_kernel - 1` inputs) and an SSM state.
    Nemotron-H's blocks hold a mixer or an MLP; paired into layers, some layers have no MLP (`no_mlp`, their MLPs
    stacked apart: `Params.mlp_layers`) or no mixer (`no_mixer`: an MLP alone).

    `kind` "short_conv" (LFM2's): the input projection into B, C and x, the causal convolution of B * x, times C,
    the output projection; its width `inner` (one head of the model's width, no state: `state_size` 0)."""

    layers: tuple[int, ...]
    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int = 1
    conv_kernel: int = 4
    conv_bias: bool = True
    proj_bias: bool = False
    time_step_min: float = 0.0  # dt clamped to [min, max] after its softplus (transformers' `time_step_limit`)
    time_step_max: float = math.inf
    norm_eps: float = 1e-6  # the gated norm's (the model's `rms_norm_eps`; OLMo Hybrid's 1e-5)
    beta_scale: float = 1.0  # a DeltaNet's beta, sigmoid(b) times this (OLMo Hybrid's 2: eigenvalues down to -1)
    no_mlp: tuple[int, ...] = ()  # layers of a mixer alone
    no_mixer: tuple[int, ...] = ()  # layers of an MLP alone
    kind: str = "mamba2"  # or "short_conv", "gated_delta", "mamba1" (Jamba's: heads its channels, of one dim)
    dt_rank: int = 0  # a "mamba1" layer's low-rank step
    parallel: bool = False  # each Mamba layer also attends, both on one normed input (Falcon-H1)
    # The mixer's output: normed per group after its gate silu(z) ("gated", Mamba-2's), before it ("before"), or not
    # normed ("none": y * silu(z))
    gate_norm: str = "gated"
    # A "mamba1" layer's dt, B and C: RMSNormed with weights ("weighted", Jamba's), without ("unweighted", Falcon
    # Mamba's) or not at all ("none", Mamba's)
    step_norms: str = "weighted"
    # The residual kept in float32 under a narrower dtype, each layer's norm reading it in the weights' dtype, the head
    # the final norm's output in it (Mamba's, Falcon Mamba's and Mamba-2's `residual_in_fp32`)
    residual_fp32: bool = False

    def mlp_layers(self, num_layers: int, first: int = 0) -> tuple[int, ...]:
        """The layers with an MLP, from layer `first` on (after a model's dense first layers: their MLPs stacked
        apart, `Params.dense_layers`)."""
        return tuple(i for i in range(first, num_layers) if i not in self.no_mlp)

    @property
    def inner(self) -> int:
        """The scan's width: `num_heads * head_dim`."""
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """The convolved channels: x, then B and C of each group (q and k of each key head, then v); "mamba1": x."""
        return self.inner + (0 if self.kind == "mamba1" else 2 * self.n_groups * self.state_size)

    @property
    def proj_dim(self) -> int:
        """The input projection's outputs: z, the convolved channels, dt (a short convolution's: B, C, x; a Gated
        DeltaNet's: the convolved channels, z, beta, a)."""
        if self.kind in ("short_conv", "mamba1"):  # (B, C, x; x and z)
            return (3 if self.kind == "short_conv" else 2) * self.inner
        return self.inner + self.conv_dim + self.num_heads * (2 if self.kind == "gated_delta" else 1)

    def check(self, num_layers: int) -> None:
        if self.kind not in ("mamba2", "short_conv", "gated_delta", "mamba1"):
            raise UnsupportedModelError(f"mamba kind {self.kind!r} is not supported (mamba2, short_conv, gated_delta, "
                                        "mamba1)")
        if self.kind == "mamba1" and (self.head_dim != 1 or self.dt_rank <= 0):
            raise UnsupportedModelError(f"a mamba1 layer's heads are its channels, of one dim ({self.head_dim}), and "
                                        f"its dt_rank ({self.dt_rank}) is positive")
        for name in ("num_heads", "head_dim", "state_size", "n_groups", "conv_kernel"):
            if getattr(self, name) <= 0 and (name, self.kind) != ("state_size", "short_conv"):
                raise UnsupportedModelError(f"mamba {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.n_groups:
            raise UnsupportedModelError(f"mamba_n_heads ({self.num_heads}) must be a multiple of mamba_n_groups "
                                        f"({self.n_groups})")
        if not self.layers or len(set(self.layers)) != len(self.layers) or not all(
                0 <= i < num_layers for i in self.layers):
            raise UnsupportedModelError(f"mamba layers {self.layers} must be distinct layers of the {num_layers}")
        if set(self.layers) & set(self.no_mixer) or set(self.no_mlp) & set(self.no_mixer):
            raise UnsupportedModelError(f"a layer without a mixer ({self.no_mixer}) has an MLP and no Mamba mixer")
        if self.gate_norm not in ("gated", "before", "none"):
            raise UnsupportedModelError(f"mamba gate_norm {self.gate_norm!r} is not supported (gated, before, none)")
        if self.step_norms not in ("weighted", "unweighted", "none"):
            raise UnsupportedModelError(f"mamba step_norms {self.step_norms!r} is not supported (weighted, "
                                        "unweighted, none)")


def bamba(d: dict[str, Any]) -> dict[str, Any]:
    """A Bamba config with its layers' kinds listed (from `attn_layer_indices`) and its rotary embedding over half
    of each head (transformers' `BambaConfig` sets 0.5 whatever the config says); any other config as it is."""
    if d.get("model_type") != "bamba" and "BambaForCausalLM" not in (d.get("architectures") or []):
        return d
    attn = set(d.get("attn_layer_indices") or ())
    kinds = ["attention" if i in attn else "mamba" for i in range(d["num_hidden_layers"])]
    rope = {k: {**d[k], "partial_rotary_factor": 0.5} for k in ("rope_parameters", "rope_scaling")
            if isinstance(d.get(k), dict)}
    return {**d, **rope, "layer_types": kinds, "partial_rotary_factor": 0.5}


def hybrid_config(d: dict[str, Any]) -> dict[str, Any]:
    """A Bamba, Nemotron-H, LFM2, Qwen3-Next, Qwen3.5, OLMo Hybrid, Falcon-H1, Jamba, Mamba or Mamba-2 config in
    Granite 4.0-H's keys (`bamba`, `config_nemotron.nemotron_h`, `config_lfm2.lfm2`, `config_qwen3_next.qwen3_next`,
    `config_olmo_hybrid.olmo_hybrid`, `config_falcon_h1.falcon_h1`, `config_jamba.jamba`,
    `config_mamba_lm.mamba_lm`); any other as it is."""
    return mamba_lm(jamba(falcon_h1(olmo_hybrid(qwen3_next(lfm2(nemotron_h(bamba(d))))))))


def mamba_config(d: dict[str, Any]) -> MambaConfig | None:
    """A Granite 4.0 hybrid or Bamba config's Mamba layers (None when all its layers attend)."""
    kinds = d.get("layer_types") or d.get("layers_block_type") or ["mamba"] * d["num_hidden_layers"]
    unknown = set(kinds) - set(MAMBA_KINDS) - set(ATTENTION_KINDS) - set(MLP_KINDS)
    if unknown or len(kinds) != d["num_hidden_layers"]:
        raise UnsupportedModelError(f"hybrid layer kinds {sorted(unknown) or kinds} are not supported (one of mamba / "
                                    f"attention for each of {d['num_hidden_layers']} layers)")
    layers = tuple(i for i, k in enumerate(kinds) if k in MAMBA_KINDS)
    if not layers:
        return None
    heads = d.get("mamba_n_heads", 128)
    head_dim = d.get("mamba_d_head", "auto")
    if head_dim in (None, "auto"):  # (the scan's width, heads x head_dim, from mamba_expand x hidden_size)
        inner = d.get("mamba_expand", 2) * d["hidden_size"]
        if inner % heads:
            raise UnsupportedModelError(f"mamba_n_heads ({heads}) must divide mamba_expand x hidden_size ({inner})")
        head_dim = inner // heads
    # (transformers writes an infinite limit as {"__float__": "Infinity"})
    limit = [float(x["__float__"] if isinstance(x, dict) else x) for x in d.get("time_step_limit") or (0.0, math.inf)]
    return MambaConfig(layers=layers, num_heads=heads, head_dim=head_dim, state_size=d.get("mamba_d_state", 256),
                       n_groups=d.get("mamba_n_groups", 1), conv_kernel=d.get("mamba_d_conv", 4),
                       conv_bias=bool(d.get("mamba_conv_bias", True)), proj_bias=bool(d.get("mamba_proj_bias", False)),
                       time_step_min=limit[0], time_step_max=limit[1],
                       norm_eps=float(d.get("mamba_norm_eps", d.get("rms_norm_eps", 1e-6))),
                       beta_scale=float(d.get("mamba_beta_scale", 1.0)), no_mlp=tuple(d.get("mamba_no_mlp") or ()),
                       no_mixer=tuple(i for i, k in enumerate(kinds) if k in MLP_KINDS),
                       kind=d.get("mamba_kind", "mamba2"), parallel=bool(d.get("mamba_parallel", False)),
                       gate_norm=d.get("mamba_gate_norm", "gated"), dt_rank=int(d.get("mamba_dt_rank") or 0),
                       step_norms=d.get("mamba_step_norms", "weighted"),
                       residual_fp32=bool(d.get("mamba_residual_fp32", False)))


def apart_mlp_layers(cfg: Any) -> tuple[int, ...]:
    """The layers of a hybrid model `cfg` whose MLPs `Params.mlp_layers` stacks, in order: those with an MLP, but the
    dense layers of a MoE model (`ModelConfig.dense_layer`: its dense first layers, or Jamba's between experts),
    stacked in `Params.dense_layers`."""
    return tuple(i for i in cfg.mamba.mlp_layers(cfg.num_layers) if not (cfg.num_experts and cfg.dense_layer(i)))


def mamba_hf(m: MambaConfig, num_layers: int, hidden_size: int, family: str) -> dict[str, Any]:
    """The HF config keys of `m` (the inverse of `mamba_config`; Bamba's attention layers by index)."""
    kinds = {"attn_layer_indices": [i for i in range(num_layers) if i not in m.layers]} if family == "bamba" else {
        "layer_types": ["mamba" if i in m.layers else "attention" for i in range(num_layers)]}
    return {**kinds, "mamba_n_heads": m.num_heads, "mamba_d_head": m.head_dim, "mamba_d_state": m.state_size,
            "mamba_n_groups": m.n_groups, "mamba_d_conv": m.conv_kernel, "mamba_conv_bias": m.conv_bias,
            "mamba_proj_bias": m.proj_bias, "mamba_expand": m.inner // hidden_size,
            "time_step_limit": [m.time_step_min, m.time_step_max]}
