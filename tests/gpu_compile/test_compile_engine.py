"""Compile the engine's jitted steps for an H200 (sm_90) without a GPU: SmolLM2 shapes, bfloat16, the
Pallas attention, every shape bucket of the default `EngineArgs()`.

This is the whole device program a GPU server runs (30-layer scan, Pallas attention per layer, KV write,
LM head, sampling, the on-device decode loop), so shared-memory overflows, unsupported primitives and
non-power-of-two tiles anywhere in it fail here, on the CPU.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import ModelConfig
from jaxserve.engine.logprobs import PromptLogprobInputs
from jaxserve.engine.penalties import PenaltyInputs
from jaxserve.engine.pooler import pool_step
from jaxserve.engine.runner import MAX_STOP_IDS, DecodeState, RunnerConfig, decode_loop, mixed_step
from jaxserve.engine.sampler import SamplingTensors
from jaxserve.engine_args import EngineArgs
from jaxserve.models.inputs import KVCache, ModelInputs
from jaxserve.models.lora import empty_lora
from jaxserve.models.params import abstract_params
from jaxserve.models.quantized import METHODS

# SmolLM2-135M-Instruct as `ModelConfig.from_gguf_metadata` reads it from the bundled GGUF (the second venv
# that runs the compile has no gguf reader; tests/test_engine_pallas.py keeps these in step with the file).
SMOLLM2 = ModelConfig(
    family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
    num_kv_heads=3, head_dim=64, rms_norm_eps=9.999999747378752e-06, rope_theta=100000.0,
    max_position_embeddings=8192, tie_word_embeddings=True,
)
DTYPE = jnp.bfloat16
H200_MEMORY_BYTES = 150754820096
# XLA's allocator takes 75% of device memory by default; the engine then keeps gpu_memory_utilization of
# that, less the weights, and 90% of the rest for the KV pool (`kv_cache_pages`).
XLA_MEM_FRACTION = 0.75


def h200_num_pages(args: EngineArgs, cfg: ModelConfig) -> int:
    """The KV pool the engine would size on an H200: ~245k pages of 16 tokens for SmolLM2 in bfloat16."""
    weights = sum(int(np.prod(x.shape)) * 2 for x in jax.tree.leaves(abstract_params(cfg, DTYPE)))
    budget = int(H200_MEMORY_BYTES * XLA_MEM_FRACTION * args.gpu_memory_utilization) - weights
    return int(budget * 0.9) // KVCache.bytes_per_page(cfg, args.page_size, DTYPE)


def runner_config() -> RunnerConfig:
    """The runner shapes `LLMEngine` builds from the default `EngineArgs()` on an H200, backend `pallas`."""
    args = EngineArgs()
    max_model_len = args.max_model_len or SMOLLM2.max_position_embeddings
    return RunnerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=max(args.max_num_batched_tokens, args.max_num_seqs),
        max_model_len=max_model_len, page_size=args.page_size, num_pages=h200_num_pages(args, SMOLLM2),
        num_scheduler_steps=args.num_scheduler_steps, backend="pallas", max_logprobs=args.max_logprobs,
    )


RC = runner_config()


def _abstract(spec, tree):
    """The same pytree with every leaf a ShapeDtypeStruct on the deviceless H200."""
    return jax.tree.map(lambda x: spec(np.shape(x), np.asarray(x).dtype if not hasattr(x, "dtype") else x.dtype),
                        tree)


def _common(spec, S: int, kv_dtype=DTYPE, cfg: ModelConfig = SMOLLM2):
    params = _abstract(spec, abstract_params(cfg, DTYPE))
    if cfg.kv_cache_scales:  # float32 whatever the model's dtype, as the loader keeps them
        L = cfg.num_layers
        params.layers = dataclasses.replace(params.layers, k_scale=spec((L,), jnp.float32),
                                            v_scale=spec((L,), jnp.float32))
    shape = (SMOLLM2.num_layers, RC.num_pages, RC.page_size, SMOLLM2.num_kv_heads, SMOLLM2.head_dim)
    kv = KVCache(k=spec(shape, kv_dtype), v=spec(shape, kv_dtype))
    sampling = _abstract(spec, SamplingTensors.from_params([], [], S, SMOLLM2.vocab_size, []))
    pen = PenaltyInputs(spec((S, RC.max_model_len), jnp.int32), spec((S,), jnp.int32))
    return params, kv, sampling, pen, spec((), jnp.bool_)


def model_inputs(spec, cfg: ModelConfig, num_pages: int, S: int) -> tuple:
    """A model's own step inputs, abstract: its stacked parameters, a pool of `num_pages` pages of its entries,
    sampling and penalty inputs for S rows, the top-k flag; and the pool's bytes."""
    params = _abstract(spec, abstract_params(cfg, DTYPE))
    k_dim, v_dim = cfg.kv_cache_dims
    shape = (cfg.num_layers, num_pages, RC.page_size, cfg.num_kv_heads)
    kv = KVCache(k=spec((*shape, k_dim), DTYPE), v=spec((*shape, v_dim), DTYPE))
    sampling = _abstract(spec, SamplingTensors.from_params([], [], S, cfg.vocab_size, []))
    pen = PenaltyInputs(spec((S, RC.max_model_len), jnp.int32), spec((S,), jnp.int32))
    return params, kv, sampling, pen, spec((), jnp.bool_), num_pages * KVCache.bytes_per_page(cfg, RC.page_size, DTYPE)


