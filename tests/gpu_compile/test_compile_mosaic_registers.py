"""The warp-specialized ragged Mosaic GPU kernel's registers, read from ptxas (sm_90) without a GPU: the counts its
warpgroups ask for with `setmaxnreg` fit the registers the program is launched with, and nothing spills.

`setmaxnreg.inc` waits until the registers it asks for come free in the program's pool; asking for more than
the launch gave hangs the kernel on the GPU (it did on an H200, with float8 pages), and neither the interpreter
nor the compile sees it. Pages of q's dtype and float8 pages, 64- and 128-wide heads, and the sinks / window /
soft-cap form."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu_compile

_CHILD = """
import sys
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from tests.gpu_compile.conftest import _h200_mesh
from pallas_kernels.ragged_attention_mosaic import ragged_paged_attention_mosaic
jax.config.update("jax_enable_compilation_cache", False)
mesh = _h200_mesh()
spec = lambda s, d: jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, P()))
kv_dtype = jnp.dtype(sys.argv[1]); d, kvh, group = (int(a) for a in sys.argv[2:5]); extras = sys.argv[5] == "1"
args = (spec((512, kvh * group, d), jnp.bfloat16), spec((2048, 16, kvh, d), kv_dtype), spec((2048, 16, kvh, d), kv_dtype),
        spec((4, 128), jnp.int32), spec((4,), jnp.int32), spec((5,), jnp.int32), spec((kvh * group,), jnp.float32))

def fn(*a):
    kw = dict(sliding_window=128, soft_cap=30.0, sinks=a[6]) if extras else {}
    return ragged_paged_attention_mosaic(*a[:6], sm_scale=d ** -0.5, compute_wgs=2, **kw)

with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    jax.jit(fn).trace(*args).lower().compile()
"""


@pytest.mark.parametrize("kv_dtype,d,kvh,group,extras", [
    ("bfloat16", 64, 3, 3, False), ("bfloat16", 128, 8, 4, True),
    ("float8_e4m3fn", 64, 3, 3, False), ("float8_e4m3fn", 128, 8, 4, False), ("float8_e4m3fn", 128, 8, 4, True),
])
def test_warp_specialized_registers_fit_the_launch_and_do_not_spill(tmp_path, kv_dtype, d, kvh, group, extras):
    env = dict(os.environ, MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_TO=str(tmp_path),
               JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1", JAX_PLATFORMS="cpu", PYTHONPATH=os.getcwd())
    subprocess.run([sys.executable, "-c", _CHILD, kv_dtype, str(d), str(kvh), str(group), str(int(extras))],
                   env=env, check=True, timeout=600)
    [ptx] = [p for p in tmp_path.glob("*.ptx") if "_ws_" in p.name]
    [report] = [p.read_text() for p in tmp_path.glob("*.ptxas") if "_ws_" in p.name]
    text = ptx.read_text()
    threads = int(re.search(r"\.maxntid (\d+)", text).group(1))
    used = int(re.search(r"Used (\d+) registers", report).group(1))
    [down] = {int(n) for n in re.findall(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+(\d+);", text)}
    [up] = {int(n) for n in re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(\d+);", text)}
    assert threads == 384 and used * threads <= 65536
    # One loading warpgroup at `down`, the others at `up`: within the launch's registers.
    assert down * 128 + up * (threads - 128) <= used * threads, (down, up, used)
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
    assert spills and not any(spills), report
