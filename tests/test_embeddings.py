"""Embedding models (`--runner pooling`): against HF transformers, chunked and batched, prefix hits,
Matryoshka cuts, the errors, `LLM.embed`, and `/v1/embeddings` through the OpenAI client.

The tiny model is saved as embedding models ship: the bare backbone (`AutoModel`, tensor names
without `model.`), no vocabulary head although its config is untied.
"""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402

from jaxserve.engine.llm_engine import LLMEngine  # noqa: E402
from jaxserve.engine.model_loading import LoadedModel  # noqa: E402
from jaxserve.engine.pooling_engine import PoolingEngine  # noqa: E402
from jaxserve.engine_args import EngineArgs  # noqa: E402
from jaxserve.loader import CheckpointError  # noqa: E402
from jaxserve.pooling_params import PoolerConfig, PoolingParams  # noqa: E402
from jaxserve.sampling_params import SamplingParams  # noqa: E402
from tests.fake_model import save_fake_tokenizer  # noqa: E402

VOCAB = 64
LENGTHS = (5, 23, 40, 61)  # with a 32-token budget the longer prompts are chunked, beside the others
ARGS = dict(runner="pooling", max_num_batched_tokens=32, max_num_seqs=8, max_model_len=128,
            kv_cache_memory_bytes=1 << 22, compile_cache_dir=None)


