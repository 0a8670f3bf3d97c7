"""Qwen3-Next's and Qwen3.5's llama.cpp GGUF files ("qwen3next", "qwen35", "qwen35moe") as the HF config and tensors
their converter read.

The converter writes a Gated DeltaNet layer's projections as `attn_qkv` (q, k, v) and `attn_gate` (z), Qwen3-Next's
`in_proj_ba` as `ssm_ba` (each key head's b then a, as the checkpoint has them), Qwen3.5's as `ssm_beta` and
`ssm_alpha`; A as -exp(A_log) (`ssm_a`), dt's bias as `ssm_dt.bias`, the convolution squeezed to [channels, taps];
every RMSNorm but the DeltaNet's gated one as 1 + w. Qwen3.5's value heads (in v, z, b, a, A, dt's bias, the
convolution's v channels and the output projection's columns) it writes tiled across key heads (value head j of each
key head, then j + 1) where the checkpoint groups them by key head; they are grouped back here. Its multi-token
prediction layer is not in the file."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

QWEN3_NEXT_GGUF = {"qwen3next": ("Qwen3NextForCausalLM", "qwen3_next"), "qwen35": ("Qwen3_5ForCausalLM", "qwen3_5_text"),
                   "qwen35moe": ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text")}

# A DeltaNet layer's tensors: llama.cpp's name (after `blk.N.`) to the HF module's (after `linear_attn.`).
_DELTA = {"attn_qkv.weight": "in_proj_qkv.weight", "attn_gate.weight": "in_proj_z.weight",
          "ssm_ba.weight": "in_proj_ba.weight", "ssm_beta.weight": "in_proj_b.weight",
          "ssm_alpha.weight": "in_proj_a.weight", "ssm_conv1d.weight": "conv1d.weight", "ssm_a": "A_log",
          "ssm_dt.bias": "dt_bias", "ssm_norm.weight": "norm.weight", "ssm_out.weight": "out_proj.weight"}
# (the norm before the MLP, `post_attention_layernorm`, under Gemma's name for a norm after attention)
NAMES = {"post_attention_norm.weight": "post_attention_layernorm.weight"}


def qwen3_next_gguf_hf(meta: dict[str, Any], arch: str, get: Callable[..., Any], d: dict[str, Any]) -> dict[str, Any]:
    """The HF config of a "qwen3next", "qwen35" or "qwen35moe" file (`d`: the fields every architecture has)."""
    hf_arch, model_type = QWEN3_NEXT_GGUF[arch]
    heads, inner = int(get("ssm.time_step_rank")), int(get("ssm.inner_size"))
    sections = meta.get(f"{arch}.rope.dimension_sections")
    rope = {"rope_type": "default", "rope_theta": d["rope_theta"], "partial_rotary_factor": d["partial_rotary_factor"],
            **({"mrope_section": [int(n) for n in list(sections)[:3]]} if sections is not None else {})}
    return {**d, "architectures": [hf_arch], "model_type": model_type, "rope_parameters": rope,
            "full_attention_interval": int(get("full_attention_interval", 4)),
            "linear_conv_kernel_dim": int(get("ssm.conv_kernel")), "linear_key_head_dim": int(get("ssm.state_size")),
            "linear_num_key_heads": int(get("ssm.group_count")), "linear_num_value_heads": heads,
            "linear_value_head_dim": inner // heads}


def gated_delta_tensor(layer: str, rest: str, arr: np.ndarray, cfg: Any, arch: str) -> tuple[str, np.ndarray] | None:
    """A DeltaNet layer's tensor (`rest` after `blk.{layer}.`) by its HF name, in HF layout (Qwen3.5's value heads
    grouped back by key head); None for any other."""
    if rest not in _DELTA or int(layer) not in cfg.mamba.layers:
        return None
    m = cfg.mamba
    if rest == "ssm_a":
        arr = np.log(-arr.reshape(-1))
    elif rest == "ssm_conv1d.weight":
        arr = arr.reshape(arr.shape[0], -1)
    if arch != "qwen3next" and m.num_heads != m.n_groups:  # (Qwen3.5's value heads, tiled: grouped back)
        qk = 2 * m.n_groups * m.state_size
        if rest in ("attn_qkv.weight", "ssm_conv1d.weight"):
            arr = np.concatenate([arr[:qk], _grouped(arr[qk:], 0, m)])
        elif rest == "ssm_out.weight":
            arr = _grouped(arr, 1, m)
        elif rest != "ssm_norm.weight":
            arr = _grouped(arr, 0, m)
    if rest == "ssm_conv1d.weight":
        arr = arr.reshape(arr.shape[0], 1, -1)
    return f"model.layers.{layer}.linear_attn.{_DELTA[rest]}", arr


def _grouped(arr: np.ndarray, axis: int, m: Any) -> np.ndarray:
    """`arr` with its value heads along `axis` (each one or `head_dim` wide) from tiled order (value head j of every
    key head, then j + 1) to grouped (each key head's value heads together), as the checkpoint has them."""
    r, G = m.num_heads // m.n_groups, m.n_groups
    shape = arr.shape
    width = shape[axis] // (r * G)
    x = arr.reshape(*shape[:axis], r, G, width, *shape[axis + 1:])
    return np.swapaxes(x, axis, axis + 1).reshape(shape)
