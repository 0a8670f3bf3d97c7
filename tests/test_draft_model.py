"""Speculative decoding with a draft model: the target's outputs unchanged, whatever the draft; the draft's own KV
kept in lockstep with the target's pages (a model drafting for itself has every greedy draft accepted, through
chunked prefill, prefix cache hits and preemption); drafts verified as rows or as chunks; bad drafts refused."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from jaxserve.engine.llm_engine import LLMEngine  # noqa: E402
from jaxserve.engine_args import EngineArgs  # noqa: E402
from jaxserve.sampling_params import SamplingParams  # noqa: E402
from jaxserve.speculative_config import SpeculativeConfig  # noqa: E402
from tests.fake_model import fake_tokenizer  # noqa: E402
from tests.modelrun import drain  # noqa: E402
from tests.test_model_families import VOCAB, save_tiny_hf  # noqa: E402

ARGS = dict(dtype="float32", max_num_seqs=32, max_num_batched_tokens=32, max_model_len=160, page_size=8,
            kv_cache_memory_bytes=1 << 20, strict_compile=True)


def _with_tokenizer(path: str, tokenizer=None) -> str:
    (tokenizer or fake_tokenizer())._backend.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<eos>"}, f)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Directories of a tiny target, a smaller draft of its vocabulary, and the target with its weights perturbed
    (a draft that is often right)."""
    root = tmp_path_factory.mktemp("draft")
    save_tiny_hf("LlamaConfig", root / "target", seed=0, tie_word_embeddings=False)
    save_tiny_hf("LlamaConfig", root / "small", seed=5, num_hidden_layers=1, hidden_size=32, intermediate_size=48,
                 num_attention_heads=2, num_key_value_heads=1)
    near = save_tiny_hf("LlamaConfig", root / "near", seed=0, tie_word_embeddings=False)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(9)
        for p in near.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=gen))
    near.save_pretrained(root / "near", safe_serialization=True)
    return {"target": _with_tokenizer(str(root / "target")), "small": _with_tokenizer(str(root / "small")),
            "near": _with_tokenizer(str(root / "near"))}


def _prompts(n: int = 4, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(2, VOCAB, int(length)).tolist() for length in rng.integers(3, 70, n)]


PARAMS = [
    SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
    SamplingParams(temperature=0.9, seed=4, max_tokens=30, n=2, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=25, frequency_penalty=0.5, logprobs=2, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=30, min_tokens=10, stop_token_ids=[7, 8]),
]


def _engine(target: str, spec: dict, **args) -> LLMEngine:
    """An engine drafting with `spec`, warmed up (a compile while serving raises), every draft the step has room
    for verified: the costs measured at warmup would make the CPU draft little (drafting a token with these tiny
    models costs about a step; `test_speculative.py` checks that choice)."""
    engine = LLMEngine(EngineArgs(model=target, speculative_config=spec, **{**ARGS, **args}), progress=False)
    assert engine.drafter.costs.draft is not None
    engine.drafter.costs = None
    return engine


def _serve(engine: LLMEngine, prompts, params) -> dict:
    for i, p in enumerate(prompts):
        for j, sp in enumerate(params):
            engine.add_request(f"{i}/{j}", p, sp)
    return drain(engine)


def _same(want: dict, got: dict) -> None:
    assert want.keys() == got.keys()
    for rid, w in want.items():
        for a, b in zip(w.outputs, got[rid].outputs, strict=True):
            assert (b.token_ids, b.finish_reason) == (a.token_ids, a.finish_reason), rid
            for x, y in zip(a.logprobs or [], b.logprobs or [], strict=True):
                assert x.keys() == y.keys() and all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)


@pytest.fixture(scope="module")
def base(models):
    return _serve(LLMEngine(EngineArgs(model=models["target"], **ARGS), progress=False), _prompts(), PARAMS)


