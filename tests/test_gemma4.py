"""Gemma 4 (`Gemma4ForCausalLM`, `config_gemma4`) against HF transformers: windowed layers of 16-wide heads (4 KV
heads) and full-attention layers of 32-wide heads (1 KV head, its keys as values), each a pool row's 64 dims viewed
as 2 heads of 32 (the one head written twice), the full layers' proportional rotary (4 of 16 pairs turned), values
normed without weight, each layer's output scale; the MoE form's experts beside the MLP. Logits of a 40-token
prompt (and not them without the window, with the full layers rotated as the windowed ones, or the MoE's expert
scales left out), the engine's greedy tokens past the window, the checkpoint and config written back, the E2B/E4B
forms refused by name."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from jaxserve.config import ModelConfig  # noqa: E402
from jaxserve.errors import UnsupportedModelError  # noqa: E402
from tests.modelrun import prompt_logits  # noqa: E402
from tests.test_model_families import (  # noqa: E402
    assert_engine_greedy,
    assert_logits_match,
    assert_written_back,
    hf_logits,
    random_prompt,
    rel_err,
    tiny_loaded,
)

TINY = dict(num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=16, global_head_dim=32,
            num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=8, final_logit_softcapping=30.0,
            layer_types=["sliding_attention", "full_attention"] * 2, hidden_size_per_layer_input=0,
            num_kv_shared_layers=0, pad_token_id=0, bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_loaded(tmp_path_factory, "Gemma4TextConfig", "gemma4", **TINY)


def test_gemma4_config(tiny):
    _, _, cfg, params = tiny
    g = cfg.gemma4
    assert (g.head_dim, g.num_kv_heads, g.rope_pairs, g.k_eq_v) == (32, 1, 4, True)
    assert cfg.num_dense_layers == 2 and [cfg.stack_index(i, cfg.dense_layer(i)) for i in range(4)] == [0, 0, 1, 1]
    assert params.layers.wq.shape == (2, 64, 8, 16) and params.dense_layers.wq.shape == (2, 64, 8, 32)
    assert params.dense_layers.wv is None and params.layers.layer_scalar.shape == (2,)
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    with pytest.raises(UnsupportedModelError, match="page rows"):  # (3 heads of 32 do not fill a row of 64)
        ModelConfig.from_hf({**cfg.to_hf(), "num_global_key_value_heads": 3})
    with pytest.raises(UnsupportedModelError, match="sharing keys"):  # (no full-attention layer before the shared)
        ModelConfig.from_hf({**cfg.to_hf(), "num_kv_shared_layers": 3})


def test_gemma4_logits_match_transformers(tiny):
    """Transformers' logits on both attention backends; without the window, or with the full-attention layers'
    pairs all turned, they are not; nor with each layer's output scale left at one."""
    _, model, cfg, params = tiny
    g = dataclasses.replace(cfg.gemma4, rope_pairs=16)
    assert_logits_match(model, cfg, params, dict(sliding_window=10**6), dict(gemma4=g),
                        backends=("xla", "pallas_interpret"))
    unscaled = dataclasses.replace(params, layers=dataclasses.replace(
        params.layers, layer_scalar=np.ones_like(params.layers.layer_scalar)))
    ids = random_prompt()
    assert rel_err(prompt_logits(cfg, unscaled, ids), hf_logits(model, ids)) > 1e-3


def test_gemma4_checkpoint_written_back_reads_the_same(tiny):
    path, _, cfg, params = tiny
    assert_written_back(path, cfg, params)


def test_gemma4_engine_greedy_equals_transformers(tiny):
    """Prompts of 21 and 13 tokens prefilled 16 tokens a step (past the 8-key window), then decoded together."""
    _, model, cfg, params = tiny
    assert_engine_greedy(model, cfg, params, "scan")


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    return tiny_loaded(tmp_path_factory, "Gemma4TextConfig", "gemma4_moe", **TINY, enable_moe_block=True,
                       num_experts=4, top_k_experts=2, moe_intermediate_size=24)


def test_gemma4_moe_logits_and_checkpoint(tiny_moe):
    """Experts beside the MLP: transformers' logits (not them with the per-expert scales left at one), the
    checkpoint written back exactly (the experts packed, output-major, as transformers saves them), the engine's
    greedy tokens."""
    path, model, cfg, params = tiny_moe
    assert cfg.num_experts == 4 and params.dense_layers.we_gate.shape == (2, 4, 64, 24)
    assert_logits_match(model, cfg, params)
    flat = dataclasses.replace(params, layers=dataclasses.replace(
        params.layers, expert_scale=np.ones_like(params.layers.expert_scale)))
    ids = random_prompt()
    assert rel_err(prompt_logits(cfg, flat, ids), hf_logits(model, ids)) > 1e-3
    assert_written_back(path, cfg, params)
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    assert_engine_greedy(model, cfg, params, "scan")


# E2B/E4B's form: 6 layers, the last 2 attending over layers 2's and 3's pages (holding none), each layer's own input
# embedding of 8 dims, the shared layers' MLPs twice as wide; windowed layers' 1 KV head of 16 and full-attention
# layers' 1 of 32 (values their own projection): rows of 32, each windowed key written twice.
SMALL = dict(TINY, num_hidden_layers=6, layer_types=["sliding_attention", "full_attention"] * 3, num_key_value_heads=1,
             attention_k_eq_v=False, num_global_key_value_heads=None, hidden_size_per_layer_input=8,
             vocab_size_per_layer_input=160, num_kv_shared_layers=2, use_double_wide_mlp=True)


