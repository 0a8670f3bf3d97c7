"""The device mesh: data, expert and model axes, built from the engine's parallel sizes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import Mesh

DATA, EXPERT, MODEL = "data", "expert", "model"
MESH_AXES: tuple[str, str, str] = (DATA, EXPERT, MODEL)


@dataclass(frozen=True)
class ParallelConfig:
    """How many devices each kind of parallelism uses; their product is the devices used."""

    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1
    data_parallel_size: int = 1

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "expert_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    @property
    def devices_per_replica(self) -> int:
        return self.tensor_parallel_size * self.expert_parallel_size

    @property
    def world_size(self) -> int:
        return self.devices_per_replica * self.data_parallel_size

    @property
    def is_single_device(self) -> bool:
        return self.world_size == 1


def make_mesh(pc: ParallelConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A `(data, expert, model)` mesh over the first `pc.world_size` devices.

    The model axis is innermost so tensor-parallel peers are neighbours (the fastest links on
    a GPU host); the axes are Auto so XLA's partitioner inserts the collectives.
    """
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < pc.world_size:
        raise ValueError(
            f"tensor_parallel_size {pc.tensor_parallel_size} x expert_parallel_size {pc.expert_parallel_size} x "
            f"data_parallel_size {pc.data_parallel_size} needs {pc.world_size} devices, but only {len(devices)} "
            f"are visible ({devices[0].platform if devices else 'none'})"
        )
    grid = np.array(devices[: pc.world_size], dtype=object).reshape(
        pc.data_parallel_size, pc.expert_parallel_size, pc.tensor_parallel_size
    )
    return Mesh(grid, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3)


def replica_meshes(mesh: Mesh) -> list[Mesh]:
    """One `(data=1, expert, model)` mesh per data-parallel replica: its own slice of `mesh`."""
    return [
        Mesh(mesh.devices[i: i + 1], MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3)
        for i in range(mesh.devices.shape[0])
    ]