def _save_backbone(path, seed: int = 0, config_cls: str = "LlamaConfig", **config) -> object:
    torch.manual_seed(seed)
    cfg = getattr(transformers, config_cls)(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=False, **config)
    model = transformers.AutoModel.from_config(cfg, attn_implementation="eager")
    with torch.no_grad():  # norms away from one, so a skipped final norm shows
        for _, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p)) if p.ndim == 1 else p.normal_(0.0, 0.15)
    model.save_pretrained(path, safe_serialization=True)
    save_fake_tokenizer(path)
    return model.eval()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model directory, the HF backbone)."""
    path = str(tmp_path_factory.mktemp("tiny-embed"))
    return path, _save_backbone(path)


@pytest.fixture(scope="module")
def engines(tiny):
    cache: dict = {}

    def get(kind: str = "LAST", **changes) -> PoolingEngine:
        key = (kind, tuple(sorted(changes.items())))
        if key not in cache:
            cache[key] = LLMEngine(EngineArgs(model=tiny[0], pooler_config={"pooling_type": kind}, **{**ARGS, **changes}),
                                   progress=False)
        return cache[key]
    return get


def prompts(seed: int = 1) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(2, VOCAB, n).tolist() for n in LENGTHS]


def hf_pooled(model, ids: list[int], kind: str, normalize: bool = True) -> np.ndarray:
    with torch.no_grad():
        h = model(torch.tensor([ids])).last_hidden_state[0].double().numpy()
    v = {"LAST": h[-1], "MEAN": h.mean(0), "CLS": h[0]}[kind]
    return v / np.linalg.norm(v) if normalize else v


def embed(engine, items: dict[str, tuple[list[int], PoolingParams]]):
    for rid, (ids, params) in items.items():
        engine.add_request(rid, ids, params)
    out = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            assert o.finished
            out[o.request_id] = o
    engine.check_integrity()
    assert engine.scheduler.kv_cache_usage == 0.0  # every request's pages went back (cached ones count as free)
    return out


@pytest.mark.parametrize("kind", ["LAST", "MEAN", "CLS"])
def test_embeddings_match_hf_chunked_and_batched(engines, tiny, kind):
    engine = engines(kind)
    assert isinstance(engine, PoolingEngine)
    ps = prompts()
    out = embed(engine, {str(i): (p, PoolingParams()) for i, p in enumerate(ps)})
    for i, p in enumerate(ps):
        got = np.array(out[str(i)].outputs.embedding)
        assert got.shape == (64,)
        np.testing.assert_allclose(got, hf_pooled(tiny[1], p, kind), atol=3e-6)
        assert out[str(i)].prompt_token_ids == p
    # Alone, each gives what it gave in the batch.
    alone = embed(engine, {"alone": (ps[3], PoolingParams())})["alone"].outputs.embedding
    np.testing.assert_allclose(alone, out["3"].outputs.embedding, atol=1e-6)


def test_qwen3_backbone_as_qwen3_embedding_ships(tmp_path):
    """Qwen3 (q/k norms, explicit head_dim) saved as its embedding models are: flat names, no head."""
    path = str(tmp_path / "qwen3")
    model = _save_backbone(path, config_cls="Qwen3Config", head_dim=16)
    engine = LLMEngine(EngineArgs(model=path, **ARGS), progress=False)
    assert engine.model.config.family == "qwen3"
    ps = prompts(seed=4)
    out = embed(engine, {str(i): (p, PoolingParams()) for i, p in enumerate(ps)})
    for i, p in enumerate(ps):
        np.testing.assert_allclose(out[str(i)].outputs.embedding, hf_pooled(model, p, "LAST"), atol=3e-6)


def test_last_pooling_reads_cached_prefixes_mean_does_not(engines, tiny):
    p = prompts(seed=2)[3]  # 61 tokens: three full pages of 16 are cached after the first
    last = engines("LAST")
    first = embed(last, {"a": (p, PoolingParams())})["a"]
    again = embed(last, {"b": (p, PoolingParams())})["b"]
    assert first.metrics.num_cached_tokens == 0 and again.metrics.num_cached_tokens == 48
    np.testing.assert_allclose(again.outputs.embedding, first.outputs.embedding, atol=1e-6)
    # A shared prefix with another ending: a hit, and the embedding of the new text.
    other = p[:50] + [3, 4, 5]
    hit = embed(last, {"c": (other, PoolingParams())})["c"]
    assert hit.metrics.num_cached_tokens == 48
    np.testing.assert_allclose(hit.outputs.embedding, hf_pooled(tiny[1], other, "LAST"), atol=3e-6)
    mean = engines("MEAN")
    embed(mean, {"a": (p, PoolingParams())})
    second = embed(mean, {"b": (p, PoolingParams())})["b"]
    assert second.metrics.num_cached_tokens == 0  # every token's hidden state is needed
    np.testing.assert_allclose(second.outputs.embedding, hf_pooled(tiny[1], p, "MEAN"), atol=3e-6)


@pytest.mark.parametrize("kind", ["MEAN", "LAST"])
def test_preempted_and_aborted_requests(engines, tiny, kind):
    """A pool of 6 pages for prompts of 4: chunked prompts preempt each other and are recomputed, with the
    embeddings unchanged (a mean restarts with its prompt); an abort mid-prompt gives its pages back."""
    # 8 KiB a page; chunks of 8 tokens, so the three prompts grow side by side
    engine = engines(kind, kv_cache_memory_bytes=7 * 8192, max_model_len=64, long_prefill_token_threshold=8)
    assert engine.scheduler.pool.num_usable_pages == 6
    rng = np.random.default_rng(7)
    ps = [rng.integers(2, VOCAB, 60).tolist() for _ in range(3)]
    before = engine.num_preemptions
    out = embed(engine, {str(i): (p, PoolingParams()) for i, p in enumerate(ps)})
    assert engine.num_preemptions > before
    for i, p in enumerate(ps):
        np.testing.assert_allclose(out[str(i)].outputs.embedding, hf_pooled(tiny[1], p, kind), atol=3e-6)
    engine.add_request("gone", ps[0], PoolingParams())
    engine.add_request("kept", ps[1], PoolingParams())
    assert engine.step() == []  # the first chunks computed, nothing finished
    aborted = engine.abort_request("gone")
    assert aborted.finished and aborted.outputs is None
    rest = embed(engine, {})
    np.testing.assert_allclose(rest["kept"].outputs.embedding, out["1"].outputs.embedding, atol=1e-6)
    assert engine.abort_request("gone") is None


def test_normalize_truncate_and_dimensions(engines, tiny, tmp_path):
    engine = engines("LAST")
    p = prompts(seed=3)[2]
    out = embed(engine, {"raw": (p, PoolingParams(normalize=False)),
                         "cut": (p, PoolingParams(truncate_prompt_tokens=10))})
    raw = np.array(out["raw"].outputs.embedding)
    np.testing.assert_allclose(raw, hf_pooled(tiny[1], p, "LAST", normalize=False), rtol=1e-5, atol=1e-5)
    assert abs(np.linalg.norm(raw) - 1.0) > 0.1
    assert out["cut"].prompt_token_ids == p[-10:]
    np.testing.assert_allclose(out["cut"].outputs.embedding, hf_pooled(tiny[1], p[-10:], "LAST"), atol=3e-6)
    with pytest.raises(ValueError, match="does not support Matryoshka"):
        engine.add_request("d", p, PoolingParams(dimensions=16))
    # A model that declares Matryoshka embeddings: the first 16 values of the pooled vector, normalized.
    path = str(tmp_path / "mrl")
    _save_backbone(path, matryoshka_dimensions=[16, 32, 64])
    mrl = LLMEngine(EngineArgs(model=path, **ARGS), progress=False)
    got = embed(mrl, {"d": (p, PoolingParams(dimensions=16))})["d"].outputs.embedding
    ref = hf_pooled(tiny[1], p, "LAST", normalize=False)[:16]
    np.testing.assert_allclose(got, ref / np.linalg.norm(ref), atol=3e-6)
    for dims, match in ((24, "not one the model was trained for: 16, 32, 64"), (128, "exceeds the model's")):
        with pytest.raises(ValueError, match=match):
            mrl.add_request("e", p, PoolingParams(dimensions=dims))


def test_refusals_name_the_problem(engines, tiny):
    engine = engines("LAST")
    with pytest.raises(ValueError, match="computes embeddings, not generations"):
        engine.add_request("g", [3, 4], SamplingParams())
    with pytest.raises(ValueError, match="maximum context length is 128 tokens. However, the input has 129"):
        engine.add_request("long", [3] * 129, PoolingParams())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("bad", [3, VOCAB], PoolingParams())
    with pytest.raises(ValueError, match="dimensions must be a positive integer"):
        PoolingParams(dimensions=0)
    # A prompt of exactly max_model_len tokens fits: nothing is generated after it; -1 truncates to that length.
    full = embed(engine, {"full": ([5] * 128, PoolingParams())})["full"]
    assert len(full.outputs.embedding) == 64
    cut = embed(engine, {"cut": ([7] + [5] * 128, PoolingParams(truncate_prompt_tokens=-1))})["cut"]
    assert cut.prompt_token_ids == [5] * 128
    np.testing.assert_allclose(cut.outputs.embedding, full.outputs.embedding, atol=1e-6)  # a prefix-cache hit
    with pytest.raises(ValueError, match="truncate_prompt_tokens 129 exceeds"):
        engine.add_request("over", [5] * 10, PoolingParams(truncate_prompt_tokens=129))
    assert not engine.has_unfinished_requests()
    for args, match in (
        (dict(pooler_config={"pooling_type": "LAST"}), "add runner 'pooling'"),
        (dict(runner="pooling", pooler_config={"pooling_type": "max"}), "pooling_type must be one of LAST, MEAN, CLS"),
        (dict(runner="pooling", pooler_config='{"pooling": "LAST"}'), "unknown keys pooling"),
        (dict(runner="pooling", speculative_config={"method": "ngram"}), "speculative decoding"),
        (dict(runner="pooling", num_processes=2, coordinator_address="127.0.0.1:1"), "runs on one host"),
    ):
        with pytest.raises(ValueError, match=match):
            EngineArgs(**args)


def test_generating_engine_refuses_pooling_and_the_headless_checkpoint(tiny):
    # Generating needs the vocabulary head this checkpoint lacks: the loader names it.
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        LLMEngine(EngineArgs(model=tiny[0], **{**ARGS, "runner": "generate"}), progress=False)
    from tests.fake_model import fake_loaded_model

    gen = LLMEngine(EngineArgs(**{**ARGS, "runner": "generate", "warmup": False}), loaded=fake_loaded_model(),
                    progress=False)
    with pytest.raises(ValueError, match="PoolingParams needs an embedding model"):
        gen.add_request("x", [3, 4], PoolingParams())


def test_sentence_transformers_pooling_config(tmp_path):
    assert PoolerConfig().resolve(str(tmp_path)) == PoolerConfig("LAST", True)
    (tmp_path / "1_Pooling").mkdir()
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
         "pooling_mode_max_tokens": False, "pooling_mode_lasttoken": False}))
    assert PoolerConfig().resolve(str(tmp_path)) == PoolerConfig("MEAN", False)
    assert PoolerConfig(normalize=True).resolve(str(tmp_path)) == PoolerConfig("MEAN", True)
    assert PoolerConfig("cls").resolve(str(tmp_path)) == PoolerConfig("CLS", False)
    modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    assert PoolerConfig().resolve(str(tmp_path)) == PoolerConfig("MEAN", True)
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match="pooling_mode_max_tokens; jaxserve pools with one of"):
        PoolerConfig().resolve(str(tmp_path))


def test_llm_embed_and_openai_client(tiny):
    import openai

    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.llm import LLM
    from server.config import ServerConfig
    from server.runner import serve_in_thread

    llm = LLM(tiny[0], **{k: v for k, v in ARGS.items()}, progress=False)
    texts = ["t5 t6 t7", "t9 t9 t10 t11 t12"]
    outs = llm.embed(texts + [{"prompt_token_ids": [4, 5, 6]}], use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [[5, 6, 7], [9, 9, 10, 11, 12], [4, 5, 6]]
    for o in outs:
        np.testing.assert_allclose(o.outputs.embedding, hf_pooled(tiny[1], o.prompt_token_ids, "LAST"), atol=3e-6)
    with pytest.raises(ValueError, match="not generations"):
        llm.generate("t5", SamplingParams(max_tokens=2), use_tqdm=False)
    scored = llm.score(texts[0], [texts[1], texts[0]], use_tqdm=False)
    cos = float(np.dot(outs[0].outputs.embedding, outs[1].outputs.embedding))
    np.testing.assert_allclose([s.outputs.score for s in scored], [cos, 1.0], atol=1e-6)
    assert scored[0].prompt_token_ids == [5, 6, 7, 9, 9, 10, 11, 12]
    with pytest.raises(ValueError, match="text_1 has 2 texts and text_2 3"):
        llm.score(texts, texts + texts[:1], use_tqdm=False)
    engine = AsyncEngine(llm.engine)
    try:
        with serve_in_thread(engine, ServerConfig(port=0)) as srv:
            client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)
            # The client asks for base64 by default and decodes it.
            r = client.embeddings.create(model=srv.state.model_name, input=texts + [[4, 5, 6]])
            assert [d.index for d in r.data] == [0, 1, 2]
            for d, o in zip(r.data, outs, strict=True):
                np.testing.assert_allclose(d.embedding, o.outputs.embedding, atol=1e-7)
            assert r.usage.prompt_tokens == r.usage.total_tokens == 11
            import httpx

            body = {"input": "t5 t6 t7", "encoding_format": "float", "truncate_prompt_tokens": 2}
            j = httpx.post(f"{srv.url}/v1/embeddings", json=body).json()
            np.testing.assert_allclose(j["data"][0]["embedding"], hf_pooled(tiny[1], [6, 7], "LAST"), atol=3e-6)
            assert j["object"] == "list" and j["usage"]["prompt_tokens"] == 2
            b64 = httpx.post(f"{srv.url}/v1/embeddings", json={"input": [4, 5, 6], "encoding_format": "base64"}).json()
            vec = np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), "<f4")
            np.testing.assert_allclose(vec, outs[2].outputs.embedding, atol=0)
            for bad, param, status in (({"input": ""}, "input", 400), ({"input": [3] * 129}, "input", 400),
                                       ({"input": "t5", "dimensions": 8}, None, 400),
                                       ({"input": "t5", "encoding_format": "hex"}, "encoding_format", 400),
                                       ({"input": "t5", "temperature": 1}, "temperature", 400),
                                       ({}, "input", 400), ({"input": "t5", "model": "other"}, "model", 404)):
                resp = httpx.post(f"{srv.url}/v1/embeddings", json=bad)
                assert resp.status_code == status, (bad, resp.text)
                assert resp.json()["error"]["param"] == param, (bad, resp.text)
            refused = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "t5", "max_tokens": 2})
            assert refused.status_code == 400 and "not generations" in refused.json()["error"]["message"]
            traced = httpx.post(f"{srv.url}/v1/embeddings", json={"input": "t5"}, headers={"x-request-id": "emb-1"})
            assert traced.status_code == 200
            events = [(r["layer"], r["event"]) for r in httpx.get(f"{srv.url}/v1/requests/emb-1/trace").json()["records"]]
            assert events == [("L1", "received"), ("L4", "queued"), ("L4", "finished")]
            # Score and rerank: cosines of the embeddings LLM.embed gave.
            unit = [np.asarray(o.outputs.embedding) for o in outs[:2]]
            cos = float(unit[0] @ unit[1])
            sc = httpx.post(f"{srv.url}/score", json={"text_1": texts[0], "text_2": [texts[1], texts[0]]}).json()
            assert [d["index"] for d in sc["data"]] == [0, 1] and sc["data"][0]["object"] == "score"
            np.testing.assert_allclose([d["score"] for d in sc["data"]], [cos, 1.0], atol=1e-6)
            assert sc["usage"]["prompt_tokens"] == 8  # each distinct text embedded once
            pairs = httpx.post(f"{srv.url}/v1/score", json={"text_1": texts, "text_2": texts[::-1]}).json()
            np.testing.assert_allclose([d["score"] for d in pairs["data"]], [cos, cos], atol=1e-6)
            docs = ["t30 t31", texts[0], {"text": texts[1]}, "t5 t6 t8"]
            rr = httpx.post(f"{srv.url}/v1/rerank", json={"query": texts[0], "documents": docs, "top_n": 3}).json()
            ranked = [r["index"] for r in rr["results"]]
            assert len(ranked) == 3 and ranked[0] == 1 and rr["results"][0]["document"] == {"text": texts[0]}
            got = [r["relevance_score"] for r in rr["results"]]
            assert got == sorted(got, reverse=True) and got[0] == pytest.approx(1.0, abs=1e-6)
            everything = httpx.post(f"{srv.url}/rerank", json={"query": texts[0], "documents": docs,
                                                               "return_documents": False}).json()["results"]
            assert len(everything) == 4 and "document" not in everything[0]
            np.testing.assert_allclose(next(r["relevance_score"] for r in everything if r["index"] == 2), cos,
                                       atol=1e-6)
            for path, bad, param in (("/score", {"text_1": ["t5", "t6"], "text_2": ["t7"]}, "text_2"),
                                     ("/score", {"text_1": "t5"}, "text_2"),
                                     ("/rerank", {"query": "t5", "documents": []}, "documents"),
                                     ("/rerank", {"query": ["t5"], "documents": ["t6"]}, "query"),
                                     ("/rerank", {"query": "t5", "documents": ["t6"], "top_n": -1}, "top_n")):
                resp = httpx.post(f"{srv.url}{path}", json=bad)
                assert resp.status_code == 400 and resp.json()["error"]["param"] == param, (path, bad, resp.text)
            metrics = httpx.get(f"{srv.url}/metrics").text
            assert 'vllm:request_success_total{finished_reason="stop"' in metrics
    finally:
        engine.shutdown()
    llm.engine.check_integrity()


def test_real_model_embeddings_equal_hf(smollm_path, smollm_f32, hf_smollm, chat_prompt_ids):
    """SmolLM2 as an embedding model: last-token and mean pooling equal transformers' hidden states."""
    from jaxserve.tokenizer import Tokenizer

    cfg, params = smollm_f32
    loaded = LoadedModel(smollm_path, "SmolLM2-135M-Instruct", cfg, params, Tokenizer.from_gguf(smollm_path),
                         jnp.float32, 0.0)
    model, _ = hf_smollm
    ids = chat_prompt_ids[:3]
    for kind in ("LAST", "MEAN"):
        engine = LLMEngine(EngineArgs(runner="pooling", pooler_config={"pooling_type": kind}, dtype="float32",
                                      max_num_batched_tokens=32, max_num_seqs=4, max_model_len=256,
                                      kv_cache_memory_bytes=16 << 20, layer_loop="scan"), loaded=loaded, progress=False)
        out = embed(engine, {str(i): (p, PoolingParams()) for i, p in enumerate(ids)})
        for i, p in enumerate(ids):
            with torch.no_grad():
                h = model.model(torch.tensor([p])).last_hidden_state[0].double().numpy()
            ref = h[-1] if kind == "LAST" else h.mean(0)
            got = np.array(out[str(i)].outputs.embedding)
            cos = float(got @ ref / np.linalg.norm(ref))
            assert cos > 0.99999, (kind, i, cos)
            np.testing.assert_allclose(got, ref / np.linalg.norm(ref), atol=2e-4)


