"""Tiny random-weight models of every supported family against HF transformers.

Each model is built locally from a transformers config class (never downloaded), saved
with `save_pretrained`, read back through our safetensors loader and compared logit for logit.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402

from jaxserve.loader import HFDirectory, load_params, open_checkpoint  # noqa: E402
from tests.modelrun import prompt_logits  # noqa: E402

VOCAB = 160
PROMPT_LEN = 40
TINY = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
)
REL_TOL = 1e-4


def save_tiny_hf(config_cls: str, path, dtype: str = "float32", max_shard_size: str | None = None,
                 seed: int = 0, model_cls: str | None = None, tiny: bool = True, **overrides):
    """Build a random model of `transformers.<config_cls>` (TINY shape + overrides, or the overrides alone without
    `tiny`: an image-text config's sub-configs; `model_cls`: a model class transformers' auto classes do not map it
    to), save it to `path` as safetensors and return the float32 torch
    model holding the very saved weights."""
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**({**TINY, **overrides} if tiny else overrides))
    config._attn_implementation = "eager"
    model = (getattr(transformers, model_cls)(config) if model_cls else
             transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager"))
    with torch.no_grad():
        # HF's init leaves norms at one and biases at zero, which would hide a misplaced norm or bias.
        for name, p in model.named_parameters():
            if p.ndim == 1 and "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif p.ndim == 1:
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
        for name, b in model.named_buffers():  # a router's bias for choosing experts (DeepSeek-V3's, GLM-4.5's, LFM2-MoE's)
            if name.endswith(("e_score_correction_bias", "expert_bias")):
                b.copy_(0.2 * torch.randn_like(b))
            elif name.endswith("layer_scalar"):  # (Gemma 4's output scale of each layer, saved)
                b.copy_(0.5 + torch.rand_like(b))
    model = model.to(getattr(torch, dtype))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    return model.float().eval()


def tiny_loaded(tmp_path_factory, config_cls: str, name: str, **overrides) -> tuple:
    """A tiny random model of `transformers.<config_cls>` saved in a fresh folder (`save_tiny_hf`): (its path, the
    torch model, our config of it, our float32 parameters read from it)."""
    path = tmp_path_factory.mktemp(name)
    model = save_tiny_hf(config_cls, path, **overrides)
    ckpt = HFDirectory(path)
    cfg = ckpt.config()
    return path, model, cfg, load_params(ckpt, cfg, jnp.float32, progress=False)


def assert_logits_match(model, cfg, params, *changes: dict, backends=("xla",)) -> tuple[list[int], np.ndarray]:
    """Our logits of a random prompt are the torch `model`'s (relative error under 1e-4) on each attention backend;
    with each config change in `changes` they are not (over 1e-3), so each one is needed. (ids, the reference)."""
    import dataclasses

    ids = random_prompt()
    ref = hf_logits(model, ids)
    for backend in backends:
        assert rel_err(prompt_logits(cfg, params, ids, backend=backend), ref) < 1e-4, backend
    for change in changes:
        assert rel_err(prompt_logits(dataclasses.replace(cfg, **change), params, ids), ref) > 1e-3, change
    return ids, ref


def assert_engine_greedy(model, cfg, params, loop: str = "auto", backend: str = "auto") -> None:
    """The engine's greedy tokens are the torch `model`'s: prompts of 21 and 13 tokens prefilled 16 tokens a step,
    then decoded together (`test_engine_gemma.PROMPTS`)."""
    from tests.modelrun import tiny_engine
    from tests.test_engine_gemma import NEW_TOKENS, PROMPTS, _greedy, hf_greedy

    assert _greedy(tiny_engine(cfg, params, loop, backend=backend)) == [hf_greedy(model, p, NEW_TOKENS)
                                                                         for p in PROMPTS]


def random_prompt(n: int = PROMPT_LEN, seed: int = 1) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, n).tolist()


def hf_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def ours_logits(path, ids: list[int]) -> tuple[np.ndarray, object]:
    ckpt = open_checkpoint(str(path))
    assert isinstance(ckpt, HFDirectory)
    cfg = ckpt.config()
    params = load_params(ckpt, cfg, jnp.float32, progress=False)
    return prompt_logits(cfg, params, ids), cfg


def assert_written_back(path, cfg, params) -> None:
    """Our parameters as an HF checkpoint (`keymap.hf_tensors`) are the tensors of the checkpoint at `path`, exactly."""
    from safetensors.numpy import load_file

    from jaxserve.loader.keymap import hf_tensors
    from jaxserve.models.params import param_paths

    saved = {k: v for f in sorted(Path(path).glob("*.safetensors")) for k, v in load_file(f).items()}
    written = dict(hf_tensors(cfg, {k: np.asarray(v) for k, v in param_paths(params).items()}))
    assert set(written) == set(saved)
    for name, t in written.items():
        np.testing.assert_array_equal(t, saved[name], err_msg=name)


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))


# Each entry compiles its own forward (the config is static under jit), so the list stays short;
# the other tests below reuse these configs and hit the same compiled function.
FAMILIES = {
    "llama": ("LlamaConfig", {"tie_word_embeddings": True}),
    "llama_untied_bias": ("LlamaConfig", {"tie_word_embeddings": False, "attention_bias": True, "mlp_bias": True}),
    "llama3_rope": ("LlamaConfig", {"rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}}),
    "llama_yarn_rope": ("LlamaConfig", {"rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
        "max_position_embeddings": 64}),
    "qwen2": ("Qwen2Config", {}),
    "qwen2_sliding": ("Qwen2Config", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}),
    "qwen3": ("Qwen3Config", {"head_dim": 24}),
    "mistral": ("MistralConfig", {"sliding_window": 8}),
    # Helium (Kyutai): Llama's layers with rotary pairs interleaved (read half-split at load), q/k/v and MLP biases,
    # the norms' weights applied in float32.
    "helium": ("HeliumConfig", {"head_dim": 16, "attention_bias": True, "mlp_bias": True}),
    # Ministral 8B: Mistral's layers, windowed or global by `layer_types`.
    "ministral": ("MinistralConfig", {"head_dim": 16, "num_hidden_layers": 4, "sliding_window": 8, "layer_types": [
        "sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]}),
    # Ministral 3: YaRN over an original context of 8, queries scaled up past each multiple of it (Llama 4's).
    "ministral3": ("Ministral3Config", {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 8, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1}}),
    # Mistral's architecture with fused q/k/v and gate/up projections, split at load.
    "phi3": ("Phi3Config", {"sliding_window": 8, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    # As Phi-4-mini: LongRoPE within its original context of 48 (the short factors and the attention factor of
    # 256 / 48) over half of each head's dims (a partial rotary embedding).
    "phi3_longrope": ("Phi3Config", {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
                                     "partial_rotary_factor": 0.5, "original_max_position_embeddings": 48,
                                     "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0, 1.5, 3.0, 1.2],
                                                      "long_factor": [9.0, 2.0, 17.0, 5.0]}}),
    # Granite 3's scalars, none of them 1: embeddings x 12, attention scale 1/8 (not 1/sqrt(16)), block outputs
    # x 0.22 into the residual, logits / 8; biases on attention and the MLP.
    "granite": ("GraniteConfig", {"embedding_multiplier": 12.0, "attention_multiplier": 0.125,
                                  "residual_multiplier": 0.22, "logits_scaling": 8.0, "attention_bias": True,
                                  "mlp_bias": True, "tie_word_embeddings": True}),
    # Granite 4.0 dense (its hybrid architecture, attention layers only): the MLP is its shared MLP, gate and up
    # in one tensor.
    "granitemoehybrid_dense": ("GraniteMoeHybridConfig", {"num_local_experts": 0, "shared_intermediate_size": 96,
                                                          "layer_types": ["attention"] * 2, "logits_scaling": 8.0,
                                                          "position_embedding_type": "rope",
                                                          "residual_multiplier": 0.22}),
    # Gemma (1): Llama's layers with Gemma's (1 + w) norms, embeddings scaled, a tanh-GELU gated MLP (its legacy
    # `gelu` taken as that, as transformers does), tied embeddings, multi-query attention.
    "gemma": ("GemmaConfig", {"head_dim": 16, "hidden_act": "gelu", "num_key_value_heads": 1}),
    # Layer 0 windowed, layer 1 global; soft-caps small enough that tanh bends the logits.
    "gemma2": ("Gemma2Config", {"head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 24,
                                "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0}),
    # Sliding layers on their own rotary base, the global layer's linearly scaled; q/k norms.
    "gemma3": ("Gemma3TextConfig", {"head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 24,
                                    "layer_types": ["sliding_attention", "full_attention"], "rope_parameters": {
                                        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                        "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                           "rope_theta": 10000.0}}}),
    # Every layer global though a window is declared: one scanned layer, no window.
    "gemma3_global": ("Gemma3TextConfig", {"head_dim": 16, "sliding_window": 8,
                                           "layer_types": ["full_attention", "full_attention"]}),
    # Three layers in groups of two: the loop over groups, then the last layer alone.
    "gemma3_odd": ("Gemma3TextConfig", {"num_hidden_layers": 3, "head_dim": 16, "sliding_window": 8,
                                        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}),
    # Layer 1 not rotated by position (NoPE), layers 0 and 2 rotated: groups of two, then the last layer alone.
    "smollm3": ("SmolLM3Config", {"num_hidden_layers": 3, "no_rope_layers": [1, 0, 1], "pad_token_id": 0,
                                  "bos_token_id": 1, "eos_token_id": 2}),
    # Interleaved rotary pairs over half of each head, q/k/v biases, gate and up fused; GLM-4 also norms the
    # attention's and the MLP's outputs.
    "glm": ("GlmConfig", {"head_dim": 16, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    "glm4": ("Glm4Config", {"head_dim": 16, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    # Interleaved rotary pairs over the whole head, biases on every projection (use_bias), tied embeddings.
    "ernie4_5": ("Ernie4_5Config", {"head_dim": 16, "use_bias": True}),
    # OLMo 2: norms after attention and the MLP only, q and k normed over all their heads.
    "olmo2": ("Olmo2Config", {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    # OLMo 3: OLMo 2's layers, three windowed and one global, the windowed ones on their own unscaled rotary base.
    "olmo3": ("Olmo3Config", {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "num_hidden_layers": 4,
                              "sliding_window": 8, "rope_parameters": {
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                  "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 10000.0}}}),
    # Seed-OSS: Llama with q/k/v biases, which is Qwen2.
    "seed_oss": ("SeedOssConfig", {"head_dim": 16}),
    # EXAONE 4: OLMo 2's norms after attention and the MLP, q and k normed per head; three windowed layers and a
    # global one, not rotated (NoPE), on Llama 3's rope scaling; without a window every layer global and rotated.
    "exaone4": ("Exaone4Config", {"head_dim": 16, "num_hidden_layers": 4, "sliding_window": 8,
                                  "sliding_window_pattern": 4, "rope_parameters": {
                                      "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
                                      "rope_theta": 10000.0}}),
    # Command R(+): LayerNorm, attention and the MLP side by side on the same normed input, interleaved rotary pairs,
    # q and k normed per head (a weight per head and dim), tied embeddings, logits scaled.
    "cohere": ("CohereConfig", {"use_qk_norm": True, "logit_scale": 0.125, "pad_token_id": 0, "bos_token_id": 1,
                                "eos_token_id": 2}),
    # Command R7B / Command A: Cohere's layers, three of four windowed, the global ones without rotary embedding.
    "cohere2": ("Cohere2Config", {"num_hidden_layers": 4, "sliding_window": 8, "pad_token_id": 0, "bos_token_id": 1,
                                  "eos_token_id": 2}),
    # AFM (Arcee): Llama with an ungated MLP, down(relu(up)^2), biases on every projection.
    "arcee": ("ArceeConfig", {"attention_bias": True, "mlp_bias": True}),
    # Apertus: an ungated MLP with xIELU (its parameters learned per layer), q and k normed per head.
    "apertus": ("ApertusConfig", {"head_dim": 16, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    "exaone4_global": ("Exaone4Config", {"head_dim": 16, "sliding_window": None,
                                         "layer_types": ["full_attention"] * 2}),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_logits_match_transformers(family, tmp_path):
    config_cls, overrides = FAMILIES[family]
    model = save_tiny_hf(config_cls, tmp_path, **overrides)
    ids = random_prompt()
    ours, cfg = ours_logits(tmp_path, ids)
    ref = hf_logits(model, ids)
    rel = rel_err(ours, ref)
    print(f"{family}: max relative error {rel:.2e}")
    assert rel < REL_TOL, f"{family}: relative error {rel:.2e}"
    assert (ours.argmax(-1) == ref.argmax(-1)).all()
    # The config must describe what HF built, or a lucky match would hide a parsing bug.
    hf = model.config
    assert cfg.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
    assert cfg.sliding_window == getattr(hf, "sliding_window", None)
    assert cfg.tie_word_embeddings == hf.tie_word_embeddings


def test_ministral3_queries_scaled_by_position(tmp_path):
    """Ministral 3's queries scaled by 1 + 0.1 log(1 + floor(position / 8)): without the scale the logits are not
    transformers'; the config written back (and an image-text one's language model) reads the same."""
    import dataclasses

    from jaxserve.config import ModelConfig

    model = save_tiny_hf("Ministral3Config", tmp_path, **FAMILIES["ministral3"][1])
    ckpt = open_checkpoint(str(tmp_path))
    cfg = ckpt.config()
    assert (cfg.family, cfg.query_scale_beta, cfg.query_scale_length) == ("mistral", 0.1, 8)
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    assert ModelConfig.from_hf({"architectures": ["Mistral3ForConditionalGeneration"], "model_type": "mistral3",
                                "text_config": model.config.to_dict()}) == cfg
    ids = random_prompt()
    params = load_params(ckpt, cfg, jnp.float32, progress=False)
    plain = prompt_logits(dataclasses.replace(cfg, query_scale_beta=0.0, query_scale_length=0), params, ids)
    assert rel_err(plain, hf_logits(model, ids)) > 1e-3


def test_smollm3_nope_layers(tmp_path):
    """SmolLM3's layers without rotary embedding: its config's default (every 4th layer) and list, the logits of
    the stacked and the unrolled layers and greedy decoding equal transformers', which rotating layer 1 too
    changes; the config written back reads the same."""
    from jaxserve.config import ModelConfig
    from jaxserve.models.unstack import unstack_layers
    from tests.modelrun import greedy, torch_greedy

    default = ModelConfig.from_hf({**TINY, "architectures": ["SmolLM3ForCausalLM"], "num_hidden_layers": 8})
    assert default.no_rope_layers == (1, 1, 1, 0, 1, 1, 1, 0) and default.layer_period == 4
    model = save_tiny_hf("SmolLM3Config", tmp_path, **FAMILIES["smollm3"][1])
    ckpt = open_checkpoint(str(tmp_path))
    cfg = ckpt.config()
    assert cfg.family == "smollm3" and cfg.no_rope_layers == (1, 0, 1) and cfg.layer_period == 2
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    params = load_params(ckpt, cfg, jnp.float32, progress=False)
    ids = random_prompt()
    ref = hf_logits(model, ids)
    assert rel_err(prompt_logits(cfg, unstack_layers(params), ids), ref) < REL_TOL
    tokens, _ = torch_greedy(lambda x: model(torch.tensor([x])).logits[0, -1], ids[:12], 6)
    assert greedy(cfg, params, ids[:12], 6) == tokens
    model.model.layers[1].self_attn.use_rope = 1
    assert rel_err(prompt_logits(cfg, params, ids), hf_logits(model, ids)) > 1e-2


def test_gemma_reads_writes_back_and_serves_as_transformers(tmp_path):
    """Gemma (1): its config (no norms after attention or the MLP, no window, no soft-caps; the legacy `gelu` the
    tanh GELU) and checkpoint written back as read, and the engine's greedy tokens, chunked and batched, the model's."""
    from jaxserve.config import ModelConfig

    config_cls, overrides = FAMILIES["gemma"]
    model = save_tiny_hf(config_cls, tmp_path, **overrides)
    ckpt = HFDirectory(str(tmp_path))
    cfg = ckpt.config()
    assert (cfg.output_norms, cfg.layer_types, cfg.sliding_window, cfg.attn_logit_softcap, cfg.hidden_act) == (
        False, None, None, None, "gelu_pytorch_tanh")
    hf = cfg.to_hf()
    assert (hf["model_type"], hf["architectures"]) == ("gemma", ["GemmaForCausalLM"])
    assert ModelConfig.from_hf(hf) == cfg
    params = load_params(ckpt, cfg, jnp.float32, progress=False)
    assert params.layers.post_attn_norm is None
    assert_written_back(tmp_path, cfg, params)
    assert_engine_greedy(model, cfg, params, "scan")


def test_helium_checkpoint_written_back(tmp_path):
    """Helium's q and k rows, read in the half-split rotary order, written back interleaved as they were; its q/k/v
    biases without the output projection's."""
    config_cls, overrides = FAMILIES["helium"]
    save_tiny_hf(config_cls, tmp_path, **overrides)
    ckpt = HFDirectory(str(tmp_path))
    cfg = ckpt.config()
    assert (cfg.family, cfg.attention_bias, cfg.output_bias, cfg.mlp_bias) == ("helium", True, False, True)
    assert_written_back(tmp_path, cfg, load_params(ckpt, cfg, jnp.float32, progress=False))