@pytest.fixture(scope="module")
def tiny_small(tmp_path_factory):
    return tiny_loaded(tmp_path_factory, "Gemma4TextConfig", "gemma4_small", **SMALL)


def test_gemma4_per_layer_inputs_and_shared_keys(tiny_small):
    """Transformers' logits on both attention backends (not them without the per-layer inputs, nor with the shared
    layers attending over their own zero keys), the pool's 4 layers of 2 heads of 16, the checkpoint written back
    exactly, the engine's greedy tokens past the window."""
    path, model, cfg, params = tiny_small
    g = cfg.gemma4
    assert (g.ple_width, g.shared_layers, g.double_wide, g.k_eq_v) == (8, 2, True, False)
    assert cfg.attention_layers == (0, 1, 2, 3) and cfg.kv_pool_heads == 2
    assert params.ple_embed.shape == (160, 48) and params.layers.w_up.shape == (3, 64, 192)
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    with pytest.raises(UnsupportedModelError, match="float8 KV scales"):
        dataclasses.replace(cfg, kv_cache_scales=True)
    assert_logits_match(model, cfg, params, dict(gemma4=dataclasses.replace(g, shared_layers=0)),
                        backends=("xla", "pallas_interpret"))
    ids = random_prompt()
    unfed = dataclasses.replace(params, layers=dataclasses.replace(
        params.layers, ple_gate=np.zeros_like(params.layers.ple_gate)))
    assert rel_err(prompt_logits(cfg, unfed, ids), hf_logits(model, ids)) > 1e-3
    assert_written_back(path, cfg, params)
    assert_engine_greedy(model, cfg, params, "scan")


def test_gemma4_prefix_hits_equal_misses(tiny_small):
    """The E2B form's prompts served again from the prefix cache (the shared layers reading the cached pages of the
    layers they share) give the same greedy tokens."""
    from tests.modelrun import tiny_engine
    from tests.test_engine_gemma import NEW_TOKENS, PROMPTS, _greedy, hf_greedy

    _, model, cfg, params = tiny_small
    engine = tiny_engine(cfg, params, "scan", prefix_caching=True)
    expected = [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    assert _greedy(engine) == expected
    assert _greedy(engine) == expected and engine.scheduler.cache.hit_tokens > 0


def test_gemma4_image_text_checkpoint_serves_its_language_model(tmp_path):
    """A `Gemma4ForConditionalGeneration` checkpoint (its language model under `model.language_model`, a vision tower
    beside it): served as text, its logits the whole model's on a text prompt."""
    import torch
    import transformers

    from jaxserve.loader import HFDirectory, load_params
    from tests.test_model_families import TINY as BASE

    torch.manual_seed(0)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16)
    model = transformers.Gemma4ForConditionalGeneration(transformers.Gemma4Config(
        text_config={**BASE, **TINY}, vision_config=vision, audio_config=None)).eval()
    model.save_pretrained(tmp_path)
    ckpt = HFDirectory(tmp_path)
    cfg = ckpt.config()
    assert cfg.family == "gemma4" and cfg.gemma4.head_dim == 32
    params = load_params(ckpt, cfg, np.float32, progress=False)
    ids = random_prompt()
    assert rel_err(prompt_logits(cfg, params, ids), hf_logits(model, ids)) < 1e-4


@pytest.mark.parametrize("form", ["31b", "e2b"])
def test_gemma4_adapters_equal_peft(tmp_path, form):
    """A LoRA adapter on every projection (q, k, v where a layer has one, o, gate, up, down) equals PEFT's, prompt
    logprobs and greedy tokens, in one batch with the base model: the slots held at the wider kind's widths and cut
    to each layer's (the full-attention layers' keys, and so their values, take k's delta); E2B's form with its
    double-wide MLPs and shared layers (no k or v there), its layers scanned in their two stacks (the 31B form's
    unrolled)."""
    import torch
    import transformers

    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.engine_args import EngineArgs
    from tests.fake_model import save_fake_tokenizer
    from tests.test_lora import PEFT_ARGS, VOCAB, _adapter, adapter_equals_peft
    from tests.test_model_families import save_tiny_hf

    base = str(tmp_path / "base")
    settings = {k: v for k, v in (TINY if form == "31b" else SMALL).items() if k != "vocab_size_per_layer_input"}
    save_tiny_hf("Gemma4TextConfig", base, vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB, **settings)
    save_fake_tokenizer(base)
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = _adapter(hf, str(tmp_path / "all"), 5, r=4, lora_alpha=8, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    engine = LLMEngine(EngineArgs(model=base, lora_modules=(("all", str(tmp_path / "all")),), **PEFT_ARGS,
                                  **({"layer_loop": "scan"} if form == "e2b" else {})), progress=False)
    # (E2B's form to 3e-4: transformers' own float32 logprobs of it are 1.1e-4 from its float64 ones, ours 5e-5)
    adapter_equals_peft(engine, peft_model, "all", 7, atol=3e-5 if form == "31b" else 3e-4)
    engine.check_integrity()
