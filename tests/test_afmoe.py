"""Arcee's AFMoE (Trinity: `AfmoeForCausalLM`, `config_afmoe`) against transformers: a tiny random model with a dense
first layer, then four MoE layers of which three are windowed (8 keys) and rotated and the fourth global and unrotated;
attention's output gated by its own projection, four norms a layer, sigmoid-routed experts with a bias for choosing
and a route scale, muP's embedding scale. Logits of a 40-token prompt (and not them without each feature), greedy
tokens through the engine (chunked prefill past the window, batched decode), the checkpoint and config written back,
LoRA adapters against PEFT's."""

from __future__ import annotations

import dataclasses
import math
import re

import jax
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
    rel_err,
    tiny_loaded,
)

TINY = dict(num_hidden_layers=5, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
            num_shared_experts=1, num_dense_layers=1, sliding_window=8, global_attn_every_n_layers=4, route_scale=2.5,
            mup_enabled=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_loaded(tmp_path_factory, "AfmoeConfig", "afmoe", **TINY)


def test_afmoe_config(tiny):
    _, _, cfg, _ = tiny
    assert (cfg.family, cfg.first_dense_layers, cfg.qk_norm, cfg.router_scoring, cfg.router_bias) == (
        "afmoe", 1, True, "sigmoid", True)
    assert cfg.layer_types == ("sliding_attention",) * 3 + ("full_attention", "sliding_attention")
    assert cfg.no_rope_layers == (1, 1, 1, 0, 1) and cfg.sliding_window == 8
    assert (cfg.shared_expert_intermediate_size, cfg.routed_scaling_factor, cfg.norm_topk_prob) == (24, 2.5, True)
    assert cfg.attn_gate_width == cfg.head_dim and cfg.output_norms
    assert cfg.embedding_multiplier == math.sqrt(cfg.hidden_size)
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    with pytest.raises(UnsupportedModelError, match="AFMoE with attention_bias"):
        ModelConfig.from_hf({**cfg.to_hf(), "attention_bias": True})


def test_afmoe_logits_match_transformers(tiny):
    """Transformers' logits; without the window, with the global layer rotated, without muP's scale, or with the
    output gate's half of `wq` zeroed (a gate of 1/2), they are not."""
    _, model, cfg, params = tiny
    ids, ref = assert_logits_match(model, cfg, params, dict(sliding_window=None), dict(no_rope_layers=None),
                                   dict(embedding_multiplier=1.0))
    D = cfg.head_dim
    no_gate = jax.tree.map(lambda x: x, params)
    no_gate.layers.wq = params.layers.wq.at[..., D:].set(0)
    assert rel_err(prompt_logits(cfg, no_gate, ids), ref) > 1e-3


def test_afmoe_checkpoint_written_back_reads_the_same(tiny):
    path, _, cfg, params = tiny
    assert_written_back(path, cfg, params)


def test_afmoe_engine_greedy_equals_transformers(tiny):
    """Prompts of 21 and 13 tokens prefilled 16 tokens a step (past the 8-key window), then decoded together, the
    layers stacked (the dense layer, then the MoE stack in groups of four)."""
    _, model, cfg, params = tiny
    assert_engine_greedy(model, cfg, params, "scan")


# An HF AFMoE's tensors as llama.cpp's converter names them (the experts' stacked apart)
GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
              "self_attn.gate_proj": "attn_gate", "input_layernorm": "attn_norm",
              "post_attention_layernorm": "post_attention_norm", "pre_mlp_layernorm": "ffn_norm",
              "post_mlp_layernorm": "post_ffw_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "mlp.router.gate": "ffn_gate_inp", "mlp.expert_bias": "exp_probs_b",
              **{f"mlp.shared_experts.{p}_proj": f"ffn_{p}_shexp" for p in ("gate", "up", "down")}}


