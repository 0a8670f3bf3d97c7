"""LoRA adapters: against HF PEFT (the adapters are PEFT's own files), several adapters and the base model
in one batch, chunked prompts, prefix caches kept apart per adapter, loading on first use, refusals, and
adapters served as models over HTTP."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from jaxserve.engine.kv_events import hash_token_pages  # noqa: E402
from jaxserve.engine.llm_engine import LLMEngine  # noqa: E402
from jaxserve.engine.lora_manager import LoRAError  # noqa: E402
from jaxserve.engine_args import EngineArgs  # noqa: E402
from jaxserve.lora_request import LoRARequest, lora_cache_salt  # noqa: E402
from jaxserve.sampling_params import SamplingParams  # noqa: E402
from tests.fake_model import save_fake_tokenizer  # noqa: E402
from tests.modelrun import drain  # noqa: E402
from tests.test_mimo import TINY as MIMO  # noqa: E402
from tests.test_model_families import save_tiny_hf  # noqa: E402

VOCAB = 64
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ARGS = dict(max_num_batched_tokens=32, max_num_seqs=8, max_model_len=128, kv_cache_memory_bytes=1 << 22,
            compile_cache_dir=None, enable_lora=True, max_loras=3, max_lora_rank=8)
# An engine compared with PEFT compiles only the buckets its requests use (the engines checked for compiles after
# warmup take ARGS).
PEFT_ARGS = {**ARGS, "warmup": False}


def _adapter(base_model, path: str, seed: int, **config) -> object:
    """A PEFT LoRA adapter with random A and B (PEFT's default B = 0 would change nothing), saved to `path`."""
    torch.manual_seed(seed)
    model = peft.get_peft_model(base_model, peft.LoraConfig(init_lora_weights=False, **config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.2)
    model.save_pretrained(path)
    model.eval()
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(base directory, {adapter name: (path, its PEFT model)}, the base HF model)."""
    root = tmp_path_factory.mktemp("lora")
    base = str(root / "base")
    save_tiny_hf("LlamaConfig", base, vocab_size=VOCAB, tie_word_embeddings=False)
    save_fake_tokenizer(base)
    adapters = {}
    # all4: per-module ranks and alphas (PEFT's rank_pattern and alpha_pattern: the first key to match the module's end)
    specs = {"all4": dict(r=4, lora_alpha=8, target_modules=ALL, rank_pattern={"down_proj": 2, r"1\.self_attn\.q_proj": 6},
                          alpha_pattern={"o_proj": 2, "up_proj": 12}),
             "qv8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], use_rslora=True),
             "mlp2": dict(r=2, lora_alpha=3, target_modules=["gate_proj", "down_proj"])}
    for seed, (name, spec) in enumerate(specs.items()):
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        adapters[name] = (str(root / name), _adapter(hf, str(root / name), seed + 10, **spec))
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    return base, adapters, hf_base


@pytest.fixture(scope="module")
def engine(tiny):
    base, adapters, _ = tiny
    return LLMEngine(EngineArgs(model=base, lora_modules=tuple((n, adapters[n][0]) for n in ("all4", "qv8")),
                                **ARGS), progress=False)


def run(engine, requests: dict[str, tuple[list[int], SamplingParams, object]]) -> dict:
    for rid, (ids, params, lora) in requests.items():
        engine.add_request(rid, ids, params, lora_request=lora)
    return drain(engine)


def hf_prompt_logprobs(model, ids: list[int]) -> np.ndarray:
    """Each prompt token's logprob after the ones before it (positions 1..n-1)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    lp = torch.log_softmax(logits, -1).numpy()
    return np.array([lp[i - 1, ids[i]] for i in range(1, len(ids))])


def prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(2, VOCAB, n).tolist()


def adapter_equals_peft(engine, peft_model, adapter: str, seed: int, atol: float) -> dict:
    """A 40-token prompt of `adapter` and of the base model in one batch: the adapter's prompt logprobs are the PEFT
    model's (to `atol`) and so are its 6 greedy tokens, which are not the base's. Returns the outputs by request."""
    ids = prompt(40, seed)
    p = SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=0, ignore_eos=True)
    out = run(engine, {"a": (ids, p, adapter), "base": (ids, p, None)})
    got = np.array([e[t].logprob for e, t in zip(out["a"].prompt_logprobs[1:], ids[1:], strict=True)])
    np.testing.assert_allclose(got, hf_prompt_logprobs(peft_model, ids), atol=atol)
    with torch.no_grad():
        greedy = peft_model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, min_new_tokens=6,
                                     pad_token_id=0)[0, len(ids):].tolist()
    assert out["a"].outputs[0].token_ids == greedy != out["base"].outputs[0].token_ids
    return out


