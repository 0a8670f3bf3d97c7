"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5: `config_mla.DSA_FAMILIES`, `models.sparse_mla`).

The sparse attention (in XLA and on the sparse latent kernel) against a numpy reference (every key scored, the best
ones attended) over ragged batches of random pages; tiny random models of both families against transformers with a
top-k of 6 keys a token, so prompts of 21-40 tokens attend sparsely (the logits of the dense attention are far from
transformers'): logits, the engine's greedy tokens (chunked prefill, batched decode reading the indexer keys back from
the pages, layers unrolled and scanned, the xla backend and the Pallas one), a prefix hit against a miss, the
checkpoint written back; the released configs' page entries.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import ModelConfig, UnsupportedModelError
from jaxserve.models.inputs import KVCache
from jaxserve.models.kv_pages import kv_storage_bits
from jaxserve.models.sparse_mla import sparse_mla_attention


def _reference(q, iq, iw, pool, tables, seq_lens, qsl, key_dim, value_dim, topk, sm_scale):
    """Per token, in numpy: every key it sees scored, the `topk` best attended (a pool of one KV head)."""
    T, Hq, _ = q.shape
    Di = pool.shape[-1] - key_dim
    out = np.zeros((T, Hq, value_dim), np.float32)
    for s in range(len(seq_lens)):
        lo, hi = qsl[s], qsl[s + 1]
        entries = pool[tables[s]].reshape(-1, pool.shape[-1])[: seq_lens[s]]
        for t in range(lo, hi):
            pos = seq_lens[s] - (hi - t)
            keys = entries[: pos + 1]
            scores = (iw[t][:, None] * np.maximum(iq[t] @ keys[:, key_dim:].T * Di ** -0.5, 0)).sum(0)
            chosen = np.argsort(-scores, kind="stable")[:topk]
            logits = (q[t] @ keys[chosen, :key_dim].T) * sm_scale
            p = np.exp(logits - logits.max(-1, keepdims=True))
            out[t] = (p / p.sum(-1, keepdims=True)) @ keys[chosen, :value_dim]
    return out


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("kv_heads,backend", [(1, "xla"), (2, "xla"), (1, "pallas_interpret"), (2, "pallas_interpret")])
def test_sparse_attention_matches_reference(dtype, kv_heads, backend):
    """A mixed batch (a prompt chunk after a cached prefix, a whole prompt, two decode tokens; one sequence shorter
    than the top-k) over shuffled pages of 4; pools in the engine's forms (on xla bfloat16 as its bits; one entry
    copied to each KV head); the attention in XLA and on the sparse latent kernel."""
    rng = np.random.default_rng(0)
    key_dim, value_dim, Di, Hq, Hi, topk, page_size = 12, 8, 16, 4, 3, 5, 4  # (latent 8, rotary 4: powers of two)
    seq_lens, q_lens = np.array([19, 9, 23, 3]), np.array([7, 9, 1, 1])
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    T = int(qsl[-1]) + 3  # (padding tokens)
    pages = rng.permutation(np.arange(1, 40))
    tables = np.zeros((4, 8), np.int32)
    for s, n in enumerate(-(-seq_lens // page_size)):
        tables[s, :n], pages = pages[:n], pages[n:]
    pool = rng.normal(size=(40, page_size, key_dim + Di)).astype(np.float32)
    q = rng.normal(size=(T, Hq, key_dim)).astype(np.float32)
    iq, iw = rng.normal(size=(T, Hi, Di)).astype(np.float32), rng.normal(size=(T, Hi)).astype(np.float32)
    pool, q, iq = (np.asarray(jnp.asarray(x, dtype).astype(jnp.float32)) for x in (pool, q, iq))
    want = _reference(q, iq, iw, pool, tables, seq_lens, qsl, key_dim, value_dim, topk, 0.3)
    stored = jnp.broadcast_to(jnp.asarray(pool, dtype)[:, :, None], (40, page_size, kv_heads, key_dim + Di))
    stored = stored[:, :, 0] if kv_heads == 1 else stored
    bits = kv_storage_bits(dtype) if backend == "xla" else None
    if bits is not None:
        stored = jax.lax.bitcast_convert_type(stored, bits)
    got = sparse_mla_attention(jnp.asarray(q, dtype), jnp.asarray(iq, dtype), jnp.asarray(iw), stored,
                               jnp.asarray(tables), jnp.asarray(seq_lens, jnp.int32), jnp.asarray(qsl),
                               key_dim=key_dim, value_dim=value_dim, topk=topk, sm_scale=0.3,
                               kv_dtype=None if bits is None else dtype, backend=backend)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got[: qsl[-1]], np.float32), want[: qsl[-1]], atol=tol, rtol=tol)
    assert not np.asarray(got[qsl[-1]:]).any()  # padding tokens: zero
    # The choice matters: attending all keys (a top-k past every length) gives other outputs.
    dense = _reference(q, iq, iw, pool, tables, seq_lens, qsl, key_dim, value_dim, 64, 0.3)
    assert np.abs(dense[: qsl[-1]] - want[: qsl[-1]]).max() > 0.1


def test_released_configs_parse():
    """DeepSeek-V3.2's config.json fields and transformers' GLM-5 defaults: 704-wide page entries (latent 512,
    rotary key 64, indexer key 128), top-2048 keys a token."""
    pytest.importorskip("torch")
    from tests.test_mla import DEEPSEEK_V3

    v32 = ModelConfig.from_hf({**DEEPSEEK_V3, "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
                               "index_n_heads": 64, "index_head_dim": 128, "index_topk": 2048})
    assert (v32.kv_cache_dims, v32.index_heads, v32.index_head_dim, v32.index_topk) == ((704, 0), 64, 128, 2048)
    assert (v32.router_scoring, v32.expert_groups, v32.expert_topk_groups, v32.first_dense_layers) == (
        "sigmoid", 8, 4, 3)
    assert KVCache.bytes_per_page(v32, 64, jnp.bfloat16) == 61 * 64 * 704 * 2
    transformers = pytest.importorskip("transformers")
    glm5 = ModelConfig.from_hf(transformers.GlmMoeDsaConfig().to_dict())
    assert (glm5.family, glm5.kv_cache_dims, glm5.index_heads, glm5.num_layers) == ("glm_moe_dsa", (704, 0), 32, 78)
    assert ModelConfig.from_hf(glm5.to_hf()) == glm5


def test_refusals():
    transformers = pytest.importorskip("transformers")
    d = transformers.GlmMoeDsaConfig(num_hidden_layers=4).to_dict()
    for types in (["shared", "full", "full", "full"], ["full", "full", "full"], ["full", "skip", "full", "full"]):
        with pytest.raises(UnsupportedModelError, match="indexer_types"):
            ModelConfig.from_hf({**d, "indexer_types": types})
    with pytest.raises(UnsupportedModelError, match="indexer_types"):  # (DeepSeek-V3.2's indexers all choose)
        ModelConfig.from_hf({**d, "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
                             "indexer_types": ["full", "shared", "full", "full"]})
    # GLM-5.2's config.json: the layer types from a frequency and an offset (of 78 layers, 21 choose)
    released = {k: v for k, v in d.items() if k != "indexer_types"} | dict(
        num_hidden_layers=8, index_topk_freq=4, index_skip_topk_offset=3)
    shared = ModelConfig.from_hf(released)
    assert shared.index_shared_layers == (3, 4, 5, 7) and ModelConfig.from_hf(shared.to_hf()) == shared
    assert len(ModelConfig.from_hf(released | dict(num_hidden_layers=78)).index_shared_layers) == 78 - 21
    with pytest.raises(UnsupportedModelError, match="index_shared_layers"):
        dataclasses.replace(shared, index_shared_layers=(0, 1))
    with pytest.raises(UnsupportedModelError, match="mlp_layer_types"):
        ModelConfig.from_hf({**d, "mlp_layer_types": ["dense", "sparse", "dense", "sparse"]})
    with pytest.raises(UnsupportedModelError, match="q_lora_rank"):
        ModelConfig.from_hf({**d, "q_lora_rank": None})
    cfg = ModelConfig.from_hf(d)
    with pytest.raises(UnsupportedModelError, match="indexer"):
        dataclasses.replace(cfg, index_topk=0)
    with pytest.raises(UnsupportedModelError, match="indexer"):
        dataclasses.replace(cfg, index_head_dim=cfg.rotary_dims - 2)


_TINY = dict(num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
             v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
             first_k_dense_replace=1, num_hidden_layers=3, n_group=2, topk_group=1, routed_scaling_factor=2.5,
             index_n_heads=8, index_head_dim=16, index_topk=6)
# GLM-5.2's IndexShare: layers 1 and 2 reuse layer 0's choice of keys (the first dense, the next in the MoE stack),
# layer 3 chooses its own.
SHARED = dict(num_hidden_layers=4, index_topk_freq=3, index_skip_topk_offset=1)
FAMILIES = {"deepseek_v32": ("DeepseekV32Config", {}), "glm_moe_dsa": ("GlmMoeDsaConfig", {}),
            "glm_index_share": ("GlmMoeDsaConfig", SHARED)}


@pytest.fixture(scope="module", params=list(FAMILIES))
def tiny_dsa(request, tmp_path_factory):
    """(family, checkpoint path, transformers' model, our config, our params)."""
    pytest.importorskip("torch")
    from jaxserve.loader import HFDirectory, load_params
    from tests.test_model_families import save_tiny_hf

    path = tmp_path_factory.mktemp(request.param)
    config_cls, overrides = FAMILIES[request.param]
    model = save_tiny_hf(config_cls, path, **_TINY | overrides)
    ckpt = HFDirectory(path)
    cfg = ckpt.config()
    return request.param, path, model, cfg, load_params(ckpt, cfg, jnp.float32, progress=False)


def test_dsa_logits_match_transformers(tiny_dsa):
    from tests.modelrun import prompt_logits
    from tests.test_model_families import hf_logits, random_prompt, rel_err

    family, _, model, cfg, params = tiny_dsa
    assert (cfg.family, cfg.kv_cache_dims, cfg.index_topk) == (family.replace("glm_index_share", "glm_moe_dsa"),
                                                               (56, 0), 6)
    assert cfg.index_shared_layers == ((1, 2) if family == "glm_index_share" else ())
    ids = random_prompt()
    ours, ref = prompt_logits(cfg, params, ids), hf_logits(model, ids)
    assert rel_err(ours, ref) < 1e-4
    # What the test would miss otherwise: the keys the indexer leaves out; a shared layer choosing its own.
    assert rel_err(prompt_logits(dataclasses.replace(cfg, index_topk=64), params, ids), ref) > 1e-3
    if family == "glm_index_share":
        assert rel_err(prompt_logits(dataclasses.replace(cfg, index_shared_layers=(1,)), params, ids), ref) > 1e-3
        # The Pallas backends' choice (the indexer kernel, interpreted), carried alike.
        assert rel_err(prompt_logits(cfg, params, ids, backend="pallas_interpret"), ref) < 1e-4


def test_dsa_checkpoint_written_back_reads_the_same(tiny_dsa):
    """Our parameters as an HF checkpoint (GLM-5's indexer rows interleaved again) equal the checkpoint's own."""
    from tests.test_model_families import assert_written_back

    _, path, _, cfg, params = tiny_dsa
    assert_written_back(path, cfg, params)
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg


def test_dsa_engine_greedy_equals_transformers(tiny_dsa):
    """Chunked prefill (21 tokens: 16 + 5) and batched decode over the pages' indexer keys, layers unrolled
    (DeepSeek-V3.2, GLM-5.2's IndexShare) and scanned (GLM-5), and on the Pallas backend: transformers' tokens."""
    from tests.modelrun import tiny_engine
    from tests.test_engine_gemma import NEW_TOKENS, PROMPTS, _greedy, hf_greedy

    family, _, model, cfg, params = tiny_dsa
    expected = [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    assert _greedy(tiny_engine(cfg, params, "scan" if family == "glm_moe_dsa" else "unroll")) == expected
    if family == "deepseek_v32":  # the sparse latent kernel (interpreted; GLM-5's attention is V3.2's)
        assert _greedy(tiny_engine(cfg, params, "scan", backend="pallas_interpret")) == expected


@pytest.mark.parametrize("tiny_dsa", ["deepseek_v32"], indirect=True)  # (GLM-5's sparse attention is V3.2's)
def test_dsa_prefix_hit_equals_miss(tiny_dsa):
    """A prompt whose first two pages come from the prefix cache (their indexer keys too) gives a cold engine's
    tokens."""
    from tests.test_mla import prefix_hit_equals_miss

    _, _, _, cfg, params = tiny_dsa
    prefix_hit_equals_miss(cfg, params)
