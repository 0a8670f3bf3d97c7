"""Hybrid models (Granite 4.0-H, Bamba: Mamba-2 layers beside attention) against HF transformers: logits, chunked against
whole, batched against alone, and through the engine (its state slots, the device decode loop, preemption)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxserve.config import ModelConfig, UnsupportedModelError  # noqa: E402
from jaxserve.engine.hybrid import state_layout  # noqa: E402
from jaxserve.engine.llm_engine import LLMEngine  # noqa: E402
from jaxserve.engine.model_loading import LoadedModel  # noqa: E402
from jaxserve.engine_args import EngineArgs  # noqa: E402
from jaxserve.loader import load_params, open_checkpoint  # noqa: E402
from jaxserve.models.inputs import KVCache, ModelInputs  # noqa: E402
from jaxserve.sampling_params import SamplingParams  # noqa: E402
from tests.fake_model import VOCAB, fake_tokenizer  # noqa: E402
from tests.modelrun import drain, jitted, pages_for, run_chunks  # noqa: E402
from tests.test_engine_gemma import hf_greedy  # noqa: E402
from tests.test_model_families import hf_logits, rel_err, save_tiny_hf  # noqa: E402

# Three Mamba layers around an attention layer; 8 heads of 16 channels in 2 groups, a state of 16 per channel.
HYBRID = dict(num_hidden_layers=4, layer_types=["mamba", "attention", "mamba", "mamba"], mamba_n_heads=8,
              mamba_d_head=16, mamba_d_state=16, mamba_n_groups=2, mamba_expand=2, mamba_d_conv=4,
              position_embedding_type="rope", residual_multiplier=0.5, logits_scaling=4.0, vocab_size=VOCAB)
VARIANTS = {
    "dense": ("GraniteMoeHybridConfig", dict(num_local_experts=0, shared_intermediate_size=96)),
    # Experts beside the shared MLP; biased Mamba projections, dt clamped from below.
    "moe": ("GraniteMoeHybridConfig", dict(num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=48,
                                           intermediate_size=32, mamba_proj_bias=True, time_step_limit=[0.05, 100.0])),
    # Bamba: Llama's attention (rotated over half of each head) and MLP under its own names, no Granite scalars;
    # biased projections, dt clamped from above.
    "bamba": ("BambaConfig", dict(attn_layer_indices=[1], intermediate_size=96, attention_bias=True, mlp_bias=True,
                                  mamba_proj_bias=True, time_step_limit=[0.0, 0.5])),
}
_GRANITE_ONLY = ("layer_types", "position_embedding_type", "residual_multiplier", "logits_scaling")


def _overrides(variant: str) -> tuple[str, dict]:
    """The transformers config class and arguments of a tiny hybrid model of `variant`."""
    config_cls, kw = VARIANTS[variant]
    base = {k: v for k, v in HYBRID.items() if config_cls != "BambaConfig" or k not in _GRANITE_ONLY}
    return config_cls, {**base, **kw}
NEW_TOKENS = 10
PROMPTS = [np.random.default_rng(seed).integers(2, VOCAB, n).tolist() for seed, n in ((1, 21), (2, 13), (3, 30))]


_BUILT: dict[str, tuple] = {}


def _build(variant: str, tmp_path_factory) -> tuple:
    """(HF model, our config, our params, its directory) of a tiny Granite 4.0-H, built once per module."""
    if variant not in _BUILT:
        path = tmp_path_factory.mktemp(f"hybrid_{variant}")
        config_cls, kw = _overrides(variant)
        model = save_tiny_hf(config_cls, path, **kw)
        ckpt = open_checkpoint(str(path))
        cfg = ckpt.config()
        _BUILT[variant] = model, cfg, load_params(ckpt, cfg, jnp.float32, progress=False), str(path)
    return _BUILT[variant]


@pytest.fixture(scope="module", params=list(VARIANTS))
def hybrid(request, tmp_path_factory):
    return _build(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """The dense variant (the engine's tests: the MoE variant's Mamba layers are the same code)."""
    return _build("dense", tmp_path_factory)


def test_config_reads_the_mamba_layers(hybrid):
    model, cfg, _, _ = hybrid
    m = cfg.mamba
    assert m.layers == (0, 2, 3) and cfg.attention_layers == (1,)
    assert (m.num_heads, m.head_dim, m.state_size, m.n_groups, m.conv_kernel) == (8, 16, 16, 2, 4)
    assert (m.proj_bias, m.time_step_min, m.time_step_max) == {
        "granitemoehybrid": (True, 0.05, 100.0) if getattr(model.config, "num_local_experts", 0) else
        (False, 0.0, np.inf), "bamba": (True, 0.0, 0.5)}[cfg.family]
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    # The pages hold the attention layer only.
    assert KVCache.bytes_per_page(cfg, 8, jnp.float32) == 8 * cfg.num_kv_heads * 2 * cfg.head_dim * 4


def test_logits_match_transformers(hybrid):
    from tests.modelrun import prompt_logits

    model, cfg, params, _ = hybrid
    ids = (PROMPTS[2] + PROMPTS[0]) * 2  # 102 tokens: two of the scan's chunks
    ours, ref = prompt_logits(cfg, params, ids), hf_logits(model, ids)
    assert rel_err(ours, ref) < 1e-4
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_chunks_and_batches_equal_one_whole_prompt(dense):
    """A prompt in chunks of 7, 1 and the rest (its states carried in its slot between steps) gives the logits of
    the whole prompt at once; two prompts in one step give each one's logits alone. 100 tokens in 128-token steps:
    the scan's two chunks of 64 (`mamba.CHUNK`) split the prompt, alone and after the other prompt."""
    _, cfg, params, _ = dense
    a, b = (PROMPTS[2] * 4)[:100], PROMPTS[1]
    pages_a, pages_b = pages_for(0, len(a), 8), pages_for(1, len(b), 8)

    def pool():
        return KVCache.allocate(cfg, 128, 8, jnp.float32, state_slots=3)

    def run(kv, seqs):  # (one compiled shape for every call)
        return run_chunks(cfg, params, kv, seqs, 8, num_tokens=128, num_seqs=2, pages_per_seq=16)

    whole, _ = run(pool(), [(a, 0, pages_a)])
    kv, chunks = pool(), []
    for start, end in ((0, 7), (7, 8), (8, len(a))):
        logits, kv = run(kv, [(a[start:end], start, pages_a)])
        chunks.append(logits[: end - start])
    np.testing.assert_allclose(np.concatenate(chunks), whole[: len(a)], rtol=2e-5, atol=2e-5)
    both, _ = run(pool(), [(b, 0, pages_b), (a, 0, pages_a)])
    alone_b, _ = run(pool(), [(b, 0, pages_b)])
    np.testing.assert_allclose(both[: len(b)], alone_b[: len(b)], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(both[len(b): len(b) + len(a)], whole[: len(a)], rtol=2e-5, atol=2e-5)


def _engine(cfg, params, path, pages: int = 40, **kw) -> LLMEngine:
    """An engine of `pages` pages besides its states (`kw`: other EngineArgs)."""
    loaded = LoadedModel(path, cfg.family, cfg, params, fake_tokenizer(), jnp.float32, 0.0)
    args = EngineArgs(**{**dict(
        max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, page_size=8, num_scheduler_steps=4,
        dtype="float32", warmup=False, compile_cache_dir=None), **kw})
    budget = pages * KVCache.bytes_per_page(cfg, 8, jnp.float32) + state_layout(cfg, args, jnp.float32).bytes
    return LLMEngine(dataclasses.replace(args, kv_cache_memory_bytes=budget), loaded=loaded, progress=False)


def _greedy(engine, prompts=PROMPTS) -> list[list[int]]:
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, greedy)
    final = drain(engine)
    return [list(final[str(i)].outputs[0].token_ids) for i in range(len(prompts))]


