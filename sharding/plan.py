"""A sharding plan: one model on one mesh, from logical axes to device placements.

The plan checks the layout (head counts divisible, axes not colliding), widens the KV heads
when there are fewer of them than tensor-parallel devices (each device then holds a copy of
the KV head its query heads use, as vLLM does), and places weights straight into their
shards: each device receives only its slice of each host tensor.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve.config import ModelConfig
from jaxserve.models.inputs import KVCache
from jaxserve.models.params import ParamInfo, Params, declare_params, from_param_paths, param_paths
from jaxserve.models.quantized import QuantizedWeight
from sharding.mesh import EXPERT, MODEL
from sharding.rules import ShardingError, ShardingRules

logger = logging.getLogger(__name__)

KV_AXES: tuple[str | None, ...] = ("layers", None, None, "kv_heads", "head_dim")  # [L, N, page, Hkv, D]

_AXIS_NAMES = {
    "q_heads": "num_heads (attention heads)",
    "kv_heads": "num_kv_heads (KV heads)",
    "mlp": "intermediate_size (MLP width)",
    "vocab": "vocab_size",
    "experts": "num_experts",
    "expert_mlp": "moe_intermediate_size (expert MLP width)",
}


def logical_sizes(cfg: ModelConfig) -> dict[str, int]:
    """The size of every logical axis the model's parameters use."""
    sizes: dict[str, int] = {}
    for info in jax.tree.leaves(declare_params(cfg), is_leaf=lambda x: isinstance(x, ParamInfo)):
        for name, n in zip(info.axes, info.shape, strict=True):
            if name is not None:
                sizes[name] = n
    sizes.setdefault("kv_heads", cfg.num_kv_heads)  # (an MLA model's one latent: the page pool's only use of it)
    return sizes


@dataclass(frozen=True)
class StepShardings:
    """The shardings a jitted step takes and returns: parameters, KV pool, everything else replicated."""

    params: Params  # NamedSharding leaves
    kv: KVCache  # NamedSharding leaves
    replicated: NamedSharding


@dataclass(frozen=True)
class MeshLayout:
    """What a sharded model's step needs to know of its mesh where it runs code per device: the axes the MoE block
    splits experts and their width over, and the one the attention kernels split heads over (query and KV heads
    on the same axis, of more than one device; else None, and the kernels see whole arrays)."""

    mesh: Mesh
    expert_axis: str | None
    model_axis: str | None
    head_axis: str | None = None


@dataclass(frozen=True)
class ShardingPlan:
    """One model laid out on one mesh; `model_cfg` is the config the sharded model runs with."""

    mesh: Mesh
    rules: ShardingRules
    source_cfg: ModelConfig
    model_cfg: ModelConfig
    kv_repeat: int  # copies of each KV head (1 unless KV heads < tensor-parallel size)

    # -- layouts -------------------------------------------------------------------------------------

    def sharding(self, axes: tuple[str | None, ...]) -> NamedSharding:
        return NamedSharding(self.mesh, self.rules.spec(axes))

    def param_shardings(self) -> Params:
        decl = declare_params(self.model_cfg)
        return jax.tree.map(lambda i: self.sharding(i.axes), decl, is_leaf=lambda x: isinstance(x, ParamInfo))

    def kv_sharding(self) -> NamedSharding:
        return self.sharding(KV_AXES)

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def step_shardings(self, kv_cache: KVCache | None = None) -> StepShardings:
        """Shardings of a step's parameters, KV cache (of `kv_cache`'s form; a plain float pool by
        default) and replicated outputs."""
        return StepShardings(self.param_shardings(), self._pool_shardings(kv_cache or KVCache(k=0, v=0)),
                             self.replicated())

    def _pool_shardings(self, kv_cache: KVCache) -> KVCache:
        """A pool's shardings: its pages split by KV head; a hybrid model's states whole on every device (its Mamba
        layers run whole on each: their parameters' axes are replicated)."""
        kv, whole = self.kv_sharding(), self.replicated()
        return dataclasses.replace(jax.tree.map(lambda _: kv, kv_cache),
                                   **{name: whole for name in ("conv", "ssm") if getattr(kv_cache, name) is not None})

    @property
    def kv_shards(self) -> int:
        """Devices each KV page is split over (its KV heads' mesh axis)."""
        axis = self.rules.mesh_axis("kv_heads")
        return self.mesh.shape[axis] if axis is not None else 1

    def layout(self) -> MeshLayout:
        heads = self.rules.mesh_axis("q_heads")
        if heads is None or heads != self.rules.mesh_axis("kv_heads") or self.mesh.shape[heads] == 1:
            heads = None
        return MeshLayout(self.mesh, self.rules.mesh_axis("experts"), self.rules.mesh_axis("expert_mlp"), heads)

    def with_weight_quant(self, method: str | None) -> ShardingPlan:
        """The same layout of the model with its weights stored as `method` quantizes them (None: in float)."""
        return dataclasses.replace(self, source_cfg=dataclasses.replace(self.source_cfg, weight_quant=method),
                                   model_cfg=dataclasses.replace(self.model_cfg, weight_quant=method))

    # -- placement -----------------------------------------------------------------------------------

    def place(self, path: str, host: Any) -> Any:
        """Put one host parameter (source layout, e.g. "layers.wk") into its shards on the mesh (a quantized
        weight's values and scales each into theirs)."""
        info = param_paths(declare_params(self.source_cfg))[path]
        if isinstance(info, QuantizedWeight):
            return QuantizedWeight(self._place(path, np.asarray(host.q), info.q),
                                   self._place(path, np.asarray(host.scale), info.scale))
        return self._place(path, host, info)

    def _place(self, path: str, host: np.ndarray, info: ParamInfo) -> jax.Array:
        if tuple(host.shape) != info.shape:
            raise ShardingError(f"parameter {path} has shape {host.shape}, declared {info.shape}")
        if self.kv_repeat > 1 and "kv_heads" in info.axes:
            host = np.repeat(host, self.kv_repeat, axis=info.axes.index("kv_heads"))
        sharding = self.sharding(info.axes)
        # Each device (and each process) reads only its own slice of the host array.
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    def shard_params(self, params: Params) -> Params:
        """Lay out a source-config parameter tree (host or single-device arrays) on the mesh."""
        flat = {path: self.place(path, value if isinstance(value, QuantizedWeight) else np.asarray(value))
                for path, value in param_paths(params).items()}
        return from_param_paths(self.model_cfg, flat)

    def allocate_kv(self, num_pages: int, page_size: int, dtype: Any, as_bits: bool = False, state_slots: int = 0,
                    state_dtypes: tuple[Any, Any] = (np.float32, np.float32)) -> KVCache:
        """A zeroed page pool created directly in its shards (split by KV head); `as_bits`, `state_slots` and
        `state_dtypes` as in `KVCache.allocate`."""
        def make():
            return KVCache.allocate(self.model_cfg, num_pages, page_size, dtype, as_bits, state_slots, state_dtypes)

        return jax.jit(make, out_shardings=self._pool_shardings(jax.eval_shape(make)))()

    def describe(self) -> str:
        shape = dict(self.mesh.shape)
        return (f"mesh {shape} over {self.mesh.devices.size} {self.mesh.devices.flat[0].platform} device(s); "
                f"rules {dict(self.rules.mapping)}")


