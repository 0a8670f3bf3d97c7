"""MiMo-V2-Flash GGUF files (llama.cpp's "mimo2"), written as llama.cpp's converter writes them from the released
config: KV heads per layer (the windowed layers' twice the full ones'), the layers' kinds as a pattern, keys and values
of their own widths, each kind's rotary base, the window as the keys before the query, sinks on the windowed layers,
the experts stacked by projection. The HF checkpoint's config and transformers' logits; the value scale the file gives
(and the model's own where it gives none); a file that counts its multi-token prediction blocks reads as the model."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from jaxserve.loader import HFDirectory, open_checkpoint  # noqa: E402
from tests.test_gguf_models import _ours, written  # noqa: E402
from tests.test_mimo import TINY  # noqa: E402
from tests.test_model_families import hf_logits, random_prompt, rel_err, save_tiny_hf  # noqa: E402


def write_mimo2_gguf(path, model, value_scale: float | None = 0.707, prediction_blocks: int = 0,
                     counted: bool = True) -> str:
    """`model` (a tiny transformers MiMo-V2-Flash of `TINY`) as an F32 GGUF, as llama.cpp's converter writes one;
    `value_scale` None: as files from before the converter wrote it; `prediction_blocks` after the model's: counted
    (`nextn_predict_layers`) and not held, or with `counted` False held (a `nextn` tensor each) and not counted."""
    c = model.config
    n, kv = c.num_hidden_layers, TINY["num_key_value_heads"]
    windowed = [t == "sliding_attention" for t in c.layer_types]
    rope = c.rope_parameters
    w = gguf.GGUFWriter(str(path), "mimo2")
    w.add_block_count(n + prediction_blocks)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv([2 * kv if s else kv for s in windowed] + [2 * kv] * prediction_blocks)
    w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_expert_count(c.n_routed_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_group_count(c.n_group)
    w.add_expert_group_used_count(c.topk_group)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_key_length(TINY["head_dim"])
    w.add_value_length(TINY["v_head_dim"])
    w.add_sliding_window(c.sliding_window - 1)  # (the released config's window: the keys before the query)
    w.add_sliding_window_pattern([int(s) for s in windowed] + [1] * prediction_blocks)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_rope_dimension_count(int(TINY["head_dim"] * rope["full_attention"]["partial_rotary_factor"]))
    if value_scale is not None:
        w.add_float32("mimo2.attention.value_scale", value_scale)
    if prediction_blocks and counted:
        w.add_uint32("mimo2.nextn_predict_layers", prediction_blocks)
    for i in range(n, n + prediction_blocks if not counted else n):
        w.add_tensor(f"blk.{i}.nextn.eh_proj.weight", np.zeros((c.hidden_size, 2 * c.hidden_size), np.float32))
    w.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MIMO2, n)
    renames = {"self_attn.sinks": "self_attn.attention_sink_bias.weight",  # (as the released checkpoints name them)
               "gate.e_score_correction_bias": "gate.e_score_correction.bias",
               "experts.down_proj": "experts.down_proj.weight"}
    for name, t in model.state_dict().items():
        a = t.numpy().astype(np.float32)
        parts = {name: a}
        if name.endswith("experts.gate_up_proj"):  # (stacked gate and up, each [X, I, E])
            stem, half = name.removesuffix("gate_up_proj"), a.shape[1] // 2
            parts = {stem + "gate_proj.weight": a[:, :half], stem + "up_proj.weight": a[:, half:]}
        for hf, part in parts.items():
            hf = next((hf.replace(k, v) for k, v in renames.items() if hf.endswith(k)), hf)
            key = names.get_name(hf, try_suffixes=(".weight", ".bias"))
            assert key is not None, hf
            w.add_tensor(key, part)
    return written(w, path)


def _rounded(cfg):
    """`cfg` with the values a file holds as float32 rounded."""
    return dataclasses.replace(cfg, rms_norm_eps=round(cfg.rms_norm_eps, 9),
                               attention_value_scale=round(cfg.attention_value_scale, 6))


def test_mimo2_gguf_reads_as_its_checkpoint(tmp_path):
    model = save_tiny_hf("MiMoV2FlashConfig", tmp_path / "hf", **TINY)
    want = HFDirectory(tmp_path / "hf").config()
    path = write_mimo2_gguf(tmp_path / "m.gguf", model)
    cfg = open_checkpoint(path).config()
    assert _rounded(cfg) == _rounded(want)
    ids = random_prompt()
    ref = hf_logits(model, ids)
    assert rel_err(_ours(path, ids), ref) < 1e-4
    unscaled = write_mimo2_gguf(tmp_path / "unscaled.gguf", model, value_scale=1.0)
    assert rel_err(_ours(unscaled, ids), ref) > 1e-3
    # An older file without the scale takes the model's; one counting prediction blocks it does not hold, or holding
    # one it does not count, reads as the model.
    for kwargs in (dict(value_scale=None), dict(prediction_blocks=1), dict(prediction_blocks=1, counted=False)):
        other = open_checkpoint(write_mimo2_gguf(tmp_path / "other.gguf", model, **kwargs)).config()
        assert _rounded(other) == _rounded(want), kwargs
