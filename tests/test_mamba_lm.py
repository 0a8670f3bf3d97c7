"""Models of Mamba layers alone (`config_mamba_lm`) against HF transformers: Mamba (the selective scan, no norms on
its step), Falcon Mamba (dt, B and C RMSNormed without weights) and Mamba-2 (SSD, the gated norm per group). Logits
(and not them with the norms turned the other way), the checkpoint written back, and the engine, whose pages hold
nothing: its greedy tokens in one batch, again from the prefix cache's kept states, the states' budget refused by
name."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxserve.config import ModelConfig, UnsupportedModelError  # noqa: E402
from jaxserve.engine.hybrid import state_layout  # noqa: E402
from jaxserve.engine.llm_engine import LLMEngine  # noqa: E402
from jaxserve.engine.model_loading import LoadedModel  # noqa: E402
from jaxserve.engine_args import EngineArgs  # noqa: E402
from jaxserve.models.inputs import KVCache  # noqa: E402
from tests.fake_model import VOCAB, fake_tokenizer  # noqa: E402
from tests.modelrun import prompt_logits  # noqa: E402
from tests.test_engine_gemma import hf_greedy  # noqa: E402
from tests.test_hybrid import NEW_TOKENS, PROMPTS, _greedy, _run  # noqa: E402
from tests.test_model_families import assert_written_back, hf_logits, rel_err, tiny_loaded  # noqa: E402

SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, state_size=8, expand=2,
             conv_kernel=4, pad_token_id=0, bos_token_id=1, eos_token_id=2)
VARIANTS = {
    # 128 channels, a step of rank 8; biased projections
    "mamba": ("MambaConfig", dict(time_step_rank=8, use_bias=True)),
    # ... its step, B and C normed; an untied head
    "falcon_mamba": ("FalconMambaConfig", dict(time_step_rank=8, mixer_rms_eps=1e-5, tie_word_embeddings=False)),
    # 8 heads of 16 channels in 2 groups; dt clamped from below
    "mamba2": ("Mamba2Config", dict(num_heads=8, head_dim=16, n_groups=2, time_step_limit=(0.05, 100.0))),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def mamba(request, tmp_path_factory):
    config_cls, kw = VARIANTS[request.param]
    path, model, cfg, params = tiny_loaded(tmp_path_factory, config_cls, request.param, **SHAPE, **kw)
    return request.param, model, cfg, params, str(path)


def test_config_reads_every_layer_as_a_mixer_alone(mamba):
    family, _, cfg, params, _ = mamba
    m = cfg.mamba
    assert (cfg.family, m.layers, m.no_mlp, cfg.attention_layers, m.inner, m.state_size) == (
        family, (0, 1, 2), (0, 1, 2), (), 128, 8)
    assert (m.kind, m.step_norms) == {"mamba": ("mamba1", "none"), "falcon_mamba": ("mamba1", "unweighted"),
                                      "mamba2": ("mamba2", "weighted")}[family]
    assert params.mlp_layers is None and params.attn_layers is None and params.layers.mlp_norm is None
    assert cfg.tie_word_embeddings == (family == "mamba")
    hf = cfg.to_hf()
    assert ModelConfig.from_hf(hf) == cfg
    hf.pop("max_position_embeddings")  # (their configs name none: 2048, as vLLM takes)
    assert ModelConfig.from_hf(hf).max_position_embeddings == 2048


def test_logits_match_transformers(mamba):
    """Transformers' logits, the prompt scanned token by token (the XLA backend's) and chunk by chunk (the Pallas
    ones', here interpreted); Mamba's and Falcon Mamba's step norms each needed (one with the other's: not them)."""
    family, model, cfg, params, _ = mamba
    ids = (PROMPTS[2] + PROMPTS[0]) * 2
    ours, ref = prompt_logits(cfg, params, ids), hf_logits(model, ids)
    assert rel_err(ours, ref) < 1e-4 and (ours.argmax(-1) == ref.argmax(-1)).all()
    assert rel_err(prompt_logits(cfg, params, ids, backend="pallas_interpret"), ref) < 1e-4
    if family != "mamba2":
        other = "none" if family == "falcon_mamba" else "unweighted"
        changed = dataclasses.replace(cfg, mamba=dataclasses.replace(cfg.mamba, step_norms=other))
        assert rel_err(prompt_logits(changed, params, ids), ref) > 1e-3


def test_checkpoint_written_back_reads_the_same(mamba):
    """Every tensor under the model's own names (`backbone.layers.{i}.mixer`), exactly."""
    _, _, cfg, params, path = mamba
    assert_written_back(path, cfg, params)


def _engine(cfg, params, path, **kw) -> LLMEngine:
    loaded = LoadedModel(path, cfg.family, cfg, params, fake_tokenizer(), jnp.float32, 0.0)
    args = EngineArgs(**{**dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, page_size=8,
                                num_scheduler_steps=4, dtype="float32", warmup=False, compile_cache_dir=None), **kw})
    budget = state_layout(cfg, args, jnp.float32).bytes
    return LLMEngine(dataclasses.replace(args, kv_cache_memory_bytes=budget), loaded=loaded, progress=False)


