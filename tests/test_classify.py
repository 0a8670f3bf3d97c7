"""Sequence classification models and cross-encoders (`*ForSequenceClassification`, `--runner pooling`):
class probabilities against HF transformers, chunked and batched; a cross-encoder's pair scores against
HF on the tokenizer's pair encoding; `LLM.classify` and `LLM.score`; `/classify`, `/score` and `/rerank`
over HTTP; and the refusals."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import tokenizers  # noqa: E402

from jaxserve.config import UnsupportedModelError  # noqa: E402
from jaxserve.engine.llm_engine import LLMEngine  # noqa: E402
from jaxserve.engine_args import EngineArgs  # noqa: E402
from jaxserve.llm import LLM  # noqa: E402
from jaxserve.pooling_params import PoolerConfig, PoolingParams  # noqa: E402
from jaxserve.sampling_params import SamplingParams  # noqa: E402
from tests.fake_model import EOS, fake_tokenizer  # noqa: E402

VOCAB = 64
ARGS = dict(runner="pooling", max_num_batched_tokens=32, max_num_seqs=8, max_model_len=128,
            kv_cache_memory_bytes=1 << 22, compile_cache_dir=None)
LABELS = {0: "negative", 1: "neutral", 2: "positive"}
SCORE_TEMPLATE = ("{% for m in messages %}{% if m.role == 'query' %}t20 {{ m.content }} {% else %}t21 {{ m.content }}"
                  "{% endif %}{% endfor %}")


def _save(path: str, config_cls: str, model_cls: str, seed: int, **config) -> object:
    """A random `*ForSequenceClassification` model with the fake tokenizer (whose pair template puts <eos>
    between the two texts), saved as such checkpoints ship."""
    torch.manual_seed(seed)
    cfg = getattr(transformers, config_cls)(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                            pad_token_id=0, **config)
    model = getattr(transformers, model_cls)(cfg)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p)) if p.ndim == 1 else p.normal_(0.0, 0.15)
    model.save_pretrained(path, safe_serialization=True)
    backend = fake_tokenizer()._backend
    backend.post_processor = tokenizers.processors.TemplateProcessing(
        single="$A", pair="$A <eos> $B:1", special_tokens=[("<eos>", EOS)])
    backend.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<eos>", "pad_token": "<pad>"}, f)
    return model.eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{"labels": (path, HF model) of a 3-label Llama classifier, "cross": a 1-label Qwen2 cross-encoder}."""
    root = tmp_path_factory.mktemp("classify")
    return {"labels": (str(root / "labels"), _save(str(root / "labels"), "LlamaConfig", "LlamaForSequenceClassification",
                                                   0, num_labels=3, id2label=LABELS,
                                                   label2id={v: k for k, v in LABELS.items()})),
            "cross": (str(root / "cross"), _save(str(root / "cross"), "Qwen2Config", "Qwen2ForSequenceClassification",
                                                 1, num_labels=1))}


@pytest.fixture(scope="module")
def engines(models):
    return {k: LLMEngine(EngineArgs(model=path, **ARGS), progress=False) for k, (path, _) in models.items()}


def _hf_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double().numpy()


def _classify(engine, prompts: list[list[int]], params: PoolingParams | None = None) -> list[list[float]]:
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params or PoolingParams())
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o.outputs.probs) for o in engine.step())
    engine.check_integrity()
    assert engine.scheduler.pool.num_free == engine.scheduler.pool.num_usable_pages - engine.scheduler.cache.num_cached_pages
    return [done[str(i)] for i in range(len(prompts))]


def _llm_over(engine) -> LLM:
    """`LLM`'s API over an engine the fixture already built (and warmed up)."""
    llm = LLM.__new__(LLM)
    llm.engine, llm._ids = engine, iter(range(10**6))
    return llm


def _prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(2, VOCAB, n).tolist()


def test_probabilities_equal_hf_chunked_and_batched(models, engines):
    """Softmax over the labels of the last token's score, as HF's LlamaForSequenceClassification: prompts of
    5 to 61 tokens in one batch (the longer chunked by the 32-token budget), and each alone."""
    engine, hf = engines["labels"], models["labels"][1]
    prompts = [_prompt(n, n) for n in (5, 23, 40, 61)]
    batched = _classify(engine, prompts)
    for ids, probs in zip(prompts, batched, strict=True):
        z = _hf_logits(hf, ids)
        want = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
        np.testing.assert_allclose(probs, want, atol=2e-6)
        assert abs(sum(probs) - 1.0) < 1e-5
    np.testing.assert_allclose(_classify(engine, prompts[2:3]), batched[2:3], atol=1e-6)  # alone, on a prefix hit
    logits = _classify(engine, prompts[:1], PoolingParams(activation=False))[0]
    np.testing.assert_allclose(logits, _hf_logits(hf, prompts[0]), atol=2e-5)
    assert engine.classifier.labels == ("negative", "neutral", "positive")


