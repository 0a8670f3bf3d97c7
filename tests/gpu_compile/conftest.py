"""Deviceless sm_90 compile tests: skipped unless JAX's CUDA plugin is importable (see .ci/gpu_compile.sh)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

H200_TARGET_CONFIG = """
gpu_device_info {
  threads_per_block_limit: 1024  threads_per_warp: 32  shared_memory_per_block: 49152
  shared_memory_per_core: 233472  threads_per_core_limit: 2048  core_count: 132  fpus_per_core: 128
  block_dim_limit_x: 2147483647  block_dim_limit_y: 65535  block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000  l2_cache_size: 62914560  clock_rate_ghz: 1.98
  device_memory_size: 150754820096  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 }
  registers_per_core_limit: 65536  registers_per_block_limit: 65536
}
runtime_version: { major: %d minor: %d patch: 0 }
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 7 }
device_description_str: "NVIDIA H200"
"""


# The CUDA plugins the compile check can use, with the runtime version each is built against.
CUDA_PLUGINS = {"jax_cuda13_plugin": (13, 0), "jax_cuda12_plugin": (12, 8)}


def _cuda_plugin() -> str | None:
    return next((name for name in CUDA_PLUGINS if importlib.util.find_spec(name) is not None), None)


def h200_target_config() -> str:
    """The H200's target description, with the CUDA runtime version of the installed plugin."""
    return H200_TARGET_CONFIG % CUDA_PLUGINS[_cuda_plugin() or "jax_cuda12_plugin"]


def _h200_mesh():
    """A one-device mesh on a deviceless H200 topology."""
    import jax
    from jax.experimental import topologies

    topo = topologies.get_topology_desc("h200", "cuda", target_config=h200_target_config(), topology="1x1x1")
    return jax.sharding.Mesh(np.array(topo.devices[:1]), ("x",))


@pytest.fixture(scope="module")
def spec():
    """`spec(shape, dtype)`: a ShapeDtypeStruct on a deviceless one-GPU H200 mesh."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    # Deviceless executables cannot be deserialized without a client; keep them out of the shared cache.
    jax.config.update("jax_enable_compilation_cache", False)
    mesh = _h200_mesh()
    sharding = NamedSharding(mesh, P())
    # From JAX 0.11 the Pallas Triton lowering reads the target GPU from the abstract mesh when no GPU is
    # attached; earlier versions ignore it.
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        yield lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def pytest_collection_modifyitems(config, items):
    if _cuda_plugin() is not None:
        return
    skip = pytest.mark.skip(reason="needs jax[cuda12] or jax[cuda13] (a JAX CUDA plugin); run .ci/gpu_compile.sh")
    for item in items:
        if "gpu_compile" in item.keywords:
            item.add_marker(skip)
