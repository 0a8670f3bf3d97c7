"""State-space language models without attention: Mamba (`MambaForCausalLM`: the selective scan, Jamba's mixer
without its norms), Falcon Mamba (`FalconMambaForCausalLM`: its dt, B and C RMSNormed, without weights) and Mamba-2
(`Mamba2ForCausalLM`: SSD, Granite 4.0-H's mixer). Every layer a normed mixer added to the residual, no MLP; read as
hybrid models of Mamba layers alone (`config_mamba`), their checkpoints named as Nemotron-H's blocks
(`backbone.layers.{i}.mixer`). They hold no KV pages: the page pool only counts their tokens (`kv_cache_pages`)."""

from __future__ import annotations

import math
from typing import Any

from jaxserve.config_families import HF_ARCHITECTURES
from jaxserve.errors import UnsupportedModelError

MAMBA_LM_FAMILIES = ("mamba", "falcon_mamba", "mamba2")
ARCHITECTURES = {arch: family for arch, family in HF_ARCHITECTURES.items() if family in MAMBA_LM_FAMILIES}
# Their configs give no context length; vLLM's when a config names none.
DEFAULT_CONTEXT = 2048


def mamba_lm_family(d: dict[str, Any]) -> str | None:
    return next((ARCHITECTURES[a] for a in d.get("architectures") or () if a in ARCHITECTURES), None) or (
        d.get("model_type") if d.get("model_type") in MAMBA_LM_FAMILIES else None)


def mamba_lm(d: dict[str, Any]) -> dict[str, Any]:
    """A Mamba, Falcon Mamba or Mamba-2 config in Granite 4.0-H's keys (every layer a mixer without an MLP), with
    transformers' defaults; any other config as it is."""
    family = mamba_lm_family(d)
    if family is None:
        return d
    if d.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"{family} with hidden_act {d['hidden_act']!r} is not supported (silu)")
    n, hidden = int(d.get("num_hidden_layers", 64 if family == "mamba2" else 32)), int(d.get("hidden_size", 768))
    inner = int(d.get("expand", 2)) * hidden  # (Mamba's and Falcon Mamba's mixers take intermediate_size if given)
    inner = inner if family == "mamba2" else int(d.get("intermediate_size") or inner)
    common = {"architectures": [next(a for a, f in ARCHITECTURES.items() if f == family)], "model_type": family,
              "num_hidden_layers": n, "hidden_size": hidden, "num_attention_heads": 1, "num_key_value_heads": 1,
              "head_dim": 2, "intermediate_size": inner, "hidden_act": "silu", "position_embedding_type": None,
              "rms_norm_eps": float(d.get("layer_norm_epsilon", 1e-5)),
              "max_position_embeddings": int(d.get("max_position_embeddings") or DEFAULT_CONTEXT),
              "tie_word_embeddings": bool(d.get("tie_word_embeddings", family != "mamba2")),
              "layer_types": ["mamba"] * n, "mamba_no_mlp": list(range(n)),
              "mamba_d_conv": int(d.get("conv_kernel", 4)), "mamba_conv_bias": bool(d.get("use_conv_bias", True)),
              "mamba_proj_bias": bool(d.get("use_bias", False)),
              "mamba_residual_fp32": bool(d.get("residual_in_fp32", True))}
    if family == "mamba2":
        heads, head_dim = int(d.get("num_heads", 128)), int(d.get("head_dim", 64))
        if heads * head_dim != inner:
            raise UnsupportedModelError(f"mamba2 num_heads x head_dim ({heads} x {head_dim}) must be expand x "
                                        f"hidden_size ({inner})")
        return {**d, **common, "mamba_kind": "mamba2", "mamba_n_heads": heads, "mamba_d_head": head_dim,
                "mamba_d_state": int(d.get("state_size", 128)), "mamba_n_groups": int(d.get("n_groups", 8)),
                "time_step_limit": d.get("time_step_limit") or (0.0, math.inf),
                "mamba_norm_eps": float(d.get("layer_norm_epsilon", 1e-5))}
    rank = d.get("time_step_rank", "auto")
    return {**d, **common, "mamba_kind": "mamba1", "mamba_n_heads": inner, "mamba_d_head": 1,
            "mamba_d_state": int(d.get("state_size", 16)), "mamba_n_groups": 1,
            "mamba_dt_rank": math.ceil(hidden / 16) if rank == "auto" else int(rank),
            "mamba_step_norms": "unweighted" if family == "falcon_mamba" else "none",
            "mamba_norm_eps": float(d.get("mixer_rms_eps", 1e-6))}


def mamba_lm_hf(cfg: Any) -> dict[str, Any]:
    """The model's own HF config (the inverse of `mamba_lm`)."""
    m = cfg.mamba
    arch = next(a for a, f in ARCHITECTURES.items() if f == cfg.family)
    d = {"architectures": [arch], "model_type": cfg.family, "vocab_size": cfg.vocab_size,
         "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers, "state_size": m.state_size,
         "expand": m.inner // cfg.hidden_size, "intermediate_size": m.inner, "conv_kernel": m.conv_kernel,
         "use_conv_bias": m.conv_bias, "use_bias": m.proj_bias, "layer_norm_epsilon": cfg.rms_norm_eps,
         "hidden_act": "silu", "residual_in_fp32": m.residual_fp32,
         "tie_word_embeddings": cfg.tie_word_embeddings, "torch_dtype": "float32"}
    if cfg.max_position_embeddings != DEFAULT_CONTEXT:
        d["max_position_embeddings"] = cfg.max_position_embeddings
    if cfg.family == "mamba2":
        return {**d, "num_heads": m.num_heads, "head_dim": m.head_dim, "n_groups": m.n_groups,
                "time_step_limit": [m.time_step_min, m.time_step_max]}
    return {**d, "time_step_rank": m.dt_rank, **({"mixer_rms_eps": m.norm_eps} if cfg.family == "falcon_mamba" else {})}
