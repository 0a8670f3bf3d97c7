"""Llama 4's language model (`config_llama4`) against transformers.

A tiny random model with chunks of 8 positions, its fourth layer unrotated with its queries scaled from position 8 on,
weightless q/k norms after the rotation, 4 experts (top-2, their inputs weighted) beside a shared expert: logits of a
40-token prompt, each part checked by the logits it changes; greedy tokens through the engine (chunked prefill across
chunk boundaries, batched decode; the xla backend and the Pallas kernels); the checkpoint written back; an image-text config's language model.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from jaxserve.config import ModelConfig, UnsupportedModelError  # noqa: E402
from jaxserve.loader import HFDirectory, load_params  # noqa: E402
from jaxserve.models.inputs import KVCache  # noqa: E402
from tests.modelrun import prompt_logits  # noqa: E402
from tests.test_model_families import hf_logits, random_prompt, rel_err, save_tiny_hf  # noqa: E402

TINY = dict(intermediate_size=24, intermediate_size_mlp=48, num_hidden_layers=4, head_dim=16, num_local_experts=4,
            num_experts_per_tok=2, attention_chunk_size=8, floor_scale=8, attn_scale=0.1, use_qk_norm=True,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama4")
    model = save_tiny_hf("Llama4TextConfig", path, **TINY)
    ckpt = HFDirectory(path)
    cfg = ckpt.config()
    return path, model, cfg, load_params(ckpt, cfg, jnp.float32, progress=False)


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
    with pytest.raises(UnsupportedModelError, match="dense layers between its MoE layers"):
        ModelConfig.from_hf({**model.config.to_dict(), "interleave_moe_layer_step": 2, "moe_layers": None})


def test_llama4_logits_match_transformers(tiny):
    """Transformers' logits (the routing weights on the experts' inputs: on their outputs, as other models weigh
    them, the SwiGLU experts give others); without the chunks, the temperature or the q/k norms, they are not."""
    _, model, cfg, params = tiny
    ids = random_prompt()
    ref = hf_logits(model, ids)
    assert rel_err(prompt_logits(cfg, params, ids), ref) < 1e-4
    for change in (dict(attention_chunk=None), dict(query_scale_beta=0.0, query_scale_length=0),
                   dict(rope_qk_norm=False)):
        assert rel_err(prompt_logits(dataclasses.replace(cfg, **change), params, ids), ref) > 1e-3, change


def test_llama4_engine_greedy_equals_transformers(tiny):
    """Prompts of 21 and 13 tokens prefilled 16 tokens a step (across chunks of 8), then decoded together, on the
    xla attention backend and on the Pallas kernels."""
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.engine.model_loading import LoadedModel
    from jaxserve.engine_args import EngineArgs
    from tests.fake_model import fake_tokenizer
    from tests.test_engine_gemma import NEW_TOKENS, PROMPTS, _greedy, hf_greedy

    _, model, cfg, params = tiny
    expected = [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    loaded = LoadedModel("tiny", cfg.family, cfg, params, fake_tokenizer(), jnp.float32, 0.0)
    args = EngineArgs(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, page_size=8,
                      kv_cache_memory_bytes=24 * KVCache.bytes_per_page(cfg, 8, jnp.float32), num_scheduler_steps=4,
                      dtype="float32", warmup=False, compile_cache_dir=None)
    assert _greedy(LLMEngine(args, loaded=loaded, progress=False)) == expected
    # The Pallas kernel (interpreted) walks and masks the chunks too.
    pallas = LLMEngine(dataclasses.replace(args, attention_backend="pallas_interpret"), loaded=loaded, progress=False)
    assert _greedy(pallas) == expected


def test_llama4_checkpoint_written_back_reads_the_same(tiny):
    """Our parameters as an HF checkpoint (rotary rows interleaved again, experts packed input-major under
    `feed_forward`) equal the checkpoint's own tensors."""
    from safetensors.numpy import load_file

    from jaxserve.loader.keymap import hf_tensors
    from jaxserve.models.params import param_paths

    path, _, cfg, params = tiny
    saved = {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}
    written = dict(hf_tensors(cfg, {k: np.asarray(v) for k, v in param_paths(params).items()}))
    assert set(written) == set(saved)
    for name, t in written.items():
        np.testing.assert_array_equal(t, saved[name], err_msg=name)