def _kv_pool_bytes(kv_dtype=DTYPE) -> int:
    """K and V of every layer: ~91 GB in bfloat16."""
    return RC.num_pages * KVCache.bytes_per_page(SMOLLM2, RC.page_size, kv_dtype)


def _compile(fn, *args, mosaic: bool = False, triton: bool = True, donate: tuple[int, ...] = (1,),
             kv_dtype=DTYPE, pool_bytes: int | None = None, on_text=None) -> float:
    """Compile for sm_90; check which Pallas lowerings the executable holds (and pass its HLO text to `on_text`,
    if given). Returns the seconds taken.

    For an engine step (the pool donated), also check that the ~90 GB pool is updated in place: aliased to
    the output, never copied into a temporary.
    """
    t0 = time.perf_counter()
    compiled = jax.jit(fn, donate_argnums=donate).trace(*args).lower().compile()
    seconds = time.perf_counter() - t0
    if donate:
        mem = compiled.memory_analysis()
        assert mem.alias_size_in_bytes >= (pool_bytes or _kv_pool_bytes(kv_dtype)), "the KV pool is not updated in place"
        assert mem.temp_size_in_bytes < (1 << 30), f"{mem.temp_size_in_bytes / 1e9:.1f} GB of temporaries"
    text = compiled.as_text()
    if triton:  # (the Pallas Triton lowering's custom call: XLA's own Triton fusions are no Pallas kernel)
        assert 'custom_call_target="__gpu$xla.gpu.triton"' in text, "no Pallas Triton kernel in the compiled step"
    if mosaic:
        assert 'custom_call_target="mosaic_gpu' in text, "no Mosaic GPU kernel in the compiled step"
    if on_text is not None:
        on_text(text)
    return seconds


@pytest.mark.gpu_compile
# fp8: `--kv-cache-dtype fp8` (float8_e4m3fn pages, upcast in the kernel), in the largest bucket; pallas_mosaic
# (the default on Hopper): a lax.cond over the Mosaic GPU decode kernel and the ragged Mosaic GPU kernel, in
# every bucket, as pallas (the default on other GPUs and over float8 pages).
@pytest.mark.parametrize("T,backend,kv_dtype", [(t, b, DTYPE) for b in ("pallas", "pallas_mosaic") for t in RC.token_buckets]
                         + [(RC.token_buckets[-1], "pallas", jnp.float8_e4m3fn)])
def test_mixed_step_compiles_for_sm90(spec, T, backend, kv_dtype):
    S = min(T, RC.max_num_seqs)
    params, kv, sampling, pen, want_top = _common(spec, S, kv_dtype)
    host = ModelInputs.build([([0], 0, [0])], RC.page_size, num_tokens=T, num_seqs=S, pages_per_seq=RC.pages_per_seq)
    inputs = _abstract(spec, host)
    step = functools.partial(mixed_step, cfg=SMOLLM2, backend=backend, top_k=RC.max_logprobs, hidden=True)
    plp = PromptLogprobInputs(spec((T,), jnp.int32))
    seconds = _compile(step, params, kv, inputs, sampling, pen, plp, want_top, mosaic=backend == "pallas_mosaic",
                       triton=backend == "pallas", kv_dtype=kv_dtype)
    print(f"mixed_step T={T} S={S} {backend} KV {jnp.dtype(kv_dtype).name}: compiled for sm_90 in {seconds:.1f} s")


