"""Hybrid models from llama.cpp GGUF files against the HF models they come from: Granite 4.0-H ("granitehybrid"),
dense and with experts; Nemotron-H and Nemotron 3 ("nemotron_h", "nemotron_h_moe"); LFM2 and LFM2-MoE ("lfm2",
"lfm2moe"); Granite MoE ("granitemoe"), whose experts are written as Granite 4.0-H's; Falcon-H1 ("falcon-h1"), its
multipliers folded into its weights; Jamba ("jamba": Mamba layers of the selective scan, experts every other
layer); Mamba, Falcon Mamba ("mamba") and Mamba-2 ("mamba2"), Mamba layers alone.

The tiny random models of tests/test_hybrid.py written as llama.cpp's converter writes them: tensor names from the
gguf package's map; each Mamba layer's A as -exp(A_log), A and D as [heads, 1], the convolution squeezed to
[channels, taps], the gated norm as [groups, channels per group], dt's bias as `ssm_dt.bias`; KV heads per layer (0 in
a Mamba layer); Llama's rotary row order on the attention layer; Granite's shared MLP's gate and up split (the MLP of a
dense model, a shared expert beside experts), the experts' fused gate and up split and stacked; Granite's scalars.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from jaxserve.loader import open_checkpoint  # noqa: E402
from tests.test_gguf_models import _llama_cpp_permute, _ours, written  # noqa: E402
from tests.test_hybrid import PROMPTS, _overrides  # noqa: E402
from tests.test_model_families import hf_logits, rel_err, save_tiny_hf  # noqa: E402


def _write(path, model, hf_dir, hybrid: bool = True) -> str:
    """`model` (an HF Granite 4.0-H, or with `hybrid` False a Granite MoE, saved at `hf_dir`) as an F32 GGUF, as
    llama.cpp's converter writes one from the checkpoint's tensors."""
    from safetensors.numpy import load_file

    c = model.config
    ssm = [i for i, k in enumerate(getattr(c, "layer_types", None) or ()) if k in ("mamba", "linear_attention")]
    experts = c.num_local_experts
    w = gguf.GGUFWriter(str(path), "granitehybrid" if hybrid else "granitemoe")
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(2**20 if hybrid else c.max_position_embeddings)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv([0 if i in ssm else c.num_key_value_heads for i in range(c.num_hidden_layers)] if hybrid
                        else c.num_key_value_heads)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_embedding_scale(c.embedding_multiplier)
    w.add_residual_scale(c.residual_multiplier)
    w.add_logit_scale(c.logits_scaling)
    w.add_attention_scale(c.attention_multiplier)
    if getattr(c, "shared_intermediate_size", 0):
        w.add_expert_shared_feed_forward_length(c.shared_intermediate_size)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(c.num_experts_per_tok)
    if hybrid:
        w.add_rope_scaling_finetuned(False)  # (llama.cpp's flag that a hybrid is not rotated)
        _add_ssm(w, c.mamba_d_conv, c.mamba_d_state, c.mamba_n_groups, c.mamba_n_heads, c.mamba_d_head)
    w.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    names = gguf.TensorNameMap(gguf.MODEL_ARCH.GRANITE_HYBRID if hybrid else gguf.MODEL_ARCH.GRANITE_MOE,
                               c.num_hidden_layers)
    for name, a in load_file(str(hf_dir / "model.safetensors")).items():
        a = a.astype(np.float32)
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if name.endswith("input_linear.weight"):  # gate and up rows: split
            F = a.shape[-2] // 2
            kind = "shexp" if "shared_mlp" in name and experts else "exps" if "block_sparse_moe" in name else None
            for part, rows in (("gate", a[..., :F, :]), ("up", a[..., F:, :])):
                w.add_tensor(f"blk.{layer}.ffn_{part}{'_' + kind if kind else ''}.weight", rows)
            continue
        if name.endswith("shared_mlp.output_linear.weight") and not experts:
            w.add_tensor(f"blk.{layer}.ffn_down.weight", a)
            continue
        if name.endswith(".dt_bias"):
            name = name.replace(".dt_bias", ".dt_proj.bias")
        key = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert key is not None, name
        w.add_tensor(key, _as_written(name, key, a, c, getattr(c, "mamba_n_groups", 1)))
    return written(w, path)


def _add_ssm(w, conv_kernel: int, state: int, groups: int, heads: int, head_dim: int) -> None:
    """The Mamba layers' shape, as llama.cpp's converter writes it (its `time_step_rank` the head count)."""
    w.add_ssm_conv_kernel(conv_kernel)
    w.add_ssm_state_size(state)
    w.add_ssm_group_count(groups)
    w.add_ssm_inner_size(heads * head_dim)
    w.add_ssm_time_step_rank(heads)


def _as_written(name: str, key: str, a: np.ndarray, c, groups: int) -> np.ndarray:
    """Tensor `name` (the GGUF's `key`) as llama.cpp's converter writes it: a Mamba layer's convolution squeezed, A as
    -exp(A_log) and D as [heads, 1], its gated norm as [groups, channels per group]; q and k rows in Llama's rotary
    order."""
    if name.endswith("conv1d.weight"):
        return a.squeeze()
    if name.endswith((".A_log", ".D")):
        return (-np.exp(a) if name.endswith("A_log") else a).reshape(-1, 1)
    if key.endswith("ssm_norm.weight"):
        return a.reshape(groups, -1)
    if name.endswith("q_proj.weight"):
        return _llama_cpp_permute(a, c.num_attention_heads)
    if name.endswith("k_proj.weight"):
        return _llama_cpp_permute(a, c.num_key_value_heads)
    return a


@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_granite_hybrid_gguf_equals_the_hf_model(tmp_path, variant):
    """The file's config is the HF model's (its Mamba layers, groups, biases; its experts and shared MLP; its
    scalars), and its logits the HF model's over 102 tokens."""
    config_cls, kw = _overrides(variant)
    # (no clamp on dt: llama.cpp's file has none, and applies none)
    model = save_tiny_hf(config_cls, tmp_path / "hf", **{**kw, "position_embedding_type": "nope",
                                                         "time_step_limit": [0.0, float("inf")]})
    path = _write(tmp_path / "granite-h.gguf", model, tmp_path / "hf")
    cfg = open_checkpoint(path).config()
    hf_cfg = open_checkpoint(str(tmp_path / "hf")).config()
    assert dataclasses.replace(cfg.mamba, norm_eps=1e-6) == hf_cfg.mamba and cfg.mamba.norm_eps == pytest.approx(1e-6)
    assert cfg.no_rope_layers == hf_cfg.no_rope_layers == (0,) * 4
    assert (cfg.num_experts, cfg.intermediate_size, cfg.shared_expert_intermediate_size, cfg.residual_multiplier,
            cfg.logits_scaling) == (hf_cfg.num_experts, hf_cfg.intermediate_size,
                                    hf_cfg.shared_expert_intermediate_size, 0.5, 4.0)
    ids = (PROMPTS[2] + PROMPTS[0]) * 2
    assert rel_err(_ours(path, ids), hf_logits(model, ids)) < 1e-4


@pytest.mark.parametrize("family", ["granitemoe", "granitemoeshared"])
def test_granite_moe_gguf_equals_the_hf_model(tmp_path, family):
    """Granite MoE ("granitemoe": its experts' fused gate and up split and stacked, Llama's rotary row order, its
    scalars) and with a shared MLP (GraniteMoeShared's, by its width): the HF model's config and logits."""
    from tests.test_moe import FAMILIES

    config_cls, overrides = FAMILIES[family]
    model = save_tiny_hf(config_cls, tmp_path / "hf", **overrides)
    path = _write(tmp_path / "granite-moe.gguf", model, tmp_path / "hf", hybrid=False)
    cfg = open_checkpoint(path).config()
    hf_cfg = open_checkpoint(str(tmp_path / "hf")).config()
    scalars = ("rms_norm_eps", "embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling")
    assert [getattr(cfg, f) for f in scalars] == pytest.approx([getattr(hf_cfg, f) for f in scalars])  # (float32)
    assert dataclasses.replace(cfg, **{f: getattr(hf_cfg, f) for f in scalars}) == hf_cfg
    ids = (PROMPTS[2] + PROMPTS[0]) * 2
    assert rel_err(_ours(path, ids), hf_logits(model, ids)) < 1e-4


def _write_nemotron(path, model, hf_dir) -> str:
    """`model` (an HF Nemotron-H, saved at `hf_dir`) as an F32 GGUF, as llama.cpp's converter writes one: a block per
    layer, its kind told by its KV heads and MLP width; the experts stacked; the Mamba blocks' tensors as
    Granite 4.0-H's."""
    from safetensors.numpy import load_file

    c = model.config
    blocks = [{"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}[b] for b in c.layers_block_type]
    experts = c.n_routed_experts if "E" in blocks else 0
    arch = gguf.MODEL_ARCH.NEMOTRON_H_MOE if experts else gguf.MODEL_ARCH.NEMOTRON_H
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(len(blocks))
    w.add_context_length(2**20)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv([c.num_key_value_heads if b == "*" else 0 for b in blocks])
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    width = c.moe_intermediate_size if experts else c.intermediate_size
    w.add_feed_forward_length([width if b in "-E" else 0 for b in blocks])
    w.add_layer_norm_rms_eps(c.layer_norm_epsilon)
    w.add_rope_scaling_finetuned(False)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(c.moe_shared_expert_intermediate_size)
        w.add_expert_shared_count(c.n_shared_experts)
        w.add_expert_weights_norm(c.norm_topk_prob)
        w.add_expert_weights_scale(c.routed_scaling_factor)
        w.add_expert_group_count(c.n_group)
        if c.moe_latent_size:
            w.add_moe_latent_size(c.moe_latent_size)
    _add_ssm(w, c.conv_kernel, c.ssm_state_size, c.n_groups, c.mamba_num_heads, c.mamba_head_dim)
    w.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    names = gguf.TensorNameMap(arch, len(blocks))
    stacked: dict[str, list] = {}
    for name, a in load_file(str(hf_dir / "model.safetensors")).items():
        a = a.astype(np.float32)
        parts = name.split(".")
        if ".mixer.experts." in name:  # stacked per block and kind, in expert order
            stacked.setdefault(f"model.layers.{parts[2]}.mlp.experts.{parts[6]}.weight", []).append((int(parts[5]), a))
            continue
        name = name.replace(".dt_bias", ".dt.bias").replace("e_score_correction_bias", "e_score_correction.bias")
        key = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert key is not None, name
        w.add_tensor(key, _as_written(name, key, a, c, c.n_groups))
    for name, parts in stacked.items():
        w.add_tensor(names.get_name(name, try_suffixes=(".weight",)), np.stack([a for _, a in sorted(parts)]))
    return written(w, path)


@pytest.mark.parametrize("variant", ["dense", "moe", "latent"])
def test_nemotron_h_gguf_equals_the_hf_model(tmp_path, variant):
    """Nemotron-H (its blocks paired into the layers of tests/test_nemotron_h.py) and Nemotron 3's MoE (Nano's, and
    Super's latent MoE: `ffn_latent_down` / `ffn_latent_up`) from their GGUF files: the HF model's config and
    logits."""
    from tests.test_nemotron_h import LATENT, MOE, TINY

    # (no clamp on dt, one group of experts: the file holds neither)
    kw = {**{"dense": TINY, "moe": MOE, "latent": LATENT}[variant], "time_step_limit": [0.0, float("inf")], "n_group": 1,
          "topk_group": 1}
    model = save_tiny_hf("NemotronHConfig", tmp_path / "hf", **kw)
    path = _write_nemotron(tmp_path / "nemotron-h.gguf", model, tmp_path / "hf")
    cfg = open_checkpoint(path).config()
    hf_cfg = open_checkpoint(str(tmp_path / "hf")).config()
    # (float32 epsilons; a MoE model's dense MLP width, which nothing reads, is not in the file)
    assert dataclasses.replace(cfg, rms_norm_eps=hf_cfg.rms_norm_eps, mamba=dataclasses.replace(
        cfg.mamba, norm_eps=hf_cfg.mamba.norm_eps), max_position_embeddings=hf_cfg.max_position_embeddings,
        intermediate_size=hf_cfg.intermediate_size if cfg.num_experts else cfg.intermediate_size) == hf_cfg
    ids = (PROMPTS[2] + PROMPTS[0]) * 2
    assert rel_err(_ours(path, ids), hf_logits(model, ids)) < 1e-4


@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_lfm2_gguf_equals_the_hf_model(tmp_path, variant):
    """LFM2 as llama.cpp writes it (KV heads 0 in its convolution layers, the convolution as [channels, taps], the
    MLP's width as the model makes it, its final norm as `token_embd_norm`) and LFM2-MoE ("lfm2moe": its experts
    stacked, its dense first layers counted, its choosing bias as `exp_probs_b`): the HF model's config and logits."""
    from safetensors.numpy import load_file

    from tests.test_lfm2 import MOE, TINY

    moe = variant == "moe"
    model = save_tiny_hf("Lfm2MoeConfig" if moe else "Lfm2Config", tmp_path / "hf", **(MOE if moe else TINY))
    c = model.config
    arch = gguf.MODEL_ARCH.LFM2MOE if moe else gguf.MODEL_ARCH.LFM2
    w = gguf.GGUFWriter(str(tmp_path / "lfm2.gguf"), gguf.MODEL_ARCH_NAMES[arch])
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv([c.num_key_value_heads if t != "conv" else 0 for t in c.layer_types])
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_vocab_size(c.vocab_size)
    w.add_shortconv_l_cache(c.conv_L_cache)
    w.add_layer_norm_rms_eps(c.norm_eps)
    w.add_feed_forward_length(96)  # (2/3 of 144, rounded up to 32; LFM2-MoE's dense layers' as given)
    if moe:
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        w.add_leading_dense_block_count(c.num_dense_layers)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_weights_scale(c.routed_scaling_factor)
    w.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    names = gguf.TensorNameMap(arch, c.num_hidden_layers)
    experts: dict[str, list] = {}
    for name, a in load_file(str(tmp_path / "hf" / "model.safetensors")).items():
        if ".experts." in name:  # stacked per layer and kind, in expert order
            parts = name.split(".")
            experts.setdefault(f"layers.{parts[2]}.feed_forward.experts.{parts[6]}.weight", []).append((int(parts[5]), a))
            continue
        key = names.get_name(name.replace("expert_bias", "expert_bias.bias"), try_suffixes=(".weight", ".bias"))
        assert key is not None, name
        w.add_tensor(key, a.astype(np.float32).squeeze(1) if "conv.conv.weight" in name else a.astype(np.float32))
    for name, parts in experts.items():
        w.add_tensor(names.get_name(name, try_suffixes=(".weight",)), np.stack([a for _, a in sorted(parts)]))
    path = written(w, tmp_path / "lfm2.gguf")
    cfg = open_checkpoint(path).config()
    hf_cfg = open_checkpoint(str(tmp_path / "hf")).config()
    assert dataclasses.replace(cfg, rms_norm_eps=hf_cfg.rms_norm_eps, mamba=dataclasses.replace(
        cfg.mamba, norm_eps=hf_cfg.mamba.norm_eps)) == hf_cfg
    ids = (PROMPTS[2] + PROMPTS[0]) * 2
    assert rel_err(_ours(path, ids), hf_logits(model, ids)) < 1e-4


def _write_falcon_h1(path, model, hf_dir) -> str:
    """`model` (an HF Falcon-H1, saved at `hf_dir`) as an F32 GGUF, as llama.cpp's converter writes one: every
    multiplier folded into the weights (the embedding's into the embeddings, the LM head's into the head), the
    mixer's tensors as Granite 4.0-H's, Llama's rotary row order on q and k."""
    from safetensors.numpy import load_file

    from jaxserve.loader.falcon_keys import falcon_folded

    c = model.config
    cfg = open_checkpoint(str(hf_dir)).config()
    w = gguf.GGUFWriter(str(path), "falcon-h1")
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    _add_ssm(w, c.mamba_d_conv, c.mamba_d_state, c.mamba_n_groups, c.mamba_n_heads, c.mamba_d_head)
    w.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    names = gguf.TensorNameMap(gguf.MODEL_ARCH.FALCON_H1, c.num_hidden_layers)
    for name, a in load_file(str(hf_dir / "model.safetensors")).items():
        ours = name.replace(".feed_forward.", ".mlp.")  # (the fold's names for the MLP)
        a = falcon_folded(ours, a.astype(np.float32), cfg)
        if name == "model.embed_tokens.weight":
            a = a * c.embedding_multiplier
        if name == "lm_head.weight":
            a = a * c.lm_head_multiplier
        if name.endswith(".dt_bias"):
            name = name.replace(".dt_bias", ".dt_proj.bias")
        key = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert key is not None, name
        if name.endswith(".weight") and not key.endswith(".weight"):  # (the gguf package maps `pre_ff_layernorm.weight`
            # whole)
            key += "." + name.rsplit(".", 1)[1]
        w.add_tensor(key, _as_written(name, key, a, c, c.mamba_n_groups))
    return written(w, path)


@pytest.mark.parametrize("rms_norm", [False, True])
def test_falcon_h1_gguf_equals_the_hf_model(tmp_path, rms_norm):
    """The file's config is the HF model's but its multipliers (1: in the weights) and its mixer's norm's place
    (after the gate, as llama.cpp norms it: the same where the HF model has none); its logits the HF model's over
    102 tokens."""
    from tests.test_falcon_h1 import TINY

    kw = {**TINY, "mamba_rms_norm": rms_norm, "mamba_norm_before_gate": False}
    model = save_tiny_hf("FalconH1Config", tmp_path / "hf", **kw)
    path = _write_falcon_h1(tmp_path / "falcon-h1.gguf", model, tmp_path / "hf")
    cfg = open_checkpoint(path).config()
    hf_cfg = open_checkpoint(str(tmp_path / "hf")).config()
    assert dataclasses.replace(cfg.mamba, norm_eps=1e-5) == hf_cfg.mamba and cfg.attention_layers == (0, 1, 2)
    assert cfg.falcon.key == cfg.falcon.ssm[0] == cfg.embedding_multiplier == cfg.logits_scaling == 1.0
    ids = (PROMPTS[2] + PROMPTS[0]) * 2
    assert rel_err(_ours(path, ids), hf_logits(model, ids)) < 1e-4


def _write_jamba(path, model, hf_dir) -> str:
    """`model` (an HF Jamba, saved at `hf_dir`) as an F32 GGUF, as llama.cpp's converter writes one: KV heads per layer
    (0 in a Mamba layer), the experts stacked per projection, A as -exp(A_log), the convolution squeezed, q and k
    rows as they are."""
    from safetensors.numpy import load_file

    c = model.config
    w = gguf.GGUFWriter(str(path), "jamba")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv([c.num_key_value_heads if t == "attention" else 0 for t in c.layers_block_type])
    w.add_ssm_conv_kernel(c.mamba_d_conv)
    w.add_ssm_inner_size(c.mamba_expand * c.hidden_size)
    w.add_ssm_state_size(c.mamba_d_state)
    w.add_ssm_time_step_rank(c.mamba_dt_rank)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_expert_count(c.num_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    names = gguf.TensorNameMap(gguf.MODEL_ARCH.JAMBA, c.num_hidden_layers)
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for name, a in load_file(str(hf_dir / "model.safetensors")).items():
        parts = name.split(".")
        if ".experts." in name:
            experts.setdefault((parts[2], parts[-2]), {})[int(parts[5])] = a
            continue
        key = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert key is not None, name
        if name.endswith(".weight") and not key.endswith(".weight"):  # (`pre_ff_layernorm.weight` mapped whole)
            key += ".weight"
        w.add_tensor(key, a.squeeze() if "conv1d.weight" in name else -np.exp(a) if name.endswith("A_log") else a)
    kinds = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}
    for (layer, kind), by_expert in experts.items():
        w.add_tensor(f"blk.{layer}.{kinds[kind]}.weight", np.stack([by_expert[j] for j in sorted(by_expert)]))
    return written(w, path)


def test_jamba_gguf_equals_the_hf_model(tmp_path):
    """The file's config is the HF model's (its attention and expert layers found by their KV heads and routers, its
    Mamba layers' shape and biases), its logits the HF model's over 102 tokens."""
    from tests.test_jamba import TINY

    model = save_tiny_hf("JambaConfig", tmp_path / "hf", **TINY)
    path = _write_jamba(tmp_path / "jamba.gguf", model, tmp_path / "hf")
    cfg = open_checkpoint(path).config()
    hf_cfg = open_checkpoint(str(tmp_path / "hf")).config()
    assert dataclasses.replace(cfg, rms_norm_eps=hf_cfg.rms_norm_eps, mamba=dataclasses.replace(
        cfg.mamba, norm_eps=hf_cfg.mamba.norm_eps), max_position_embeddings=hf_cfg.max_position_embeddings) == hf_cfg
    ids = (PROMPTS[2] + PROMPTS[0]) * 2
    assert rel_err(_ours(path, ids), hf_logits(model, ids)) < 1e-4


def _write_mamba(path, model, hf_dir) -> str:
    """`model` (an HF Mamba, Falcon Mamba or Mamba-2, saved at `hf_dir`) as an F32 GGUF, as llama.cpp's converter
    writes one: the context length a placeholder, no heads; A as -exp(A_log) (Mamba-2's A and D as [heads, 1], its
    gated norm as [groups, channels per group]), the convolution squeezed; Falcon Mamba's flag for its step norms."""
    from safetensors.numpy import load_file

    c = model.config
    two = c.model_type == "mamba2"
    arch = "mamba2" if two else "mamba"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(2**20)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(0)
    w.add_head_count(0)
    w.add_block_count(c.num_hidden_layers)
    w.add_ssm_conv_kernel(c.conv_kernel)
    w.add_ssm_state_size(c.state_size)
    w.add_layer_norm_rms_eps(c.layer_norm_epsilon)
    if two:
        w.add_ssm_inner_size(c.num_heads * c.head_dim)
        w.add_ssm_time_step_rank(c.num_heads)
        w.add_ssm_group_count(c.n_groups)
    else:
        w.add_ssm_inner_size(c.intermediate_size)
        w.add_ssm_time_step_rank(c.time_step_rank)
        w.add_ssm_dt_b_c_rms(c.model_type == "falcon_mamba")
    w.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    names = gguf.TensorNameMap(gguf.MODEL_ARCH.MAMBA2 if two else gguf.MODEL_ARCH.MAMBA, c.num_hidden_layers)
    for name, a in load_file(str(hf_dir / "model.safetensors")).items():
        name = name.replace(".dt_bias", ".dt_proj.bias")
        key = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert key is not None, name
        w.add_tensor(key, a.squeeze() if "conv1d.weight" in name else _as_written(name, key, a, c, c.n_groups)
                     if two else -np.exp(a) if name.endswith("A_log") else a)
    return written(w, path)


@pytest.mark.parametrize("family", ["mamba", "falcon_mamba", "mamba2"])
def test_mamba_gguf_equals_the_hf_model(tmp_path, family):
    """The file's config is the HF model's (Falcon Mamba's by its flag, Mamba-2's heads by its step rank; the
    placeholder context not taken), its logits the HF model's over 102 tokens (Mamba-2's step unclamped: the file
    holds no clamp, Falcon Mamba's step norms transformers' eps)."""
    from tests.test_mamba_lm import SHAPE, VARIANTS

    config_cls, kw = VARIANTS[family]
    kw = {k: v for k, v in kw.items() if k not in ("time_step_limit", "mixer_rms_eps")}  # (not in the file)
    model = save_tiny_hf(config_cls, tmp_path / "hf", **SHAPE, **kw)
    path = _write_mamba(tmp_path / f"{family}.gguf", model, tmp_path / "hf")
    cfg = open_checkpoint(path).config()
    hf_cfg = open_checkpoint(str(tmp_path / "hf")).config()
    assert cfg.max_position_embeddings == 2048
    mamba = dataclasses.replace(cfg.mamba, norm_eps=hf_cfg.mamba.norm_eps)  # (eps in float32 in the file)
    assert dataclasses.replace(cfg, max_position_embeddings=hf_cfg.max_position_embeddings,
                               rms_norm_eps=hf_cfg.rms_norm_eps, mamba=mamba) == hf_cfg
    ids = (PROMPTS[2] + PROMPTS[0]) * 2
    assert rel_err(_ours(path, ids), hf_logits(model, ids)) < 1e-4
