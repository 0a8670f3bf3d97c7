"""LoRA on a MoE model's experts: an adapter's expert tensors read into the experts' adapter slots (`models.lora`).

Two forms, as PEFT writes them:
- per expert (models whose experts are modules: `layers.N.mlp.experts.E.gate_proj.lora_A.weight` [r, E] and
  `.lora_B.weight` [Fe, r]; likewise `up_proj` and `down_proj`, Mixtral's `block_sparse_moe.experts.E.w1` / `w3` /
  `w2`);
- on the fused expert parameters (transformers' `experts.gate_up_proj` [X, 2 Fe, E] and `experts.down_proj`
  [X, E, Fe], named in `target_parameters`): `lora_A.weight` [r X, in] (expert-major: rows e r .. e r + r - 1 are
  expert e's) and `lora_B.weight` [out, r X] (rank-major: column j X + e is expert e's j-th); the gate_up projection's
  one A serves the gate and the up rows of its B (the first Fe rows the gate's). PEFT nests the parameters of one
  module: a parameter's pair sits under its own `base_layer.` depth, told apart by their shapes.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from jaxserve.config import ModelConfig

_PER_EXPERT = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                         r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.lora_([AB])\.weight$")
_FUSED = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(mlp|block_sparse_moe)\.experts\."
                    r"((?:base_layer\.)*)lora_([AB])\.weight$")
_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_PARAMS = ("gate_up_proj", "down_proj")


def fused_parameters(ac: dict[str, Any], cfg: ModelConfig, path: str, error: type[Exception]) -> tuple[str, ...]:
    """The expert parameters an adapter's `target_parameters` names, in its order ("gate_up_proj", "down_proj");
    `error` naming any other target, or a model whose experts take none. The router's weight ("mlp.gate.weight") may
    be named beside them: PEFT saves its pair as a module's (`lora_manager`)."""
    given = [t for t in ac.get("target_parameters") or () if t.rsplit(".", 2)[-2:] not in (["gate", "weight"],
                                                                                           ["router", "weight"])]
    names = tuple(t.rsplit(".", 1)[-1] for t in given)
    if not names:
        return ()
    # (PEFT names them as given: "mlp.experts.down_proj", or "down_proj" from target_modules it moved there, both
    # at once from 0.22 on: one parameter)
    if any(t.rsplit(".", 2)[-2:-1] not in ([], ["experts"]) or n not in _PARAMS
           for t, n in zip(given, names, strict=True)):
        raise error(f"adapter {path!r}: target_parameters {ac['target_parameters']} name other parameters than the "
                    f"experts' {' and '.join(_PARAMS)} and the router's weight; it is not supported")
    check_experts(cfg, path, error)
    return tuple(dict.fromkeys(names))


def check_experts(cfg: ModelConfig, path: str, error: type[Exception]) -> None:
    if not cfg.num_experts or cfg.family == "gpt_oss" or not cfg.gated_mlp:
        raise error(f"adapter {path!r} adapts experts; {cfg.family}'s " + (
            "model has none" if not cfg.num_experts else "interleaved experts take no adapters"
            if cfg.family == "gpt_oss" else "ungated experts take no adapters"))


