"""Sharded steps on 8 simulated CPU devices against the unsharded step: time per step and collective bytes.

For a dense and a MoE model (random weights) and a decode step (16 sequences x 1 token at context 256)
and a prefill step (1 sequence x 256 tokens), prints per layout: the median step time here, the
per-device collective bytes the layout implies (`sharding.comm`, the model that holds on GPUs), and
the collectives XLA actually put in the compiled step (counted in its HLO, loops counted once).
On this host the 8 "devices" share the same cores, so sharded times measure overhead, not speed-up.
Usage: `python -m bench.sharding [--devices 8] [--rounds 5] [--out results.json]`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time

DENSE = dict(family="llama", vocab_size=8192, hidden_size=512, intermediate_size=1536, num_layers=4,
             num_heads=16, num_kv_heads=8, head_dim=32, max_position_embeddings=2048)
MOE = dict(DENSE, family="qwen3_moe", qk_norm=True, num_experts=16, num_experts_per_tok=2,
           moe_intermediate_size=256, norm_topk_prob=True)
LAYOUTS = {"dense": [(1, 1), (2, 1), (4, 1), (8, 1)], "moe": [(1, 1), (1, 8), (2, 4), (8, 1)]}
PAGE = 16
CONTEXT = 256
_COLLECTIVE = re.compile(r"\b(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(-start)?\(")


def _inputs(kind: str):
    from jaxserve.models.inputs import ModelInputs

    pages_per_seq = CONTEXT // PAGE
    if kind == "decode":
        seqs = [([7], CONTEXT - 1, list(range(1 + s * pages_per_seq, 1 + (s + 1) * pages_per_seq)))
                for s in range(16)]
        return ModelInputs.build(seqs, PAGE, num_tokens=16, num_seqs=16, pages_per_seq=pages_per_seq)
    seqs = [(list(range(CONTEXT)), 0, list(range(1, 1 + pages_per_seq)))]
    return ModelInputs.build(seqs, PAGE, num_tokens=CONTEXT, num_seqs=1, pages_per_seq=pages_per_seq)


def _measure(cfg, params, tp: int, ep: int, kind: str, rounds: int) -> dict:
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxserve.models.inputs import KVCache
    from jaxserve.models.llama import forward
    from sharding import ParallelConfig, make_mesh, make_plan
    from sharding.comm import step_collective_bytes

    num_pages = 16 * CONTEXT // PAGE + 1
    inputs = jax.tree.map(np.asarray, _inputs(kind))
    if tp * ep == 1:
        plan, run_cfg, p = None, cfg, params
        kv = KVCache.allocate(cfg, num_pages, PAGE, jnp.float32)
        step = jax.jit(functools.partial(forward, cfg=cfg, backend="xla"), donate_argnums=(1,))
    else:
        plan = make_plan(cfg, make_mesh(ParallelConfig(tp, ep)))
        run_cfg, p = plan.model_cfg, plan.shard_params(params)
        kv = plan.allocate_kv(num_pages, PAGE, jnp.float32)
        sh = plan.step_shardings()
        step = jax.jit(functools.partial(forward, cfg=run_cfg, backend="xla", layout=plan.layout()), donate_argnums=(1,),
                       in_shardings=(sh.params, sh.kv, sh.replicated), out_shardings=(sh.replicated, sh.kv))
    hlo = step.lower(p, kv, inputs).compile().as_text()
    ops: dict[str, int] = {}
    for m in _COLLECTIVE.finditer(hlo):
        ops[m.group(1)] = ops.get(m.group(1), 0) + 1
    times = []
    for _ in range(rounds + 1):
        t0 = time.perf_counter()
        logits, kv = step(p, kv, inputs)
        logits.block_until_ready()
        times.append(time.perf_counter() - t0)
    num_tokens = inputs.token_ids.shape[0]
    cost = step_collective_bytes(cfg, tp, ep, num_tokens, inputs.logits_indices.shape[0],
                                 vocab_split=plan is None or plan.rules.mesh_axis("vocab") is not None)
    return {
        "model": "moe" if cfg.num_experts else "dense", "step": kind, "tp": tp, "ep": ep,
        "step_ms": 1e3 * statistics.median(times[1:]),
        "collective_bytes_per_device": cost.total,
        "collective_bytes_by_part": {"embed": cost.embed, "attention": cost.attention, "mlp": cost.mlp,
                                     "lm_head": cost.lm_head},
        "hlo_collectives": ops,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    if "jax" in sys.modules:
        raise SystemExit("run `python -m bench.sharding` in a fresh process: the device count is fixed when JAX "
                         "starts")
    # Run as a file, this module's folder comes first on the path and its name hides the `sharding` package.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={args.devices}").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    from jaxserve.config import ModelConfig
    from jaxserve.models.params import init_params

    rows = []
    print(f"{'model':6} {'step':7} {'tp':>3} {'ep':>3} {'ms/step':>9} {'coll. MB/dev':>13}  HLO collectives")
    for name, fields in (("dense", DENSE), ("moe", MOE)):
        cfg = ModelConfig(**fields)
        params = init_params(cfg, jax.random.PRNGKey(0), scale=0.05)
        for tp, ep in LAYOUTS[name]:
            if tp * ep > jax.device_count():
                continue
            for kind in ("decode", "prefill"):
                r = _measure(cfg, params, tp, ep, kind, args.rounds)
                rows.append(r)
                print(f"{name:6} {kind:7} {tp:3d} {ep:3d} {r['step_ms']:9.1f} "
                      f"{r['collective_bytes_per_device'] / 1e6:13.3f}  {r['hlo_collectives']}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
