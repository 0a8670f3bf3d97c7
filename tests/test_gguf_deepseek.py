"""DeepSeek-V2 / -V3 from llama.cpp GGUF files (architecture "deepseek2") against the HF models they come from.

The tiny random models of tests/test_mla.py written as llama.cpp's converter writes them: the latent's page entry
as `key_length` / `value_length` and the heads' dims as the `_mla` keys, `kv_b_proj` split per head into
`attn_k_b` (transposed) and `attn_v_b` (V3's file), or whole in `attn_kv_b` with the heads' dims as `key_length` /
`value_length` (an older file: V2's here); the routing's gating function (softmax: V2, sigmoid: V3), YaRN's mscale
as `yarn_log_multiplier`, each projection's experts stacked, rotary rows left interleaved.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402

from jaxserve.loader import HFDirectory, load_params, open_checkpoint  # noqa: E402
from tests.modelrun import prompt_logits  # noqa: E402
from tests.test_gguf_models import written  # noqa: E402
from tests.test_mla import FAMILIES  # noqa: E402
from tests.test_model_families import save_tiny_hf  # noqa: E402

_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "q_proj": "attn_q",
          "q_a_proj": "attn_q_a", "q_a_layernorm": "attn_q_a_norm", "q_b_proj": "attn_q_b",
          "kv_a_proj_with_mqa": "attn_kv_a_mqa", "kv_a_layernorm": "attn_kv_a_norm", "o_proj": "attn_output",
          "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


_INDEXER = {"wq_b": "attn_q_b", "wk": "attn_k", "k_norm": "k_norm", "weights_proj": "proj"}


def _write_deepseek2(path, hf_dir, split_kv_b: bool, arch: str = "deepseek2") -> str:
    from safetensors.numpy import load_file

    cfg = HFDirectory(str(hf_dir)).config()
    H, Dr, R = cfg.num_heads, cfg.rotary_dims, cfg.kv_lora_rank
    Dn, Dv = cfg.head_dim - Dr, cfg.v_head_dim
    w = gguf.GGUFWriter(str(path), arch)
    u32 = {"embedding_length": cfg.hidden_size, "attention.head_count": H, "block_count": cfg.num_layers,
           "context_length": cfg.max_position_embeddings, "feed_forward_length": cfg.intermediate_size,
           "leading_dense_block_count": cfg.first_dense_layers, "attention.kv_lora_rank": R,
           "expert_feed_forward_length": cfg.moe_intermediate_size, "expert_count": cfg.num_experts,
           "expert_used_count": cfg.num_experts_per_tok, "expert_group_count": cfg.expert_groups,
           "expert_group_used_count": cfg.expert_topk_groups, "rope.dimension_count": Dr,
           "expert_shared_count": cfg.shared_expert_intermediate_size // cfg.moe_intermediate_size,
           "expert_gating_func": 2 if cfg.router_scoring == "sigmoid" else 1}
    if split_kv_b:  # (llama.cpp's current form: the latent's entry, and the heads' dims apart)
        u32.update({"attention.head_count_kv": 1, "attention.key_length": R + Dr, "attention.value_length": R,
                    "attention.key_length_mla": Dn + Dr, "attention.value_length_mla": Dv})
    else:
        u32.update({"attention.head_count_kv": H, "attention.key_length": Dn + Dr, "attention.value_length": Dv})
    if cfg.q_lora_rank:
        u32["attention.q_lora_rank"] = cfg.q_lora_rank
    if cfg.index_topk:  # (GLM-5's indexer)
        u32.update({"attention.indexer.head_count": cfg.index_heads, "attention.indexer.key_length": cfg.index_head_dim,
                    "attention.indexer.top_k": cfg.index_topk})
    for key, value in u32.items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_float32(f"{arch}.rope.freq_base", cfg.rope_theta)
    w.add_float32(f"{arch}.expert_weights_scale", cfg.routed_scaling_factor)
    if cfg.norm_topk_prob:
        w.add_bool(f"{arch}.expert_weights_norm", True)
    rs = cfg.rope_scaling
    if rs.rope_type == "yarn":
        w.add_string(f"{arch}.rope.scaling.type", "yarn")
        w.add_float32(f"{arch}.rope.scaling.factor", rs.factor)
        w.add_uint32(f"{arch}.rope.scaling.original_context_length", rs.original_max_position_embeddings)
        w.add_float32(f"{arch}.rope.scaling.yarn_log_multiplier", 0.1 * rs.mscale_all_dim)
    w.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    tensors = {k: v for f in sorted(hf_dir.glob("*.safetensors")) for k, v in load_file(f).items()}
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for name, a in tensors.items():
        a = a.astype(np.float32)
        parts = name.split(".")
        if name == "lm_head.weight":
            w.add_tensor("output.weight", a)
        elif parts[1] != "layers":
            w.add_tensor({"embed_tokens": "token_embd", "norm": "output_norm"}[parts[1]] + ".weight", a)
        elif "experts" in parts and "shared_experts" not in parts:
            experts.setdefault((parts[2], parts[-2]), {})[int(parts[5])] = a
        elif parts[-1] == "e_score_correction_bias":
            w.add_tensor(f"blk.{parts[2]}.exp_probs_b.bias", a)
        elif parts[-2] == "gate" and parts[-3] == "mlp":
            w.add_tensor(f"blk.{parts[2]}.ffn_gate_inp.weight", a)
        elif "shared_experts" in parts:
            w.add_tensor(f"blk.{parts[2]}.{_NAMES[parts[-2]]}_shexp.weight", a)
        elif "indexer" in parts:
            w.add_tensor(f"blk.{parts[2]}.indexer.{_INDEXER[parts[-2]]}.{parts[-1]}", a)
        elif parts[-2] == "kv_b_proj" and split_kv_b:
            heads = a.reshape(H, Dn + Dv, R)
            w.add_tensor(f"blk.{parts[2]}.attn_k_b.weight", np.ascontiguousarray(heads[:, :Dn].transpose(0, 2, 1)))
            w.add_tensor(f"blk.{parts[2]}.attn_v_b.weight", np.ascontiguousarray(heads[:, Dn:]))
        elif parts[-2] == "kv_b_proj":
            w.add_tensor(f"blk.{parts[2]}.attn_kv_b.weight", a)
        else:
            w.add_tensor(f"blk.{parts[2]}.{_NAMES[parts[-2]]}.{parts[-1]}", a)
    for (layer, kind), by_expert in experts.items():
        w.add_tensor(f"blk.{layer}.ffn_{kind.removesuffix('_proj')}_exps.weight",
                     np.stack([by_expert[j] for j in sorted(by_expert)]))
    return written(w, path)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_deepseek2_gguf_config_and_logits_equal_the_hf_model(tmp_path, family):
    config_cls, overrides = FAMILIES[family]
    model = save_tiny_hf(config_cls, tmp_path / "hf", **overrides)
    want = HFDirectory(str(tmp_path / "hf")).config()
    path = _write_deepseek2(tmp_path / "m.gguf", tmp_path / "hf", split_kv_b=family == "deepseek_v3")
    ckpt = open_checkpoint(path)
    cfg = ckpt.config()
    assert cfg.rms_norm_eps == pytest.approx(want.rms_norm_eps, rel=1e-6)  # (float32 in the file)
    got = dataclasses.replace(cfg, rms_norm_eps=want.rms_norm_eps)
    if family == "deepseek_v3":  # YaRN's mscale from the file's multiplier (float32), taken for both mscales
        rs = got.rope_scaling
        assert (rs.rope_type, rs.factor, rs.original_max_position_embeddings) == ("yarn", 4.0, 64)
        assert rs.mscale == rs.mscale_all_dim == pytest.approx(1.0, rel=1e-6)
        got = dataclasses.replace(got, rope_scaling=want.rope_scaling,
                                  routed_scaling_factor=pytest.approx(want.routed_scaling_factor))
    assert got == want
    ids = np.random.default_rng(5).integers(0, want.vocab_size, 24).tolist()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    ours = prompt_logits(cfg, load_params(ckpt, cfg, jnp.float32, progress=False), ids)
    np.testing.assert_allclose(ours, ref, atol=1e-4 * np.abs(ref).max(), rtol=0)


def test_glm5_gguf_config_and_logits_equal_the_hf_model(tmp_path):
    """GLM-5 ("glm-dsa"): DeepSeek-V3's form with the indexer's keys and tensors; its top-k of 6 keys a token."""
    from tests.test_dsa import _TINY

    model = save_tiny_hf("GlmMoeDsaConfig", tmp_path / "hf", **_TINY)
    want = HFDirectory(str(tmp_path / "hf")).config()
    ckpt = open_checkpoint(_write_deepseek2(tmp_path / "m.gguf", tmp_path / "hf", split_kv_b=True, arch="glm-dsa"))
    cfg = ckpt.config()
    assert (cfg.family, cfg.index_heads, cfg.index_head_dim, cfg.index_topk) == ("glm_moe_dsa", 8, 16, 6)
    assert dataclasses.replace(cfg, rms_norm_eps=want.rms_norm_eps) == want
    ids = np.random.default_rng(5).integers(0, want.vocab_size, 24).tolist()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    ours = prompt_logits(cfg, load_params(ckpt, cfg, jnp.float32, progress=False), ids)
    np.testing.assert_allclose(ours, ref, atol=1e-4 * np.abs(ref).max(), rtol=0)
