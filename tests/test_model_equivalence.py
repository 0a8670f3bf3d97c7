"""The paged forward pass against itself and a dense reference, on a tiny random model.

Whole prompts against chunked prefill plus decode, a sequence alone against the same sequence
in a mixed ragged batch, lengths at page boundaries, scattered page tables, float32 and
bfloat16. Every step is padded to one bucket shape per page size, so each case compiles once.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import ModelConfig, rope_inv_freq_and_scale
from jaxserve.models.inputs import KVCache
from jaxserve.models.params import Params, init_params
from jaxserve.models.unstack import unstack_layers
from tests.modelrun import run_chunks

CFG = ModelConfig(
    family="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0, tie_word_embeddings=True,
)
NUM_PAGES = 64
BUCKET = dict(num_tokens=64, num_seqs=4, pages_per_seq=8)


@pytest.fixture(scope="module")
def params32() -> Params:
    return init_params(CFG, jax.random.key(0), jnp.float32, 0.15)


def prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, CFG.vocab_size, n).tolist()


def random_pages(n: int, rng: np.random.Generator, taken: set[int]) -> list[int]:
    """n distinct, scattered page ids (never page 0, never one in `taken`)."""
    free = [p for p in range(1, NUM_PAGES) if p not in taken]
    pages = [int(p) for p in rng.choice(free, n, replace=False)]
    taken.update(pages)
    return pages


def _np_rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def _np_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def dense_logits(cfg: ModelConfig, params: Params, ids: list[int]) -> np.ndarray:
    """Reference forward over one whole sequence in float64 numpy: plain causal attention, no pages."""
    f64 = jax.tree.map(lambda a: np.asarray(a.astype(jnp.float32), np.float64), params)
    n, eps = len(ids), cfg.rms_norm_eps
    x = f64.embed[np.asarray(ids)]  # [n, E]
    inv_freq, scale = rope_inv_freq_and_scale(cfg)
    angles = np.arange(n)[:, None] * np.asarray(inv_freq)[None, :]  # [n, D/2]
    angles = np.concatenate([angles, angles], axis=-1)
    cos, sin = np.cos(angles) * scale, np.sin(angles) * scale
    qpos, kpos = np.arange(n)[:, None], np.arange(n)[None, :]
    mask = kpos <= qpos
    if cfg.sliding_window is not None:
        mask &= kpos > qpos - cfg.sliding_window
    for layer in range(cfg.num_layers):
        lp = jax.tree.map(lambda a, i=layer: a[i], f64.layers)
        h = _np_rms_norm(x, lp.attn_norm, eps)
        q = _np_rope(np.einsum("te,ehd->thd", h, lp.wq), cos, sin)  # [n, Hq, D]
        k = _np_rope(np.einsum("te,ehd->thd", h, lp.wk), cos, sin)  # [n, Hkv, D]
        v = np.einsum("te,ehd->thd", h, lp.wv)
        k = np.repeat(k, cfg.q_per_kv, axis=1)  # [n, Hq, D]
        v = np.repeat(v, cfg.q_per_kv, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) * cfg.head_dim ** -0.5
        s = np.where(mask[None], s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        x = x + np.einsum("hqk,khd,hde->qe", p, v, lp.wo)
        h = _np_rms_norm(x, lp.mlp_norm, eps)
        gate = h @ lp.w_gate
        x = x + (gate / (1 + np.exp(-gate)) * (h @ lp.w_up)) @ lp.w_down
    x = _np_rms_norm(x, f64.final_norm, eps)
    return x @ (f64.embed.T if f64.lm_head is None else f64.lm_head)


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def run_schedule(cfg, params, steps, page_size, dtype=jnp.float32):
    """Run `steps` (each a list of (seq_name, ids, start, pages)) on one fresh page pool; return
    {seq_name: {position: logits}} collected from every token of every step."""
    kv = KVCache.allocate(cfg, NUM_PAGES, page_size, dtype)
    out: dict[str, dict[int, np.ndarray]] = {}
    for step in steps:
        logits, kv = run_chunks(cfg, params, kv, [(ids, start, pages) for _, ids, start, pages in step],
                                page_size, **BUCKET)
        t = 0
        for name, ids, start, _ in step:
            for i in range(len(ids)):
                out.setdefault(name, {})[start + i] = logits[t + i]
            t += len(ids)
        assert np.isfinite(logits[:t]).all()
    return out


def stacked(by_pos: dict[int, np.ndarray]) -> np.ndarray:
    assert sorted(by_pos) == list(range(len(by_pos)))
    return np.stack([by_pos[i] for i in range(len(by_pos))])


def test_whole_prompt_matches_dense_reference(params32):
    ids = prompt(37, seed=1)
    pages = random_pages(5, np.random.default_rng(0), set())
    whole = stacked(run_schedule(CFG, params32, [[("a", ids, 0, pages)]], 8)["a"])
    ref = dense_logits(CFG, params32, ids)
    assert rel(whole, ref) < 1e-5
    assert (whole.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.parametrize("cfg", [CFG, dataclasses.replace(CFG, sliding_window=5)], ids=["full", "window5"])
def test_chunked_prefill_then_decode_equals_whole(cfg, params32):
    """Prefill in uneven chunks crossing pages, then one token per step, gives the whole prompt's logits."""
    ids = prompt(37, seed=2)
    pages = random_pages(5, np.random.default_rng(1), set())
    whole = stacked(run_schedule(cfg, params32, [[("a", ids, 0, pages)]], 8)["a"])
    cuts = [0, 5, 16, 30]
    steps = [[("a", ids[s:e], s, pages)] for s, e in itertools.pairwise(cuts)]
    steps += [[("a", [ids[p]], p, pages)] for p in range(30, len(ids))]
    chunked = stacked(run_schedule(cfg, params32, steps, 8)["a"])
    assert rel(chunked, whole) < 1e-5, rel(chunked, whole)
    assert (chunked.argmax(-1) == whole.argmax(-1)).all()
    ref = dense_logits(cfg, params32, ids)
    assert rel(whole, ref) < 1e-5
    if cfg.sliding_window is not None:  # the window really cuts attention short
        assert rel(ref, dense_logits(CFG, params32, ids)) > 1e-2


