"""The cases of tests/test_kernels_mosaic_ws.py: the warp-specialized ragged Mosaic GPU kernel against the
float64 oracle (in Mosaic GPU's CPU interpreter, or compiled on a GPU). Run as a module on the CPU, it is that
test's child process and prints one JSON line per case.

Its three warpgroups are three interpreter threads that block on each other's barriers, each inside a host
callback on XLA's CPU thread pool; the pool is sized by the host's cores, which on a 2-core machine leaves
a thread short, so the parent runs this with 8 simulated devices (a larger pool). Not a test module.
"""

from __future__ import annotations

import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.ragged_attention_args import quantize_kv
from pallas_kernels.ragged_attention_mosaic import ragged_paged_attention_mosaic
from tests.test_kernels_cases import make_batch, naive_attention, span_last_key

# (name, page_size, head_dim, group, kv_heads, block_kv, [(q_len, kv_len)], pages_per_seq, soft_cap, window,
#  the pages' dtype[, {"spans": spans attended both ways per sequence, "chunk": Llama 4's chunk of positions}])
CASES = [
    # Float8 pages (they land in their own ring; the loading warpgroup upcasts each block into the stage, then
    # signals it), a sliding window of 141 keys and a soft-cap. The 42-token chunk at 200-241 is one program: warpgroup 0
    # (tokens 200-220) walks window-edge blocks 0-1 masked, block 2 whole, block 3 causal; warpgroup 1 (tokens
    # 221-241) releases block 0 unread (its window starts at 81), then block 1 masked, 2 whole, 3 causal. The
    # decode token at 300 loads blocks 2-4 only (the ring starts at block 2); a 30-token prompt leaves
    # warpgroup 1 only releasing. With gpt-oss's attention sinks (a logit per query head in each row's sum:
    # token 21's three rows are heads 0-2 across the warpgroups' boundary); the empty row's sinks leave it 0.
    ("smollm-e4m3-window-cap-sinks", 16, 64, 3, 1, 64, [(42, 242), (1, 301), (0, 0), (30, 100)], 20, 5.0, 141,
     jnp.float8_e4m3fn),
    # Spans attended both ways, under a 50-key window (Gemma 3's local layers): the 60-token chunk at 40-99 is a
    # program of tokens 40-81 and one of 82-99. Span 30-70 starts in the cache and ends in warpgroup 1's tokens
    # (warpgroup 0's walk reaches past its own last token), span 72-95 starts in warpgroup 1's and ends in the next
    # program; a prompt is one span to its end.
    ("smollm-spans-window", 16, 64, 3, 1, 64, [(60, 100), (20, 20)], 7, None, 50, jnp.bfloat16,
     {"spans": [[(30, 70), (72, 95)], [(2, 19)]]}),
    # Llama 4's chunked attention, chunks of 48 positions: the 60-token chunk at 70-129 is a program of tokens
    # 70-111 and one of 112-129. In the first, warpgroup 0 (70-90) walks block 0 masked (its chunk starts at 48)
    # and block 1 causal; warpgroup 1 (91-111) straddles the edge at 96, so its rows before it see from 48 and
    # those after from 96: blocks 0-1 masked. The decode token at 149 loads block 2 only; the 60-token prompt
    # crosses the edge at 48.
    ("smollm-chunks", 16, 64, 3, 1, 64, [(60, 130), (1, 150), (60, 60)], 10, None, None, jnp.bfloat16,
     {"chunk": 48}),
]


# On a GPU also (in the interpreter the cases above hold each of its paths: two full warpgroups and one only
# releasing, a stage refilled, an empty row, heads straddling the warpgroups), the plain bfloat16 case:
GPU_CASES = [
    # SmolLM2 heads (group 3: token 21's heads straddle the two warpgroups), 64-key blocks: a 50-token chunk
    # over 60 cached tokens (a program of two full warpgroups, then one whose second warpgroup has no token
    # and only releases the stages), a decode token at 137 (three KV blocks: the loader refills a stage), an
    # empty row, a 7-token prompt.
    ("smollm-bkv64", 16, 64, 3, 1, 64, [(50, 110), (1, 137), (0, 0), (7, 7)], 9, None, None, jnp.bfloat16),
    # 128-wide heads of group 4 (Llama-3-8B's) with 128-key blocks, a 512-token prompt, a chunk over 800 cached
    # tokens and a decode token at 2000.
    ("llama-bkv128", 16, 128, 4, 2, None, [(512, 512), (100, 900), (1, 2000)], 128, None, None, jnp.bfloat16),
]


def run_cases(cases):
    """Per case: the kernel's output against the oracle, as a dict of plain values."""
    for name, page_size, head_dim, group, kv_heads, block_kv, seqs, pages_per_seq, soft_cap, window, kv_dtype, \
            *extra in cases:
        extra = extra[0] if extra else {}
        rng = np.random.default_rng(len(name))
        batch = make_batch(rng, page_size=page_size, head_dim=head_dim, group=group, num_kv_heads=kv_heads,
                           dtype=jnp.bfloat16, seqs=seqs, pages_per_seq=pages_per_seq)
        # The oracle reads the pages as stored: for float8, the attention of their float8 values.
        batch = dataclasses.replace(batch, k_pages=quantize_kv(batch.k_pages, kv_dtype),
                                    v_pages=quantize_kv(batch.v_pages, kv_dtype))
        last_key = span_last_key(batch, extra["spans"]) if "spans" in extra else None
        chunk = extra.get("chunk")
        sinks = rng.uniform(0.0, 3.0, batch.q.shape[1]).astype(np.float32) if name.endswith("-sinks") else None
        start = time.perf_counter()
        out = ragged_paged_attention_mosaic(
            batch.q, batch.k_pages, batch.v_pages, batch.block_tables, batch.seq_lens, batch.query_start_loc,
            sm_scale=head_dim**-0.5, soft_cap=soft_cap, sliding_window=window, attention_chunk=chunk,
            block_kv=block_kv, compute_wgs=2,
            interpret=jax.default_backend() == "cpu", last_key=last_key, sinks=None if sinks is None else jnp.asarray(sinks),
        )
        out = np.asarray(out.astype(jnp.float32))
        seconds = time.perf_counter() - start
        ref = naive_attention(batch, sm_scale=head_dim**-0.5, soft_cap=soft_cap, sliding_window=window,
                              attention_chunk=chunk,
                              last_key=None if last_key is None else np.asarray(last_key), sinks=sinks)
        n = batch.num_real_tokens
        yield {
            "case": name, "seconds": round(seconds, 1), "dtype": str(out.dtype), "shape_ok": out.shape == batch.q.shape,
            "finite": bool(np.isfinite(out[:n]).all()), "max_err": float(np.abs(out[:n] - ref[:n]).max()),
            "max_ref": float(np.abs(ref[:n]).max()), "padding_zero": not out[n:].any(),
        }


if __name__ == "__main__":
    if jax.default_backend() == "cpu":
        assert jax.device_count() > 2, "run with --xla_force_host_platform_device_count=8 (see the module doc)"
    for result in run_cases(CASES):
        print(json.dumps(result), flush=True)
