"""Llama 4's language model (`config_llama4`) against transformers.

A tiny random model with chunks of 8 positions, its fourth layer unrotated with its queries scaled from position 8 on,
weightless q/k norms after the rotation, 4 experts (top-2, their inputs weighted) beside a shared expert: logits of a
40-token prompt, each part checked by the logits it changes; greedy tokens through the engine (chunked prefill across
chunk boundaries, batched decode; the xla backend and the Pallas kernels); the checkpoint written back; an image-text config's language model.
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from jaxserve.config import ModelConfig, UnsupportedModelError  # noqa: E402
from jaxserve.loader import HFDirectory, load_params  # noqa: E402
from tests.modelrun import prompt_logits  # noqa: E402
from tests.test_model_families import (  # noqa: E402
    assert_logits_match,
    assert_written_back,
    hf_logits,
    random_prompt,
    rel_err,
    save_tiny_hf,
    tiny_loaded,
)

TINY = dict(intermediate_size=24, intermediate_size_mlp=48, num_hidden_layers=4, head_dim=16, num_local_experts=4,
            num_experts_per_tok=2, attention_chunk_size=8, floor_scale=8, attn_scale=0.1, use_qk_norm=True,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_loaded(tmp_path_factory, "Llama4TextConfig", "llama4", **TINY)


def test_llama4_config(tiny):
    _, model, cfg, _ = tiny
    assert (cfg.family, cfg.no_rope_layers, cfg.attention_chunk, cfg.rope_qk_norm) == ("llama4", (1, 1, 1, 0), 8, True)
    assert cfg.layer_types == ("chunked_attention",) * 3 + ("full_attention",)
    assert [cfg.is_local(i) for i in range(4)] == [True, True, True, False]
    assert (cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size) == (4, 24, 24)
    assert (cfg.router_scoring, cfg.norm_topk_prob, cfg.query_scale_beta, cfg.query_scale_length) == (
        "sigmoid", False, 0.1, 8)
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    image_text = {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4",
                  "text_config": model.config.to_dict(), "vision_config": {"hidden_size": 32}}
    assert ModelConfig.from_hf(image_text) == cfg
    with pytest.raises(UnsupportedModelError, match="MoE layers \\[0, 2, 3\\] is not supported"):
        ModelConfig.from_hf({**model.config.to_dict(), "moe_layers": [0, 2, 3]})


def test_llama4_logits_match_transformers(tiny):
    """Transformers' logits (the routing weights on the experts' inputs: on their outputs, as other models weigh
    them, the SwiGLU experts give others); without the chunks, the temperature or the q/k norms, they are not."""
    _, model, cfg, params = tiny
    assert_logits_match(model, cfg, params, dict(attention_chunk=None), dict(query_scale_beta=0.0, query_scale_length=0),
                        dict(rope_qk_norm=False))


def test_llama4_engine_greedy_equals_transformers(tiny):
    """Prompts of 21 and 13 tokens prefilled 16 tokens a step (across chunks of 8), then decoded together, on the
    xla attention backend and on the Pallas kernels."""
    from tests.modelrun import tiny_engine
    from tests.test_engine_gemma import NEW_TOKENS, PROMPTS, _greedy, hf_greedy

    _, model, cfg, params = tiny
    expected = [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    assert _greedy(tiny_engine(cfg, params)) == expected
    # The Pallas kernel (interpreted) walks and masks the chunks too.
    assert _greedy(tiny_engine(cfg, params, backend="pallas_interpret")) == expected


def test_llama4_checkpoint_written_back_reads_the_same(tiny):
    """Our parameters as an HF checkpoint (rotary rows interleaved again, experts packed input-major under
    `feed_forward`) equal the checkpoint's own tensors."""
    path, _, cfg, params = tiny
    assert_written_back(path, cfg, params)


def test_llama4_maverick_layers_match_transformers(tmp_path):
    """Maverick's layout: experts in every second layer (`interleave_moe_layer_step` 2), the others a dense MLP of
    `intermediate_size_mlp`, with Scout's rotated, chunked and NoPE layers: logits stacked (a loop over groups of 4
    layers, each from its own stack) and unrolled (the layers in order), the engine's greedy tokens, the checkpoint
    and config written back."""
    from jaxserve.models.unstack import unstack_layers
    from tests.modelrun import tiny_engine
    from tests.test_engine_gemma import NEW_TOKENS, PROMPTS, _greedy, hf_greedy

    model = save_tiny_hf("Llama4TextConfig", tmp_path, **{**TINY, "interleave_moe_layer_step": 2})
    ckpt = HFDirectory(tmp_path)
    cfg = ckpt.config()
    assert (cfg.moe_layer_step, cfg.num_dense_layers, cfg.intermediate_size, cfg.moe_intermediate_size) == (2, 2, 48, 24)
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    params = load_params(ckpt, cfg, jnp.float32, progress=False)
    assert params.dense_layers.w_gate.shape == (2, 64, 48) and params.layers.router.shape[0] == 2
    ids = random_prompt()
    ref = hf_logits(model, ids)
    assert rel_err(prompt_logits(cfg, params, ids), ref) < 1e-4
    assert rel_err(prompt_logits(cfg, unstack_layers(params, cfg=cfg), ids), ref) < 1e-4
    assert_written_back(tmp_path, cfg, params)
    assert _greedy(tiny_engine(cfg, params, "scan")) == [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]


def test_llama4_adapters_equal_peft(tmp_path):
    """A LoRA adapter on the attention (q, k, v, o) and the shared expert (gate, up, down; under `feed_forward.` in
    Llama 4's names) equals PEFT's, prompt logprobs and greedy tokens, in one batch with the base model; one on the
    experts is refused by name."""
    import torch
    import transformers

    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.engine.lora_manager import LoRAError
    from jaxserve.engine_args import EngineArgs
    from tests.fake_model import save_fake_tokenizer
    from tests.test_lora import PEFT_ARGS, VOCAB, _adapter, adapter_equals_peft

    base = str(tmp_path / "base")
    save_tiny_hf("Llama4TextConfig", base, vocab_size=VOCAB, **TINY)
    save_fake_tokenizer(base)
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = _adapter(hf, str(tmp_path / "all"), 5, r=4, lora_alpha=8, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    assert any(".feed_forward.shared_expert.up_proj." in n for n, _ in peft_model.named_modules())
    from jaxserve.engine.lora_manager import _KEY  # (the image-text model's names too)

    assert _KEY.match("base_model.model.language_model.model.layers.3.feed_forward.shared_expert.up_proj.lora_B.weight"
                      ).groups() == ("3", "shared_expert.up_proj", "B")
    engine = LLMEngine(EngineArgs(model=base, lora_modules=(("all", str(tmp_path / "all")),), **PEFT_ARGS),
                       progress=False)
    adapter_equals_peft(engine, peft_model, "all", 7, atol=3e-5)
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    _adapter(hf, str(tmp_path / "experts"), 6, r=2, target_modules=[],
             target_parameters=["feed_forward.experts.down_proj"])
    with pytest.raises(LoRAError, match="experts"):
        engine.loras.load("experts", str(tmp_path / "experts"))
    engine.check_integrity()
