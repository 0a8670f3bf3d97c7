"""Parallelism for jaxserve: the device mesh, the logical-axis rules and the sharding plan of a model."""

from sharding.data_parallel import DataParallelEngine
from sharding.mesh import DATA, EXPERT, MESH_AXES, MODEL, ParallelConfig, make_mesh, replica_meshes
from sharding.plan import (
    MeshLayout,
    ShardingPlan,
    StepShardings,
    logical_sizes,
    make_plan,
    replicated_array,
)
from sharding.rules import DEFAULT_RULES, ShardingError, ShardingRules

__all__ = [
    "DATA", "DEFAULT_RULES", "DataParallelEngine", "EXPERT", "MESH_AXES", "MeshLayout", "MODEL", "ParallelConfig", "ShardingError",
    "ShardingPlan", "ShardingRules", "StepShardings", "logical_sizes", "make_mesh", "make_plan", "replica_meshes",
    "replicated_array",
]
