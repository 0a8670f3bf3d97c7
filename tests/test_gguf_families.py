"""EXAONE 4, Command R (+), Command R7B, ERNIE 4.5 (dense and MoE) and Jais 2 from llama.cpp GGUF files, against the
HF models they come from.

The tiny random models of tests/test_model_families.py written as llama.cpp's converter writes them: no row
permutation (EXAONE 4 turns half-split pairs as llama.cpp's NEOX rope does, Cohere adjacent pairs as its NORM rope
does); EXAONE 4's norms after attention and the MLP under Gemma's names, its windowed layers as a per-layer array,
Llama 3's rope scaling as `rope_freqs`; Cohere's LayerNorm epsilon and logit scale, its embeddings tied (no
`output`), Command R+'s per-head q/k norms found by their tensors, Command R7B's window with its pattern left to
the reader (three windowed layers, then a global one without rotation); ERNIE's interleaved pairs as they are,
its experts stacked, its choosing bias `exp_probs_b` as [1, X], its shared experts' count (their width llama.cpp
writes is a guess from other fields, not read), its MoE layers from `leading_dense_block_count`; Jais 2's rows as they
are (half-split pairs, NEOX's), its LayerNorms' and projections' biases, its squared-ReLU MLP (llama.cpp's for it).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from jaxserve.loader import HFDirectory, open_checkpoint  # noqa: E402
from tests.test_gguf_models import _llama3_rope_freqs, _ours, shaped_writer, written  # noqa: E402
from tests.test_model_families import FAMILIES, save_tiny_hf  # noqa: E402

_NAMES = {"embed_tokens": "token_embd", "norm": "output_norm", "input_layernorm": "attn_norm", "q_proj": "attn_q",
          "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output", "q_norm": "attn_q_norm",
          "k_norm": "attn_k_norm", "post_attention_layernorm": "post_attention_norm",
          "post_feedforward_layernorm": "post_ffw_norm", "gate_proj": "ffn_gate", "up_proj": "ffn_up",
          "down_proj": "ffn_down"}
ARCHS = {"exaone4": "exaone4", "exaone4_alternating": "exaone4", "cohere": "command-r", "cohere2": "cohere2",
         "ernie4_5": "ernie4_5", "ernie4_5_moe": "ernie4_5-moe", "jais2": "jais2",
         "starcoder2": "starcoder2", "stablelm": "stablelm", "nemotron": "nemotron"}
ERNIE_MOE = ("Ernie4_5_MoeConfig", {"moe_num_experts": 8, "moe_k": 2, "moe_intermediate_size": 32,
                                    "moe_num_shared_experts": 1, "moe_layer_start_index": 1, "num_hidden_layers": 3,
                                    "head_dim": 16})
# StableLM 2: a quarter of each head rotated, q/k/v biases.
STABLELM = {"partial_rotary_factor": 0.25, "use_qkv_bias": True, "bos_token_id": 1, "eos_token_id": 2}
# Nemotron-4 / Minitron: LayerNorms scaled by (1 + w) (stored so), half of each head rotated, every projection biased.
NEMOTRON = {"attention_bias": True, "mlp_bias": True, "bos_token_id": 1, "eos_token_id": 2}
# EXAONE 4 with every other layer global: the file's per-layer array, not the period of 4 llama.cpp assumes.
ALTERNATING = {**FAMILIES["exaone4"][1], "sliding_window_pattern": None,
               "layer_types": ["sliding_attention", "full_attention"] * 2}


def _write(path, hf_dir, model, arch: str) -> str:
    from safetensors.numpy import load_file

    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w = shaped_writer(path, arch, c)
    rope = c.rope_parameters
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    if arch.startswith("ernie4_5"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_layer_norm_rms_eps(c.rms_norm_eps)
        if arch == "ernie4_5-moe":  # (as llama.cpp's converter writes them)
            for key, value in (("expert_count", c.moe_num_experts), ("expert_used_count", c.moe_k),
                               ("interleave_moe_layer_step", c.moe_layer_interval),
                               ("leading_dense_block_count", c.moe_layer_start_index),
                               ("expert_feed_forward_length", c.moe_intermediate_size),
                               ("expert_shared_count", c.moe_num_shared_experts),
                               ("expert_shared_feed_forward_length", c.intermediate_size // c.num_key_value_heads)):
                w.add_uint32(f"{arch}.{key}", value)
    elif arch == "exaone4":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_layer_norm_rms_eps(c.rms_norm_eps)
        w.add_sliding_window(c.sliding_window)
        w.add_sliding_window_pattern([t == "sliding_attention" for t in c.layer_types])
        if rope.get("rope_type") == "llama3":
            w.add_tensor("rope_freqs.weight", _llama3_rope_freqs(head_dim, rope["rope_theta"], rope))
    elif arch == "jais2":  # (its converter's: the rotary dims beside the shape)
        w.add_layer_norm_eps(c.layer_norm_eps)
        w.add_rope_dimension_count(head_dim)
    elif arch == "starcoder2":  # (no window: its converter writes none)
        w.add_layer_norm_eps(c.norm_epsilon)
    elif arch == "stablelm":  # (its rotary dims: a quarter of each head)
        w.add_layer_norm_eps(c.layer_norm_eps)
        w.add_rope_dimension_count(int(head_dim * rope["partial_rotary_factor"]))
    elif arch == "nemotron":  # (half of each head rotated)
        w.add_layer_norm_eps(c.norm_eps)
        w.add_rope_dimension_count(int(head_dim * rope["partial_rotary_factor"]))
    else:
        w.add_layer_norm_eps(c.layer_norm_eps)
        w.add_logit_scale(c.logit_scale)
        if arch == "cohere2":
            w.add_sliding_window(c.sliding_window)
            w.add_rope_dimension_count(head_dim)
    tensors = {k: v for f in sorted(hf_dir.glob("*.safetensors")) for k, v in load_file(f).items()}
    names = {**_NAMES, "post_attention_layernorm": "ffn_norm", "c_fc": "ffn_up", "c_proj": "ffn_down"} \
        if arch.startswith(("ernie", "jais2", "starcoder2", "stablelm", "nemotron")) else _NAMES
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for name, a in tensors.items():
        parts = name.split(".")
        if arch == "nemotron" and name.endswith("norm.weight"):  # (its converter's: 1 + w)
            a = a + 1.0
        if name == "lm_head.weight":
            w.add_tensor("output.weight", a)
        elif parts[1] != "layers":
            w.add_tensor(f"{names[parts[1]]}.{parts[-1]}", a)
        elif "experts" in parts:  # (stacked per projection)
            experts.setdefault((parts[2], parts[-2]), {})[int(parts[5])] = a
        elif "shared_experts" in parts:
            w.add_tensor(f"blk.{parts[2]}.{names[parts[-2]]}_shexp.weight", a)
        elif parts[-1] == "e_score_correction_bias":
            w.add_tensor(f"blk.{parts[2]}.exp_probs_b.bias", a)  # ([1, X], as it is)
        elif parts[-2] == "gate" and parts[-3] == "mlp":
            w.add_tensor(f"blk.{parts[2]}.ffn_gate_inp.weight", a)
        else:
            w.add_tensor(f"blk.{parts[2]}.{names[parts[-2]]}.{parts[-1]}", a)
    for (layer, kind), by_expert in experts.items():
        w.add_tensor(f"blk.{layer}.{names[kind]}_exps.weight", np.stack([by_expert[j] for j in sorted(by_expert)]))
    return written(w, path)


@pytest.mark.parametrize("family", list(ARCHS))
def test_gguf_config_and_logits_equal_the_hf_model(tmp_path, family):
    config_cls, overrides = {"exaone4_alternating": (FAMILIES["exaone4"][0], ALTERNATING), "ernie4_5_moe": ERNIE_MOE,
                             "ernie4_5": (FAMILIES["ernie4_5"][0], {"head_dim": 16}),
                             "jais2": ("Jais2Config", {"head_dim": 16, "bos_token_id": 1, "eos_token_id": 2}),
                             "starcoder2": ("Starcoder2Config", {"bos_token_id": 1, "eos_token_id": 2}),
                             "stablelm": ("StableLmConfig", STABLELM),
                             "nemotron": ("NemotronConfig", NEMOTRON)}.get(
        family) or FAMILIES[family]
    model = save_tiny_hf(config_cls, tmp_path / "hf", **overrides)
    want = HFDirectory(str(tmp_path / "hf")).config()
    path = _write(tmp_path / "m.gguf", tmp_path / "hf", model, ARCHS[family])
    cfg = open_checkpoint(path).config()
    assert cfg.rms_norm_eps == pytest.approx(want.rms_norm_eps, rel=1e-6)  # (float32 in the file)
    got = dataclasses.replace(cfg, rms_norm_eps=want.rms_norm_eps)
    if family.startswith("exaone4"):  # Llama 3's scaling as the file's divisors
        assert cfg.rope_scaling.rope_type == "factors" and want.rope_scaling.rope_type == "llama3"
        got = dataclasses.replace(got, rope_scaling=want.rope_scaling)
    if family.startswith("cohere"):  # (Jais 2's LayerNorm epsilon: `rms_norm_eps` above)
        assert cfg.logits_scaling == pytest.approx(want.logits_scaling, rel=1e-6)
        got = dataclasses.replace(got, logits_scaling=want.logits_scaling)
    assert got == want
    assert (cfg.layer_types, cfg.no_rope_layers) == (want.layer_types, want.no_rope_layers)
    ids = np.random.default_rng(9).integers(0, model.config.vocab_size, 30).tolist()  # (past the window of 8)
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(_ours(path, ids), ref, atol=1e-4 * np.abs(ref).max(), rtol=0)
