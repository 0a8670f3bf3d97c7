"""LongRoPE models (Phi-3's 128k models, Phi-3.5, Phi-4-mini) served past their original context, against HF
transformers.

transformers picks the short or the long factors per forward call: the prompt's call takes the long ones when the
prompt is longer than the original context, each generated token's call from the token at that context on. The
engine gives each token that set whatever chunk, batch or decode loop computes it, and keeps the KV of long
prompts in a prefix-cache namespace of their own. A tiny random Phi-3 of original context 24 (so the factors
switch within a few pages), over half of each head's dims, as Phi-4-mini's.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from jaxserve.engine.llm_engine import LLMEngine  # noqa: E402
from jaxserve.engine.model_loading import LoadedModel  # noqa: E402
from jaxserve.engine_args import EngineArgs  # noqa: E402
from jaxserve.loader import load_params, open_checkpoint  # noqa: E402
from jaxserve.models.inputs import KVCache  # noqa: E402
from jaxserve.rope import prompt_cache_salt  # noqa: E402
from jaxserve.sampling_params import SamplingParams  # noqa: E402
from tests.fake_model import VOCAB, fake_tokenizer  # noqa: E402
from tests.modelrun import drain  # noqa: E402
from tests.test_model_families import save_tiny_hf  # noqa: E402

ORIGINAL = 24
PHI3_LONGROPE = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, partial_rotary_factor=0.5,
                     original_max_position_embeddings=ORIGINAL, vocab_size=VOCAB,
                     rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.5, 3.0, 1.2],
                                   "long_factor": [9.0, 2.0, 17.0, 5.0]})


def prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, VOCAB, n).tolist()


def hf_steps(model, ids: list[int], generated: list[int]) -> np.ndarray:
    """Log-probabilities [len(generated), V] of each generated token's step as transformers' generation computes
    them: the prompt in one call, then a call per token on the cache."""
    rows = []
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
        rows.append(out.logits[0, -1])
        for t in generated[:-1]:
            out = model(torch.tensor([[t]]), cache=out.cache, use_cache=True)
            rows.append(out.logits[0, -1])
    return torch.log_softmax(torch.stack(rows).double(), -1).numpy()


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    """(HF model, loaded model) of a tiny LongRoPE Phi-3."""
    path = tmp_path_factory.mktemp("phi3_longrope")
    model = save_tiny_hf("Phi3Config", path, **PHI3_LONGROPE)
    ckpt = open_checkpoint(str(path))
    cfg = ckpt.config()
    assert (cfg.long_rope_context, cfg.max_position_embeddings, cfg.rotary_dims) == (ORIGINAL, 256, 8)
    loaded = LoadedModel(str(path), "phi3", cfg, load_params(ckpt, cfg, jnp.float32, progress=False),
                         fake_tokenizer(), jnp.float32, 0.0)
    return model, loaded


def engine_of(loaded, **kw) -> LLMEngine:
    cfg = loaded.config
    args = EngineArgs(**{**dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, page_size=8,
                                kv_cache_memory_bytes=40 * KVCache.bytes_per_page(cfg, 8, jnp.float32),
                                num_scheduler_steps=4, dtype="float32", warmup=False, compile_cache_dir=None), **kw})
    return LLMEngine(args, loaded=loaded, progress=False)


def run(engine: LLMEngine, prompts: dict[str, tuple[list[int], int]]) -> dict:
    """Greedy outputs by request id, all requests queued together."""
    for rid, (ids, n) in prompts.items():
        engine.add_request(rid, ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=0))
    return drain(engine)


def assert_as_transformers(model, ids: list[int], out) -> None:
    """Each generated token is transformers' greedy choice after the tokens before it, with its log-probability."""
    tokens = list(out.outputs[0].token_ids)
    ref = hf_steps(model, ids, tokens)
    ours = np.array([lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, tokens, strict=True)])
    np.testing.assert_allclose(ours, ref[np.arange(len(tokens)), tokens], atol=2e-4)
    best = ref.max(-1)
    assert np.all(ref[np.arange(len(tokens)), tokens] >= best - 2e-4), "a token is not transformers' greedy choice"