def test_adapters_and_base_in_one_batch_equal_peft(tiny, engine):
    """Every prompt position's logprob under each adapter, and the base model's, in one batch of chunked
    prompts (40 tokens, 32 a step), equals PEFT's; so do greedy continuations."""
    _, adapters, hf_base = tiny
    ids = prompt(40, 1)
    p = SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=0, ignore_eos=True)
    out = run(engine, {"a": (ids, p, "all4"), "b": (ids, p, LoRARequest("qv8", 2)), "base": (ids, p, None)})
    refs = {"a": adapters["all4"][1], "b": adapters["qv8"][1], "base": hf_base}
    for rid, model in refs.items():
        got = np.array([e[t].logprob for e, t in zip(out[rid].prompt_logprobs[1:], ids[1:], strict=True)])
        np.testing.assert_allclose(got, hf_prompt_logprobs(model, ids), atol=2e-5)
        with torch.no_grad():
            greedy = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, min_new_tokens=6,
                                    pad_token_id=0)[0, len(ids):].tolist()
        assert out[rid].outputs[0].token_ids == greedy, rid
    assert out["a"].outputs[0].token_ids != out["base"].outputs[0].token_ids
    # Alone, each gives what it gave in the batch.
    alone = run(engine, {"a2": (ids, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), "all4")})
    assert alone["a2"].outputs[0].token_ids == out["a"].outputs[0].token_ids
    assert engine.stats().compilations_after_warmup == 0  # adapters are data: one executable per bucket


GLM4_MOE = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, n_group=2,
                topk_group=1, first_k_dense_replace=1, attention_bias=True, num_hidden_layers=3, head_dim=16)
# Models whose attention takes LoRA but not all of their MLP: (config class, its settings, an MLP target refused,
# what the refusal says).
ATTENTION_ONLY = {
    # Qwen2-MoE (q/k/v biases, a shared expert): its embeddings take none (its experts, router and shared expert:
    # tests/test_lora_experts.py).
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=40, norm_topk_prob=False),
                  "embed_tokens", "not LoRA on a projection jaxserve serves"),
    # GLM-4: q and k rows read into the half-split rotary order, so an adapter's q and k B rows follow them (its
    # fused gate_up_proj: below).
    "glm4": ("Glm4Config", dict(head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2), "embed_tokens",
             "not LoRA on a projection jaxserve serves"),
    # GLM-4.5: a dense first layer stacked apart from the MoE layers, each stack with its adapter slots (the engine
    # here unrolls the layers; scanned, below, it keeps the two stacks). The LM head takes none (its experts:
    # tests/test_lora_experts.py).
    "glm4_moe": ("Glm4MoeConfig", GLM4_MOE, "lm_head", "not LoRA on a projection jaxserve serves"),
    # Jais 2: biased attention after a LayerNorm with a bias.
    "jais2": ("Jais2Config", dict(head_dim=16, bos_token_id=1, eos_token_id=2), "embed_tokens",
              "not LoRA on a projection jaxserve serves"),
    # Command A MoE's layers: the experts read the attention's normed input, beside a dense first layer.
    "cohere2_moe": ("Cohere2MoeConfig", dict(head_dim=16, num_experts=8, intermediate_size=24, num_shared_experts=1,
                                             first_k_dense_replace=1, prefix_dense_intermediate_size=40,
                                             sliding_window=8, pad_token_id=0, bos_token_id=1, eos_token_id=2),
                    "lm_head", "not LoRA on a projection jaxserve serves"),
    # MiMo-V2-Flash: its k, v and o held uniform (a full layer's KV heads twice, values padded to the keys' width),
    # and so their deltas; sinks on its windowed layers, a value scale.
    "mimo_v2_flash": ("MiMoV2FlashConfig", MIMO, "lm_head", "not LoRA on a projection jaxserve serves"),
}