def test_bench_embed_does_the_work_it_reports(tiny, monkeypatch):
    import bench.embed
    from bench.embed import EmbedConfig, format_report, run_embed

    # The tiny model's word-level vocabulary (t2 ... t63) cannot spell the workloads' texts: texts of its words,
    # each starting with its own word so that no two share a cached page.
    rng = np.random.default_rng(5)
    texts = [" ".join(f"t{t}" for t in [10 + i, *rng.integers(2, VOCAB, 15 + 3 * i)]) for i in range(6)]
    monkeypatch.setattr(bench.embed, "_texts", lambda spec, tok, n: texts[:n])
    cfg = EmbedConfig(batch_sizes=(1, 6), repeats=2, hf_peer=True)
    result = run_embed(EngineArgs(model=tiny[0], **ARGS), cfg, progress=False, log=lambda _m: None)
    assert [r["batch"] for r in result["runs"]] == [1, 6]
    for r in result["runs"]:
        assert r["cached_tokens"] == 0  # no run reuses another's pages
        assert r["prompt_tokens"] >= 15 * r["batch"] and len(r["seconds"]) == 2
        assert r["min_cosine_vs_hf"] > 0.99999  # both systems computed the same embeddings
    assert result["compilations_after_warmup"] == 0
    assert "| 6 |" in format_report(result)
