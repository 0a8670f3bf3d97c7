"""Hybrid models' llama.cpp GGUF files as the HF config and tensors their converter read: Granite 4.0-H's
("granitehybrid": Mamba-2 layers beside attention, told apart by their KV head count, 0 in a Mamba layer),
Nemotron-H's ("nemotron_h", "nemotron_h_moe": a block per layer, its kind told by its KV heads and MLP width) and
LFM2's ("lfm2", "lfm2moe": short convolutions, told by their KV heads too; the convolution as [channels, taps]),
Falcon-H1's ("falcon-h1": a mixer beside attention in every layer) and Jamba's ("jamba": Mamba layers of the selective
scan told by their KV heads, expert layers by their routers); Mamba's, Falcon Mamba's ("mamba") and Mamba-2's
("mamba2"), Mamba layers alone.

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
            # (the experts' width is `feed_forward_length`, as Granite MoE's; a dense model's MLP is its shared one)
            "num_local_experts": experts, "shared_intermediate_size": shared or d["intermediate_size"],
            **granite_scalars(meta, arch)}


def falcon_h1_gguf_hf(get: Callable[..., Any], d: dict[str, Any], tensor_names: frozenset[str]) -> dict[str, Any]:
    """The Falcon-H1 HF config of a "falcon-h1" file: its mixer's shape and biases; a norm of the mixer's output
    where the file has one, after its gate (as llama.cpp applies it); no multipliers (llama.cpp's converter folds
    every one, the embedding's and the LM head's too, into the weights)."""
    heads, inner = int(get("ssm.time_step_rank")), int(get("ssm.inner_size"))
    if inner % heads:
        raise UnsupportedModelError(f"GGUF ssm.inner_size {inner} must be a multiple of ssm.time_step_rank {heads}")
    return {**d, "mamba_n_heads": heads, "mamba_d_ssm": inner, "mamba_d_head": inner // heads,
            "mamba_d_state": int(get("ssm.state_size")), "mamba_n_groups": int(get("ssm.group_count")),
            "mamba_d_conv": int(get("ssm.conv_kernel")), "mamba_conv_bias": "blk.0.ssm_conv1d.bias" in tensor_names,
            "mamba_proj_bias": "blk.0.ssm_in.bias" in tensor_names, "projectors_bias": "blk.0.ssm_out.bias" in
            tensor_names, "mamba_rms_norm": "blk.0.ssm_norm.weight" in tensor_names, "mamba_norm_before_gate": False}


def jamba_gguf_hf(get: Callable[..., Any], d: dict[str, Any], kv_heads: list[int],
                  tensor_names: frozenset[str]) -> dict[str, Any]:
    """The Jamba HF config of a "jamba" file: its attention layers by their KV heads (0 in a Mamba layer), its MoE
    layers by their routers (`ffn_gate_inp`), each every so many layers (refused otherwise), its Mamba layers'
    shape and biases."""
    n = len(kv_heads)
    attn = [i for i, h in enumerate(kv_heads) if h]
    moe = [i for i in range(n) if f"blk.{i}.ffn_gate_inp.weight" in tensor_names]
    period = attn[1] - attn[0] if len(attn) > 1 else n
    if not attn or attn != list(range(attn[0], n, period)):
        raise UnsupportedModelError(f"a jamba GGUF file's attention layers {attn} are not every so many layers")
    every = moe[1] - moe[0] if len(moe) > 1 else n
    if moe and moe != list(range(every - 1, n, every)):
        raise UnsupportedModelError(f"a jamba GGUF file's expert layers {moe} are not the last of every so many")
    inner = int(get("ssm.inner_size"))
    first = f"blk.{next(i for i in range(n) if i not in attn)}."
    return {**d, "architectures": ["JambaForCausalLM"], "model_type": "jamba", "attn_layer_period": period,
            "attn_layer_offset": attn[0], "expert_layer_period": every if moe else 1,
            "expert_layer_offset": every - 1 if moe else 0, "num_experts": d.get("num_experts", 1) if moe else 1,
            "mamba_expand": inner // d["hidden_size"], "mamba_d_state": int(get("ssm.state_size")),
            "mamba_d_conv": int(get("ssm.conv_kernel")), "mamba_dt_rank": int(get("ssm.time_step_rank")),
            "mamba_conv_bias": first + "ssm_conv1d.bias" in tensor_names,
            "mamba_proj_bias": first + "ssm_in.bias" in tensor_names}


def mamba_gguf_hf(meta: dict[str, Any], arch: str, get: Callable[..., Any], vocab_size: int, has_output_weight: bool,
                  tensor_names: frozenset[str]) -> dict[str, Any]:
    """The HF config of a "mamba" file (Mamba's, or Falcon Mamba's where `ssm.dt_b_c_rms` says its step is normed) or a
    "mamba2" file (its `time_step_rank` the head count). The files' context length is a placeholder (2**20): the
    model's default stands; Falcon Mamba's step norms take transformers' eps (llama.cpp's takes the layers')."""
    hidden, inner = int(get("embedding_length")), int(get("ssm.inner_size"))
    d = {"vocab_size": vocab_size, "hidden_size": hidden, "num_hidden_layers": int(get("block_count")),
         "state_size": int(get("ssm.state_size")), "conv_kernel": int(get("ssm.conv_kernel")),
         "layer_norm_epsilon": float(get("attention.layer_norm_rms_epsilon")),
         "tie_word_embeddings": not has_output_weight, "use_conv_bias": "blk.0.ssm_conv1d.bias" in tensor_names,
         "use_bias": "blk.0.ssm_in.bias" in tensor_names}
    if arch == "mamba":
        falcon = bool(meta.get(f"{arch}.ssm.dt_b_c_rms"))
        return {**d, "architectures": ["FalconMambaForCausalLM" if falcon else "MambaForCausalLM"],
                "intermediate_size": inner, "time_step_rank": int(get("ssm.time_step_rank"))}
    heads = int(get("ssm.time_step_rank"))
    if inner % heads or inner % hidden:
        raise UnsupportedModelError(f"GGUF ssm.inner_size {inner} must be a multiple of ssm.time_step_rank {heads} "
                                    f"and of the embedding length {hidden}")
    return {**d, "architectures": ["Mamba2ForCausalLM"], "num_heads": heads, "head_dim": inner // heads,
            "expand": inner // hidden, "n_groups": int(get("ssm.group_count"))}


# A Jamba Mamba layer's tensors: llama.cpp's name (after `blk.N.`) to the HF module's (after `model.layers.N.mamba.`).
_SSM1 = {**_SSM, "ssm_x.weight": "x_proj.weight", "ssm_dt.weight": "dt_proj.weight", "ssm_dt.bias": "dt_proj.bias",
         "ssm_dt_norm.weight": "dt_layernorm.weight", "ssm_b_norm.weight": "b_layernorm.weight",
         "ssm_c_norm.weight": "c_layernorm.weight"}


def jamba_ssm_tensor(prefix: str, rest: str, arr: np.ndarray) -> tuple[str, np.ndarray] | None:
    """A Jamba Mamba layer's tensor by its HF name (after the mixer's `prefix`), in HF layout (A as its log again,
    [channels, state]; the convolution [channels, 1, taps]); None for any other."""
    if rest not in _SSM1:
        return None
    if rest == "ssm_a":
        arr = np.log(-arr)
    elif rest == "ssm_conv1d.weight":
        arr = arr.reshape(arr.shape[0], 1, -1)
    return prefix + _SSM1[rest], arr


def granite_scalars(meta: dict[str, Any], arch: str) -> dict[str, float]:
    """Granite's four scalars (HF config keys) from a file of `arch` (1.0 where absent, as transformers defaults)."""
    return {hf: float(meta.get(f"{arch}.{key}", 1.0)) for key, hf in (
        ("embedding_scale", "embedding_multiplier"), ("attention.scale", "attention_multiplier"),
        ("residual_scale", "residual_multiplier"), ("logit_scale", "logits_scaling"))}


def ssm_tensor(prefix: str, rest: str, arr: np.ndarray) -> tuple[str, np.ndarray] | None:
    """A Mamba layer's tensor (`rest` after `blk.N.`) by its HF name (after the mixer's `prefix`), in HF layout; None
    for any other."""
    if rest not in _SSM:
        return None
    if rest == "ssm_a":
        arr = np.log(-arr.reshape(-1))
    elif rest == "ssm_conv1d.weight":
        arr = arr.reshape(arr.shape[0], 1, -1)
    elif rest in ("ssm_d", "ssm_norm.weight"):
        arr = arr.reshape(-1)
    return prefix + _SSM[rest], arr


def nemotron_h_hf(meta: dict[str, Any], arch: str, get: Callable[..., Any], d: dict[str, Any], experts: int,
                  kv_heads: list[int], ffn: list[int], tensor_names: frozenset[str]) -> dict[str, Any]:
    """The Nemotron-H HF config of a "nemotron_h" / "nemotron_h_moe" file (`kv_heads`, `ffn`: per block)."""
    if len(kv_heads) != len(ffn):
        raise UnsupportedModelError(f"GGUF {arch} KV heads ({len(kv_heads)}) and MLP widths ({len(ffn)}) per block differ")
    blocks = ["attention" if kv else ("moe" if experts else "mlp") if f else "mamba"
              for kv, f in zip(kv_heads, ffn, strict=True)]
    if "mamba" not in blocks:
        raise UnsupportedModelError(f"a {arch} GGUF file without Mamba blocks is not supported")
    heads, inner, first = int(get("ssm.time_step_rank")), int(get("ssm.inner_size")), f"blk.{blocks.index('mamba')}."
    groups = int(meta.get(f"{arch}.expert_group_count") or 1)
    moe = {"n_routed_experts": experts, "num_experts_per_tok": int(get("expert_used_count")),
           "moe_intermediate_size": int(get("expert_feed_forward_length")),
           "moe_shared_expert_intermediate_size": int(meta.get(f"{arch}.expert_shared_feed_forward_length") or 0),
           "norm_topk_prob": bool(meta.get(f"{arch}.expert_weights_norm", True)),
           "routed_scaling_factor": float(meta.get(f"{arch}.expert_weights_scale") or 1.0),
           # (no count of groups chosen in the file: every group open to the choice)
           "n_group": groups, "topk_group": int(meta.get(f"{arch}.expert_group_used_count") or groups),
           "moe_latent_size": meta.get(f"{arch}.moe_latent_size")} if experts else {}
    return {**d, **moe, "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
            "layers_block_type": blocks, "num_hidden_layers": len(blocks), "layer_norm_epsilon": d["rms_norm_eps"],
            "intermediate_size": max(ffn), "mamba_num_heads": heads, "mamba_head_dim": inner // heads,
            "ssm_state_size": int(get("ssm.state_size")), "n_groups": int(get("ssm.group_count")),
            "conv_kernel": int(get("ssm.conv_kernel")), "use_conv_bias": first + "ssm_conv1d.bias" in tensor_names,
            "use_bias": first + "ssm_in.bias" in tensor_names,
            "mlp_bias": any(n.endswith("ffn_up.bias") for n in tensor_names)}


# A Nemotron-H block's tensors other than its Mamba mixer's: llama.cpp's name to the HF one (after the block's
# `backbone.layers.N.`); the experts, stacked in the file, one by one.
_NEMOTRON = {"attn_norm.weight": "norm.weight", "attn_q.weight": "mixer.q_proj.weight",
             "attn_k.weight": "mixer.k_proj.weight", "attn_v.weight": "mixer.v_proj.weight",
             "attn_output.weight": "mixer.o_proj.weight", "ffn_up.weight": "mixer.up_proj.weight",
             "ffn_up.bias": "mixer.up_proj.bias", "ffn_down.weight": "mixer.down_proj.weight",
             "ffn_down.bias": "mixer.down_proj.bias", "ffn_gate_inp.weight": "mixer.gate.weight",
             "exp_probs_b.bias": "mixer.gate.e_score_correction_bias",
             "ffn_up_shexp.weight": "mixer.shared_experts.up_proj.weight",
             "ffn_down_shexp.weight": "mixer.shared_experts.down_proj.weight",
             "ffn_latent_down.weight": "mixer.fc1_latent_proj.weight",  # (Nemotron 3 Super's latent MoE)
             "ffn_latent_up.weight": "mixer.fc2_latent_proj.weight"}


def nemotron_h_tensors(block: str, rest: str, arr: np.ndarray) -> list[tuple[str, np.ndarray]] | None:
    """A Nemotron-H block's tensor by its HF names (the checkpoints', `backbone.layers.{block}.`, which the key map
    pairs into layers), in HF layout; None for a name it does not know."""
    prefix = f"backbone.layers.{block}."
    if rest in ("ffn_up_exps.weight", "ffn_down_exps.weight"):
        kind = rest.split("_exps")[0].removeprefix("ffn_")
        return [(f"{prefix}mixer.experts.{j}.{kind}_proj.weight", arr[j]) for j in range(arr.shape[0])]
    found = ssm_tensor(prefix + "mixer.", rest, arr)
    if found is not None:
        return [found]
    return [(prefix + _NEMOTRON[rest], arr)] if rest in _NEMOTRON else None


def lfm2_gguf_hf(meta: dict[str, Any], arch: str, get: Callable[..., Any], d: dict[str, Any], kv_heads: list[int],
                 tensor_names: frozenset[str]) -> dict[str, Any]:
    """The LFM2 HF config of an "lfm2" or "lfm2moe" file (its MLP width as the file gives it; LFM2-MoE's experts
    after its `leading_dense_block_count` dense layers, a bias choosing them where `exp_probs_b` is stored)."""
    kinds = ["full_attention" if n else "conv" for n in kv_heads]
    if "conv" not in kinds:
        raise UnsupportedModelError(f"an {arch} GGUF file without convolution layers (KV heads 0) is not supported")
    if arch == "lfm2moe":
        d = {**d, "architectures": ["Lfm2MoeForCausalLM"], "model_type": "lfm2_moe",
             "num_dense_layers": int(get("leading_dense_block_count")),
             "use_expert_bias": any(n.endswith("exp_probs_b.bias") for n in tensor_names),
             "routed_scaling_factor": float(meta.get(f"{arch}.expert_weights_scale") or 1.0)}
    return {"architectures": ["Lfm2ForCausalLM"], "model_type": "lfm2", **d, "layer_types": kinds,
            "conv_L_cache": int(get("shortconv.l_cache")), "norm_eps": d["rms_norm_eps"],
            "conv_bias": f"blk.{kinds.index('conv')}.shortconv.conv.bias" in tensor_names,
            "block_auto_adjust_ff_dim": False}


# An LFM2 convolution layer's tensors: llama.cpp's name (after `blk.N.`) to the hybrid layer's (after
# `model.layers.N.`).
_SHORTCONV = {"shortconv.in_proj.weight": "mamba.in_proj.weight", "shortconv.in_proj.bias": "mamba.in_proj.bias",
              "shortconv.conv.weight": "mamba.conv1d.weight", "shortconv.conv.bias": "mamba.conv1d.bias",
              "shortconv.out_proj.weight": "mamba.out_proj.weight", "shortconv.out_proj.bias": "mamba.out_proj.bias"}


def shortconv_tensor(layer: str, rest: str, arr: np.ndarray) -> tuple[str, np.ndarray] | None:
    """An LFM2 convolution layer's tensor by its hybrid layer's name, in HF layout; None for any other."""
    if rest not in _SHORTCONV:
        return None
    return f"model.layers.{layer}.{_SHORTCONV[rest]}", arr.reshape(arr.shape[0], 1, -1) if rest.endswith(
        "conv.weight") else arr
