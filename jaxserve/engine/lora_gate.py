"""LoRA on an attention output gate's own projection (AFMoE's `self_attn.gate_proj`, LFM3's `self_attn.g_proj`).

These models read the gate's projection into the query projection's weight, each head's gate channels after its
query channels (`ModelConfig.attn_gate_width`), so the gate has no adapter slot of its own. Its pair shares the
query projection's: its A's rows follow the q_proj A's (rank r_q + r_g in the slot), and its B fills the gate
channels of B's columns from row r_q, the query channels zero (as the q_proj B's gate channels are). The product
of the two blocks is each projection's own delta on its own channels, so the result is exact; the two ranks
together must fit `max_lora_rank`.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from jaxserve.config import ModelConfig

# Families whose attention gate has its own projection beside q_proj, read after each head's query
# (`ModelConfig.attn_gate_width`): an adapter's q_proj has the queries' rows alone.
SEPARATE_GATE = ("lfm3", "afmoe")
_GATE = re.compile(r"\.layers\.(\d+)\.self_attn\.(?:gate_proj|g_proj)\.lora_([AB])\.weight$")


def adapter_rows(cfg: ModelConfig, part: str, rows: int) -> int:
    """The rows of an adapter's B for `part`: the slot's, but a separately gated q_proj's queries alone."""
    return cfg.num_heads * cfg.head_dim if part == "q_proj" and cfg.family in SEPARATE_GATE else rows


def query_rows(cfg: ModelConfig, rows: np.ndarray) -> np.ndarray:
    """A separately gated q_proj's B [Hq D, r] as the slot's [Hq (D + G), r]: zeros on each head's gate channels."""
    heads = rows.reshape(cfg.num_heads, cfg.head_dim, -1)
    return np.pad(heads, ((0, 0), (0, cfg.attn_gate_width), (0, 0))).reshape(-1, rows.shape[-1])


def gate_tensor(cfg: ModelConfig, name: str) -> bool:
    return cfg.family in SEPARATE_GATE and _GATE.search(name) is not None


def write_gates(gates: dict[str, np.ndarray], out: dict[str, np.ndarray], cfg: ModelConfig, rank: Any,
                max_rank: int, seen: set, path: str, q_field: tuple[str, int, str], error: type[Exception]) -> None:
    """The gate projections' pairs (`gates`: tensor name -> array) into the q_proj slot's fields `q_field` (A's
    field, its place among the down projections of its input, B's field) of `out`, after each layer's q_proj pair
    (`seen` names the layers that have one; `rank(key)`: a module's (rank, scale))."""
    a_field, place, b_field = q_field
    H, D, G, E = cfg.num_heads, cfg.head_dim, cfg.attn_gate_width, cfg.hidden_size
    for name, w in sorted(gates.items()):
        m = _GATE.search(name)
        layer, which = int(m.group(1)), m.group(2)
        if layer >= cfg.num_layers:
            raise error(f"adapter {path!r}: tensor {name!r} names layer {layer}; the model has {cfg.num_layers}")
        key = name.removeprefix("base_model.model.").rsplit(".lora_", 1)[0]
        r, scale = rank(key)
        base = rank(key.rsplit(".", 1)[0] + ".q_proj")[0] if (layer, "q_proj", "A") in seen else 0
        if base + r > max_rank:
            raise error(f"adapter {path!r}: layer {layer}'s attention gate projection (rank {r}) shares the query "
                        f"projection's slot after its rank {base}: {base + r} is above max_lora_rank {max_rank} "
                        "(raise --max-lora-rank)")
        want = (r, E) if which == "A" else (H * G, r)
        if tuple(w.shape) != want:
            raise error(f"adapter {path!r}: tensor {name!r} has shape {tuple(w.shape)}, expected {want}")
        w = w.astype(np.float32)
        if which == "A":
            out[a_field][layer, :E, place * max_rank + base: place * max_rank + base + r] = w.T
        else:  # each head's gate channels after its query channels (zeros)
            rows = np.pad(w.reshape(H, G, r), ((0, 0), (D, 0), (0, 0))).reshape(-1, r)
            out[b_field][layer, base: base + r, :rows.shape[0]] = rows.T * scale
        seen.add((layer, "self_attn.gate_proj", which))
