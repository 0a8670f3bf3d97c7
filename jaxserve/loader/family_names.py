"""Module names some families' checkpoints give to what the key map reads under other names: Hy3's router, router
bias and shared expert (read as dots.llm1's), Llama 4's MLP and router (`feed_forward`, `feed_forward.router`: read
as `mlp`, `mlp.gate`, and written back as its own), Hunyuan's q/k norms, router and shared MLP (`query_layernorm`,
`key_layernorm`, `mlp.gate.wg`, `mlp.shared_mlp`: written back as its own), AFMoE's router, routing bias and MLP norms
(read as DeepSeek-V3's and Gemma's, written back as its own), MiMo-V2-Flash's sinks (`attention_sink_bias`), Granite
MoE SWA's experts and router (transformers' `experts.gate_up_proj`, `experts.down_proj`, `router.weight`: read as
Granite MoE's `input_linear`, `output_linear`, `router.layer`, written back as its own), Gemma 4's packed experts
(`experts.gate_up_proj`: read as `mlp.experts.gate_up_proj`, packed as Qwen3-VL-MoE's, written back as its own),
StarCoder2's MLP (`mlp.c_fc`, `mlp.c_proj`: read as `mlp.up_proj`, `mlp.down_proj`, written back as its own), Phi's
attention output, MLP and final norm (`self_attn.dense`, `mlp.fc1`, `mlp.fc2`, `final_layernorm`)."""

from __future__ import annotations

import re
from typing import Any

from jaxserve.config_hunyuan import HUNYUAN_FAMILIES

_HY3_NAMES = {"mlp.router.gate.": "mlp.gate.", "mlp.expert_bias": "mlp.gate.e_score_correction_bias",
              "mlp.shared_mlp.": "mlp.shared_experts."}
_HY3_RE = re.compile(r"(?<=\.)(" + "|".join(re.escape(k) for k in _HY3_NAMES) + ")")
_HUNYUAN_NAMES = {"self_attn.query_layernorm.": "self_attn.q_norm.", "self_attn.key_layernorm.": "self_attn.k_norm.",
                  "mlp.gate.wg.": "mlp.gate.", "mlp.shared_mlp.": "mlp.shared_expert."}
_HUNYUAN_RE = re.compile(r"(?<=\.)(" + "|".join(re.escape(k) for k in _HUNYUAN_NAMES) + ")")
_AFMOE_NAMES = {"mlp.router.gate.": "mlp.gate.", "mlp.expert_bias": "mlp.gate.e_score_correction_bias",
                "pre_mlp_layernorm.": "pre_feedforward_layernorm.", "post_mlp_layernorm.": "post_feedforward_layernorm."}
_AFMOE_RE = re.compile(r"(?<=\.)(" + "|".join(re.escape(k) for k in _AFMOE_NAMES) + ")")
# Module names of their own, each read as ours (the first that a name holds).
_OWN_NAMES = {"starcoder2": {"mlp.c_fc.": "mlp.up_proj.", "mlp.c_proj.": "mlp.down_proj."},
              "phi": {"self_attn.dense.": "self_attn.o_proj.", "mlp.fc1.": "mlp.up_proj.", "mlp.fc2.": "mlp.down_proj.",
                      "final_layernorm.": "norm.", "self_attn.q_layernorm.": "self_attn.q_norm.",
                      "self_attn.k_layernorm.": "self_attn.k_norm."}}


# Granite MoE SWA's experts and router as transformers holds them, read as Granite MoE's checkpoints name them.
_GRANITE_SWA_NAMES = {".block_sparse_moe.experts.gate_up_proj": ".block_sparse_moe.input_linear.weight",
                      ".block_sparse_moe.experts.down_proj": ".block_sparse_moe.output_linear.weight",
                      ".block_sparse_moe.router.weight": ".block_sparse_moe.router.layer.weight"}


_GEMMA4_EXPERTS_RE = re.compile(r"^(model\.layers\.\d+\.)experts\.")


def family_name(name: str, cfg: Any) -> str:
    """A tensor's name as the key map reads it."""
    if cfg is not None and cfg.family == "granitemoe_swa":
        return next((name[:-len(k)] + v for k, v in _GRANITE_SWA_NAMES.items() if name.endswith(k)), name)
    if cfg is not None and cfg.family == "dots1":
        return _HY3_RE.sub(lambda m: _HY3_NAMES[m.group(1)], name)
    if cfg is not None and cfg.family == "llama4":
        return name.replace(".feed_forward.", ".mlp.").replace(".mlp.router.", ".mlp.gate.")
    if cfg is not None and cfg.family in HUNYUAN_FAMILIES:
        return _HUNYUAN_RE.sub(lambda m: _HUNYUAN_NAMES[m.group(1)], name)
    if cfg is not None and cfg.family == "afmoe":
        return _AFMOE_RE.sub(lambda m: _AFMOE_NAMES[m.group(1)], name)
    if cfg is not None and cfg.family == "gemma4":  # (its packed experts beside its MLP: read as Qwen3-VL-MoE's)
        return _GEMMA4_EXPERTS_RE.sub(r"\1mlp.experts.", name)
    if cfg is not None and cfg.family == "mimo_v2_flash":  # (its sinks under its own name)
        return name.replace(".self_attn.attention_sink_bias", ".self_attn.sinks")
    if cfg is not None and cfg.family in _OWN_NAMES:
        return next((name.replace(k, v) for k, v in _OWN_NAMES[cfg.family].items() if k in name), name)
    return name


def family_hf_name(name: str, cfg: Any) -> str:
    """The inverse of `family_name` for a family written back under its own names (Llama 4's, Hunyuan's, AFMoE's)."""
    if cfg.family == "llama4":
        return name.replace(".mlp.gate.", ".feed_forward.router.").replace(".mlp.", ".feed_forward.")
    if cfg.family == "gemma4":
        return name.replace(".mlp.experts.", ".experts.")
    if cfg.family == "granitemoe_swa":
        return next((name[:-len(v)] + k for k, v in _GRANITE_SWA_NAMES.items() if name.endswith(v)), name)
    names = _HUNYUAN_NAMES if cfg.family in HUNYUAN_FAMILIES else _AFMOE_NAMES if cfg.family == "afmoe" else {
        "self_attn.attention_sink_bias": "self_attn.sinks"} if cfg.family == "mimo_v2_flash" else \
        _OWN_NAMES.get(cfg.family, {})
    for theirs, ours in sorted(names.items(), key=lambda kv: -len(kv[1])):  # (the longest of ours first)
        name = name.replace("." + ours, "." + theirs)
    return name


def router_bias_name(family: str) -> str:
    """Where a family's checkpoints keep the bias for choosing experts, after the MoE module's name: under the router
    (DeepSeek-V3's, GLM-4.5's), in ERNIE's `moe_statics`, or beside the router (MiniMax-M2's, K-EXAONE's)."""
    beside = {"ernie4_5_moe": "moe_statics.", "minimax_m2": "", "exaone_moe": ""}.get(family, "gate.")
    return f"{beside}e_score_correction_bias"