@pytest.mark.gpu_compile
def test_mixed_step_with_lora_adapters_compiles_for_sm90(spec):
    """`--enable-lora --max-loras 4 --max-lora-rank 16`: adapter slots in every layer, each token's slot in the
    inputs, in the largest bucket."""
    T = RC.token_buckets[-1]
    S = min(T, RC.max_num_seqs)
    params, kv, sampling, pen, want_top = _common(spec, S)
    lora = jax.eval_shape(lambda: empty_lora(SMOLLM2, 4, 16, DTYPE))
    params.layers = dataclasses.replace(params.layers, lora=jax.tree.map(lambda a: spec(a.shape, a.dtype), lora))
    host = ModelInputs.build([([0], 0, [0])], RC.page_size, num_tokens=T, num_seqs=S, pages_per_seq=RC.pages_per_seq,
                             lora_slots=[1])
    step = functools.partial(mixed_step, cfg=SMOLLM2, backend="pallas", top_k=RC.max_logprobs, hidden=True)
    plp = PromptLogprobInputs(spec((T,), jnp.int32))
    seconds = _compile(step, params, kv, _abstract(spec, host), sampling, pen, plp, want_top)
    print(f"mixed_step with LoRA T={T} S={S}: compiled for sm_90 in {seconds:.1f} s")


@pytest.mark.gpu_compile
@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN"])
def test_pool_step_compiles_for_sm90(spec, pooling_type):
    """An embedding model's step (`--runner pooling`) in the largest bucket: the forward without the LM
    head, pooled rows out."""
    T = RC.token_buckets[-1]
    S = min(T, RC.max_num_seqs)
    params, kv, _, _, _ = _common(spec, S)
    host = ModelInputs.build([([0], 0, [0])], RC.page_size, num_tokens=T, num_seqs=S, pages_per_seq=RC.pages_per_seq)
    step = functools.partial(pool_step, cfg=SMOLLM2, backend="pallas", pooling_type=pooling_type)
    seconds = _compile(step, params, kv, _abstract(spec, host))
    print(f"pool_step {pooling_type} T={T} S={S}: compiled for sm_90 in {seconds:.1f} s")


def decode_state(spec, S: int) -> DecodeState:
    """The decode loop's state for S rows, abstract."""
    i32 = jnp.int32
    return DecodeState(
        tokens=spec((S,), i32), positions=spec((S,), i32), block_tables=spec((S, RC.pages_per_seq), i32),
        max_steps=spec((S,), i32), stop_ids=spec((S, MAX_STOP_IDS), i32), min_tokens_left=spec((S,), i32),
        num_steps=spec((), i32),
    )


@pytest.mark.gpu_compile
# pallas_mosaic: the decode loop's attention is a lax.cond over both kernels (decode rows on Mosaic GPU,
# anything else on the Triton kernel), so one bucket compiles both lowerings inside the engine step.
# Float8 pages go to either kernel (the Mosaic kernel upcasts them in SMEM); the float8 cases carry per-layer
# KV scales (`--calculate-kv-scales` or a checkpoint's).
@pytest.mark.parametrize("S,backend,kv_dtype", [(s, b, DTYPE) for b in ("pallas", "pallas_mosaic") for s in RC.seq_buckets]
                         + [(64, "pallas", jnp.float8_e4m3fn), (64, "pallas_mosaic", jnp.float8_e4m3fn)])
def test_decode_loop_compiles_for_sm90(spec, S, backend, kv_dtype):
    cfg = dataclasses.replace(SMOLLM2, kv_cache_scales=jnp.dtype(kv_dtype).itemsize == 1)
    params, kv, sampling, pen, want_top = _common(spec, S, kv_dtype, cfg)
    loop = functools.partial(decode_loop, cfg=cfg, backend=backend, top_k=RC.max_logprobs,
                             n_max=RC.num_scheduler_steps)
    # (pallas_mosaic's decode steps hold the Mosaic GPU decode kernel alone)
    seconds = _compile(loop, params, kv, decode_state(spec, S), sampling, pen, want_top,
                       mosaic=backend == "pallas_mosaic", triton=backend == "pallas", kv_dtype=kv_dtype)
    print(f"decode_loop S={S} n={RC.num_scheduler_steps} {backend} KV {jnp.dtype(kv_dtype).name}: "
          f"compiled for sm_90 in {seconds:.1f} s")


