"""Logical axis names to mesh axes: one rules object, checked against the model it shards."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from jax.sharding import PartitionSpec

from sharding.mesh import EXPERT, MESH_AXES, MODEL

# The model's logical axes (see `jaxserve.models.params`) and where tensor/expert parallelism puts them.
DEFAULT_RULES: dict[str, str | None] = {
    "layers": None,
    "embed": None,
    "head_dim": None,
    "latent": None,  # MLA's latent and query bottleneck (`config_mla`): every device holds them whole
    "q_heads": MODEL,
    "kv_heads": MODEL,
    "mlp": MODEL,
    "vocab": MODEL,
    "experts": EXPERT,
    "expert_mlp": MODEL,
}


class ShardingError(ValueError):
    """A layout that cannot shard this model on this mesh."""


@dataclass(frozen=True)
class ShardingRules:
    """Maps each logical axis name to one mesh axis (or None = replicated).

    One array may not put two of its logical axes on the same mesh axis: that would shard the
    same devices twice. `spec` refuses it, naming both logical axes.
    """

    mapping: Mapping[str, str | None] = field(default_factory=lambda: dict(DEFAULT_RULES))

    def __post_init__(self) -> None:
        bad = {k: v for k, v in self.mapping.items() if v is not None and v not in MESH_AXES}
        if bad:
            raise ShardingError(f"rules map {bad} to unknown mesh axes (mesh axes: {', '.join(MESH_AXES)})")

    def __hash__(self) -> int:
        return hash(tuple(sorted(self.mapping.items(), key=lambda kv: kv[0])))

    def replace(self, **changes: str | None) -> ShardingRules:
        """These rules with some logical axes remapped."""
        return dataclasses.replace(self, mapping={**self.mapping, **changes})

    def mesh_axis(self, logical: str | None) -> str | None:
        if logical is None:
            return None
        if logical not in self.mapping:
            raise ShardingError(f"no sharding rule for logical axis {logical!r} (known: {', '.join(self.mapping)})")
        return self.mapping[logical]

    def spec(self, axes: tuple[str | None, ...]) -> PartitionSpec:
        """The partition spec of an array whose dimensions have logical names `axes`."""
        physical = [self.mesh_axis(a) for a in axes]
        used: dict[str, str] = {}
        for logical, mesh_axis in zip(axes, physical, strict=True):
            if mesh_axis is None:
                continue
            if mesh_axis in used:
                raise ShardingError(
                    f"logical axes {used[mesh_axis]!r} and {logical!r} of one array both map to mesh axis "
                    f"{mesh_axis!r} (array axes {axes}); map one of them elsewhere or to None"
                )
            used[mesh_axis] = logical  # type: ignore[assignment]
        return PartitionSpec(*physical)

    def check_tree(self, axes_tree: Any) -> None:
        """Raise ShardingError if any array of a tree of logical-axes tuples is laid out invalidly."""
        import jax

        for axes in jax.tree.leaves(axes_tree, is_leaf=lambda x: isinstance(x, tuple)):
            self.spec(axes)
