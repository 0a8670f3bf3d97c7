"""Time the L7 kernels on one GPU against the XLA reference and cuDNN attention, as achieved bytes/s.

Decode: batch 1/32/256 x context 1k/8k/32k, on both lowerings (the generic Pallas kernel through Triton, and
the Mosaic GPU decode kernel); prefill: 2k/8k tokens of one sequence (the generic kernel and the ragged Mosaic
GPU kernel in both forms); decode over float8 pages at 8k (both lowerings) and an 8k prefill over them (the
generic kernel and both Mosaic GPU forms); a mixed step (32 decode tokens at 8k beside a 512-token chunk) with
its decode tokens on the decode kernel or with the chunk on the ragged one; decode at 32k context under a
sliding window of 4096 keys, and under chunked attention (Llama 4's chunks of 8192: the last chunk's keys) (bytes:
the window's or the chunk's KV only, which is all a kernel needs to read); a 4k prefill
holding 256-token images attended both ways (Gemma 3's; `last_key`) against the same prefill all causal; gpt-oss's
heads (64q/8kv/64) with and without attention sinks, in decode at 8k and a 4k prefill. Both for
SmolLM2 heads (9q/3kv/64) and Llama-3-8B heads (32q/8kv/128), bfloat16, page size 16. Each row is the median of several
rounds of warm calls, rotating over input sets whose pages are scattered over a pool larger than L2, and is
printed against a copy bandwidth and (prefill) a bfloat16 matmul rate measured in the same run; the rows that
decide the targets run first. Usage: `python bench/gpu_kernels.py [--budget-s N] [--quick]`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.gpu_inputs import (
    DTYPE,
    IMAGE_TOKENS,
    MIN_POOL_BYTES,
    PAGE_SIZE,
    Heads,
    as_rows,
    decode_case,
    dense_sets,
    mixed_case,
    span_sets,
    work,
)
from pallas_kernels import (
    AttentionTuning,
    paged_decode_attention_mosaic,
    ragged_paged_attention,
    ragged_paged_attention_mosaic,
    ragged_paged_attention_reference,
    triton_available,
    write_kv,
    write_kv_reference,
    write_kv_triton,
)

# The reference materializes per-token KV and logits; skip it (and cuDNN's dense copy) past this.
REF_LIMIT_BYTES = 24 << 30
WINDOW = 4096  # the sliding window of the windowed decode row (Mistral 7B's)
CHUNK = 8192  # the chunks of the chunked decode row (Llama 4's): at 32k context, the last 8192 keys
MIXED_CHUNK = 512  # the prefill chunk of the mixed-step row (beside its decode tokens)
DRAFT_TOKENS = 5  # the drafts rows: a request's token and its 4 drafts, verified in one step


MODELS = (Heads("smollm2", 9, 3, 64), Heads("llama3-8b", 32, 8, 128))
WIDE = Heads("gemma2-2b", 8, 4, 256)  # 256-wide heads: the Mosaic decode kernel's split partials in bfloat16
GPT_OSS = Heads("gpt-oss", 64, 8, 64)  # its attention sinks: a logit per head in every softmax
# Heads that are no power of two, read by the generic kernel in power-of-two parts (the Mosaic GPU kernels: 192 only)
PHI3, MIMO = Heads("phi3-mini", 32, 32, 96), Heads("mimo-v2-flash", 64, 8, 192)
# Gemma 4 31B's full-attention layers as the engine's pages hold them: 4 KV heads of 512, each written twice into a
# row of 8 (`models.gemma4`); the generic kernel's 32 keys a step (the Mosaic kernels take no 512-wide heads, nor cuDNN).
# Its rows count the bytes of the layer's own 4 heads: `pallas_copies` reads those (one copy, as the engine calls it),
# `pallas` and `xla` both copies.
GEMMA4, GEMMA4_COPIES = Heads("gemma4-31b-full", 32, 8, 512), 2


def timeit(fn, arg_sets, rounds=5, min_calls=3, target_s=0.05) -> float:
    """Median seconds per call: warm, then rounds of back-to-back calls cycling through the input sets."""
    for args in arg_sets:
        jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*arg_sets[0]))
    one = max(time.perf_counter() - t0, 1e-6)
    calls = max(min_calls, min(200, int(target_s / one)))
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        out = None
        for i in range(calls):
            out = fn(*arg_sets[i % len(arg_sets)])
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / calls)
    return statistics.median(samples)


def copy_bandwidth(num_elements: int = 1 << 30) -> float:
    """Read+write bytes/s of an elementwise pass over `num_elements` bfloat16 (2 GiB by default)."""
    x = jnp.ones((num_elements,), DTYPE)
    f = jax.jit(lambda a: a + jnp.asarray(1, DTYPE))
    sec = timeit(f, [(x,)], rounds=5, min_calls=5)
    return 2 * x.nbytes / sec


def run_row(label, fns, sets, nbytes, flops, dense, copy_bw, matmul_flops=None):
    """One table row: per implementation, time per call, bytes/s against the copy bandwidth, FLOP/s (and
    against the bf16 matmul rate, for prefill rows)."""
    cells = [label]
    for impl, fn in fns:
        args = dense if impl == "cudnn" else sets
        if args is None:
            cells.append(f"{impl}: skip")
            continue
        try:
            sec = timeit(fn, args)
        except Exception as e:  # one failing implementation must not end the run
            cells.append(f"{impl}: FAIL {type(e).__name__}")
            print(f"  [{label} {impl}] {type(e).__name__}: {str(e).splitlines()[0][:300]}", file=sys.stderr)
            continue
        bw = nbytes / sec
        cell = (f"{impl}: {sec * 1e6:9.1f} us {bw / 1e9:7.0f} GB/s ({100 * bw / copy_bw:5.1f}%) "
                f"{flops / sec / 1e12:7.1f} TFLOP/s")
        if matmul_flops:
            cell += f" ({100 * flops / sec / matmul_flops:5.1f}% of matmul)"
        cells.append(cell)
    print(" | ".join(cells), flush=True)


def matmul_rate(n: int) -> float:
    """FLOP/s of a bfloat16 [n, n] x [n, n] matmul (float32 accumulation): the prefill rows' yardstick."""
    keys = jax.random.split(jax.random.key(1), 2)
    a, b = (jax.random.normal(k, (n, n), DTYPE) for k in keys)
    f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32).astype(DTYPE))
    return 2 * n**3 / timeit(f, [(a, b)], rounds=5, min_calls=5)


