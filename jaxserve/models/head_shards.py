"""Attention kernels on a mesh: each device runs the kernel on its own heads."""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P


def on_head_shards(layout, kernel, q: jax.Array | None, pools: tuple, replicated: tuple, per_head: tuple = (),
                   out_heads=1):
    """`kernel(q, *pools, *replicated, *per_head)` ([T, Hq, ...] out), run on each device's own heads where
    `layout` splits heads over a mesh axis: q [T, Hq, D] split by query head, the per-head arrays on their first
    axis (vectors [Hq] by query head, or arrays [Hkv, ...] by KV head), the pools [N, page_size, Hkv, D] by KV head,
    the rest (page tables, lengths) whole. A kernel is an opaque call to
    XLA's partitioner, which would otherwise gather every device's heads, pages included, into each device (a whole
    pool a layer). None arguments pass through as None. `out_heads`: the output's axis of heads, or for a kernel of
    several outputs one such axis each (None: an output every device computes whole)."""
    axis = None if layout is None else layout.head_axis
    if axis is None:
        return kernel(q, *pools, *replicated, *per_head)
    if any(pool.ndim != 4 for pool in pools):
        raise ValueError("pools split by KV head must be [N, page_size, Hkv, D]")
    args = (q, *pools, *replicated, *per_head)
    specs = (P(None, axis), *(P(None, None, axis) for _ in pools), *(P() for _ in replicated),
             *(P(axis) for _ in per_head))
    given = [i for i, a in enumerate(args) if a is not None]

    def per_device(*local):
        full = [None] * len(args)
        for i, a in zip(given, local, strict=True):
            full[i] = a
        return kernel(*full)

    spec = lambda a: P() if a is None else P(*(None,) * a, axis)  # noqa: E731
    out_specs = tuple(map(spec, out_heads)) if isinstance(out_heads, tuple) else spec(out_heads)
    return jax.shard_map(per_device, mesh=layout.mesh, in_specs=tuple(specs[i] for i in given),
                         out_specs=out_specs, check_vma=False)(*(args[i] for i in given))