def test_logits_do_not_depend_on_batch_neighbours(params32):
    """A sequence alone and the same sequence beside others (prefilling and decoding, padded to the
    bucket, pages interleaved) gets the same logits; its neighbours get their own right logits."""
    rng = np.random.default_rng(3)
    taken: set[int] = set()
    a, b, c = prompt(21, seed=4), prompt(13, seed=5), prompt(9, seed=6)
    pa, pb, pc = (random_pages(4, rng, taken) for _ in range(3))
    alone = run_schedule(CFG, params32, [[("a", a[:12], 0, pa)], [("a", a[12:], 12, pa)]], 8)["a"]
    mixed = run_schedule(CFG, params32, [
        [("b", b[:12], 0, pb)],
        # a prefills, b decodes, c prefills: one ragged batch, padded to 64 tokens and 4 sequences.
        [("a", a[:12], 0, pa), ("b", b[12:13], 12, pb), ("c", c, 0, pc)],
        [("c", [a[0]], 9, pc), ("a", a[12:], 12, pa)],
    ], 8)
    got = stacked(mixed["a"])
    want = stacked(alone)
    assert rel(got, want) < 1e-6, rel(got, want)
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert rel(stacked(mixed["a"]), dense_logits(CFG, params32, a)) < 1e-5
    assert rel(stacked(mixed["b"]), dense_logits(CFG, params32, b)) < 1e-5
    assert rel(stacked(mixed["c"]), dense_logits(CFG, params32, c + [a[0]])) < 1e-5