def test_afmoe_gguf_equals_the_hf_model(tiny, tmp_path):
    """A file as llama.cpp's converter writes AFMoE: its config (every 4th layer global, the scale, the experts'
    counts) and logits are the HF model's; a file without the window, with softmax routing or unrenormalized weights,
    is refused by name."""
    import gguf
    import numpy as np
    import torch
    from safetensors.numpy import load_file

    from jaxserve.loader import open_checkpoint
    from tests.test_gguf_models import _ours, shaped_writer, written

    path, model, cfg, _ = tiny
    c = model.config

    def write(name: str, **changes):
        w = shaped_writer(tmp_path / name, "afmoe", c)
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
        w.add_layer_norm_rms_eps(c.rms_norm_eps)
        w.add_rope_freq_base(cfg.rope_theta)
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        w.add_expert_shared_count(c.num_shared_experts)
        w.add_leading_dense_block_count(c.num_dense_layers)
        w.add_expert_weights_norm(changes.get("norm", True))
        w.add_expert_weights_scale(c.route_scale)
        if changes.get("window", True):
            w.add_sliding_window(c.sliding_window)
        if "gating" in changes:
            w.add_expert_gating_func(gguf.ExpertGatingFuncType(changes["gating"]))
        w.add_token_list([f"t{i}" for i in range(c.vocab_size)])
        experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
        for hf_name, a in load_file(path / "model.safetensors").items():
            m = re.match(r"model\.layers\.(\d+)\.(.+)\.weight$|model\.layers\.(\d+)\.(.+)$", hf_name)
            if m is None:
                top = {"model.embed_tokens.weight": "token_embd", "model.norm.weight": "output_norm",
                       "lm_head.weight": "output"}[hf_name]
                w.add_tensor(f"{top}.weight", a)
                continue
            layer, module = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
            if (e := re.fullmatch(r"mlp\.experts\.(\d+)\.(\w+)_proj", module)) is not None:  # (stacked below)
                experts.setdefault((layer, e.group(2)), {})[int(e.group(1))] = a
                continue
            kind = "bias" if module == "mlp.expert_bias" else "weight"
            w.add_tensor(f"blk.{layer}.{GGUF_NAMES[module]}.{kind}", a)
        for (layer, part), each in experts.items():  # [X, out, in], as the converter stacks them
            w.add_tensor(f"blk.{layer}.ffn_{part}_exps.weight", np.stack([each[j] for j in range(len(each))]))
        return written(w, tmp_path / name)

    gguf_path = write("afmoe.gguf")
    got = open_checkpoint(gguf_path).config()
    assert dataclasses.replace(got, rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_position_embeddings,
                               tie_word_embeddings=cfg.tie_word_embeddings) == cfg
    ids = np.random.default_rng(9).integers(0, c.vocab_size, 30).tolist()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(_ours(gguf_path, ids), ref, atol=1e-4 * np.abs(ref).max(), rtol=0)
    with pytest.raises(UnsupportedModelError, match="without afmoe.attention.sliding_window"):
        open_checkpoint(write("nowindow.gguf", window=False)).config()
    with pytest.raises(UnsupportedModelError, match="expert_gating_func 1 is not supported"):
        open_checkpoint(write("softmax.gguf", gating=1)).config()
    with pytest.raises(UnsupportedModelError, match="expert_weights_norm false"):
        open_checkpoint(write("unnormed.gguf", norm=False)).config()


def test_afmoe_adapters_equal_peft(tmp_path):
    """A PEFT adapter on the attention (q, k, v, o and the output gate's own projection, `self_attn.gate_proj`, read
    into q_proj's slot), the dense first layer's MLP, the shared experts and the routed ones: PEFT's prompt logprobs
    and greedy tokens beside the base model's; a gate and query whose ranks together pass max_lora_rank are refused."""
    import torch
    import transformers

    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.engine.lora_manager import LoRAError
    from jaxserve.engine_args import EngineArgs
    from tests.fake_model import save_fake_tokenizer
    from tests.test_lora import PEFT_ARGS, VOCAB, _adapter, adapter_equals_peft
    from tests.test_model_families import save_tiny_hf

    base = str(tmp_path / "afmoe")
    save_tiny_hf("AfmoeConfig", base, vocab_size=VOCAB, **TINY)
    save_fake_tokenizer(base)
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    # (named in full: PEFT 0.22 reads a pattern as the names it ends in)
    wanted = re.compile(r".*\.(self_attn\.(q|k|v|o|gate)_proj|mlp\.(shared_experts\.)?(gate|up|down)_proj)")
    names = [n for n, _ in hf.named_modules() if wanted.fullmatch(n)]
    peft_model = _adapter(hf, str(tmp_path / "all"), 5, r=4, lora_alpha=8, target_modules=names)
    assert any("self_attn.gate_proj" in n for n in names)
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    experts = _adapter(hf, str(tmp_path / "experts"), 8, r=2, lora_alpha=4, target_modules=["q_proj", "o_proj"],
                       target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    engine = LLMEngine(EngineArgs(model=base, lora_modules=(("all", str(tmp_path / "all")),
                                                            ("experts", str(tmp_path / "experts"))), **PEFT_ARGS),
                       progress=False)
    adapter_equals_peft(engine, peft_model, "all", 7, atol=3e-5)
    adapter_equals_peft(engine, experts, "experts", 9, atol=3e-5)
    # The gate's pair follows q_proj's in its slot: both ranks must fit max_lora_rank (8).
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    _adapter(hf, str(tmp_path / "wide"), 6, r=4, target_modules=[n for n in names if re.search(r"attn\.(q|gate)_", n)],
             rank_pattern={r"self_attn\.gate_proj": 6})
    with pytest.raises(LoRAError, match="gate projection \\(rank 6\\) shares the query projection's slot after "
                                        "its rank 4: 10 is above max_lora_rank 8"):
        LLMEngine(EngineArgs(model=base, lora_modules=(("wide", str(tmp_path / "wide")),), **PEFT_ARGS),
                  progress=False)
