"""IBM's Granite SWA ("granite-swash": `GraniteSWAForCausalLM`, and with Granite MoE's experts and shared MLP
`GraniteMoeSWAForCausalLM`): Granite's layers and scalars, most layers windowed
(`layer_types`; by default every fourth full), a learned sink logit per head on every layer (gpt-oss's, as the
softmax's extra denominator term), and a rotary base per layer (`layer_rope_theta`; 0: NoPE). Read with the full
layers' base as `rope_theta` and the windowed layers' as `rope_local_theta`: one base per kind (refused otherwise)."""

from __future__ import annotations

from typing import Any

from jaxserve.errors import UnsupportedModelError

GRANITE_SWA_FAMILIES: tuple[str, ...] = ("granite_swa", "granitemoe_swa")
_ARCHS = {"GraniteSWAForCausalLM": "granite_swa", "GraniteMoeSWAForCausalLM": "granitemoe_swa"}


def granite_swa(d: dict[str, Any]) -> dict[str, Any]:
    """A Granite SWA config with its layer kinds listed and its rotary bases as `rope_parameters` (the full layers'),
    `rope_local_base_freq` (the windowed layers') and `no_rope_layers` (0 where a layer's base is 0); any other
    config as it is."""
    family = next((_ARCHS[a] for a in d.get("architectures") or [] if a in _ARCHS), None) or (
        d.get("model_type") if d.get("model_type") in GRANITE_SWA_FAMILIES else None)
    if family is None:
        return d
    n = int(d["num_hidden_layers"])
    kinds = d.get("layer_types") or ["full_attention" if i % 4 == 0 else "sliding_attention" for i in range(n)]
    if len(kinds) != n or set(kinds) - {"full_attention", "sliding_attention"}:
        raise UnsupportedModelError(f"{family} layer_types {kinds} must be full or sliding, one per layer")
    rope = dict(d.get("rope_parameters") or {})
    if rope.get("rope_type", "default") != "default":
        raise UnsupportedModelError(f"{family} with rope_type {rope['rope_type']!r} is not supported")
    base = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
    thetas = [float(t) for t in d.get("layer_rope_theta") or [base] * n]
    by_kind = {k: {t for t, kind in zip(thetas, kinds, strict=True) if kind == k and t} for k in set(kinds)}
    if len(thetas) != n or any(len(b) > 1 for b in by_kind.values()):
        raise UnsupportedModelError(f"{family} layer_rope_theta {thetas} must give one base (or 0) per layer kind")
    full = next(iter(by_kind.get("full_attention") or {base}))
    local = next(iter(by_kind.get("sliding_attention") or {full}))
    return {**d, "architectures": [next(a for a, f in _ARCHS.items() if f == family)], "model_type": family,
            "layer_types": kinds,
            "rope_parameters": {"rope_type": "default", "rope_theta": full}, "rope_local_base_freq": local,
            "no_rope_layers": [int(bool(t)) for t in thetas]}


def granite_swa_fields(d: dict[str, Any]) -> dict[str, Any]:
    """Its `ModelConfig` fields of the layers that differ (`d` as `granite_swa` gives it)."""
    return {"layer_types": tuple(d["layer_types"]), "rope_local_theta": float(d["rope_local_base_freq"])}


def granite_swa_hf(cfg: Any) -> dict[str, Any]:
    """A Granite SWA model's own HF config keys (the inverse of `granite_swa`)."""
    kinds = cfg.layer_types
    local = cfg.rope_local_theta if cfg.rope_local_theta is not None else cfg.rope_theta
    rotated = cfg.no_rope_layers or (1,) * cfg.num_layers
    return {"layer_types": list(kinds), "sliding_window": cfg.sliding_window,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "layer_rope_theta": [(local if k == "sliding_attention" else cfg.rope_theta) if r else 0
                                 for k, r in zip(kinds, rotated, strict=True)]}