class ExpertTensors:
    """An adapter's expert tensors into the experts' fields of `out` (one slot's arrays [L, X, ...]): `take` each
    tensor (True when it is an expert adapter's), then `finish`. A fused parameter's pair (A and B under the same
    `base_layer.` depth) is told by its shapes: A's input (E for gate_up, Fe for down), else B's output (2 Fe, E)."""

    def __init__(self, out: dict[str, np.ndarray], params: tuple[str, ...], cfg: ModelConfig, rank: Any, max_rank: int,
                 seen: set, path: str, error: type[Exception]):
        # rank(key): (rank, scale) of the module or parameter PEFT names `key` ("model.layers.N.mlp.experts...")
        self.out, self.params, self.cfg, self.rank, self.max_rank = out, params, cfg, rank, max_rank
        self.seen, self.path, self.error = seen, path, error
        self.pending: dict[tuple[int, int], dict[str, tuple[str, np.ndarray]]] = {}

    def take(self, name: str, w: np.ndarray) -> bool:
        cfg = self.cfg
        X, E, F = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        if m := _PER_EXPERT.match(name):
            layer, expert, module, which = int(m.group(1)), int(m.group(2)), _NAMES.get(m.group(3), m.group(3)), \
                m.group(4)
            check_experts(cfg, self.path, self.error)
            self._check_layer(name, layer)
            if expert >= X:
                raise self.error(f"adapter {self.path!r}: tensor {name!r} names expert {expert}; the model has {X}")
            k, n = (F, E) if module == "down_proj" else (E, F)
            r, scale = self.rank(f"model.layers.{layer}.mlp.experts.{expert}.{m.group(3)}")
            self._check_shape(name, w, (r, k) if which == "A" else (n, r))
            self._write(layer, module, expert, which, w.astype(np.float32)[None], scale)
            return True
        if m := _FUSED.match(name):
            if not self.params:
                raise self.error(f"adapter {self.path!r}: tensor {name!r} adapts the fused experts, which its "
                                 "adapter_config.json names in no target_parameters")
            layer = int(m.group(1))
            self._check_layer(name, layer)
            self.pending.setdefault((layer, m.group(3).count("base_layer."), m.group(2)), {})[m.group(4)] = (name, w)
            return True
        return False

    def finish(self) -> None:
        """The fused parameters' pairs written, each told by its shapes."""
        cfg = self.cfg
        X, E, F = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        for (layer, _, moe), pair in sorted(self.pending.items()):
            ranks = {p: self.rank(f"model.layers.{layer}.{moe}.experts.{p}") for p in self.params}
            want = {p: ((r * X, E if p == "gate_up_proj" else F), (2 * F if p == "gate_up_proj" else E, r * X))
                    for p, (r, _) in ranks.items()}
            if set(pair) != {"A", "B"}:
                raise self.error(f"adapter {self.path!r}: {next(iter(pair.values()))[0]!r} has no lora_"
                                 f"{'B' if 'A' in pair else 'A'} beside it")
            shapes = (tuple(pair["A"][1].shape), tuple(pair["B"][1].shape))
            fits = [p for p in self.params if want[p] == shapes]
            if not fits:
                raise self.error(f"adapter {self.path!r}: {pair['A'][0]!r} and its lora_B have shapes {shapes}, "
                                 f"expected those of {' or '.join(f'{p} {want[p]}' for p in self.params)}")
            a, b = (pair[k][1].astype(np.float32) for k in "AB")
            r, scale = ranks[fits[0]]
            self._write(layer, fits[0], None, "A", a.reshape(X, r, -1), scale)
            self._write(layer, fits[0], None, "B", b.reshape(b.shape[0], r, X).transpose(2, 0, 1), scale)

    def _check_layer(self, name: str, layer: int) -> None:
        if layer >= self.cfg.num_layers or layer < self.cfg.first_dense_layers:
            raise self.error(f"adapter {self.path!r}: tensor {name!r} names layer {layer}, which has no experts")

    def _check_shape(self, name: str, w: np.ndarray, shape: tuple[int, ...]) -> None:
        if tuple(w.shape) != shape:
            raise self.error(f"adapter {self.path!r}: tensor {name!r} has shape {tuple(w.shape)}, expected {shape}")

    def _write(self, layer: int, module: str, expert: int | None, which: str, per: np.ndarray, scale: float) -> None:
        """A [x, r, in] or B [x, out, r] of `module` for expert `expert` (None: all) into the fields, B times
        `scale`."""
        out, max_rank, F = self.out, self.max_rank, self.cfg.moe_intermediate_size
        self.seen.add((layer, f"{module} {'' if expert is None else expert}".strip(), which))
        experts = slice(None) if expert is None else slice(expert, expert + 1)
        ts = per.transpose(0, 2, 1) * (1.0 if which == "A" else scale)  # A [x, in, r]; B [x, r, out]
        r = ts.shape[-1] if which == "A" else ts.shape[1]
        if which == "A" and module == "down_proj":
            out["ae_down"][layer, experts, :, :r] = ts
        elif which == "A":  # the gate's A, the up's, or (fused) one A for both
            for place in ((0, 1) if module == "gate_up_proj" else (0,) if module == "gate_proj" else (1,)):
                out["ae_gate_up"][layer, experts, :, place * max_rank: place * max_rank + r] = ts
        elif module == "down_proj":
            out["be_down"][layer, experts, :r] = ts
        elif module == "gate_up_proj":  # (its first Fe rows the gate's)
            out["be_gate"][layer, experts, :r], out["be_up"][layer, experts, :r] = ts[..., :F], ts[..., F:]
        else:
            out["be_gate" if module == "gate_proj" else "be_up"][layer, experts, :r] = ts