@pytest.mark.parametrize("draft", ["target", "small", "near"])
def test_outputs_are_the_targets_whatever_the_draft(models, base, draft):
    """Greedy, seeded sampling (n=2), penalties with logprobs, stop ids after min_tokens: the outputs without
    drafts, from the model itself (every greedy draft right), a smaller random one (almost never), or a
    perturbed copy (often)."""
    engine = _engine(models["target"], {"model": models[draft], "num_speculative_tokens": 3})
    _same(base, _serve(engine, _prompts(), PARAMS))
    stats = engine.stats()
    assert stats.compilations_after_warmup == 0 and engine.draft.compilations_after_warmup == 0
    assert stats.spec_num_draft_tokens > 100
    rate = stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens
    assert {"target": 0.6 < rate < 1.0, "small": rate < 0.3, "near": 0.3 < rate < 0.95}[draft], rate
    engine.check_integrity()


def test_a_model_drafting_for_itself_is_always_right_greedy(models):
    """The draft's pages hold its KV wherever the target's hold theirs: through prefill chunks, preemption in a
    small pool, and prefix cache hits on pages written by decode steps that verified drafts, every greedy draft
    of the model drafting for itself is accepted. Without the lockstep writes most are not."""

    def run(follow: bool) -> LLMEngine:
        engine = _engine(models["target"], {"model": models["target"], "num_speculative_tokens": 3})
        if not follow:
            engine.draft.follow = engine.draft.follow_decode = lambda *a: None
        first = _prompts(16, seed=1)  # more than the pool holds at once
        greedy = [SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)]
        _serve(engine, first, greedy)
        assert engine.stats().num_preemptions > 0
        again = first[0] + [5, 6, 7]
        out = _serve(engine, [again], greedy)["0/0"].outputs[0].token_ids
        hits = engine.stats().prefix_cache_hits
        _serve(engine, [again + out[:30] + [9]], greedy)  # its prompt and 30 of its outputs cached
        assert engine.stats().prefix_cache_hits - hits == (len(again) + 30) // 8 * 8 > len(again)
        return engine

    stats = run(follow=True).stats()
    assert stats.spec_num_draft_tokens > 300
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
    broken = run(follow=False).stats()
    assert broken.spec_num_accepted_tokens < 0.5 * broken.spec_num_draft_tokens


def test_drafts_verified_as_chunks(models, base):
    engine = _engine(models["target"], {"model": models["near"], "num_speculative_tokens": 4,
                                        "draft_verification": "chunks"})
    kinds = []
    launch = engine._launch

    def watch():
        launched = launch()
        if launched is not None and launched[3] is not None:
            kinds.append(launched[1].kind)
        return launched

    engine._launch = watch
    _same(base, _serve(engine, _prompts(), PARAMS))
    assert kinds and set(kinds) == {"mixed"}
    assert engine.stats().spec_num_accepted_tokens > 50


def test_config_and_refusals(models, tmp_path):
    cfg = SpeculativeConfig.parse('{"model": "m", "num_speculative_tokens": 2}')
    assert (cfg.method, cfg.model, cfg.num_speculative_tokens) == ("draft_model", "m", 2)
    assert SpeculativeConfig().method == "ngram"
    with pytest.raises(ValueError, match="needs the draft model"):
        SpeculativeConfig(method="draft_model")
    with pytest.raises(ValueError, match="takes no model"):
        SpeculativeConfig(method="ngram", model="m")
    with pytest.raises(ValueError, match="unknown keys draft"):
        SpeculativeConfig.parse({"draft": "m"})
    assert SpeculativeConfig.parse({"model": "m", "draft_tensor_parallel_size": 1}).draft_tensor_parallel_size == 1
    with pytest.raises(ValueError, match="draft_tensor_parallel_size must be 1"):
        SpeculativeConfig.parse({"model": "m", "draft_tensor_parallel_size": 2})
    ns = EngineArgs.add_cli_args(__import__("argparse").ArgumentParser()).parse_args(
        ["--speculative-config", json.dumps({"model": models["small"]})])
    assert EngineArgs.from_cli_args(ns).speculative_config.method == "draft_model"

    # A draft over another vocabulary: ids 2.. are other tokens.
    import tokenizers

    from jaxserve.tokenizer import Tokenizer

    vocab = {"<pad>": 0, "<eos>": 1} | {f"u{i}": i for i in range(2, VOCAB)}
    other = Tokenizer(tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<pad>")), bos_token_id=None,
                      eos_token_ids=[1], pad_token_id=0)
    save_tiny_hf("LlamaConfig", tmp_path / "other", num_hidden_layers=1)
    spec = {"model": _with_tokenizer(str(tmp_path / "other"), other)}
    with pytest.raises(ValueError, match=r"does not share the vocabulary .* 62 of the 64 ids .*'t2' / 'u2'"):
        LLMEngine(EngineArgs(model=models["target"], speculative_config=spec, **ARGS), progress=False)