def test_ministral_layer_kinds_written_back_and_served(tmp_path):
    """Ministral's windowed and global layers (a global one in the first three, then a windowed one alone): its
    config and checkpoint written back as read, logits not those of every layer windowed, and the engine's greedy
    tokens (the layers scanned by kind), chunked and batched, the model's."""
    from jaxserve.config import ModelConfig

    config_cls, overrides = FAMILIES["ministral"]
    model = save_tiny_hf(config_cls, tmp_path, **overrides)
    ckpt = HFDirectory(str(tmp_path))
    cfg = ckpt.config()
    assert (cfg.family, cfg.sliding_window, cfg.layer_types[:2]) == ("ministral", 8, ("sliding_attention",
                                                                                      "full_attention"))
    hf = cfg.to_hf()
    assert (hf["architectures"], hf["layer_types"][1]) == (["MinistralForCausalLM"], "full_attention")
    assert ModelConfig.from_hf(hf) == cfg
    params = load_params(ckpt, cfg, jnp.float32, progress=False)
    assert_logits_match(model, cfg, params, {"layer_types": None})
    assert_written_back(tmp_path, cfg, params)
    assert_engine_greedy(model, cfg, params, "scan")


def test_sliding_window_changes_logits(tmp_path):
    """The Mistral window is in force: the same weights without it give other logits past the window."""
    model = save_tiny_hf("MistralConfig", tmp_path, **FAMILIES["mistral"][1])
    ids = random_prompt()
    ours, cfg = ours_logits(tmp_path, ids)
    assert cfg.sliding_window == 8
    model.config.sliding_window = None
    full = hf_logits(model, ids)
    assert rel_err(ours[:8], full[:8]) < REL_TOL  # inside the window nothing differs
    assert rel_err(ours[8:], full[8:]) > 1e-2