@pytest.mark.parametrize("mamba", ["mamba", "mamba2"], indirect=True)  # (Falcon Mamba's mixer is Mamba's)
def test_engine_greedy_equals_transformers(mamba):
    """Chunked prefills beside decodes and the device's decode loop, three requests in one batch, and again from the
    prefix cache's kept states: transformers' greedy tokens; the pages hold nothing and count 2 x 4 sequences of 64
    tokens; every state slot back. A budget short of the states is refused by name."""
    family, model, cfg, params, path = mamba
    expected = [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    engine = _engine(cfg, params, path)
    assert KVCache.bytes_per_page(cfg, 8, jnp.float32) == 0 and engine.runner.kv.k.size == 0
    assert engine.runner.cfg.num_pages == 1 + 2 * 4 * 8 and engine.max_model_len == 64
    assert _greedy(engine) == expected
    assert _run(engine, PROMPTS[2], "again") == (expected[2], 24)  # (its states kept at 24 of its 30 tokens)
    assert sorted(engine.scheduler.states.free) == [1, 2, 3, 4]
    engine.check_integrity()
    if family == "mamba":
        args = EngineArgs(max_num_seqs=4, max_model_len=64, page_size=8, dtype="float32", warmup=False,
                          compile_cache_dir=None, kv_cache_memory_bytes=1000)
        loaded = LoadedModel(path, cfg.family, cfg, params, fake_tokenizer(), jnp.float32, 0.0)
        with pytest.raises(ValueError, match=r"does not hold the Mamba states \(\d+ bytes\)"):
            LLMEngine(args, loaded=loaded, progress=False)


@pytest.mark.parametrize("mamba", ["mamba", "mamba2"], indirect=True)
def test_bfloat16_keeps_the_residual_in_float32(mamba):
    """`residual_in_fp32` (their configs' default): under bfloat16 weights the residual stream is float32, each
    layer's norm reading it in bfloat16 (the state leaving the last layer float32; bfloat16 with the flag off), and the
    logits are transformers' in bfloat16 as near as bfloat16 allows."""
    import copy
    import functools

    import jax

    from jaxserve.loader import HFDirectory, load_params
    from jaxserve.models.inputs import ModelInputs
    from jaxserve.models.llama import forward

    _, model, cfg, _, path = mamba
    hf = cfg.to_hf()
    off = ModelConfig.from_hf({**hf, "residual_in_fp32": False})
    assert (cfg.mamba.residual_fp32, hf["residual_in_fp32"], off.mamba.residual_fp32) == (True, True, False)
    assert ModelConfig.from_hf(off.to_hf()) == off
    params = load_params(HFDirectory(path), cfg, jnp.bfloat16, progress=False)
    ids = PROMPTS[2] + PROMPTS[0]
    kv = KVCache.allocate(cfg, 8, 16, jnp.bfloat16, state_slots=2)
    inputs = ModelInputs.build([(ids, 0, [1, 2, 3, 4])], 16, num_tokens=64, num_seqs=1, pages_per_seq=4, state_slots=[1])
    for c, state in ((cfg, jnp.float32), (off, jnp.bfloat16)):
        logits, _, x = jax.eval_shape(functools.partial(forward, cfg=c, return_hidden=True), params, kv, inputs)
        assert (x.dtype, logits.dtype) == (state, jnp.float32)
    ref = hf_logits(copy.deepcopy(model).to(torch.bfloat16), ids)
    assert rel_err(prompt_logits(cfg, params, ids, dtype=jnp.bfloat16), ref) < 0.03


@pytest.mark.parametrize("mamba", ["mamba2"], indirect=True)
def test_what_it_refuses(mamba):
    """Tensor parallelism (nothing to split: the Mamba layers are whole on each device), LoRA adapters (nothing they
    apply to), a Mamba-2 config whose heads are not its width, another activation."""
    from jax.sharding import AbstractMesh

    from jaxserve.engine.lora_manager import LoRAError
    from sharding import ShardingError, make_plan

    with pytest.raises(ShardingError, match=f"tensor parallelism splits attention layers.*{mamba[0]} has none"):
        make_plan(mamba[2], AbstractMesh((2,), ("model",)))
    with pytest.raises(LoRAError, match=r"LoRA adapters on mamba2 \(Mamba layers, no attention or MLP\)"):
        _engine(*mamba[2:], enable_lora=True, max_lora_rank=8)
    with pytest.raises(UnsupportedModelError, match="num_heads x head_dim"):
        ModelConfig.from_hf({"architectures": ["Mamba2ForCausalLM"], "vocab_size": 64, "hidden_size": 64,
                             "num_heads": 4, "head_dim": 16})
    with pytest.raises(UnsupportedModelError, match="hidden_act 'gelu'"):
        ModelConfig.from_hf({"model_type": "mamba", "vocab_size": 64, "hidden_act": "gelu"})