def test_long_prompts_cache_namespace():
    assert prompt_cache_salt(None, 1000, "s") == "s"  # a model without LongRoPE, or served within its context
    assert prompt_cache_salt(ORIGINAL, ORIGINAL, None) is None
    assert prompt_cache_salt(ORIGINAL, ORIGINAL + 1, None) == "longrope:"
    assert prompt_cache_salt(ORIGINAL, ORIGINAL + 1, "") == "longrope:|"  # not the unsalted namespace
    assert prompt_cache_salt(ORIGINAL, ORIGINAL + 1, "tenant") == "longrope:|tenant"
    with pytest.raises(ValueError, match="salts beginning 'longrope:'"):
        prompt_cache_salt(None, 3, "longrope:|tenant")


def test_generation_past_the_original_context_equals_transformers(phi3):
    """A short prompt generating past the original context (the factors switch in the device's decode loop) and a
    long prompt (chunked 16 + 16 + 8, every token long), batched: each as transformers generates it."""
    model, loaded = phi3
    engine = engine_of(loaded)
    assert engine.runner.cfg.long_rope
    short, long = prompt(20, 1), prompt(40, 2)
    final = run(engine, {"short": (short, 20), "long": (long, 12)})
    assert_as_transformers(model, short, final["short"])
    assert_as_transformers(model, long, final["long"])
    # The set matters here: the short prompt's tokens in one call of its whole sequence (every token long, as a
    # prompt of that length takes them) give other log-probabilities.
    tokens = list(final["short"].outputs[0].token_ids)
    with torch.no_grad():
        whole = torch.log_softmax(model(torch.tensor([short + tokens[:-1]])).logits[0, len(short) - 1:].double(), -1)
    assert np.abs(whole.numpy() - hf_steps(model, short, tokens)).max() > 0.05


def test_long_prompts_are_cached_apart(phi3):
    """A long prompt never reads the pages a shorter prompt of the same tokens wrote (their keys took the short
    factors); long prompts share theirs, short ones theirs."""
    model, loaded = phi3
    engine = engine_of(loaded, enable_prefix_caching=True)
    base = prompt(20, 3)
    first = run(engine, {"short": (base, 4)})["short"]
    long = base[:16] + prompt(24, 4)  # its first two pages are the short prompt's
    again = base[:16] + prompt(4, 5)
    out = run(engine, {"long": (long, 6), "short_again": (again, 4)})
    assert out["long"].metrics.num_cached_tokens == 0
    assert out["short_again"].metrics.num_cached_tokens == 16
    long2 = long[:32] + prompt(8, 6)
    out2 = run(engine, {"long2": (long2, 6)})["long2"]
    assert out2.metrics.num_cached_tokens == 32
    for ids, o in ((base, first), (long, out["long"]), (again, out["short_again"]), (long2, out2)):
        assert_as_transformers(model, ids, o)


def test_within_the_original_context_steps_carry_no_flags(phi3):
    """An engine whose longest sequence fits the original context keeps the short factors and its steps' inputs
    as any model's (and its prompts in the plain cache namespace)."""
    model, loaded = phi3
    engine = engine_of(loaded, max_model_len=ORIGINAL, max_num_batched_tokens=8)
    assert engine.long_rope_context is None and not engine.runner.cfg.long_rope
    ids = prompt(16, 7)
    assert_as_transformers(model, ids, run(engine, {"r": (ids, 8)})["r"])


def test_a_long_prompts_pages_move_between_engines(phi3):
    """Disaggregated prefill: the pages a long prompt's prefill cached (in the long prompts' namespace) are found,
    sent and cached by the receiver where its own request of that prompt reads them."""
    from jaxserve.engine.kv_transfer import (
        KVLayout,
        KVPayload,
        TransferMeta,
        import_pages,
        pin_prompt,
        read_pages,
        release_import,
    )

    model, loaded = phi3
    sender, receiver = engine_of(loaded, enable_prefix_caching=True), engine_of(loaded, enable_prefix_caching=True)
    ids = prompt(40, 8)
    run(sender, {"prefill": (ids, 1)})
    pin = pin_prompt(sender, ids, None)
    assert pin is not None and len(pin.token_ids) == 32  # the full pages before the last prompt token
    k, v = read_pages(sender, pin)
    meta = TransferMeta("t", "r", pin.token_ids, pin.pages, KVLayout.of_engine(sender), "m", "http://127.0.0.1:1",
                        None, len(ids))
    imported = import_pages(receiver, KVPayload.build(meta, k, v))
    assert imported is not None and imported.pages_written == 4
    release_import(receiver, imported)  # cached, evictable: nothing else runs here
    out = run(receiver, {"decode": (ids, 6)})["decode"]
    assert out.metrics.num_cached_tokens == 32
    assert_as_transformers(model, ids, out)