def test_qwen2_window_off_below_max_window_layers(tmp_path):
    """HF Qwen windows only layers >= max_window_layers; with that past the depth, attention is full."""
    model = save_tiny_hf("Qwen2Config", tmp_path, use_sliding_window=True, sliding_window=8, max_window_layers=28)
    ids = random_prompt()
    ours, cfg = ours_logits(tmp_path, ids)
    assert cfg.sliding_window is None
    assert rel_err(ours, hf_logits(model, ids)) < REL_TOL


def test_sharded_checkpoint(tmp_path):
    model = save_tiny_hf("LlamaConfig", tmp_path, max_shard_size="40KB", **FAMILIES["llama"][1])
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    ids = random_prompt()
    ours, _ = ours_logits(tmp_path, ids)
    assert rel_err(ours, hf_logits(model, ids)) < REL_TOL


def test_bfloat16_checkpoint(tmp_path):
    """bfloat16 safetensors load (upcast to float32) to the very weights HF holds."""
    model = save_tiny_hf("Qwen3Config", tmp_path, dtype="bfloat16", **FAMILIES["qwen3"][1])
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), framework="numpy") as f:
        assert str(f.get_tensor("model.embed_tokens.weight").dtype) == "bfloat16"
    # HF's own float32 load of the file: casting the live model down and up would also round its
    # rotary frequencies, which a checkpoint never stores.
    del model
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), dtype=torch.float32, attn_implementation="eager").eval()
    ids = random_prompt()
    ours, _ = ours_logits(tmp_path, ids)
    ref = hf_logits(ref_model, ids)
    assert rel_err(ours, ref) < REL_TOL
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_gemma3_image_text_checkpoint_serves_its_language_model(tmp_path):
    """Gemma 3's 4B-27B ship as image-text models: `text_config` nests the language model's config (leaving out
    what Gemma3TextConfig defaults), its weights sit under `language_model.`, and a vision tower and projector
    come alongside. Served as text, the logits equal HF's on a text-only prompt."""
    torch.manual_seed(0)
    text = {**TINY, **FAMILIES["gemma3"][1], "query_pre_attn_scalar": 256}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    model = transformers.Gemma3ForConditionalGeneration(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.ndim == 1:
                p.copy_(0.2 * torch.randn_like(p))
            elif p.ndim > 1:
                p.normal_(0.0, 0.15)
    model.save_pretrained(tmp_path, safe_serialization=True)
    saved = json.loads((tmp_path / "config.json").read_text())
    saved["text_config"].pop("query_pre_attn_scalar")  # left to its default (256), as published files do
    (tmp_path / "config.json").write_text(json.dumps(saved))
    ids = random_prompt()
    ours, cfg = ours_logits(tmp_path, ids)
    assert cfg.family == "gemma3" and cfg.query_pre_attn_scalar == 256 and cfg.num_layers == 2
    ref = hf_logits(model.eval(), ids)
    assert rel_err(ours, ref) < REL_TOL
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_exaone4_5_image_text_checkpoint_serves_its_language_model(tmp_path):
    """EXAONE 4.5 (`Exaone4_5_ForConditionalGeneration`) as its language model: its `text_config` (EXAONE 4's,
    windowed and global layers) and the tensors under `model.language_model` (its tower's are read by
    tests/test_engine_qwen2_vl.py): the logits of a text prompt; the first release's text model type,
    "exaone4_5_text", read alike."""
    from jaxserve.config import ModelConfig

    text = {**TINY, **FAMILIES["exaone4"][1], "model_type": "exaone4"}
    vision = dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=4, num_key_value_heads=2, out_hidden_size=64,
                  fullatt_block_indexes=[0], window_size=28, patch_size=14, spatial_merge_size=2)
    model = save_tiny_hf("Exaone4_5_Config", tmp_path, model_cls="Exaone4_5_ForConditionalGeneration", tiny=False,
                         text_config=text, vision_config=vision)
    ids = random_prompt()
    ours, cfg = ours_logits(tmp_path, ids)
    assert (cfg.family, cfg.num_layers, cfg.sliding_window, cfg.tie_word_embeddings) == ("exaone4", 4, 8, False)
    ref = hf_logits(model, ids)
    assert rel_err(ours, ref) < REL_TOL and (ours.argmax(-1) == ref.argmax(-1)).all()
    saved = json.loads((tmp_path / "config.json").read_text())
    saved["text_config"]["model_type"] = "exaone4_5_text"
    assert ModelConfig.from_hf(saved) == cfg


def test_granite_hybrid_layer_kinds():
    """A Granite 4.0 config's layers: its Mamba ones read as such (`tests/test_hybrid.py` serves them), an unknown
    kind refused by name; with attention layers only, a Granite 4.0 of the attention kind (its MLP the shared one)."""
    from jaxserve.config import ModelConfig, UnsupportedModelError

    d = {**TINY, "architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid",
         "num_local_experts": 0, "layer_types": ["mamba", "attention"], "mamba_n_heads": 8}
    assert ModelConfig.from_hf(d).mamba.layers == (0,)
    with pytest.raises(UnsupportedModelError, match=r"hybrid layer kinds \['conv'\] are not supported"):
        ModelConfig.from_hf({**d, "layer_types": ["conv", "attention"]})
    cfg = ModelConfig.from_hf({**d, "layer_types": ["attention"] * 2, "shared_intermediate_size": 80})
    assert cfg.num_experts == 0 and cfg.intermediate_size == 80 and cfg.no_rope_layers == (0, 0) and cfg.mamba is None
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