def copied_weights(text: str, dtype) -> list[str]:
    """The types of the quantized arrays (of `dtype`) that an op other than a matmul fusion reads in the compiled
    program's own computations (not inside fusions): weights converted and written out whole before a matmul
    instead of converted where the matmul loads them."""
    tok = {jnp.dtype(jnp.int8): "s8", jnp.dtype(jnp.float8_e4m3fn): "f8e4m3fn"}[jnp.dtype(dtype)]
    typed: dict[str, str] = {}
    copied = []
    inside_fusion = False
    for line in text.splitlines():
        head = re.match(r"^(?:ENTRY )?%(\S+) .*\{$", line)
        if head:
            inside_fusion = head.group(1).startswith(("fused_", "gemm_fusion")) or "_computation" in head.group(1)
            continue
        op = re.match(r"^\s*(?:ROOT )?%(\S+) = (\S+) (.*)$", line)
        if inside_fusion or not op:
            continue
        name, typ, rhs = op.groups()
        read = set(re.findall(r"%([\w.\-]+)", rhs.split("calls=")[0].split(", metadata=")[0])) & typed.keys()
        if typ.startswith(tok + "["):
            typed[name] = typ  # the weights, their slices and bitcasts
        elif read and "gemm_fusion" not in rhs and not typ.startswith("("):
            copied += [typed[r] for r in read]
    return copied


@pytest.mark.gpu_compile
@pytest.mark.parametrize("method", ["fp8", "int8"])
def test_decode_loop_with_quantized_weights_compiles_for_sm90(spec, method):
    """`--quantization fp8 | int8`: every projection stored at one byte per weight with per-channel scales, the
    decode loop (64 rows) converting them inside the matmuls. The one copy XLA writes is SmolLM2's output
    projection ([9, 64, 576]: its 576-long contraction, split 8 ways, is padded to 640 before the matmul)."""
    cfg = dataclasses.replace(SMOLLM2, weight_quant=method)
    params, kv, sampling, pen, want_top = _common(spec, 64, DTYPE, cfg)
    assert params.layers.w_up.q.dtype == jnp.dtype(METHODS[method].dtype)
    loop = functools.partial(decode_loop, cfg=cfg, backend="pallas", top_k=RC.max_logprobs,
                             n_max=RC.num_scheduler_steps)
    copied: list[str] = []
    seconds = _compile(loop, params, kv, decode_state(spec, 64), sampling, pen, want_top,
                       on_text=lambda text: copied.extend(copied_weights(text, METHODS[method].dtype)))
    assert copied and all(t.split("{")[0].endswith("9,64,576]") for t in copied), copied
    print(f"decode_loop S=64 weights {method}: compiled for sm_90 in {seconds:.1f} s; copied before a matmul: "
          f"{sorted(set(copied))}")


@pytest.mark.gpu_compile
def test_llama3_8b_layers_read_quantized_weights_in_their_matmuls(spec):
    """Llama-3-8B's projections in fp8 (two layers, 64 decode rows): no weight is converted outside a matmul."""
    cfg = ModelConfig(family="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=2,
                      num_heads=32, num_kv_heads=8, head_dim=128, weight_quant="fp8")
    params = _abstract(spec, abstract_params(cfg, DTYPE))
    pages = 4096
    kv = KVCache(k=spec((2, pages, RC.page_size, 8, 128), DTYPE), v=spec((2, pages, RC.page_size, 8, 128), DTYPE))
    S = 64
    sampling = _abstract(spec, SamplingTensors.from_params([], [], S, cfg.vocab_size, []))
    pen = PenaltyInputs(spec((S, RC.max_model_len), jnp.int32), spec((S,), jnp.int32))
    loop = functools.partial(decode_loop, cfg=cfg, backend="pallas", top_k=RC.max_logprobs,
                             n_max=RC.num_scheduler_steps)
    args = (params, kv, decode_state(spec, S), sampling, pen, spec((), jnp.bool_))
    text = jax.jit(loop, donate_argnums=(1,)).trace(*args).lower().compile().as_text()
    assert copied_weights(text, jnp.float8_e4m3fn) == []
    assert "f8e4m3fn[2,4096,14336]" in text  # the stacked MLP weights are what the program reads