def make_plan(cfg: ModelConfig, mesh: Mesh, rules: ShardingRules | None = None) -> ShardingPlan:
    """Check that `cfg` can be laid out on `mesh` under `rules` and build the plan.

    Refuses, naming the numbers: head counts, MLP widths or expert counts not divisible by the
    mesh axis they split over, and arrays whose logical axes collide on one mesh axis. Widens the
    KV heads when the tensor-parallel size is a multiple of their number; replicates the
    vocabulary when it does not divide (both logged).
    """
    rules = rules or ShardingRules()
    sizes = logical_sizes(cfg)
    if sizes.get("experts") is None and mesh.shape.get(EXPERT, 1) > 1:
        raise ShardingError(f"expert_parallel_size {mesh.shape[EXPERT]} needs a mixture-of-experts model; "
                            f"{cfg.family} is dense")
    if cfg.mamba is not None and not cfg.attention_layers and mesh.shape.get(MODEL, 1) > 1:
        raise ShardingError(f"tensor parallelism splits attention layers (a hybrid's Mamba layers are whole on each "
                            f"device), and {cfg.family} has none: serve it on one device (--data-parallel-size for "
                            "replicas)")
    kv_repeat = 1
    for logical, n in sizes.items():
        mesh_axis = rules.mesh_axis(logical)
        if mesh_axis is None:
            continue
        ways = mesh.shape[mesh_axis]
        if n % ways == 0:
            continue
        what = _AXIS_NAMES.get(logical, logical)
        if logical == "kv_heads" and ways % n == 0:
            kv_repeat = ways // n
            logger.info("num_kv_heads %d < %s size %d: replicating each KV head %d times so every device holds "
                        "the KV head its query heads use", n, mesh_axis, ways, kv_repeat)
        elif logical == "vocab":
            logger.info("vocab_size %d is not divisible by %s size %d: the embedding and LM head are replicated",
                        n, mesh_axis, ways)
            rules = rules.replace(vocab=None)
        elif logical == "kv_heads":
            raise ShardingError(
                f"{what} = {n} cannot be split over {ways} devices of mesh axis {mesh_axis!r}: it must divide "
                f"by {ways}, or {ways} must be a multiple of it (then KV heads are replicated)"
            )
        else:
            size_name = {MODEL: "tensor_parallel_size", EXPERT: "expert_parallel_size"}.get(mesh_axis, mesh_axis)
            raise ShardingError(f"{what} = {n} is not divisible by {size_name} = {ways}")
    model_cfg = cfg
    if kv_repeat > 1:
        model_cfg = dataclasses.replace(cfg, num_kv_heads=cfg.num_kv_heads * kv_repeat)
    rules.check_tree(jax.tree.map(lambda i: i.axes, declare_params(model_cfg),
                                  is_leaf=lambda x: isinstance(x, ParamInfo)))
    rules.spec(KV_AXES)
    return ShardingPlan(mesh, rules, cfg, model_cfg, kv_repeat)


def replicated_array(mesh: Mesh, value: Any) -> jax.Array:
    """A host value as a replicated array on `mesh` (works across processes)."""
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, NamedSharding(mesh, PartitionSpec()), lambda i: host[i])


