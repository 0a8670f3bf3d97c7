"""Gemma 2, Gemma 3 and Granite served by the engine against HF transformers' greedy tokens.

What sets Gemma apart from the other families happens per layer or per step: sliding and global layers
alternate (each layer's window static: an unrolled loop, or a loop over the repeating groups), attention logits are
soft-capped inside the attention kernel, Gemma 3's sliding layers rotate by their own base. Tiny random
models saved from transformers' config classes, prompts longer than the window, chunked prefill and
batched decode, on the XLA path and the generic Pallas kernel (interpreted). Granite scales its embeddings,
residual adds and logits, and sets its own attention scale.
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
from jaxserve.sampling_params import SamplingParams  # noqa: E402
from tests.fake_model import VOCAB, fake_tokenizer  # noqa: E402
from tests.modelrun import drain  # noqa: E402
from tests.test_model_families import FAMILIES, save_tiny_hf  # noqa: E402

NEW_TOKENS = 10
PROMPTS = [np.random.default_rng(seed).integers(2, VOCAB, n).tolist() for seed, n in ((1, 21), (2, 13))]


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """Greedy tokens by a full forward per token (no cache)."""
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids + out])).logits[0, -1]
            out.append(int(logits.argmax()))
    return out


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def gemma(request, tmp_path_factory):
    """(loaded model, HF greedy tokens per prompt)."""
    family = request.param
    path = tmp_path_factory.mktemp(family)
    config_cls, overrides = FAMILIES[family]
    model = save_tiny_hf(config_cls, path, vocab_size=VOCAB, **overrides)
    ckpt = open_checkpoint(str(path))
    cfg = ckpt.config()
    assert not cfg.uniform_layers and cfg.sliding_window == 8
    loaded = LoadedModel(str(path), family, cfg, load_params(ckpt, cfg, jnp.float32, progress=False),
                         fake_tokenizer(), jnp.float32, 0.0)
    return loaded, [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]


@pytest.mark.parametrize("backend", ["xla", "pallas_interpret"])
def test_engine_greedy_equals_transformers(gemma, backend):
    loaded, expected = gemma
    cfg = loaded.config
    args = EngineArgs(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, page_size=8,
                      kv_cache_memory_bytes=24 * KVCache.bytes_per_page(cfg, 8, jnp.float32), num_scheduler_steps=4,
                      dtype="float32", warmup=False, compile_cache_dir=None, attention_backend=backend)
    engine = LLMEngine(args, loaded=loaded, progress=False)
    # Unrolled on the CPU's XLA path; elsewhere a loop over the groups of a sliding and a global layer.
    assert engine.runner.cfg.layer_loop == ("unroll" if backend == "xla" else "scan")
    assert _greedy(engine) == expected  # the 21-token prompt is chunked: 16 + 5


def _greedy(engine) -> list[list[int]]:
    """The engine's greedy tokens for PROMPTS, batched."""
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, greedy)
    final = drain(engine)
    return [list(final[str(i)].outputs[0].token_ids) for i in range(len(PROMPTS))]


def test_granite_engine_greedy_equals_transformers(tmp_path):
    """Granite's scalars (embeddings, attention scale, residual, logits) through the engine's own layouts (each
    layer unrolled with fused projections on the CPU, one scanned layer elsewhere), chunked and batched."""
    config_cls, overrides = FAMILIES["granite"]
    for loop, engine, expected in engines_by_layer_loop(tmp_path, config_cls, overrides):
        assert _greedy(engine) == expected, loop


@pytest.mark.parametrize("family", ["olmo2", "olmo3", "cohere2"])
def test_olmo_engine_greedy_equals_transformers(tmp_path, family):
    """OLMo 2's norms after attention and the MLP only, and its q and k normed over all heads, through the engine's
    layouts (unrolled with fused projections, and scanned), chunked and batched; OLMo 3's windowed layers too (a
    loop over each group of three windowed layers and a global one, when scanned); Command R7B's global layers
    without rotary embedding (as EXAONE 4's, whose logits test_model_families checks), its attention and MLP side
    by side."""
    config_cls, overrides = FAMILIES[family]
    for loop, engine, expected in engines_by_layer_loop(tmp_path, config_cls, overrides):
        assert _greedy(engine) == expected, loop


def engines_by_layer_loop(path, config_cls: str, overrides: dict):
    """A tiny model of `transformers.<config_cls>` saved at `path`, served by an engine with its layers unrolled,
    then by one with them scanned: (the layer loop, the engine, transformers' greedy tokens for PROMPTS) each."""
    model = save_tiny_hf(config_cls, path, **{**overrides, "vocab_size": VOCAB})
    ckpt = open_checkpoint(str(path))
    cfg = ckpt.config()
    loaded = LoadedModel(str(path), cfg.family, cfg, load_params(ckpt, cfg, jnp.float32, progress=False),
                         fake_tokenizer(), jnp.float32, 0.0)
    expected = [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    for loop in ("unroll", "scan"):
        args = EngineArgs(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, page_size=8,
                          kv_cache_memory_bytes=24 * KVCache.bytes_per_page(cfg, 8, jnp.float32),
                          num_scheduler_steps=4, dtype="float32", warmup=False, compile_cache_dir=None, layer_loop=loop)
        yield loop, LLMEngine(args, loaded=loaded, progress=False), expected