# The Mosaic GPU decode kernel alone: SmolLM2 and Llama-3-8B heads, a full decode batch, one long sequence
# (flash-decoding splits), the largest batch of the benchmark; float8 pages of both formats and head widths;
# rings of 3 to 5 stages; 256-wide heads (one long sequence: split partials in bfloat16; float8 pages); a sliding
# window of 4096 keys (Mistral's) with a logit soft-cap over 8k contexts.
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
MOSAIC_CASES = [c + (None, None) for c in [
    (64, 512, 3, 3, 64, 64, DTYPE, 2), (1, 2048, 8, 4, 128, 64, DTYPE, 2), (256, 512, 8, 4, 128, 64, DTYPE, 2),
    (32, 512, 8, 4, 128, 128, DTYPE, 2), (32, 512, 3, 3, 64, 256, DTYPE, 2),
    (64, 512, 3, 3, 64, 64, E4M3, 2), (1, 2048, 8, 4, 128, 64, E5M2, 2), (32, 512, 8, 4, 128, 128, E4M3, 2),
    (32, 512, 8, 4, 128, 64, DTYPE, 4), (256, 512, 8, 4, 128, 64, DTYPE, 5), (64, 512, 3, 3, 64, 64, E4M3, 3),
    (1, 2048, 4, 2, 256, 64, DTYPE, 2), (32, 512, 4, 2, 256, 64, E4M3, 2), (64, 512, 8, 8, 192, 64, DTYPE, 2),
]] + [(32, 512, 8, 4, 128, 64, DTYPE, 2, 50.0, 4096), (1, 2048, 8, 4, 128, 64, E4M3, 2, None, 4096)]


@pytest.mark.gpu_compile
@pytest.mark.parametrize("S,P,kvh,group,d,block_kv,kv_dtype,stages,soft_cap,window", MOSAIC_CASES)
def test_mosaic_decode_kernel_compiles_for_sm90(spec, S, P, kvh, group, d, block_kv, kv_dtype, stages, soft_cap,
                                                window):
    from pallas_kernels.paged_decode_mosaic import paged_decode_attention_mosaic

    pages = spec((65536, RC.page_size, kvh, d), kv_dtype)
    fn = functools.partial(paged_decode_attention_mosaic, sm_scale=d**-0.5, block_kv=block_kv, stages=stages,
                           soft_cap=soft_cap, sliding_window=window)
    args = (spec((S, kvh * group, d), DTYPE), pages, pages, spec((S, P), jnp.int32), spec((S,), jnp.int32))
    seconds = _compile(fn, *args, mosaic=True, triton=False, donate=())
    print(f"mosaic decode S={S} P={P} {kvh}x{group}x{d} block_kv={block_kv} stages={stages} "
          f"soft_cap={soft_cap} window={window} KV {jnp.dtype(kv_dtype).name}: compiled for sm_90 in {seconds:.1f} s")



# The ragged Mosaic GPU kernel (prefill chunks and decode in one call): 2k/8k-token prompts of SmolLM2 and
# Llama-3-8B heads, a mixed batch of chunks and decode tokens, float8 pages, 64- and 128-key blocks; the bfloat16
# engine of tests/test_engine_pallas.py (8-token pages, group 2), which bench/gpu_engine.sh serves on pallas_mosaic.
# Warp-specialized (compute_wgs None: 2 when compiled; float8 pages upcast by the loading warpgroup) and
# one-warpgroup (1) forms. Then: 256-wide heads (64-key blocks; both forms, and float8 pages, which only the
# one-warpgroup form fits); a short step of 4 sequences over 8k keys in the one-warpgroup form, which then
# splits each block's KV walk (flash decoding); Mistral's window of 4096 keys with a soft-cap on both forms.
RAGGED_MOSAIC_CASES = [c + (None, None) for c in [
    (2048, 1, 3, 3, 64, None, DTYPE, 16, None), (8192, 1, 8, 4, 128, None, DTYPE, 16, None),
    (512, 64, 8, 4, 128, None, DTYPE, 16, None), (2048, 1, 8, 4, 128, 64, DTYPE, 16, None),
    (16, 4, 2, 2, 64, None, DTYPE, 8, None),
    (2048, 1, 3, 3, 64, 64, DTYPE, 16, 1), (8192, 1, 8, 4, 128, 128, DTYPE, 16, 1),
    (2048, 1, 8, 4, 128, 64, E4M3, 16, None), (2048, 1, 3, 3, 64, None, E5M2, 16, None),
    (2048, 1, 8, 4, 128, 64, E4M3, 16, 1),
    (2048, 1, 4, 2, 256, None, DTYPE, 16, None), (2048, 1, 4, 2, 256, None, DTYPE, 16, 1),
    (2048, 1, 4, 2, 256, None, E4M3, 16, None),
    (16, 4, 8, 4, 128, None, DTYPE, 16, 1), (16, 4, 3, 3, 64, None, E4M3, 16, 1),
    (2048, 1, 8, 8, 192, None, DTYPE, 16, None), (2048, 1, 8, 8, 192, None, DTYPE, 16, 1),
]] + [(8192, 1, 8, 4, 128, None, DTYPE, 16, None, 50.0, 4096),
      (512, 64, 8, 4, 128, None, E4M3, 16, None, 50.0, 4096)]