def kernels(heads: Heads) -> dict:
    """The timed implementations for one head shape, by name."""
    scale = heads.dim**-0.5

    # The Mosaic GPU decode kernel takes one query token per sequence: q [S, QH, D] is the decode batch as is.
    def mosaic_decode(block_kv, stages=2, window=None, chunk=None):
        return jax.jit(lambda q, k, v, tables, lens, qsl: paged_decode_attention_mosaic(
            q, k, v, tables, lens, sm_scale=scale, sliding_window=window, attention_chunk=chunk, block_kv=block_kv,
            stages=stages))

    # The ragged Mosaic GPU kernel takes the packed prompt as the generic kernel does.
    def mosaic_ragged(compute_wgs, block_kv=None):
        return jax.jit(functools.partial(ragged_paged_attention_mosaic, sm_scale=scale, block_kv=block_kv,
                                         compute_wgs=compute_wgs))

    return {
        "pallas": jax.jit(functools.partial(ragged_paged_attention, sm_scale=scale)),
        "pallas_copies": jax.jit(functools.partial(ragged_paged_attention, sm_scale=scale, kv_copies=GEMMA4_COPIES)),
        # Decode rows unpadded, on the CUDA cores (the default pads them to 16 for the tensor cores).
        "pallas_rows": jax.jit(functools.partial(ragged_paged_attention, sm_scale=scale,
                                                 tuning=AttentionTuning(pad_rows_to_mma=False))),
        # Mixed steps through the dispatch of the `pallas_mosaic` backend: the decode tokens on the decode kernel
        # beside the chunks on the ragged one (split), or all on the ragged kernel (whole).
        "mosaic_split": jax.jit(functools.partial(ragged_paged_attention, sm_scale=scale, tuning=AttentionTuning(
            decode_lowering="mosaic", prefill_lowering="mosaic"))),
        "mosaic_whole": jax.jit(functools.partial(ragged_paged_attention, sm_scale=scale, tuning=AttentionTuning(
            decode_lowering="mosaic", prefill_lowering="mosaic", split_mixed=False))),
        "xla": jax.jit(functools.partial(ragged_paged_attention_reference, sm_scale=scale)),
        # Decode: 64-key blocks in a ring of 2 and of 4 stages (3 blocks in flight), 128-key blocks in 2.
        "mosaic": mosaic_decode(64),
        "mosaic_st4": mosaic_decode(64, 4),
        "mosaic_bkv128": mosaic_decode(128),
        # Decode under a sliding window: both start at the window's first KV block.
        "pallas_window": jax.jit(functools.partial(ragged_paged_attention, sm_scale=scale, sliding_window=WINDOW)),
        "mosaic_window": mosaic_decode(64, window=WINDOW),
        # ... and under chunked attention: both start at the chunk's first KV block.
        "pallas_chunk": jax.jit(functools.partial(ragged_paged_attention, sm_scale=scale, attention_chunk=CHUNK)),
        "mosaic_chunk": mosaic_decode(64, chunk=CHUNK),
        # Prefill: warp-specialized (two compute warpgroups; 128-key blocks where they fit, and 64) and one
        # warpgroup (64- and 128-key blocks).
        "mosaic_ws": mosaic_ragged(2),
        "mosaic_ws_bkv64": mosaic_ragged(2, 64),
        "mosaic_1wg": mosaic_ragged(1, 64),
        "mosaic_1wg_bkv128": mosaic_ragged(1, 128),
        # A short step over long contexts: one warpgroup, each block's KV walk split (flash decoding).
        "mosaic_1wg_split": mosaic_ragged(1),
        # Images attended both ways (`span_sets`: the last argument), and the same call all causal.
        "pallas_spans": jax.jit(lambda *a: ragged_paged_attention(*a[:6], sm_scale=scale, last_key=a[6])),
        "pallas_causal": jax.jit(lambda *a: ragged_paged_attention(*a[:6], sm_scale=scale)),
        "mosaic_ws_spans": jax.jit(lambda *a: ragged_paged_attention_mosaic(*a[:6], sm_scale=scale, last_key=a[6])),
        "mosaic_ws_causal": jax.jit(lambda *a: ragged_paged_attention_mosaic(*a[:6], sm_scale=scale)),
        # Attention sinks (the sets' last argument), and the same calls without them (`*_causal` above too).
        "pallas_sinks": jax.jit(lambda *a: ragged_paged_attention(*a[:6], sm_scale=scale, sinks=a[6])),
        "mosaic_ws_sinks": jax.jit(lambda *a: ragged_paged_attention_mosaic(*a[:6], sm_scale=scale, sinks=a[6])),
        "mosaic_sinks": jax.jit(lambda *a: paged_decode_attention_mosaic(*a[:5], sm_scale=scale, sinks=a[6])),
        "mosaic_causal": jax.jit(lambda *a: paged_decode_attention_mosaic(*a[:5], sm_scale=scale)),
        "cudnn": jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=scale, implementation="cudnn")),
        "cudnn_causal": jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, scale=scale, is_causal=True, implementation="cudnn")),
    }


