"""The latent attention kernel compiled for sm_90 without a GPU, at DeepSeek's entry (512-dim latent + 64-dim rotary
key, 576 wide): V2-Lite's 16 heads and V3's 128 per entry (two programs of 64 heads), decode buckets, one long
decode (KV splits), a prefill chunk, float8 pages."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import AttentionTuning
from pallas_kernels.latent_attention import latent_paged_attention

pytestmark = pytest.mark.gpu_compile

CASES = [
    # T, S, pages per seq, heads, pages dtype, tuning
    (32, 32, 512, 16, jnp.bfloat16, AttentionTuning()),
    (256, 256, 512, 16, jnp.bfloat16, AttentionTuning()),
    (64, 64, 512, 128, jnp.bfloat16, AttentionTuning()),
    (1, 1, 2048, 128, jnp.bfloat16, AttentionTuning()),
    (2048, 1, 128, 16, jnp.bfloat16, AttentionTuning()),
    (512, 4, 128, 128, jnp.bfloat16, AttentionTuning()),
    (64, 64, 512, 16, jnp.float8_e4m3fn, AttentionTuning()),
    (64, 64, 512, 32, jnp.bfloat16, AttentionTuning(latent_heads=16, block_kv=64, num_stages=3)),
]


@pytest.mark.parametrize("T,S,P,heads,kv_dtype,tuning", CASES)
def test_latent_attention_compiles_for_sm90(spec, T, S, P, heads, kv_dtype, tuning):
    args = (spec((T, heads, 576), jnp.bfloat16), spec((8192, 16, 576), kv_dtype), spec((S, P), jnp.int32),
            spec((S,), jnp.int32), spec((S + 1,), jnp.int32))
    fn = functools.partial(latent_paged_attention, value_dim=512, sm_scale=192**-0.5, tuning=tuning)
    text = jax.jit(fn).trace(*args).lower().compile().as_text()
    assert "triton" in text.lower(), "the latent attention did not go through the Triton lowering"


_SPILL_CHILD = """
import functools, sys
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from tests.gpu_compile.conftest import _h200_mesh
from pallas_kernels.latent_attention import latent_paged_attention
from pallas_kernels.sparse_index import index_scores
from pallas_kernels.sparse_latent_attention import sparse_latent_attention
jax.config.update("jax_enable_compilation_cache", False)
mesh = _h200_mesh()
spec = lambda s, d: jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, P()))
with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    for T, S, pages, heads in ((64, 64, 512, 128), (64, 64, 512, 16), (2048, 1, 128, 16)):
        args = (spec((T, heads, 576), jnp.bfloat16), spec((8192, 16, 576), jnp.bfloat16), spec((S, pages), jnp.int32),
                spec((S,), jnp.int32), spec((S + 1,), jnp.int32))
        fn = functools.partial(latent_paged_attention, value_dim=512, sm_scale=0.07)
        jax.jit(fn).trace(*args).lower().compile()
    for T in (64, 2048):  # DeepSeek-V3.2's sparse attention: 704-wide entries, the top 2048 a token
        args = (spec((T, 128, 576), jnp.bfloat16), spec((8192, 64, 704), jnp.bfloat16), spec((1, T, 2048), jnp.int32),
                spec((T,), jnp.int32))
        fn = functools.partial(sparse_latent_attention, key_dim=576, value_dim=512, sm_scale=0.07)
        jax.jit(fn).trace(*args).lower().compile()
    args = (spec((64, 64, 128), jnp.bfloat16), spec((64, 64), jnp.float32), spec((8192, 64, 704), jnp.bfloat16),
            spec((64, 512), jnp.int32), spec((64,), jnp.int32), spec((64,), jnp.int32))  # (its indexer's scores)
    jax.jit(functools.partial(index_scores, key_offset=576, scale=0.09)).trace(*args).lower().compile()
"""


def test_latent_attention_defaults_do_not_spill(tmp_path):
    """ptxas on the default blockings' PTX (DeepSeek-V3's 128 heads and V2-Lite's 16 in decode, a V2-Lite prefill;
    the sparse kernel's at DeepSeek-V3.2's shapes, decode and prefill, and its indexer's): no register spills. The float32 accumulator is rows x 512; 64 rows over 8 warps took 237 registers a thread
    (CUDA 12.8's ptxas), 64 rows over 4 warps spilled 4 KB."""
    import os
    import pathlib
    import re
    import subprocess
    import sys

    import nvidia

    ptxas = next((p for root in nvidia.__path__ for p in pathlib.Path(root).glob("*/bin/ptxas")), None)
    if ptxas is None:
        pytest.skip("no ptxas in the CUDA plugin's packages")
    env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={tmp_path}", JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1",
               JAX_PLATFORMS="cpu", PYTHONPATH=os.getcwd())
    subprocess.run([sys.executable, "-c", _SPILL_CHILD], env=env, check=True, timeout=600)
    names = ("latent_paged_attention", "sparse_latent_attention", "index_scores")
    kernels = [(p, n) for p in tmp_path.glob("*.ptx") for n in names if f".entry {n}" in p.read_text()]
    assert sorted(n for _, n in kernels) == [names[2]] + [names[0]] * 3 + [names[1]] * 2, [p.name for p, _ in kernels]
    for ptx, name in kernels:
        report = subprocess.run([str(ptxas), "-v", "--gpu-name", "sm_90a", str(ptx), "-o", os.devnull],
                                capture_output=True, text=True, check=True).stderr
        info = report[report.index(name):]
        spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", info)]
        assert spills and not any(spills), info