@pytest.mark.gpu_compile
@pytest.mark.parametrize("T,S,kvh,group,d,block_kv,kv_dtype,page_size,compute_wgs,soft_cap,window",
                         RAGGED_MOSAIC_CASES)
def test_ragged_mosaic_kernel_compiles_for_sm90(spec, T, S, kvh, group, d, block_kv, kv_dtype, page_size,
                                                compute_wgs, soft_cap, window):
    from pallas_kernels.ragged_attention_mosaic import ragged_paged_attention_mosaic

    P = -(-8192 // page_size)
    pages = spec((65536, page_size, kvh, d), kv_dtype)
    fn = functools.partial(ragged_paged_attention_mosaic, sm_scale=d**-0.5, block_kv=block_kv,
                           compute_wgs=compute_wgs, soft_cap=soft_cap, sliding_window=window)
    args = (spec((T, kvh * group, d), DTYPE), pages, pages, spec((S, P), jnp.int32), spec((S,), jnp.int32),
            spec((S + 1,), jnp.int32))
    seconds = _compile(fn, *args, mosaic=True, triton=False, donate=())
    print(f"ragged mosaic T={T} S={S} {kvh}x{group}x{d} page {page_size} block_kv={block_kv} "
          f"compute_wgs={compute_wgs} soft_cap={soft_cap} window={window} KV {jnp.dtype(kv_dtype).name}: "
          f"compiled for sm_90 in {seconds:.1f} s")


@pytest.mark.gpu_compile
@pytest.mark.parametrize("S", [1, 64])
def test_draft_model_steps_compile_for_sm90(spec, S):
    """A draft model's steps (`engine.draft_model`), SmolLM2 drafting: the loop writing 4 greedy drafts a row, and
    the lockstep forward over a decode step's rows and over the largest mixed step (its logits compiled away)."""
    from jaxserve.engine.draft_model import _draft_loop, _follow
    from jaxserve.models.llama import forward

    params, kv, *_ = _common(spec, S)
    common = dict(cfg=SMOLLM2, backend="pallas", model_fn=forward)
    rows = [spec((S,), jnp.int32) for _ in range(4)]
    loop = functools.partial(_draft_loop, vocab=SMOLLM2.vocab_size, n_max=4, **common)
    seconds = _compile(loop, params, kv, rows[0], rows[1], spec((S, RC.pages_per_seq), jnp.int32), rows[2])
    T = RC.token_buckets[-1]
    for n, m in ((S, S), (T, min(T, RC.max_num_seqs))):
        host = ModelInputs.build([([0], 0, [0])], RC.page_size, num_tokens=n, num_seqs=m,
                                 pages_per_seq=RC.pages_per_seq)
        inputs = _abstract(spec, dataclasses.replace(host, decode=n == S))
        seconds += _compile(functools.partial(_follow, **common), params, kv, inputs)
    print(f"draft model S={S}: its drafting loop and lockstep steps compiled for sm_90 in {seconds:.1f} s")


def _eagle3_head(spec):
    """An EAGLE-3 head for SmolLM2 (one layer, a draft vocabulary of 32k ids), abstract: its config and weights."""
    from jaxserve.models.eagle import EagleConfig, EagleParams
    from jaxserve.models.params import LayerParams, Params

    E, F, Hq, Hkv, D = (SMOLLM2.hidden_size, SMOLLM2.intermediate_size, SMOLLM2.num_heads, SMOLLM2.num_kv_heads,
                        SMOLLM2.head_dim)
    L, Vd = SMOLLM2.num_layers, 32000
    ecfg = EagleConfig("eagle3", dataclasses.replace(SMOLLM2, num_layers=1, tie_word_embeddings=False), SMOLLM2,
                       (2, L // 2, L - 3), Vd)
    layer = LayerParams(attn_norm=None, wq=spec((2 * E, Hq, D), DTYPE), wk=spec((2 * E, Hkv, D), DTYPE),
                        wv=spec((2 * E, Hkv, D), DTYPE), wo=spec((Hq, D, E), DTYPE), mlp_norm=spec((E,), DTYPE),
                        w_gate=spec((E, F), DTYPE), w_up=spec((E, F), DTYPE), w_down=spec((F, E), DTYPE))
    model = Params(embed=spec((SMOLLM2.vocab_size, E), DTYPE), layers=(layer,), final_norm=spec((E,), DTYPE),
                   lm_head=spec((E, Vd), DTYPE))
    params = EagleParams(model=model, fc=spec((3 * E, E), DTYPE), fc_bias=None,
                         norms=(spec((E,), DTYPE), spec((E,), DTYPE)), to_target=spec((Vd,), jnp.int32),
                         target_norm=None)
    return ecfg, params


@pytest.mark.gpu_compile
@pytest.mark.parametrize("S", [64])
def test_eagle3_steps_compile_for_sm90(spec, S):
    """Speculative decoding with an EAGLE-3 head (`engine.eagle`), SmolLM2 the target: its decode loop and largest
    mixed step keeping the hidden states entering three layers, and the head's steps (the lockstep forward over a
    decode step's rows and over the largest mixed step, and its drafting loop of 3 more drafts a row)."""
    from jaxserve.engine.eagle import eagle_layer
    from jaxserve.engine.mtp import _draft_loop, _follow

    ecfg, head = _eagle3_head(spec)
    params, kv, sampling, pen, want_top = _common(spec, S)
    kept = dict(keep_hidden=True, hidden_layers=ecfg.aux_layers)
    loop = functools.partial(decode_loop, cfg=SMOLLM2, backend="pallas", top_k=RC.max_logprobs,
                             n_max=RC.num_scheduler_steps, **kept)
    seconds = _compile(loop, params, kv, decode_state(spec, S), sampling, pen, want_top)
    T = RC.token_buckets[-1]
    M = min(T, RC.max_num_seqs)
    host = ModelInputs.build([([0], 0, [0])], RC.page_size, num_tokens=T, num_seqs=M, pages_per_seq=RC.pages_per_seq)
    step = functools.partial(mixed_step, cfg=SMOLLM2, backend="pallas", top_k=RC.max_logprobs, hidden=True, **kept)
    seconds += _compile(step, params, kv, _abstract(spec, host), *_common(spec, M)[2:4],
                        PromptLogprobInputs(spec((T,), jnp.int32)), want_top)
    shape = (1, RC.num_pages, RC.page_size, SMOLLM2.num_kv_heads, SMOLLM2.head_dim)
    head_kv = KVCache(k=spec(shape, DTYPE), v=spec(shape, DTYPE))
    pool = RC.num_pages * KVCache.bytes_per_page(ecfg.model, RC.page_size, DTYPE)
    layer = functools.partial(eagle_layer, ecfg=ecfg, backend="pallas")
    common = dict(layer=layer, num_ids=SMOLLM2.vocab_size)
    width = ecfg.hidden_width
    for n, m, sampled in ((S, S, (RC.num_scheduler_steps, S)), (T, M, (M,))):
        host = ModelInputs.build([([0], 0, [0])], RC.page_size, num_tokens=n, num_seqs=m, pages_per_seq=RC.pages_per_seq)
        inputs = _abstract(spec, dataclasses.replace(host, decode=n == S))
        seconds += _compile(functools.partial(_follow, rows=RC.max_num_seqs, **common), head, head_kv, inputs,
                            spec((n, width), DTYPE), spec(sampled, jnp.int32), spec((n,), jnp.int32),
                            spec((n,), jnp.int32), pool_bytes=pool)
    rows = [spec((S,), jnp.int32) for _ in range(4)]
    seconds += _compile(functools.partial(_draft_loop, n_max=3, **common), head, head_kv,
                        spec((RC.max_num_seqs, SMOLLM2.hidden_size), DTYPE), rows[0], rows[1], rows[2],
                        spec((S, RC.pages_per_seq), jnp.int32), rows[3], pool_bytes=pool)
    print(f"EAGLE-3 S={S}: the target's steps keeping 3 layers' hidden states and the head's steps compiled for "
          f"sm_90 in {seconds:.1f} s")