@pytest.mark.parametrize("page_size", [8, 16])
def test_page_boundaries(page_size, params32):
    """Prompt lengths 1, page_size - 1, page_size, page_size + 1, each followed by two decode steps
    (which cross into the next page for the last three), on scattered pages."""
    rng = np.random.default_rng(page_size)
    for n in (1, page_size - 1, page_size, page_size + 1):
        ids = prompt(n + 2, seed=100 + n)
        pages = random_pages(-(-(n + 2) // page_size), rng, set())
        steps = [[("s", ids[:n], 0, pages)], [("s", [ids[n]], n, pages)], [("s", [ids[n + 1]], n + 1, pages)]]
        got = stacked(run_schedule(CFG, params32, steps, page_size)["s"])
        ref = dense_logits(CFG, params32, ids)
        assert rel(got, ref) < 1e-5, f"prompt length {n}, page size {page_size}: {rel(got, ref):.2e}"
        assert (got.argmax(-1) == ref.argmax(-1)).all()


def test_long_sequence_spans_several_kv_blocks(params32):
    """150 tokens on 8-token pages fill 19 of 20 table slots: the xla backend's online softmax runs
    over three blocks of pages (the last padded), beside a short neighbour; chunked then decoded."""
    rng = np.random.default_rng(11)
    taken: set[int] = set()
    long_ids, short_ids = prompt(150, seed=12), prompt(6, seed=13)
    pl, ps = random_pages(19, rng, taken), random_pages(1, rng, taken)
    bucket = dict(num_tokens=160, num_seqs=2, pages_per_seq=20)
    kv = KVCache.allocate(CFG, NUM_PAGES, 8, jnp.float32)
    got = {}
    for start, end in [(0, 70), (70, 148), (148, 149), (149, 150)]:
        seqs = [(long_ids[start:end], start, pl)]
        if start == 0:
            seqs.append((short_ids, 0, ps))
        logits, kv = run_chunks(CFG, params32, kv, seqs, 8, **bucket)
        got.update({start + i: logits[i] for i in range(end - start)})
        if start == 0:
            short = logits[70:76]
    ref = dense_logits(CFG, params32, long_ids)
    err = rel(stacked(got), ref)
    assert err < 1e-5, err
    assert rel(short, dense_logits(CFG, params32, short_ids)) < 1e-5


def test_bfloat16_runs_close_to_float32(params32):
    params16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params32)
    ids = prompt(37, seed=7)
    pages = random_pages(5, np.random.default_rng(7), set())
    steps = [[("a", ids[:20], 0, pages)], [("a", ids[20:], 20, pages)]]
    got = stacked(run_schedule(CFG, params16, steps, 8, dtype=jnp.bfloat16)["a"])
    ref = stacked(run_schedule(CFG, params32, steps, 8)["a"])
    err = rel(got, ref)
    assert 0 < err < 3e-2, err  # nonzero: the bfloat16 path really ran in bfloat16
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.9


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("fuse", [False, True], ids=["per_layer", "fused"])
def test_unrolled_layers_equal_scanned(fuse, tied, params32):
    """Per-layer weights (the CPU runner's layout, optionally with fused q/k/v and gate/up, and an untied
    head stored out-major) give the scanned stack's logits, for a prefill chunk and for one-token decode
    steps (one-row KV writes)."""
    cfg = CFG if tied else dataclasses.replace(CFG, tie_word_embeddings=False)
    if not tied:
        head = jax.random.normal(jax.random.key(9), (CFG.hidden_size, CFG.vocab_size), jnp.float32) * 0.15
        params32 = dataclasses.replace(params32, lm_head=head)
    flat = unstack_layers(params32, fuse=fuse)
    assert isinstance(flat.layers, tuple) and len(flat.layers) == CFG.num_layers
    assert (flat.layers[0].wqkv is not None) == fuse and (flat.layers[0].wq is None) == fuse
    assert (flat.lm_head_t is not None) == (fuse and not tied)
    ids = prompt(19, seed=8)
    pages = random_pages(3, np.random.default_rng(8), set())

    def run(params):
        kv = KVCache.allocate(CFG, NUM_PAGES, 8, jnp.float32)
        logits, kv = run_chunks(CFG, params, kv, [(ids[:16], 0, pages)], 8, **BUCKET)
        rows = list(logits[:16])
        for p in range(16, len(ids)):  # unpadded decode steps: one token, one sequence
            logits, kv = run_chunks(CFG, params, kv, [([ids[p]], p, pages)], 8, num_tokens=1, num_seqs=1,
                                    pages_per_seq=8)
            rows.append(logits[0])
        return np.stack(rows)

    scanned, unrolled = run(params32), run(flat)
    assert rel(unrolled, scanned) < 1e-5, rel(unrolled, scanned)
    assert rel(scanned, dense_logits(cfg, params32, ids)) < 1e-5