@pytest.mark.parametrize("family", list(ATTENTION_ONLY))
def test_an_attention_adapter_equals_peft(tmp_path, family):
    """An adapter on q, k, v and o equals PEFT's (prompt logprobs and greedy tokens); one on the MLP target the
    model does not serve is refused by name."""
    import transformers

    config_cls, settings, refused, message = ATTENTION_ONLY[family]
    base = str(tmp_path / family)
    save_tiny_hf(config_cls, base, vocab_size=VOCAB, **settings)
    save_fake_tokenizer(base)
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = _adapter(hf, str(tmp_path / "attn"), 5, r=4, lora_alpha=8,
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    engine = LLMEngine(EngineArgs(model=base, lora_modules=(("attn", str(tmp_path / "attn")),), **PEFT_ARGS),
                       progress=False)
    greedy = adapter_equals_peft(engine, peft_model, "attn", 7, atol=2e-5)["a"].outputs[0].token_ids
    if family == "glm4_moe":
        scanned = LLMEngine(EngineArgs(model=base, lora_modules=(("attn", str(tmp_path / "attn")),), **PEFT_ARGS,
                                       layer_loop="scan"), progress=False)
        assert scanned.runner.params.dense_layers.lora is not None
        p = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        assert run(scanned, {"a": (prompt(40, 7), p, "attn")})["a"].outputs[0].token_ids == greedy
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    _adapter(hf, str(tmp_path / "mlp"), 6, r=2, target_modules=[refused])
    with pytest.raises(LoRAError, match=message):
        engine.loras.load("mlp", str(tmp_path / "mlp"))


def test_drafted_adapter_requests_keep_their_tokens(tiny, engine):
    """Speculative decoding verifies an adapter's drafts with that adapter: the same greedy tokens as undrafted."""
    base, adapters, _ = tiny
    spec = LLMEngine(EngineArgs(model=base, lora_modules=(("all4", adapters["all4"][0]),), **ARGS,
                                speculative_config={"num_speculative_tokens": 3, "prompt_lookup_min": 1}),
                     progress=False)
    ids = (prompt(6, 11) * 4)[:22]  # repeats, so the context proposes drafts
    p = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = run(engine, {"a": (ids, p, "all4"), "b": (ids, p, None)})
    got = run(spec, {"a": (ids, p, "all4"), "b": (ids, p, None)})
    assert spec.stats().spec_num_draft_tokens > 0
    for rid in ("a", "b"):
        assert got[rid].outputs[0].token_ids == want[rid].outputs[0].token_ids, rid


def test_adapters_in_slots_are_placed_again_over_new_weights(engine):
    """A weight update (jaxserve.engine.memory) zeroes the slots with the rest; the adapters come back."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    reqs = {n: (prompt(12, 3), params, n) for n in ("all4", "qv8")}
    before = {k: v.outputs[0].token_ids for k, v in run(engine, reqs).items()}
    assert engine.loras.slots[:2] == ["all4", "qv8"]
    engine.memory.load_weights()  # the base checkpoint, read again
    after = {k: v.outputs[0].token_ids for k, v in run(engine, reqs).items()}
    assert after == before and engine.runner.compilations_after_warmup == 0


def test_each_adapter_has_its_own_prefix_cache(engine):
    ids = prompt(50, 2)
    p = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    first = run(engine, {"x": (ids, p, "all4")})["x"]
    other = run(engine, {"y": (ids, p, "qv8")})["y"]
    base = run(engine, {"z": (ids, p, None)})["z"]
    again = run(engine, {"w": (ids, p, "all4")})["w"]
    cached = [o.metrics.num_cached_tokens for o in (first, other, base, again)]
    assert cached == [0, 0, 0, 48], cached  # another adapter's KV is never read as this one's
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_loading_on_first_use_and_the_refusals(tiny, engine, tmp_path):
    base, adapters, _ = tiny
    shared, engine = engine, LLMEngine(EngineArgs(model=base, **{**ARGS, "max_loras": 1}), progress=False)
    ids = prompt(12, 3)
    p = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with pytest.raises(LoRAError, match="'mlp2' is not loaded \\(loaded: none\\); give its lora_path"):
        engine.add_request("r", ids, p, lora_request="mlp2")
    got = run(engine, {"r": (ids, p, LoRARequest("mlp2", 3, adapters["mlp2"][0]))})["r"]
    with torch.no_grad():
        ref = adapters["mlp2"][1].generate(torch.tensor([ids]), max_new_tokens=3, do_sample=False,
                                           min_new_tokens=3, pad_token_id=0)[0, len(ids):].tolist()
    assert got.outputs[0].token_ids == ref
    assert engine.loras.paths == {"mlp2": adapters["mlp2"][0]}
    # One slot, two adapters: an idle adapter leaves the slot to the one a request needs, and comes back.
    big = prompt(40, 8)
    want = run(shared, {"w": (big, p, "all4")})["w"]
    took = run(engine, {"s": (big, p, LoRARequest("all4", 1, adapters["all4"][0]))})["s"]
    assert engine.loras.slots == ["all4"] and took.outputs[0].token_ids == want.outputs[0].token_ids
    back = run(engine, {"b": (ids, p, "mlp2")})["b"]
    assert engine.loras.slots == ["mlp2"] and back.outputs[0].token_ids == ref
    # max_cpu_loras (default max_loras, 1): only the adapter last used keeps host weights; mlp2 came back
    # into its slot read from its path again, with the same tokens.
    assert list(engine.loras._weights) == ["mlp2"] and set(engine.loras.paths) == {"mlp2", "all4"}
    again = run(engine, {"s2": (big, p, "all4")})["s2"]  # its cached pages are its own still: a hit
    assert again.metrics.num_cached_tokens == 32 and again.outputs[0].token_ids == took.outputs[0].token_ids
    # One slot, requests of two adapters and the base model at once: mlp2's waits until all4's have ended,
    # the base request runs beside all4's, and each gives what it gives alone.
    engine.add_request("q", big, p, lora_request="all4")
    engine.add_request("t", ids, p, lora_request="mlp2")
    engine.add_request("u", ids, p)
    engine.add_request("q2", big, p, lora_request="all4")  # behind mlp2's: waits its turn
    order, outs = [], {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
            if o.finished:
                order.append(o.request_id)
        assert len({r.lora_name for r in engine.scheduler.running} - {None}) <= 1
        engine.check_integrity()
    assert order.index("u") < order.index("t") and order.index("q") < order.index("t") < order.index("q2")
    assert outs["t"].outputs[0].token_ids == ref
    assert outs["q"].outputs[0].token_ids == outs["q2"].outputs[0].token_ids == took.outputs[0].token_ids
    assert outs["u"].outputs[0].token_ids == run(shared, {"ub": (ids, p, None)})["ub"].outputs[0].token_ids
    # Unloading: refused while a request uses the adapter; a reloaded name reads none of its old cached pages.
    long = prompt(40, 9)
    engine.add_request("busy", long, p, lora_request="mlp2")
    with pytest.raises(LoRAError, match="in use by 1 request"):
        engine.loras.unload("mlp2")
    stats = engine.stats()
    assert (stats.max_lora, stats.running_lora_adapters, stats.waiting_lora_adapters) == (1, (), ("mlp2",))
    first = run(engine, {})["busy"]
    engine.loras.unload("mlp2")
    assert engine.loras.slots == [None]
    engine.loras.load("mlp2", adapters["mlp2"][0])
    reloaded = run(engine, {"again": (long, p, "mlp2")})["again"]
    hit = run(engine, {"hit": (long, p, "mlp2")})["hit"]
    assert [o.metrics.num_cached_tokens for o in (first, reloaded, hit)] == [0, 0, 32]
    assert reloaded.outputs[0].token_ids == hit.outputs[0].token_ids == first.outputs[0].token_ids
    # Adapters that cannot be served are named.
    small = LLMEngine(EngineArgs(model=base, **{**ARGS, "max_lora_rank": 4, "warmup": False}), progress=False)
    with pytest.raises(LoRAError, match="rank 8, above max_lora_rank 4"):
        small.loras.load("qv8", adapters["qv8"][0])
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    for name, spec, match in (("head", dict(r=2, target_modules=["lm_head"]), "not LoRA on a projection"),
                              ("dora", dict(r=2, target_modules=["q_proj"], use_dora=True), "sets use_dora"),
                              ("bias", dict(r=2, target_modules=["q_proj"], bias="lora_only"), "trains biases")):
        _adapter(hf, str(tmp_path / name), 0, **spec)
        hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        with pytest.raises(LoRAError, match=match):
            small.loras.load(name, str(tmp_path / name))
    with pytest.raises(LoRAError, match="has no adapter_config.json"):
        small.loras.load("nothing", str(tmp_path))
    import shutil  # (PEFT itself keeps fan_in_fan_out for Conv1D layers alone: GPT-2's)

    shutil.copytree(adapters["mlp2"][0], tmp_path / "fan")
    with open(tmp_path / "fan" / "adapter_config.json") as f:
        ac = json.load(f)
    with open(tmp_path / "fan" / "adapter_config.json", "w") as f:
        json.dump({**ac, "fan_in_fan_out": True}, f)
    with pytest.raises(LoRAError, match="sets fan_in_fan_out; it is not supported"):
        small.loras.load("fan", str(tmp_path / "fan"))
    plain = LLMEngine(EngineArgs(model=base, **{**ARGS, "enable_lora": False, "warmup": False}), progress=False)
    with pytest.raises(ValueError, match="serves no LoRA adapters; start it with enable_lora"):
        plain.add_request("t", ids, p, lora_request="all4")
    for args, match in ((dict(lora_modules=("a=/x",)), "needs enable_lora"),
                        (dict(enable_lora=True, lora_modules=("a",)), "must be name=path"),
                        (dict(enable_lora=True, max_loras=2, max_cpu_loras=1), "max_cpu_loras must be an integer >= max_loras"),
                        (dict(enable_lora=True, runner="pooling"), "not served with runner 'pooling'")):
        with pytest.raises(ValueError, match=match):
            EngineArgs(**args)
    import argparse

    ns = EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(
        ["--enable-lora", "--lora-modules", "a=/x", "b=/y", "--max-loras", "2", "--max-lora-rank", "32",
         "--max-cpu-loras", "8"])
    args = EngineArgs.from_cli_args(ns)
    assert args.lora_modules == (("a", "/x"), ("b", "/y")) and (args.max_loras, args.max_lora_rank) == (2, 32)
    assert args.max_cpu_loras == 8


def test_adapters_are_models_over_http(tiny, engine):
    import httpx

    from jaxserve.engine.async_engine import AsyncEngine
    from server.config import ServerConfig
    from server.runner import serve_in_thread

    ids = prompt(10, 4)
    ref = run(engine, {"ref": (ids, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), "qv8")})["ref"]
    served = AsyncEngine(engine)
    try:
        with serve_in_thread(served, ServerConfig(port=0)) as srv:
            models = httpx.get(f"{srv.url}/v1/models").json()["data"]
            assert [m["id"] for m in models] == [srv.state.model_name, "all4", "qv8"]
            assert models[2]["parent"] == srv.state.model_name and models[2]["root"] == tiny[1]["qv8"][0]
            body = {"model": "qv8", "prompt": ids, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
            r = httpx.post(f"{srv.url}/v1/completions", json=body).json()
            assert r["model"] == "qv8" and r["choices"][0]["text"] == ref.outputs[0].text
            base = httpx.post(f"{srv.url}/v1/completions", json={**body, "model": srv.state.model_name}).json()
            assert base["choices"][0]["text"] != r["choices"][0]["text"]
            # The adapter's cached pages are published under its namespace, the hashes a router computes.
            long = prompt(40, 12)
            assert httpx.post(f"{srv.url}/v1/completions", json={**body, "prompt": long}).status_code == 200
            feed = httpx.get(f"{srv.url}/v1/kv_events").json()["events"]
            stored = {h for e in feed if e["type"] == "BlockStored" for h in e["block_hashes"]}
            ps = engine.scheduler.config.page_size
            assert set(hash_token_pages(long[:-1], ps, lora_cache_salt("qv8"))) <= stored
            assert not set(hash_token_pages(long[:-1], ps, None)) & stored
            salted = httpx.post(f"{srv.url}/v1/completions", json={**body, "cache_salt": "lora:qv8"})
            assert salted.status_code == 400 and "LoRA adapters' cache namespaces" in salted.text
            metrics = httpx.get(f"{srv.url}/metrics").text
            assert 'vllm:lora_requests_info{max_lora="3",running_lora_adapters="",waiting_lora_adapters=""}' in metrics
            missing = httpx.post(f"{srv.url}/v1/completions", json={**body, "model": "mlp2"})
            assert missing.status_code == 404 and "all4, qv8" in missing.json()["error"]["message"]
            # Runtime updates, vLLM's endpoints: off unless the environment allows them.
            load = {"lora_name": "mlp2", "lora_path": tiny[1]["mlp2"][0]}
            assert httpx.post(f"{srv.url}/v1/load_lora_adapter", json=load).status_code == 404
            os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
            try:
                r = httpx.post(f"{srv.url}/v1/load_lora_adapter", json=load)
                assert r.status_code == 200 and "added" in r.text
                assert httpx.post(f"{srv.url}/v1/completions", json={**body, "model": "mlp2"}).status_code == 200
                again = httpx.post(f"{srv.url}/v1/load_lora_adapter", json=load)
                assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
                r = httpx.post(f"{srv.url}/v1/unload_lora_adapter", json={"lora_name": "mlp2"})
                assert r.status_code == 200 and "removed" in r.text
                assert httpx.post(f"{srv.url}/v1/completions", json={**body, "model": "mlp2"}).status_code == 404
                gone = httpx.post(f"{srv.url}/v1/unload_lora_adapter", json={"lora_name": "mlp2"})
                assert gone.status_code == 400 and "not loaded" in gone.json()["error"]["message"]
            finally:
                del os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"]
    finally:
        served.shutdown()
    engine.check_integrity()


def test_stacked_and_per_layer_layouts_apply_the_same_deltas():
    """The scanned layer loop (stacked slots, GPUs) and the unrolled one (per-layer slots, fused or not, the
    CPU's) give the same logits for tokens of three slots and none in one batch; zero slots change nothing."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from jaxserve.config import ModelConfig
    from jaxserve.models.inputs import KVCache, ModelInputs
    from jaxserve.models.llama import forward
    from jaxserve.models.lora import empty_lora
    from jaxserve.models.params import init_params
    from jaxserve.models.unstack import unstack_layers

    cfg = ModelConfig(family="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=128, tie_word_embeddings=True)
    params = init_params(cfg, jax.random.PRNGKey(0), scale=0.2)
    zero = empty_lora(cfg, 3, 4, jnp.float32)
    keys = iter(jax.random.split(jax.random.PRNGKey(1), len(jax.tree.leaves(zero))))
    lora = jax.tree.map(lambda a: 0.3 * jax.random.normal(next(keys), a.shape), zero)
    seqs = [(prompt(9, 5), 0, [1]), (prompt(7, 6), 0, [2]), (prompt(5, 7), 0, [3]), (prompt(6, 8), 0, [4])]

    def logits(p, slots):
        inputs = ModelInputs.build(seqs, 16, num_tokens=32, num_seqs=4, pages_per_seq=2, all_logits=True,
                                   lora_slots=slots)
        out, _ = jax.jit(forward, static_argnums=(3, 4))(p, KVCache.allocate(cfg, 8, 16, jnp.float32), inputs, cfg,
                                                         "xla")
        return np.asarray(out)[:27]

    with_lora = dataclasses.replace(params, layers=dataclasses.replace(params.layers, lora=lora))
    slots = [0, 2, -1, 1]
    stacked = logits(with_lora, slots)
    for fuse in (False, True):
        np.testing.assert_allclose(logits(unstack_layers(with_lora, fuse=fuse), slots), stacked, atol=1e-5)
    base = logits(params, None)
    rows = np.repeat(slots, [9, 7, 5, 6])
    assert np.allclose(stacked[rows == -1], base[rows == -1], atol=1e-5)  # a slot-less row is the base model's
    assert not np.allclose(stacked[rows >= 0], base[rows >= 0], atol=1e-2)
    zeroed = dataclasses.replace(params, layers=dataclasses.replace(params.layers, lora=zero))
    np.testing.assert_allclose(logits(zeroed, slots), base, atol=1e-5)


def test_real_model_adapter_equals_peft(smollm_path, smollm_f32, hf_smollm, chat_prompt_ids, tmp_path):
    """SmolLM2 with a random rank-8 adapter on every projection: prompt logprobs and greedy tokens as PEFT's."""
    import jax.numpy as jnp

    from jaxserve.engine.model_loading import LoadedModel
    from jaxserve.tokenizer import Tokenizer

    model, _ = hf_smollm
    adapted = _adapter(model, str(tmp_path / "smol"), 3, r=8, lora_alpha=16, target_modules=ALL)
    try:
        cfg, params = smollm_f32
        loaded = LoadedModel(smollm_path, "SmolLM2-135M-Instruct", cfg, params, Tokenizer.from_gguf(smollm_path),
                             jnp.float32, 0.0)
        engine = LLMEngine(EngineArgs(enable_lora=True, max_lora_rank=8, lora_modules=(("smol", str(tmp_path / "smol")),),
                                      max_num_seqs=1, max_num_batched_tokens=32, max_model_len=256, dtype="float32",
                                      kv_cache_memory_bytes=16 << 20, layer_loop="scan", warmup=False),
                             loaded=loaded,
                             progress=False)
        ids = chat_prompt_ids[0]
        p = SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=0, ignore_eos=True)
        out = run(engine, {"r": (ids, p, "smol")})["r"]
        got = np.array([e[t].logprob for e, t in zip(out.prompt_logprobs[1:], ids[1:], strict=True)])
        # float32 through 30 layers: the error grows with the logprob's size (5.2e-4 seen at -21.5).
        np.testing.assert_allclose(got, hf_prompt_logprobs(adapted, ids), rtol=5e-5, atol=5e-4)
        with torch.no_grad():
            greedy = adapted.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, min_new_tokens=8,
                                      pad_token_id=0)[0, len(ids):].tolist()
        assert out.outputs[0].token_ids == greedy
    finally:
        adapted.unload()  # the session's HF model is shared: take the adapter's layers out again


def test_adapters_under_tensor_parallelism_equal_one_device():
    """TP=2 (KV heads split) and TP=4 (KV heads repeated, and the adapter's k/v columns with them) give one
    device's greedy tokens, for an adapter's requests beside the base model's, with no compile after warmup."""
    from tests.test_sharding_worker import PROMPTS, run_module

    r = run_module("tests.lora_tp_worker", devices=8)
    assert r["tp4"]["kv_repeat"] == 2 and [r[k]["devices"] for k in ("tp1", "tp2", "tp4")] == [1, 2, 4]
    for tp in ("tp2", "tp4"):
        assert r[tp]["adapter"] == r["tp1"]["adapter"] and r[tp]["base"] == r["tp1"]["base"], tp
        assert r[tp]["compiles_after_warmup"] == 0
    assert all(len(t) == 8 for t in r["tp1"]["adapter"]) and len(r["tp1"]["adapter"]) == len(PROMPTS)
    assert r["tp1"]["adapter"] != r["tp1"]["base"]


# Models whose projections are fused or named their own way: (config class, settings, PEFT's targets, a tensor name
# the adapter has).
FUSED = {
    "phi3": ("Phi3Config", dict(pad_token_id=0, bos_token_id=1, eos_token_id=2),
             dict(target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]), "self_attn.qkv_proj"),
    "glm4": ("Glm4Config", dict(head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2),
             dict(target_modules=["q_proj", "k_proj", "gate_up_proj", "down_proj"]), "mlp.gate_up_proj"),
    # Granite MoE's shared MLP (gate and up in `input_linear`) and its router (`router.layer`).
    "granitemoeshared": ("GraniteMoeSharedConfig", dict(num_experts_per_tok=2, num_local_experts=4,
                                                        intermediate_size=48, shared_intermediate_size=40,
                                                        residual_multiplier=0.22, logits_scaling=8.0),
                         dict(target_modules=["q_proj", "v_proj", "input_linear", "output_linear"],
                              target_parameters=["block_sparse_moe.router.weight",
                                                 "block_sparse_moe.experts.gate_up_proj",
                                                 "block_sparse_moe.experts.down_proj"]), "router.lora_B"),
    # Granite 4.0-H: a Mamba layer (which takes none) and an attention layer; both layers' MLPs take it.
    "granitemoehybrid": ("GraniteMoeHybridConfig", dict(
        layer_types=["mamba", "attention"], mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=2,
        position_embedding_type="rope", num_local_experts=0, shared_intermediate_size=40, residual_multiplier=0.5),
        dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "input_linear", "output_linear"]),
        "self_attn.o_proj"),
    # Nemotron-H: blocks paired into layers (Mamba + MLP, attention + MLP, Mamba alone), its MLP ungated.
    "nemotron_h": ("NemotronHConfig", dict(hybrid_override_pattern="M-*-M", head_dim=16, mamba_num_heads=8,
                                           mamba_head_dim=16, ssm_state_size=16, n_groups=2),
                   dict(target_modules=["q_proj", "o_proj", "up_proj", "down_proj"]), "layers.3.mixer.up_proj"),
    # LFM2-MoE: a convolution layer and an attention layer with dense MLPs (w1, w3, w2: gate, up, down), then a
    # convolution layer with experts (which take none).
    "lfm2_moe": ("Lfm2MoeConfig", dict(layer_types=["conv", "full_attention", "conv"], num_hidden_layers=3,
                                       intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                                       num_experts_per_tok=2, num_dense_layers=2),
                 dict(target_modules=["q_proj", "v_proj", "w1", "w2", "w3"]), "feed_forward.w1"),
    # Qwen3-Next: its attention's q_proj also projects each head's output gate; the routed experts, the shared
    # expert (PEFT 0.22 on: bare names take both) and its sigmoid gate (its Gated DeltaNet layers take none).
    "qwen3_next": ("Qwen3NextConfig", dict(
        layer_types=["linear_attention", "full_attention"], head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=40),
        dict(target_modules=["q_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "shared_expert_gate"]),
        "shared_expert_gate"),
}


@pytest.mark.parametrize("family", list(FUSED))
def test_fused_projection_adapters_equal_peft(tmp_path, family):
    """An adapter on fused projections (Phi-3's qkv_proj and gate_up_proj, GLM-4's gate_up_proj, Granite MoE's shared
    MLP and router; Granite 4.0-H's, Nemotron-H's and LFM2-MoE's, whose Mamba and convolution layers take none)
    gives PEFT's prompt logprobs and greedy tokens, in one batch with the base model."""
    import transformers

    config_cls, settings, targets, fused = FUSED[family]
    base = str(tmp_path / family)
    save_tiny_hf(config_cls, base, vocab_size=VOCAB, **settings)
    save_fake_tokenizer(base)
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = _adapter(hf, str(tmp_path / "a"), 9, r=4, lora_alpha=8, **targets)
    from safetensors.numpy import load_file

    names = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    assert any(fused in n for n in names) and any(t in n for n in names for t in (
        "qkv", "gate_up", "input_linear", "feed_", "mixer", "expert_gate"))
    # (No warmup: only the buckets the two requests use are compiled.)
    engine = LLMEngine(EngineArgs(model=base, lora_modules=(("a", str(tmp_path / "a")),), **ARGS, warmup=False),
                       progress=False)
    # (Qwen3-Next's base model alone is 4e-5 to 7e-5 from transformers' at some positions: the Gated DeltaNet)
    adapter_equals_peft(engine, peft_model, "a", 17, atol=1e-4 if family == "qwen3_next" else 3e-5)


# GPT-NeoX's projections under their own names (`gpt_neox.layers.N.attention.query_key_value`: each head's q, k and v
# rows together; `dense`, `dense_h_to_4h`, `dense_4h_to_h`), GPT-J's (`transformer.h.N.attn.q_proj` ... `out_proj`,
# `mlp.fc_in`, `fc_out`: q and k turned in interleaved pairs), GPT-2's (`attn.c_attn`: q, k, v one after another, its
# Conv1D layers adapted with `fan_in_fan_out`; `attn.c_proj` beside `mlp.c_proj`) and GPTBigCode's (`c_attn`
# multi-query, or per head); Falcon-40B's (`transformer.h.N.self_attention.query_key_value`: each KV head's group of
# queries, then its key and value).
_GPT2 = dict(tiny=False, vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256, bos_token_id=1,
             eos_token_id=2)
GPT_LIKE = {"gpt_neox": ("GPTNeoXConfig", dict(bos_token_id=1, eos_token_id=2),
                         ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"]),
            "gptj": ("GPTJConfig", dict(_GPT2, rotary_dim=8), ["q_proj", "k_proj", "v_proj", "out_proj", "fc_in",
                                                                "fc_out"]),
            "gpt2": ("GPT2Config", _GPT2, ["c_attn", "c_proj", "c_fc"]),
            "gpt_bigcode_mqa": ("GPTBigCodeConfig", dict(_GPT2, multi_query=True), ["c_attn", "c_proj", "c_fc"]),
            "gpt_bigcode_mha": ("GPTBigCodeConfig", dict(_GPT2, multi_query=False), ["c_attn", "c_proj", "c_fc"]),
            "falcon": ("FalconConfig", dict(bos_token_id=1, eos_token_id=2, new_decoder_architecture=True,
                                            num_kv_heads=2, ffn_hidden_size=96),
                       ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"]),
            "mpt": ("MptConfig", dict(bos_token_id=1, eos_token_id=2), ["Wqkv", "out_proj", "up_proj", "down_proj"]),
            "bloom": ("BloomConfig", dict(bos_token_id=1, eos_token_id=2, hidden_size=96, num_attention_heads=6),
                      ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"])}


@pytest.mark.parametrize("family", list(GPT_LIKE))
def test_gpt_family_adapters_equal_peft(tmp_path, family):
    """An adapter on every projection of GPT-NeoX (q, k and v fused per head), GPT-J, GPT-2, GPTBigCode, Falcon
    (fused per KV head), MPT (one after another) and BLOOM (per head), under their own module names: PEFT's prompt
    logprobs and greedy tokens, in one batch with the base model."""
    import transformers

    config_cls, settings, targets = GPT_LIKE[family]
    base = str(tmp_path / family)
    save_tiny_hf(config_cls, base, **{"vocab_size": VOCAB, **settings})
    save_fake_tokenizer(base)
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = _adapter(hf, str(tmp_path / "a"), 4, r=4, lora_alpha=8, target_modules=targets,
                          rank_pattern={targets[0]: 6})  # (the fused q/k/v's rank its own)
    engine = LLMEngine(EngineArgs(model=base, lora_modules=(("a", str(tmp_path / "a")),), **PEFT_ARGS), progress=False)
    adapter_equals_peft(engine, peft_model, "a", 21, atol=3e-5)
    engine.check_integrity()
