"""Qwen3-Next and Qwen3.5 from llama.cpp GGUF files ("qwen3next", "qwen35", "qwen35moe") against the HF models they
come from: tiny random models written as llama.cpp's converter writes them. Tensor names from the gguf package's
map; Qwen3-Next's `in_proj_qkvz` split into q, k, v (`attn_qkv`) and z (`attn_gate`) per kind, its `in_proj_ba` as
it is (`ssm_ba`); Qwen3.5's value heads tiled across key heads (v, z, b, a, A, dt's bias, the convolution's v
channels, the output projection's columns); A as -exp(A_log), dt's bias as `ssm_dt.bias`, the convolution squeezed;
every norm but the DeltaNet's gated one as 1 + w; the experts stacked; the multi-token prediction layer left out."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from jaxserve.loader import open_checkpoint  # noqa: E402
from tests.test_gguf_models import _ours, written  # noqa: E402
from tests.test_hybrid import PROMPTS  # noqa: E402
from tests.test_model_families import hf_logits, rel_err, save_tiny_hf  # noqa: E402
from tests.test_qwen3_next import MOE, TINY  # noqa: E402

# (the layers as the file's `full_attention_interval` gives them: the converter writes transformers' default, 4)
KINDS = ["linear_attention"] * 3 + ["full_attention"]
VARIANTS = {"qwen3next": ("Qwen3NextConfig", {**TINY, **MOE, "layer_types": KINDS}),
            "qwen35": ("Qwen3_5TextConfig", {**TINY, "layer_types": KINDS}),
            "qwen35moe": ("Qwen3_5MoeTextConfig", {**TINY, **MOE, "layer_types": KINDS})}


def _tiled(a: np.ndarray, axis: int, c) -> np.ndarray:
    """Qwen3.5's value heads along `axis` from grouped (by key head) to tiled order, as the converter writes them."""
    G, r = c.linear_num_key_heads, c.linear_num_value_heads // c.linear_num_key_heads
    shape = a.shape
    x = a.reshape(*shape[:axis], G, r, shape[axis] // (G * r), *shape[axis + 1:])
    return np.swapaxes(x, axis, axis + 1).reshape(shape)


def _converted(name: str, a: np.ndarray, c, arch: str) -> list[tuple[str, np.ndarray]]:
    """HF tensor `name` as the converter hands it to the name map: Qwen3.5's value heads tiled, then A as -exp(A_log),
    dt's bias renamed, the convolution squeezed, norms as 1 + w (not the DeltaNet's), Qwen3-Next's q/k/v/z split."""
    G, dk = c.linear_num_key_heads, c.linear_key_head_dim
    r, dv = c.linear_num_value_heads // G, c.linear_value_head_dim
    qk = 2 * G * dk
    if arch != "qwen3next" and "linear_attn." in name:
        if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
            a = np.concatenate([a[:qk], _tiled(a[qk:], 0, c)])
        elif name.endswith("out_proj.weight"):
            a = _tiled(a, 1, c)
        elif not name.endswith("norm.weight"):
            a = _tiled(a, 0, c)
    if name.endswith(".A_log"):
        a = -np.exp(a)
    elif name.endswith(".dt_bias"):
        name = name.replace(".dt_bias", ".dt_proj.bias")
    elif "conv1d" in name:
        a = a.squeeze()
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        a = a + 1.0
    if name.endswith("in_proj_qkvz.weight"):
        parts = np.split(a.reshape(G, 2 * dk + 2 * r * dv, -1), np.cumsum([dk, dk, r * dv]), axis=1)
        qkv = np.concatenate([p.reshape(-1, a.shape[-1]) for p in parts[:3]])
        return [(name.replace("in_proj_qkvz", "in_proj_qkv"), qkv),
                (name.replace("in_proj_qkvz", "in_proj_z"), parts[3].reshape(-1, a.shape[-1]))]
    return [(name, a)]


def _write(path, model, hf_dir, arch: str) -> str:
    """`model` (saved at `hf_dir`) as an F32 GGUF of `arch`, as llama.cpp's converter writes one."""
    from safetensors.numpy import load_file

    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    if getattr(c, "intermediate_size", None):
        w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    if "mrope_section" in c.rope_parameters:
        w.add_rope_dimension_sections((list(c.rope_parameters["mrope_section"]) + [0] * 4)[:4])
    if getattr(c, "num_experts", 0):
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    w.add_ssm_conv_kernel(c.linear_conv_kernel_dim)
    w.add_ssm_state_size(c.linear_key_head_dim)
    w.add_ssm_group_count(c.linear_num_key_heads)
    w.add_ssm_time_step_rank(c.linear_num_value_heads)
    w.add_ssm_inner_size(c.linear_value_head_dim * c.linear_num_value_heads)
    w.add_full_attention_interval(4)
    w.add_rope_dimension_count(int(c.head_dim * 0.25))  # (the converter's default: the factor sits in rope_parameters)
    w.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    kind = {"qwen3next": gguf.MODEL_ARCH.QWEN3NEXT, "qwen35": gguf.MODEL_ARCH.QWEN35,
            "qwen35moe": gguf.MODEL_ARCH.QWEN35MOE}[arch]
    names = gguf.TensorNameMap(kind, c.num_hidden_layers)
    experts: dict[str, list] = {}
    for name, a in load_file(str(hf_dir / "model.safetensors")).items():
        for hf, x in _converted(name, a.astype(np.float32), c, arch):
            parts = hf.split(".")
            if ".experts." in hf:  # stacked per layer and kind, in expert order
                experts.setdefault(f"{parts[2]}.{parts[6]}", []).append((int(parts[5]), x))
                continue
            key = names.get_name(hf, try_suffixes=(".weight", ".bias"))
            assert key is not None, hf
            w.add_tensor(key, x)
    for at, stack in experts.items():
        layer, proj = at.split(".")
        w.add_tensor(f"blk.{layer}.ffn_{proj.removesuffix('_proj')}_exps.weight", np.stack([x for _, x in sorted(stack)]))
    return written(w, path)


@pytest.mark.parametrize("arch", list(VARIANTS))
def test_qwen3_next_gguf_equals_the_hf_model(tmp_path, arch):
    """The file's config is the HF model's (its DeltaNet layers and heads, its experts), and its logits the HF
    model's over 102 tokens."""
    config_cls, kw = VARIANTS[arch]
    model = save_tiny_hf(config_cls, tmp_path / "hf", **kw)
    assert model.config.linear_num_value_heads != model.config.linear_num_key_heads  # (so Qwen3.5's tiling shows)
    path = _write(tmp_path / f"{arch}.gguf", model, tmp_path / "hf", arch)
    cfg, hf_cfg = open_checkpoint(path).config(), open_checkpoint(str(tmp_path / "hf")).config()
    # (the file's eps a float32)
    assert dataclasses.replace(cfg.mamba, norm_eps=1e-6) == hf_cfg.mamba and cfg.mamba.layers == (0, 1, 2)
    assert (cfg.family, cfg.num_experts, cfg.shared_expert_intermediate_size, cfg.rotary_dims, cfg.head_dim) == (
        hf_cfg.family, hf_cfg.num_experts, hf_cfg.shared_expert_intermediate_size, hf_cfg.rotary_dims, hf_cfg.head_dim)
    ids = (PROMPTS[2] + PROMPTS[0] + PROMPTS[1]) * 2
    assert rel_err(_ours(path, ids), hf_logits(model, ids)) < 1e-4