def test_cross_encoder_scores_pairs_as_hf(models, engines):
    """A one-label model scores a pair read as one input: the tokenizer's pair encoding, sigmoid of the logit."""
    engine, (path, hf) = engines["cross"], models["cross"]
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=os.path.join(path, "tokenizer.json"))
    query, docs = "t5 t6 t7", ["t5 t6 t8 t9", "t20 t21", "t7 t6 t5 t4 t3"]
    pair_ids = [engine.tokenizer.encode_pair(query, d) for d in docs]
    assert pair_ids == [hf_tok(query, d)["input_ids"] for d in docs]
    assert EOS in pair_ids[0] and pair_ids[0][:3] == engine.tokenizer.encode(query)
    got = _classify(engine, pair_ids)
    want = [1 / (1 + np.exp(-_hf_logits(hf, ids)[0])) for ids in pair_ids]
    np.testing.assert_allclose([g[0] for g in got], want, atol=2e-6)
    scored = _llm_over(engine).score(query, docs, use_tqdm=False)
    np.testing.assert_allclose([s.outputs.score for s in scored], want, atol=2e-6)
    assert scored[0].prompt_token_ids == pair_ids[0]


def test_a_causal_lm_as_a_reranker_from_two_tokens(tmp_path):
    """vLLM's `--hf-overrides` for Qwen3-Reranker: a Qwen3ForCausalLM checkpoint, its LM head's logits of
    "no" and "yes" (here t5, t6) after the prompt, the score sigmoid(yes - no): HF's softmax over the two."""
    from tests.test_model_families import save_tiny_hf

    path = str(tmp_path)
    hf = save_tiny_hf("Qwen3Config", path, vocab_size=VOCAB, tie_word_embeddings=False, head_dim=16)
    backend = fake_tokenizer()._backend
    backend.post_processor = tokenizers.processors.TemplateProcessing(
        single="$A", pair="$A <eos> $B:1", special_tokens=[("<eos>", EOS)])
    backend.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<eos>"}, f)
    overrides = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["t5", "t6"],
                 "is_original_qwen3_reranker": True}
    llm = LLM(path, **ARGS, hf_overrides=json.dumps(overrides), progress=False)
    query, docs = "t9 t10", ["t11 t12 t13", "t9 t10 t9"]
    scores = [s.outputs.score for s in llm.score(query, docs, use_tqdm=False)]
    with torch.no_grad():
        want = []
        for d in docs:
            z = hf(torch.tensor([llm.get_tokenizer().encode_pair(query, d)])).logits[0, -1].double()
            want.append(float(torch.softmax(z[[5, 6]], 0)[1]))
    np.testing.assert_allclose(scores, want, atol=2e-6)
    # With a score template (vLLM's form: a chat template over the roles "query" and "document").
    templated = [s.outputs.score for s in llm.score(query, docs, use_tqdm=False, chat_template=SCORE_TEMPLATE)]
    with torch.no_grad():
        for d, got in zip(docs, templated, strict=True):
            ids = [20, *llm.get_tokenizer().encode(query), 21, *llm.get_tokenizer().encode(d)]
            z = hf(torch.tensor([ids])).logits[0, -1].double()
            assert abs(got - float(torch.softmax(z[[5, 6]], 0)[1])) < 2e-6
    assert templated != scores
    three = LLMEngine(EngineArgs(model=path, **{**ARGS, "warmup": False}, hf_overrides={
        **overrides, "classifier_from_token": ["t5", "t6", "t7"]}), progress=False)
    ids = _prompt(9, 4)
    probs = _classify(three, [ids])[0]
    with torch.no_grad():
        z = hf(torch.tensor([ids])).logits[0, -1].double()
    np.testing.assert_allclose(probs, torch.softmax(z[[5, 6, 7]], 0).numpy(), atol=2e-6)
    assert three.classifier.labels == ("t5", "t6", "t7")
    one = LLMEngine(EngineArgs(model=path, **{**ARGS, "warmup": False}, hf_overrides={
        "architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["t6"],
        "method": "no_post_processing"}), progress=False)  # bge-reranker-v2-gemma's form: one token's logit
    np.testing.assert_allclose(_classify(one, [ids])[0], [1 / (1 + np.exp(-float(z[6])))], atol=2e-6)
    with pytest.raises(ValueError, match="'t99' is not a token of the model's vocabulary"):
        LLMEngine(EngineArgs(model=path, **{**ARGS, "warmup": False}, hf_overrides={
            **overrides, "classifier_from_token": ["t5", "t99"]}), progress=False)
    with pytest.raises(ValueError, match="hf_overrides must be a JSON object"):
        EngineArgs(hf_overrides="[1]")