@pytest.mark.parametrize("backend", ["xla", "pallas_interpret"])
def test_engine_greedy_equals_transformers(dense, backend):
    """Chunked prefills (16-token steps) beside decodes, then the device's decode loop of 4 steps, three requests in
    one batch: transformers' greedy tokens; every state slot is back when they are done; the pages' budget holds
    the states beside them; prefix caching is off. On the XLA backend the prompts are scanned token by token, on
    the Pallas ones (here its interpreter) chunk by chunk."""
    model, cfg, params, path = dense
    expected = [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    engine = _engine(cfg, params, path, attention_backend=backend, enable_prefix_caching=False)
    assert engine.scheduler.cache is None and engine.runner.cfg.num_pages == 40
    assert engine.runner.kv.ssm.shape == (3, 5, 8, 16, 16) and engine.runner.kv.k.shape[0] == 1
    assert _greedy(engine) == expected
    assert sorted(engine.scheduler.states.free) == [1, 2, 3, 4]
    # Again on the same engine (slots reused, their old states not read): the same tokens, one by one too.
    assert _greedy(engine) == expected
    assert [_greedy(engine, [p])[0] for p in PROMPTS[:2]] == expected[:2]


@pytest.mark.parametrize("caching", [False, True])
def test_preempted_requests_start_again_and_give_the_same_tokens(dense, caching):
    """Pages for barely two of the three requests: one is preempted (its slot given back) and recomputed from its
    first token (or, with prefix caching, from its prompt's kept states if its pages were not evicted), and every
    request still gets transformers' tokens."""
    model, cfg, params, path = dense
    expected = [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    engine = _engine(cfg, params, path, pages=10, enable_prefix_caching=caching)
    assert _greedy(engine) == expected
    assert engine.stats().num_preemptions > 0
    assert sorted(engine.scheduler.states.free) == [1, 2, 3, 4]


def test_what_a_hybrid_model_refuses(dense):
    _, cfg, params, path = dense
    with pytest.raises(UnsupportedModelError, match="speculative decoding by mtp is not supported"):
        _engine(cfg, params, path, speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    with pytest.raises(ValueError, match="max_mamba_cache_size must be an integer >= 0, got -1"):
        EngineArgs(max_mamba_cache_size=-1)
    # The CPU's default pages come on top of the states; a budget given holds both.
    from jaxserve.engine.kv_budget import CPU_DEFAULT_KV_BYTES, kv_cache_pages

    per_page = KVCache.bytes_per_page(cfg, 16, jnp.float32)
    assert kv_cache_pages(EngineArgs(), cfg, jnp.float32, 0, states=1 << 30) == CPU_DEFAULT_KV_BYTES // per_page
    assert kv_cache_pages(EngineArgs(kv_cache_memory_bytes=(1 << 20) + 10 * per_page), cfg, jnp.float32, 0,
                          states=1 << 20) == 10
    with pytest.raises(ValueError, match=r"budget \(1048576 bytes, 1048576 of them the Mamba states\) holds no two"):
        kv_cache_pages(EngineArgs(kv_cache_memory_bytes=1 << 20), cfg, jnp.float32, 0, states=1 << 20)
    off = _engine(cfg, params, path, max_mamba_cache_size=0)  # (no states kept: no prefix cache)
    assert off.scheduler.cache is None and off.runner.kv.ssm.shape[1] == 1 + 4
    with pytest.raises(ValueError, match="state slot"):
        inputs = dataclasses.replace(ModelInputs.build([([1, 2], 0, [1])], 8), state_slots=None)
        jitted()(params, KVCache.allocate(cfg, 4, 8, jnp.float32, state_slots=2), inputs, cfg, "xla")
    with pytest.raises(UnsupportedModelError, match="mamba step_norms 'rms' is not supported"):
        dataclasses.replace(cfg, mamba=dataclasses.replace(cfg.mamba, step_norms="rms"))


@pytest.mark.parametrize("variant", ["moe", "bamba"])
def test_convert_writes_the_sources_tensors(tmp_path, variant):
    """`jaxserve convert` of a Granite 4.0-H with experts, and of a Bamba: every tensor as the checkpoint had it
    (the Mamba layers' apart from the attention layer's, the experts fused back; Bamba's names for Llama's
    modules); transformers reads the output as the model."""
    from safetensors import safe_open

    from tests.test_convert import convert, write_tiny_tokenizer

    src, out = tmp_path / "src", tmp_path / "out"
    config_cls, kw = _overrides(variant)
    model = save_tiny_hf(config_cls, src, **kw)
    write_tiny_tokenizer(src)
    convert(src, out)
    with safe_open(str(out / "model.safetensors"), "numpy") as f, safe_open(str(src / "model.safetensors"), "numpy") as g:
        assert sorted(f.keys()) == sorted(g.keys()) and any(".mamba.conv1d." in k for k in g.keys())
        for key in g.keys():
            np.testing.assert_array_equal(f.get_tensor(key), g.get_tensor(key), err_msg=key)
    again = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert rel_err(hf_logits(again, PROMPTS[2]), hf_logits(model, PROMPTS[2])) < 1e-6


def _run(engine, prompt: list[int], rid: str) -> tuple[list[int], int]:
    """One request's greedy tokens and its prompt tokens served from the prefix cache."""
    engine.add_request(rid, prompt, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    out = drain(engine)[rid]
    return list(out.outputs[0].token_ids), out.metrics.num_cached_tokens


def test_prefix_cache_hits_give_the_tokens_of_misses(dense):
    """Prefix caching for a hybrid model: a prompt's states are kept at its last page boundary before its last token
    (24 of 30 tokens: a prefill chunk ends there); the same prompt again, and a next turn that extends it, start
    from there (24 cached tokens) and give transformers' tokens. With one snapshot kept, another prompt's takes its
    place: the next turn then misses, and still gives the same tokens."""
    model, cfg, params, path = dense
    first = PROMPTS[2]
    engine = _engine(cfg, params, path)
    assert engine.scheduler.snapshots is not None and engine.runner.kv.ssm.shape[1] == 1 + 4 + 4
    want = hf_greedy(model, first, NEW_TOKENS)
    assert _run(engine, first, "a") == (want, 0)
    assert len(engine.scheduler.snapshots) == 1
    assert _run(engine, first, "b") == (want, 24)
    turn = first + want + [7, 8, 9]
    turn_want = hf_greedy(model, turn, NEW_TOKENS)
    assert _run(engine, turn, "c") == (turn_want, 24)
    engine.check_integrity()
    # One snapshot slot: the second prompt's states replace the first's.
    small = _engine(cfg, params, path, max_mamba_cache_size=1)
    assert small.runner.kv.ssm.shape[1] == 1 + 4 + 1
    assert _run(small, first, "a") == (want, 0)
    assert _run(small, PROMPTS[0], "b")[0] == hf_greedy(model, PROMPTS[0], NEW_TOKENS)
    assert _run(small, turn, "c") == (turn_want, 0)
    assert _run(small, turn, "d") == (turn_want, 40)  # (the turn's own states, kept at 40 of its 43 tokens)
    small.check_integrity()


def test_aborts_samples_and_async_steps_leave_the_states_right(dense):
    """An aborted request (mid-prompt) gives its slot back and the next request in that slot starts from zero; two
    samples of one prompt (n=2, greedy) each get the same tokens; the next step dispatched before this one's outputs
    are read (async scheduling) changes nothing."""
    model, cfg, params, path = dense
    want = hf_greedy(model, PROMPTS[2], NEW_TOKENS)
    engine = _engine(cfg, params, path, async_scheduling=True)
    engine.add_request("gone", PROMPTS[0] * 2, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))
    engine.step()  # its first 16-token chunk
    assert engine.scheduler.get_request("gone").state_slot and engine.abort_request("gone") is not None
    assert sorted(engine.scheduler.states.free) == [1, 2, 3, 4]
    engine.add_request("two", PROMPTS[2], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, n=2, ignore_eos=True))
    out = drain(engine)["two"]
    assert [list(c.token_ids) for c in out.outputs] == [want, want]
    engine.check_integrity()


def test_bfloat16_states_stay_close_to_float32(dense):
    """`--mamba-cache-dtype bfloat16`: the states kept in bfloat16 (computed in float32 within a step), half the
    memory; prompts in 16-token chunks and the decode loop give the float32 states' greedy tokens, and the prompt
    logprobs stay within 0.05 of theirs."""
    _, cfg, params, path = dense
    p = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    outs = {}
    for dtype in ("float32", "bfloat16"):
        engine = _engine(cfg, params, path, mamba_cache_dtype=dtype, enable_prefix_caching=False)
        assert engine.runner.kv.conv.dtype == engine.runner.kv.ssm.dtype == jnp.dtype(dtype)
        engine.add_request("a", PROMPTS[2], p)
        outs[dtype] = drain(engine)["a"]
    assert outs["bfloat16"].outputs[0].token_ids == outs["float32"].outputs[0].token_ids
    got, want = ([e[t].logprob for e, t in zip(o.prompt_logprobs[1:], PROMPTS[2][1:], strict=True)]
                 for o in (outs["bfloat16"], outs["float32"]))
    assert 0 < np.max(np.abs(np.subtract(got, want))) < 0.05
    args = EngineArgs(mamba_cache_dtype="bfloat16", mamba_ssm_cache_dtype="float32")
    assert state_layout(cfg, args, jnp.float32).bytes < state_layout(cfg, EngineArgs(), jnp.float32).bytes
    with pytest.raises(ValueError, match="mamba_cache_dtype must be auto, float32, bfloat16 or float16, got 'fp8'"):
        EngineArgs(mamba_cache_dtype="fp8")


def test_prompt_embeddings_give_what_their_tokens_give(dense):
    """`--enable-prompt-embeds`: a prompt given as its tokens' embedding rows (in 16-token chunks, its states
    carried between them) gives the token prompt's greedy tokens, alone and again from the prefix cache."""
    model, cfg, params, path = dense
    want = hf_greedy(model, PROMPTS[2], NEW_TOKENS)
    engine = _engine(cfg, params, path, enable_prompt_embeds=True)
    rows = np.asarray(params.embed)[PROMPTS[2]]
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for rid, cached in (("a", 0), ("b", 24)):
        engine.add_request(rid, rows, greedy)
        out = drain(engine)[rid]
        assert (list(out.outputs[0].token_ids), out.metrics.num_cached_tokens) == (want, cached)
    engine.check_integrity()


def test_a_float8_cache_on_calculated_scales(dense):
    """`--kv-cache-dtype fp8 --calculate-kv-scales`: the attention layer's scales measured (the Mamba layers hold no
    pages); a prompt's logprobs within 0.1 of the float32 cache's (the tiny model's near-flat logits let the float8
    error change greedy tokens later on)."""
    _, cfg, params, path = dense
    p = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    logprobs = []
    for kw in ({}, dict(kv_cache_dtype="fp8", calculate_kv_scales=True)):
        engine = _engine(cfg, params, path, enable_prefix_caching=False, **kw)
        engine.add_request("a", PROMPTS[2], p)
        out = drain(engine)["a"]
        logprobs.append([e[t].logprob for e, t in zip(out.prompt_logprobs[1:], PROMPTS[2][1:], strict=True)])
    scales = engine.model.params.attn_layers
    assert scales.k_scale.shape == scales.v_scale.shape == (1,) and float(scales.k_scale[0]) != 1.0
    assert engine.runner.kv.dtype == jnp.float8_e4m3fn
    assert 0 < np.max(np.abs(np.subtract(*logprobs))) < 0.1


def test_weights_quantized_at_load(dense):
    """`--quantization int8` on a hybrid checkpoint: the attention layers' projections (on their own stack) and the
    MLPs' held int8, the Mamba layers' in float; prompt logprobs within 0.05 of the float model's."""
    from jaxserve.models.quantized import QuantizedWeight

    held, difference = int8_prompt_logprobs(dense[3])
    assert isinstance(held.attn_layers.wq, QuantizedWeight) and isinstance(held.layers.w_up, QuantizedWeight)
    assert not isinstance(held.mamba_layers.m_in, QuantizedWeight)
    assert 0 < difference < 0.05


def int8_prompt_logprobs(path: str) -> tuple:
    """The parameters an engine holds of checkpoint `path` under `--quantization int8`, and the largest difference
    of its prompt logprobs from the float model's."""
    from tests.fake_model import save_fake_tokenizer

    save_fake_tokenizer(path)
    p = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    logprobs = []
    for quantization in (None, "int8"):
        engine = LLMEngine(EngineArgs(model=path, quantization=quantization, max_num_seqs=4, max_num_batched_tokens=16,
                                      max_model_len=64, kv_cache_memory_bytes=1 << 22, dtype="float32", warmup=False),
                           progress=False)
        engine.add_request("a", PROMPTS[2], p)
        out = drain(engine)["a"]
        logprobs.append([e[t].logprob for e, t in zip(out.prompt_logprobs[1:], PROMPTS[2][1:], strict=True)])
    return engine.model.params, float(np.max(np.abs(np.subtract(*logprobs))))


@pytest.mark.parametrize("method", ["suffix", "draft_model"])
def test_drafts_change_nothing_but_the_number_of_steps(dense, tmp_path, method):
    """Speculative decoding (suffix drafts, or a small dense draft model's, verified as chunks): a request's states
    are kept aside before the step that verifies its drafts, and put back when one is rejected (the tokens it took
    then computed again), so the tokens are transformers' greedy ones. The same prompts twice: the second time,
    suffix drafts from the earlier responses, some taken and some rejected; the random draft model's are rejected."""
    from tests.fake_model import save_fake_tokenizer

    model, cfg, params, path = dense
    prompts = [(p * 3)[:40] for p in PROMPTS]
    want = [hf_greedy(model, p, 16) for p in prompts]
    spec = {"method": "suffix"}
    if method == "draft_model":
        save_tiny_hf("LlamaConfig", tmp_path, vocab_size=VOCAB, num_hidden_layers=1)
        save_fake_tokenizer(str(tmp_path))
        spec = {"model": str(tmp_path)}
    engine = _engine(cfg, params, path, max_model_len=96, speculative_config={**spec, "num_speculative_tokens": 3})
    assert engine.args.speculative_config.chunked and engine.runner.kv.ssm.shape[1] == 1 + 4 + 4 + 4
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    for again in (False, True):
        for i, p in enumerate(prompts):
            engine.add_request(f"{i}{again}", p, greedy)
        final = drain(engine)
        assert [list(final[f"{i}{again}"].outputs[0].token_ids) for i in range(len(prompts))] == want
    stats = engine.stats()
    assert stats.spec_num_draft_tokens > stats.spec_num_accepted_tokens >= (method == "suffix")
    assert sorted(engine.scheduler.states.free) == [1, 2, 3, 4]
    engine.check_integrity()


def test_nothing_compiles_after_warmup(dense):
    """Warmed up and strict (a compile after warmup raises): prompts whose states are kept and taken again from the
    prefix cache (the state copies between steps) and the decode loop compile nothing more."""
    model, cfg, params, path = dense
    engine = _engine(cfg, params, path, warmup=True, strict_compile=True)
    want = hf_greedy(model, PROMPTS[2], NEW_TOKENS)
    assert [_run(engine, PROMPTS[2], rid) for rid in "ab"] == [(want, 0), (want, 24)]
    assert engine.stats().compilations_after_warmup == 0
