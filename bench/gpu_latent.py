"""Time the latent attention kernel (DeepSeek's multi-head latent attention over pages of 576-wide entries) on one
GPU against the engine's XLA path, as achieved bytes/s.

Decode at batch 32 and 128 with 8k context (the issue's target shape), batch 1 at 32k; prefill of 2k tokens of one
sequence. Then the sparse latent kernel (DeepSeek-V3.2: 128 heads over 704-wide entries, each token attending the
2048 entries its indexer chose, here at random from a 32k context) at decode batch 64 and a 2k-token prefill, against
the engine's XLA path (`sparse_mla.attend_chosen`); bytes: the chosen entries' 576 scored dims once per token. Then
its indexer's choice (64 heads of 128 dims; every key a token sees scored, the best 2048 kept) at decode batch 64
over 32k contexts and a 2k-token prefill chunk ending at 32k: the kernel's scores and their top-k
(`sparse_mla.scored_keys`), the scores alone, and the XLA path's running top-k (`sparse_mla.chosen_keys`); bytes:
each token's keys (128 dims) once, FLOPs: the heads' dots over the keys each token sees. DeepSeek-V2-Lite's 16 heads per entry and DeepSeek-V3's 128 (one device; under tensor parallelism over 8
a device holds 16), bfloat16 entries (512-dim latent + 64-dim rotary key), page size 16, pages scattered over a
pool past the L2. Bytes: the entries read once (the kernel reads each as key and as value) plus q and the output;
FLOPs: the scores over 576 dims and the values over 512, per head, over the causal part. Each row is the median of
rounds of warm calls rotating over input sets. Usage: `python bench/gpu_latent.py [--budget-s N] [--quick]`.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.gpu_inputs import DTYPE, MIN_POOL_BYTES, PAGE_SIZE, table_sets
from bench.gpu_kernels import copy_bandwidth, matmul_rate, run_row
from jaxserve.models.attention import token_rows, xla_ragged_paged_attention
from jaxserve.models.sparse_mla import attend_chosen, chosen_keys, scored_keys
from pallas_kernels import AttentionTuning
from pallas_kernels.latent_attention import latent_paged_attention
from pallas_kernels.sparse_index import index_scores
from pallas_kernels.sparse_latent_attention import sparse_latent_attention

LATENT, ROPE = 512, 64
ENTRY = LATENT + ROPE
SCALE = 192**-0.5  # DeepSeek's query head: 128 unrotated + 64 rotary dims (without YaRN's mscale)
MODELS = {"deepseek-v2-lite": 16, "deepseek-v3": 128}


def latent_case(rng, heads: int, batch: int, ctx: int, q_len: int = 1, min_pool_bytes: int = MIN_POOL_BYTES):
    """Input sets (q, pages, tables, seq_lens, query_start_loc) and the row's bytes and FLOPs."""
    pages_per_seq = -(-ctx // PAGE_SIZE)
    needed = batch * pages_per_seq
    item = jnp.dtype(DTYPE).itemsize
    num_pages = max(needed + 1, min_pool_bytes // (PAGE_SIZE * ENTRY * item))
    key = jax.random.key(int(rng.integers(1 << 30)))
    pages = jax.random.normal(key, (num_pages, PAGE_SIZE, ENTRY), DTYPE)
    sets = []
    for i, (tables, seq_lens, qsl) in enumerate(table_sets(rng, num_pages, batch, ctx, q_len)):
        q = jax.random.normal(jax.random.fold_in(key, i + 1), (batch * q_len, heads, ENTRY), DTYPE)
        sets.append((q, pages, tables, seq_lens, qsl))
    nbytes = batch * ctx * ENTRY * item + batch * q_len * heads * (ENTRY + LATENT) * item
    flops = 2 * batch * heads * (ENTRY + LATENT) * (q_len * ctx - q_len * (q_len - 1) / 2)
    return sets, nbytes, flops


def implementations(decode: bool) -> list:
    kernel = functools.partial(latent_paged_attention, value_dim=LATENT, sm_scale=SCALE)
    return [
        ("pallas", jax.jit(kernel)),
        ("pallas_h32", jax.jit(functools.partial(kernel, tuning=AttentionTuning(latent_heads=32)))),
        ("pallas_bkv64", jax.jit(functools.partial(kernel, tuning=AttentionTuning(block_kv=64)))),
        ("pallas_st2", jax.jit(functools.partial(kernel, tuning=AttentionTuning(num_stages=2)))),
        # The engine's path without the kernel: the entries as keys and as values, cut to the latent.
        ("xla", jax.jit(lambda q, p, t, s, qsl: xla_ragged_paged_attention(
            q, p, None, t, s, qsl, sm_scale=SCALE, decode=decode)[..., :LATENT])),
    ]


SPARSE_ENTRY, SPARSE_TOPK, SPARSE_CTX = ENTRY + 128, 2048, 32768  # DeepSeek-V3.2: the indexer's key in the entry


def sparse_case(rng, tokens: int, min_pool_bytes: int = MIN_POOL_BYTES, heads: int = 128, topk: int = SPARSE_TOPK,
                ctx: int = SPARSE_CTX):
    """Input sets (q, pages, slots, lens): each token's `topk` entries drawn from its own `ctx`-token span of the
    pool; and the row's bytes and FLOPs."""
    item = jnp.dtype(DTYPE).itemsize
    num_pages = max(-(-tokens * ctx // PAGE_SIZE) + 1, min_pool_bytes // (PAGE_SIZE * SPARSE_ENTRY * item))
    key = jax.random.key(int(rng.integers(1 << 30)))
    pages = jax.random.normal(key, (num_pages, PAGE_SIZE, SPARSE_ENTRY), DTYPE)
    sets = []
    for i in range(3):
        first = rng.integers(PAGE_SIZE, num_pages * PAGE_SIZE - ctx, size=(tokens, 1))
        slots = (first + np.stack([rng.choice(ctx, topk, replace=False) for _ in range(tokens)])).astype(np.int32)
        q = jax.random.normal(jax.random.fold_in(key, i + 1), (tokens, heads, ENTRY), DTYPE)
        sets.append((q, pages, jnp.asarray(slots)[None], jnp.full((tokens,), topk, jnp.int32)))
    nbytes = tokens * topk * ENTRY * item + tokens * heads * (ENTRY + LATENT) * item
    flops = 2 * tokens * heads * (ENTRY + LATENT) * topk
    return sets, nbytes, flops


def sparse_implementations() -> list:
    kernel = functools.partial(sparse_latent_attention, key_dim=ENTRY, value_dim=LATENT, sm_scale=SCALE)
    return [
        ("pallas", jax.jit(kernel)),
        ("pallas_bkv64", jax.jit(functools.partial(kernel, tuning=AttentionTuning(block_kv=64)))),
        ("xla", jax.jit(lambda q, p, s, n: attend_chosen(q, p, s, n, value_dim=LATENT, sm_scale=SCALE,
                                                          kv_dtype=None))),
    ]


INDEX_HEADS, INDEX_DIM = 64, 128  # DeepSeek-V3.2's indexer


def index_case(rng, batch: int, ctx: int, q_len: int, min_pool_bytes: int = MIN_POOL_BYTES):
    """Input sets (index q, head weights, pages, tables, seq_lens, query_start_loc) of `batch` sequences of `ctx` keys,
    the last `q_len` of each the new tokens; and the row's bytes and FLOPs."""
    item = jnp.dtype(DTYPE).itemsize
    num_pages = max(batch * -(-ctx // PAGE_SIZE) + 1, min_pool_bytes // (PAGE_SIZE * SPARSE_ENTRY * item))
    key = jax.random.key(int(rng.integers(1 << 30)))
    pages = jax.random.normal(key, (num_pages, PAGE_SIZE, SPARSE_ENTRY), DTYPE)
    T = batch * q_len
    sets = [(jax.random.normal(jax.random.fold_in(key, 2 * i + 1), (T, INDEX_HEADS, INDEX_DIM), DTYPE),
             jax.random.normal(jax.random.fold_in(key, 2 * i + 2), (T, INDEX_HEADS), jnp.float32), pages, *t)
            for i, t in enumerate(table_sets(rng, num_pages, batch, ctx, q_len))]
    seen = batch * (q_len * ctx - q_len * (q_len - 1) / 2)  # keys seen, summed over the tokens
    return sets, T * ctx * INDEX_DIM * item, 2 * INDEX_HEADS * INDEX_DIM * seen


def index_implementations(topk: int) -> list:
    kw = dict(key_dim=ENTRY, topk=topk)

    def scores(iq, iw, pages, tables, seq_lens, qsl):
        seq, pos, _, _ = token_rows(seq_lens, qsl, iq.shape[0])
        return index_scores(iq, iw, pages, tables, seq, pos, key_offset=ENTRY, scale=INDEX_DIM ** -0.5)

    return [("pallas", jax.jit(functools.partial(scored_keys, **kw))), ("scores", jax.jit(scores)),
            ("xla", jax.jit(functools.partial(chosen_keys, **kw)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-s", type=float, default=60.0, help="stop starting new rows after this")
    parser.add_argument("--quick", action="store_true", help="small rows and pools (smoke test)")
    args = parser.parse_args()
    start = time.perf_counter()
    print(f"devices: {jax.devices()}  jax {jax.__version__}", flush=True)
    copy_bw = copy_bandwidth(1 << 24 if args.quick else 1 << 30)
    matmul = matmul_rate(1024 if args.quick else 8192)
    print(f"copy bandwidth (read+write): {copy_bw / 1e12:.2f} TB/s; bfloat16 matmul rate: {matmul / 1e12:.0f} "
          "TFLOP/s", flush=True)
    pool = 1 << 20 if args.quick else MIN_POOL_BYTES
    rows = [(name, b, 8192, 1) for name in MODELS for b in (32, 128)]
    rows += [(name, 1, 32768, 1) for name in MODELS] + [(name, 1, 2048, 2048) for name in MODELS]
    if args.quick:
        rows = [("deepseek-v2-lite", 4, 1024, 1), ("deepseek-v3", 2, 1024, 1), ("deepseek-v2-lite", 1, 512, 512)]
    rng = np.random.default_rng(0)
    print("latent decode / prefill: bytes = entries (576 x 2 B a token) read once + q/out; prefill FLOP/s against "
          "the matmul rate")
    for name, batch, ctx, q_len in rows:
        heads = MODELS[name]
        label = f"{name} ({heads} heads/entry) {'decode' if q_len == 1 else 'prefill'} b={batch:3d} ctx={ctx:5d}"
        if time.perf_counter() - start > args.budget_s:
            print(f"{label}: skipped (time budget)")
            continue
        sets, nbytes, flops = latent_case(rng, heads, batch, ctx, q_len, pool)
        run_row(label, implementations(q_len == 1), sets, nbytes, flops, None, copy_bw,
                None if q_len == 1 else matmul)
        del sets
    print("sparse latent (DeepSeek-V3.2, 128 heads, top 2048 of 32k): bytes = the chosen entries' 576 dims once "
          "+ q/out")
    for tokens in (4, 64) if args.quick else (64, 2048):
        label = f"deepseek-v3.2 sparse {'decode' if tokens < 2048 else 'prefill'} tokens={tokens:4d}"
        if time.perf_counter() - start > args.budget_s:
            print(f"{label}: skipped (time budget)")
            continue
        sets, nbytes, flops = sparse_case(rng, tokens, pool, topk=64 if args.quick else SPARSE_TOPK,
                                          ctx=1024 if args.quick else SPARSE_CTX)
        run_row(label, sparse_implementations(), sets, nbytes, flops, None, copy_bw, matmul)
        del sets
    print("indexer (DeepSeek-V3.2: 64 heads x 128, top 2048): bytes = each token's keys once; FLOP/s against the "
          "matmul rate")
    for batch, ctx, q_len in ((4, 1024, 1), (1, 1024, 64)) if args.quick else ((64, 32768, 1), (1, 32768, 2048)):
        label = f"deepseek-v3.2 indexer {'decode' if q_len == 1 else 'prefill'} tokens={batch * q_len:4d} ctx={ctx}"
        if time.perf_counter() - start > args.budget_s:
            print(f"{label}: skipped (time budget)")
            continue
        sets, nbytes, flops = index_case(rng, batch, ctx, q_len, pool)
        run_row(label, index_implementations(64 if args.quick else SPARSE_TOPK), sets, nbytes, flops, None, copy_bw,
                matmul)
        del sets
    print(f"\ntotal {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