def test_the_draft_pool_shares_the_kv_budget(models):
    """The draft's pages come out of the same budget: fewer pages than without it, by the bytes a page of both
    takes."""
    alone = LLMEngine(EngineArgs(model=models["target"], warmup=False, **ARGS), progress=False)
    spec = {"model": models["small"]}
    both = LLMEngine(EngineArgs(model=models["target"], warmup=False, speculative_config=spec, **ARGS),
                     progress=False)
    page_bytes = lambda kv: kv.k[:, 0].nbytes + kv.v[:, 0].nbytes  # noqa: E731 - one page of every layer
    t, d, budget = page_bytes(alone.runner.kv), page_bytes(both.draft.kv), ARGS["kv_cache_memory_bytes"]
    assert alone.scheduler.pool.num_pages == budget // t
    assert both.scheduler.pool.num_pages == budget // (t + d) < budget // t
    assert both.draft.kv.k.shape[1] == both.runner.kv.k.shape[1] == both.scheduler.pool.num_pages


def test_the_draft_model_sleeps_and_wakes_with_the_engine(models):
    """Sleep mode frees the draft's pool and weights with the target's (level 1 keeping a host copy, level 2 reading
    its checkpoint again on waking); awake, the model drafting for itself serves as before, every draft right."""
    import jax

    engine = _engine(models["target"], {"model": models["target"], "num_speculative_tokens": 3},
                     enable_sleep_mode=True)
    greedy = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)]
    want = {k: o.outputs[0].token_ids for k, o in _serve(engine, _prompts(), greedy).items()}
    for level, tags in ((1, None), (2, ["weights"]), (1, ["weights"])):
        held = jax.tree.leaves((engine.draft.params, engine.draft.kv))
        engine.memory.sleep(level)
        assert all(x.is_deleted() for x in held), "the draft's weights and pool freed on the device"
        engine.memory.wake_up(tags)
        if tags:
            engine.memory.wake_up(["kv_cache"])
        before = engine.stats()
        got = {k: o.outputs[0].token_ids for k, o in _serve(engine, _prompts(), greedy).items()}
        after = engine.stats()
        assert got == want, level
        assert after.spec_num_draft_tokens - before.spec_num_draft_tokens > 50
        assert after.spec_num_accepted_tokens - before.spec_num_accepted_tokens == \
            after.spec_num_draft_tokens - before.spec_num_draft_tokens


def test_a_lora_adapter_on_the_target_and_none_on_the_draft(models, tmp_path):
    """The target serves a request through its LoRA adapter, the draft model (the base model) drafts without one:
    the adapter's outputs without drafts, the base model's drafts accepted where the adapter agrees with it."""
    peft = pytest.importorskip("peft")
    import transformers

    from jaxserve.lora_request import LoRARequest

    base = transformers.AutoModelForCausalLM.from_pretrained(models["target"], dtype=torch.float32)
    torch.manual_seed(3)
    adapter = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                        init_lora_weights=False))
    with torch.no_grad():
        for name, p in adapter.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.05)
    adapter.save_pretrained(str(tmp_path / "ad"))
    lora = dict(ARGS, enable_lora=True, max_loras=1, max_lora_rank=4, warmup=False)  # (no costs: drafts verified)
    greedy = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)]

    def run(engine: LLMEngine) -> dict:
        for i, p in enumerate(_prompts(2)):
            engine.add_request(str(i), p, greedy[0], lora_request=LoRARequest("ad", 1, str(tmp_path / "ad")))
        return {k: o.outputs[0].token_ids for k, o in drain(engine).items()}

    want = run(LLMEngine(EngineArgs(model=models["target"], **lora), progress=False))
    spec = {"model": models["target"], "num_speculative_tokens": 3}
    engine = LLMEngine(EngineArgs(model=models["target"], speculative_config=spec, **lora), progress=False)
    assert run(engine) == want
    stats = engine.stats()
    assert stats.spec_num_draft_tokens > 30 and 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