def test_refusals_name_the_problem(models, engines):
    labels, cross = engines["labels"], engines["cross"]
    with pytest.raises(ValueError, match="it classifies, it does not embed"):
        labels.add_request("e", [3, 4], PoolingParams(task="embed"))
    with pytest.raises(ValueError, match="dimensions applies to embeddings"):
        labels.add_request("d", [3, 4], PoolingParams(dimensions=8))
    with pytest.raises(ValueError, match="classifies into 3 labels; scoring needs a cross-encoder"):
        _llm_over(labels).score("t3", "t4", use_tqdm=False)
    with pytest.raises(UnsupportedModelError, match="sequence classification model .*serve it with --runner pooling"):
        LLMEngine(EngineArgs(model=models["labels"][0], **{**ARGS, "runner": "generate"}), progress=False)
    with pytest.raises(ValueError, match="classifies the last token's hidden state as it is"):
        EngineArgs(model=models["cross"][0], **ARGS, pooler_config=PoolerConfig("MEAN")).pooler_config_for(
            models["cross"][0])
    assert cross.classifier.is_cross_encoder and cross.classifier.activation == "sigmoid"
    assert not labels.has_unfinished_requests()


def test_embedding_model_refuses_classify(tmp_path):
    from tests.test_embeddings import _save_backbone

    _save_backbone(str(tmp_path))
    engine = LLMEngine(EngineArgs(model=str(tmp_path), **{**ARGS, "warmup": False}), progress=False)
    assert engine.classifier is None
    with pytest.raises(ValueError, match="is an embedding model, not a sequence classification model"):
        engine.add_request("c", [3, 4], PoolingParams(task="classify"))
    with pytest.raises(ValueError, match="this engine generates|embedding model"):
        engine.add_request("g", [3, 4], SamplingParams())


def test_classify_score_and_rerank_over_http(models, engines):
    import httpx

    from jaxserve.engine.async_engine import AsyncEngine
    from server.config import ServerConfig
    from server.runner import serve_in_thread

    ids = _prompt(12, 3)
    want = _classify(engines["labels"], [ids])[0]
    served = AsyncEngine(engines["labels"])
    try:
        with serve_in_thread(served, ServerConfig(port=0)) as srv:
            r = httpx.post(f"{srv.url}/classify", json={"input": [ids, ids[:4]]})
            assert r.status_code == 200, r.text
            body = r.json()
            first = body["data"][0]
            np.testing.assert_allclose(first["probs"], want, atol=1e-6)
            assert first["num_classes"] == 3 and first["label"] == LABELS[int(np.argmax(want))]
            assert body["usage"]["prompt_tokens"] == 16 and body["object"] == "list"
            raw = httpx.post(f"{srv.url}/v1/classify", json={"input": ids, "activation": False}).json()
            np.testing.assert_allclose(raw["data"][0]["probs"], _hf_logits(models["labels"][1], ids), atol=2e-5)
            emb = httpx.post(f"{srv.url}/v1/embeddings", json={"input": "t3 t4"})
            assert emb.status_code == 400 and "it does not embed" in emb.text
            bad = httpx.post(f"{srv.url}/score", json={"text_1": "t3", "text_2": "t4"})
            assert bad.status_code == 400 and "scoring needs a cross-encoder" in bad.text
    finally:
        served.shutdown()
    engine = engines["cross"]
    query, docs = "t5 t6 t7", ["t20 t21", "t5 t6 t8 t9"]
    pairs = [engine.tokenizer.encode_pair(query, d) for d in docs]
    scores = [p[0] for p in _classify(engine, pairs)]
    # Before the engine is served: once it is, only the server's engine thread may step it.
    want = _llm_over(engine).score(query, docs, use_tqdm=False, chat_template=SCORE_TEMPLATE)
    served = AsyncEngine(engine)
    try:
        with serve_in_thread(served, ServerConfig(port=0)) as srv:
            r = httpx.post(f"{srv.url}/v1/score", json={"text_1": query, "text_2": docs}).json()
            np.testing.assert_allclose([d["score"] for d in r["data"]], scores, atol=1e-6)
            assert r["usage"]["prompt_tokens"] == sum(map(len, pairs))
            ranked = httpx.post(f"{srv.url}/rerank", json={"query": query, "documents": docs}).json()["results"]
            assert [x["index"] for x in ranked] == sorted(range(2), key=lambda i: -scores[i])
            np.testing.assert_allclose([x["relevance_score"] for x in ranked], sorted(scores, reverse=True), atol=1e-6)
            cls = httpx.post(f"{srv.url}/classify", json={"input": "t3 t4"}).json()["data"][0]
            assert cls["num_classes"] == 1 and cls["label"] == "LABEL_0" and 0 < cls["probs"][0] < 1
        with serve_in_thread(served, ServerConfig(port=0, chat_template=SCORE_TEMPLATE)) as srv:
            r = httpx.post(f"{srv.url}/score", json={"text_1": query, "text_2": docs}).json()
            np.testing.assert_allclose([d["score"] for d in r["data"]], [w.outputs.score for w in want], atol=1e-6)
            assert [d["score"] for d in r["data"]] != scores
    finally:
        served.shutdown()