def own_bytes(heads: Heads, batch: int, ctx: int, q_len: int) -> int | None:
    """The bytes of a row of Gemma 4's full-attention layer counting its own KV heads once (None for other heads)."""
    if heads is not GEMMA4:
        return None
    own = dataclasses.replace(heads, kv=heads.kv // GEMMA4_COPIES)
    return work(own, batch, ctx, q_len, jnp.dtype(DTYPE).itemsize)[0]


def pick(fns: dict, names) -> list:
    return [(n.removesuffix("_causal"), fns[n]) for n in names if n is not None]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-s", type=float, default=390.0, help="stop starting new rows after this")
    parser.add_argument(
        "--quick", action="store_true", help="one small row per table, small pools (smoke test)"
    )
    groups = ("targets", "mixed", "drafts", "fp8", "window", "wide", "images", "rest")
    parser.add_argument("--rows", default=",".join(groups),
                        help=f"the groups of rows to run, in the order given: a comma-separated subset of {','.join(groups)}")
    args = parser.parse_args()
    chosen = args.rows.split(",")
    if unknown := set(chosen) - set(groups):
        parser.error(f"--rows: unknown groups {sorted(unknown)}; choose from {', '.join(groups)}")
    start = time.perf_counter()
    print(f"devices: {jax.devices()}  jax {jax.__version__}", flush=True)
    copy_bw = copy_bandwidth(1 << 24 if args.quick else 1 << 30)
    pool_bytes = 1 << 20 if args.quick else MIN_POOL_BYTES
    print(f"copy bandwidth (read+write): {copy_bw / 1e12:.2f} TB/s", flush=True)
    matmul = matmul_rate(1024 if args.quick else 8192)
    print(f"bfloat16 matmul rate: {matmul / 1e12:.0f} TFLOP/s", flush=True)

    rng = np.random.default_rng(0)
    llama, smollm = MODELS[1], MODELS[0]
    # Rows in order of what they decide, so that the time budget cuts the least telling ones: the targets
    # (decode at batch >= 32 with 8k context, prefill), the mixed step (which decides `split_mixed`), float8
    # pages, the windowed decode, 256-wide heads and heads in parts, then the rest of the decode grid.
    target = [(h, "decode", b, 8192) for h in (llama, smollm) for b in (32, 256)]
    target += [(h, "prefill", 1, t) for h in (llama, smollm) for t in (2048, 8192)]
    fp8 = [(h, "fp8", b, 8192) for h in (llama, smollm) for b in (32, 256)] + [(llama, "fp8_prefill", 1, 8192)]
    rest = [(h, "decode", b, c) for h in (llama, smollm) for b in (1, 32, 256) for c in (1024, 8192, 32768)
            if c != 8192 or b == 1]
    wide = [(WIDE, "decode", 32, 8192), (WIDE, "decode", 1, 32768), (PHI3, "decode", 32, 8192),
            (MIMO, "decode", 32, 8192), (MIMO, "prefill", 1, 8192), (GEMMA4, "decode", 32, 8192),
            (GEMMA4, "prefill", 1, 8192)]
    drafts = [(h, "drafts", 4, 8192) for h in (llama, smollm)]
    images = [(WIDE, "images", 1, 4096), (GPT_OSS, "sinks", 32, 8192), (GPT_OSS, "sinks", 1, 4096)]
    by_group = dict(targets=target, mixed=[(llama, "mixed", 32, 8192)], drafts=drafts, fp8=fp8,
                    window=[(llama, "window", 32, 32768)], wide=wide, images=images, rest=rest)
    rows = [row for group in dict.fromkeys(chosen) for row in by_group[group]]
    if args.quick:
        rows = [(llama, "decode", 32, 1024), (llama, "prefill", 1, 2048), (llama, "fp8", 32, 1024),
                (llama, "fp8_prefill", 1, 1024), (llama, "mixed", 4, 1024), (llama, "drafts", 2, 1024),
                (llama, "window", 2, 8192), (WIDE, "images", 1, 1024), (GPT_OSS, "sinks", 2, 1024),
                (GPT_OSS, "sinks", 1, 1024), (GEMMA4, "decode", 2, 1024)]
    print("decode: bytes = K+V read + q/out, % of copy bandwidth; prefill (one sequence, causal): bytes = K+V +"
          " q/out, FLOP/s against the matmul rate; fp8: float8_e4m3fn pages, K+V read at 1 byte")
    fns_by_model = {h.name: kernels(h) for h in MODELS + (WIDE, GPT_OSS, PHI3, MIMO, GEMMA4)}
    for heads, kind, batch, ctx in rows:
        label = f"{heads.name} ({heads.q}q/{heads.kv}kv/{heads.dim}) {kind} b={batch:3d} ctx={ctx:5d}"
        if time.perf_counter() - start > args.budget_s:
            print(f"{label}: skipped (time budget)")
            continue
        fns = fns_by_model[heads.name]
        if kind == "prefill":
            sets, nbytes, flops = decode_case(rng, heads, 1, ctx, num_tokens=ctx, min_pool_bytes=pool_bytes)
            names = ["pallas", "mosaic_ws", "mosaic_ws_bkv64", "mosaic_1wg", "mosaic_1wg_bkv128", "xla",
                     "cudnn_causal"] if heads is not GEMMA4 else ["pallas_copies", "pallas", "xla"]
            run_row(label, pick(fns, names), sets, own_bytes(heads, 1, ctx, ctx) or nbytes, flops,
                    dense_sets(sets, heads, 1, ctx), copy_bw, matmul)
        elif kind == "fp8_prefill":  # the Mosaic forms upcast the float8 pages in SMEM (ws: in the loader)
            sets, nbytes, flops = decode_case(rng, heads, 1, ctx, num_tokens=ctx, min_pool_bytes=pool_bytes,
                                              kv_dtype=jnp.float8_e4m3fn)
            run_row(label, pick(fns, ["pallas", "mosaic_ws", "mosaic_1wg"]), sets, nbytes, flops, None, copy_bw,
                    matmul)
        elif kind == "mixed":
            sets, nbytes, flops = mixed_case(rng, heads, batch, ctx, MIXED_CHUNK, min_pool_bytes=pool_bytes)
            run_row(f"{label} + a {MIXED_CHUNK}-token chunk", pick(fns, ["pallas", "mosaic_split", "mosaic_whole"]),
                    sets, nbytes, flops, None, copy_bw)
        elif kind == "drafts":  # a token and 4 drafts per request: as chunks (one read of the KV) or as rows
            sets, nbytes, flops = decode_case(rng, heads, batch, ctx, num_tokens=batch * DRAFT_TOKENS,
                                              min_pool_bytes=pool_bytes)
            run_row(f"{label} {DRAFT_TOKENS} tokens as chunks",
                    pick(fns, ["pallas", "mosaic_ws", "mosaic_1wg", "mosaic_1wg_split"]), sets, nbytes, flops,
                    None, copy_bw)
            run_row(f"{label} {DRAFT_TOKENS} tokens as rows", pick(fns, ["pallas", "mosaic"]),
                    as_rows(sets, DRAFT_TOKENS), nbytes, flops, None, copy_bw)
        elif kind == "images":  # the same prefill with its images attended both ways, and all causal
            sets, nbytes, flops = decode_case(rng, heads, 1, ctx, num_tokens=ctx, min_pool_bytes=pool_bytes)
            names = ["pallas_causal", "pallas_spans", "mosaic_ws_causal", "mosaic_ws_spans"]
            run_row(f"{label} {IMAGE_TOKENS}-token images", pick(fns, names), span_sets(sets, ctx), nbytes, flops,
                    None, copy_bw, matmul)
        elif kind == "sinks":  # decode (batch > 1) or one prefill, with a sink logit per head appended to each set
            sets, nbytes, flops = decode_case(rng, heads, batch, ctx, num_tokens=None if batch > 1 else ctx,
                                              min_pool_bytes=pool_bytes)
            sinks = jnp.asarray(rng.uniform(-1.0, 3.0, heads.q), jnp.float32)
            names = ["pallas_causal", "pallas_sinks"] + (["mosaic_causal", "mosaic_sinks"] if batch > 1 else
                                                         ["mosaic_ws_causal", "mosaic_ws_sinks"])
            run_row(label, pick(fns, names), [(*s, sinks) for s in sets], nbytes, flops, None, copy_bw,
                    None if batch > 1 else matmul)
        elif kind == "window":
            sets, _, _ = decode_case(rng, heads, batch, ctx, min_pool_bytes=pool_bytes)
            nbytes, flops = work(heads, batch, WINDOW, 1, jnp.dtype(DTYPE).itemsize)  # the window's keys only
            run_row(f"{label} window={WINDOW}", pick(fns, ["pallas_window", "mosaic_window"]), sets, nbytes, flops,
                    None, copy_bw)
            nbytes, flops = work(heads, batch, CHUNK, 1, jnp.dtype(DTYPE).itemsize)  # the last chunk's keys only
            run_row(f"{label} chunk={CHUNK}", pick(fns, ["pallas_chunk", "mosaic_chunk"]), sets, nbytes, flops,
                    None, copy_bw)
        elif kind == "decode":
            sets, nbytes, flops = decode_case(rng, heads, batch, ctx, min_pool_bytes=pool_bytes)
            big = nbytes * 3 > REF_LIMIT_BYTES
            names = ["pallas", "pallas_rows", "mosaic", "mosaic_st4", "mosaic_bkv128", None if big else "xla", "cudnn"]
            if heads is WIDE:  # deeper rings and 128-key blocks of 256-wide heads overflow shared memory
                names = ["pallas", "pallas_rows", "mosaic", None if big else "xla", "cudnn"]
            if heads is GEMMA4:
                names = ["pallas_copies", "pallas", "pallas_rows", None if big else "xla"]
            dense = None if big else dense_sets(sets, heads, batch, ctx)
            run_row(label, pick(fns, names), sets, own_bytes(heads, batch, ctx, 1) or nbytes, flops, dense, copy_bw)
        else:
            sets, nbytes, flops = decode_case(rng, heads, batch, ctx, min_pool_bytes=pool_bytes,
                                              kv_dtype=jnp.float8_e4m3fn)
            names = ["pallas", "mosaic", "mosaic_st4", "mosaic_bkv128", None if nbytes * 6 > REF_LIMIT_BYTES else "xla"]
            run_row(label, pick(fns, names), sets, nbytes, flops, None, copy_bw)
        del sets

    print("\n== KV write (256 tokens, llama3-8b heads): bytes = 2 x new K/V rows read and written")
    heads = MODELS[1]
    num_pages = 4096
    shape = (num_pages, PAGE_SIZE, heads.kv, heads.dim)
    new = jnp.ones((256, heads.kv, heads.dim), DTYPE)
    slots = jnp.asarray(rng.choice(np.arange(PAGE_SIZE, num_pages * PAGE_SIZE), 256, replace=False), jnp.int32)
    nbytes = 2 * 2 * new.nbytes
    # All donate the pages, so each call updates the pool in place instead of copying it.
    writers = [("pallas", write_kv), ("xla", jax.jit(write_kv_reference, donate_argnums=(0, 1)))]
    if triton_available():
        writers.append(("triton", write_kv_triton))
    else:
        print("write_kv triton: skip (jax_triton does not import)")
    for name, fn in writers:
        try:
            state = [jnp.zeros(shape, DTYPE), jnp.zeros(shape, DTYPE)]
            state = list(fn(state[0], state[1], new, new, slots))  # compile
            samples = []
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(20):
                    state = list(fn(state[0], state[1], new, new, slots))  # donated, updated in place
                jax.block_until_ready(state)
                samples.append((time.perf_counter() - t0) / 20)
            sec = statistics.median(samples)
            print(f"write_kv {name}: {sec * 1e6:.1f} us, {nbytes / sec / 1e9:.1f} GB/s", flush=True)
        except Exception as e:  # one failing writer must not hide the others
            print(f"write_kv {name}: FAIL {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
    print(f"\ntotal {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
