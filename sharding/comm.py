"""The communication model of a sharded step: which collectives the layout implies, and their bytes.

Counted per device with ring algorithms, the model that holds on NVLink/InfiniBand GPUs:
an all-reduce of S bytes over n devices sends 2 (n - 1) / n * S per device, an all-gather of a
result of S bytes sends (n - 1) / n * S. Tensor parallel all-reduces the activations after the
embedding lookup (vocabulary split), after attention and after the MLP; the LM head's vocabulary
shards are all-gathered for sampling. The MoE block all-reduces its output over the expert and
model devices together (activations are replicated; expert weights are not).
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxserve.config import ModelConfig


def all_reduce_bytes(size: int, n: int) -> float:
    return 0.0 if n <= 1 else 2.0 * (n - 1) / n * size


def all_gather_bytes(size: int, n: int) -> float:
    return 0.0 if n <= 1 else (n - 1) / n * size


@dataclass(frozen=True)
class CollectiveCost:
    """Bytes one device sends in one step, by where they come from."""

    embed: float
    attention: float
    mlp: float
    lm_head: float

    @property
    def total(self) -> float:
        return self.embed + self.attention + self.mlp + self.lm_head


def step_collective_bytes(cfg: ModelConfig, tp: int, ep: int, num_tokens: int, num_logits: int,
                          act_bytes: int = 4, vocab_split: bool = True) -> CollectiveCost:
    """Per-device collective bytes of one forward step over `num_tokens` tokens returning `num_logits`
    rows of float32 logits, with tensor-parallel size `tp` and expert-parallel size `ep`."""
    act = num_tokens * cfg.hidden_size * act_bytes  # one [T, E] activation
    L = cfg.num_layers
    embed = all_reduce_bytes(act, tp) if vocab_split else 0.0
    attention = L * all_reduce_bytes(act, tp)
    if cfg.num_experts:
        mlp = L * all_reduce_bytes(act, tp * ep)
        if cfg.shared_expert_intermediate_size:
            mlp += L * all_reduce_bytes(act, tp)
    else:
        mlp = L * all_reduce_bytes(act, tp)
    lm_head = all_gather_bytes(num_logits * cfg.vocab_size * 4, tp) if vocab_split else 0.0
    return CollectiveCost(embed, attention, mlp, lm_head)
