"""Granite 4.0-H's llama.cpp GGUF files (architecture "granitehybrid"): Mamba-2 layers beside attention, told apart by
their KV head count (0 in a Mamba layer), as the HF config and tensors their converter read.

llama.cpp writes each Mamba layer's A as -exp(A_log) and A and D as [heads, 1], the convolution as [channels, taps],
the gated norm as [groups, channels per group] and the step's bias as `ssm_dt.bias`; those are read back here. A clamp
on the step (`time_step_limit`) is not in the file, and llama.cpp applies none: nor does a model read from it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from jaxserve.errors import UnsupportedModelError

# A Mamba layer's tensors: llama.cpp's name (after `blk.N.`) to the HF module's (after `model.layers.N.mamba.`).
_SSM = {"ssm_in.weight": "in_proj.weight", "ssm_in.bias": "in_proj.bias", "ssm_conv1d.weight": "conv1d.weight",
        "ssm_conv1d.bias": "conv1d.bias", "ssm_dt.bias": "dt_bias", "ssm_a": "A_log", "ssm_d": "D",
        "ssm_norm.weight": "norm.weight", "ssm_out.weight": "out_proj.weight", "ssm_out.bias": "out_proj.bias"}


def granite_hybrid_hf(meta: dict[str, Any], get: Callable[..., Any], d: dict[str, Any], experts: int,
                      kv_heads: list[int], tensor_names: frozenset[str]) -> dict[str, Any]:
    """The Granite 4.0-H HF config of a "granitehybrid" file (`d`: the fields every architecture has; `kv_heads`:
    per layer, 0 in a Mamba layer)."""
    arch = "granitehybrid"
    mamba = [i for i, n in enumerate(kv_heads) if not n]
    if not mamba:
        raise UnsupportedModelError("a granitehybrid GGUF file without Mamba layers (KV heads 0) is not supported")
    heads, inner = int(get("ssm.time_step_rank")), int(get("ssm.inner_size"))
    if inner % heads or inner % d["hidden_size"]:
        raise UnsupportedModelError(f"GGUF ssm.inner_size {inner} must be a multiple of ssm.time_step_rank {heads} "
                                    f"and of the embedding length {d['hidden_size']}")
    shared = int(meta.get(f"{arch}.expert_shared_feed_forward_length") or 0)
    first = f"blk.{mamba[0]}."
    return {**d, "architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid",
            "layer_types": ["mamba" if i in mamba else "attention" for i in range(len(kv_heads))],
            "mamba_n_heads": heads, "mamba_d_head": inner // heads, "mamba_expand": inner // d["hidden_size"],
            "mamba_d_state": int(get("ssm.state_size")), "mamba_n_groups": int(get("ssm.group_count")),
            "mamba_d_conv": int(get("ssm.conv_kernel")), "mamba_conv_bias": first + "ssm_conv1d.bias" in tensor_names,
            "mamba_proj_bias": first + "ssm_in.bias" in tensor_names,
            # (llama.cpp's flag for a hybrid whose attention is rotated)
            "position_embedding_type": "rope" if meta.get(f"{arch}.rope.scaling.finetuned") else "nope",
            "num_local_experts": experts, "shared_intermediate_size": shared or d["intermediate_size"],
            "intermediate_size": int(meta.get(f"{arch}.expert_feed_forward_length") or d["intermediate_size"])
            if experts else d["intermediate_size"],
            **{hf: float(meta.get(f"{arch}.{key}", 1.0)) for key, hf in (
                ("embedding_scale", "embedding_multiplier"), ("attention.scale", "attention_multiplier"),
                ("residual_scale", "residual_multiplier"), ("logit_scale", "logits_scaling"))}}


def ssm_tensor(layer: str, rest: str, arr: np.ndarray) -> tuple[str, np.ndarray] | None:
    """A Mamba layer's tensor (`rest` after `blk.{layer}.`) by its HF name, in HF layout; None for any other."""
    if rest not in _SSM:
        return None
    if rest == "ssm_a":
        arr = np.log(-arr.reshape(-1))
    elif rest == "ssm_conv1d.weight":
        arr = arr.reshape(arr.shape[0], 1, -1)
    elif rest in ("ssm_d", "ssm_norm.weight"):
        arr = arr.reshape(-1)
    return f"model.layers.{layer}.mamba.{_SSM[rest]}", arr
