"""EXAONE 3.0 / 3.5 (`ExaoneForCausalLM`, LG's own code): Llama's architecture under other module and config
names. A tiny transformers Llama (grouped queries, Llama 3's rope scaling, untied head) saved as an EXAONE
checkpoint (its tensors renamed, its config.json as EXAONE's) loads to the Llama's config and logits, and as a
GGUF written as llama.cpp's converter writes the `exaone` architecture (rows not permuted: NEOX rotation)."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from jaxserve.errors import UnsupportedModelError  # noqa: E402
from jaxserve.loader import HFDirectory, open_checkpoint  # noqa: E402
from tests.test_gguf_models import LLAMA3_SCALING, _llama3_rope_freqs, _ours, _write_gguf  # noqa: E402
from tests.test_model_families import save_tiny_hf  # noqa: E402

_MODULES = {"input_layernorm": "ln_1", "post_attention_layernorm": "ln_2", "self_attn.q_proj": "attn.attention.q_proj",
            "self_attn.k_proj": "attn.attention.k_proj", "self_attn.v_proj": "attn.attention.v_proj",
            "self_attn.o_proj": "attn.attention.out_proj", "mlp.gate_proj": "mlp.c_fc_0", "mlp.up_proj": "mlp.c_fc_1",
            "mlp.down_proj": "mlp.c_proj"}


def _exaone_name(name: str) -> str:
    if name in ("model.embed_tokens.weight", "model.norm.weight"):
        return "transformer.wte.weight" if "embed" in name else "transformer.ln_f.weight"
    if not name.startswith("model.layers."):
        return name
    layer, module = name.removeprefix("model.layers.").removesuffix(".weight").split(".", 1)
    return f"transformer.h.{layer}.{_MODULES[module]}.weight"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(transformers' Llama, its directory, the same weights as an EXAONE checkpoint's directory)."""
    from safetensors.numpy import load_file, save_file

    root = tmp_path_factory.mktemp("exaone")
    model = save_tiny_hf("LlamaConfig", root / "llama", tie_word_embeddings=False, max_position_embeddings=256,
                         rope_scaling=LLAMA3_SCALING, rope_theta=10000.0, num_key_value_heads=2, rms_norm_eps=1e-5)
    c = model.config
    (root / "exaone").mkdir()
    tensors = {_exaone_name(k): v for f in sorted((root / "llama").glob("*.safetensors")) for k, v in load_file(f).items()}
    assert all(k.startswith("transformer.") or k == "lm_head.weight" for k in tensors)
    save_file(tensors, str(root / "exaone" / "model.safetensors"))
    (root / "exaone" / "config.json").write_text(json.dumps({
        "architectures": ["ExaoneForCausalLM"], "model_type": "exaone", "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size, "num_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
        "layer_norm_epsilon": c.rms_norm_eps, "activation_function": "silu", "rope_theta": 10000.0,
        "rope_scaling": LLAMA3_SCALING, "max_position_embeddings": 256, "tie_word_embeddings": False,
        "rotary_pct": 0.25, "bos_token_id": 1, "eos_token_id": 2}))
    return model, root / "llama", root / "exaone"


def test_exaone_checkpoint_reads_as_the_llama_it_is(tiny):
    model, llama, exaone = tiny
    cfg = HFDirectory(str(exaone)).config()
    assert cfg == HFDirectory(str(llama)).config()
    assert (cfg.family, cfg.num_layers, cfg.num_kv_heads, cfg.tie_word_embeddings) == ("llama", 2, 2, False)
    ids = np.random.default_rng(4).integers(0, model.config.vocab_size, 120).tolist()  # (past the original 32)
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(_ours(str(exaone), ids), ref, atol=1e-4 * np.abs(ref).max(), rtol=0)


def test_exaone_gguf(tiny, tmp_path):
    """llama.cpp's `exaone` architecture: Llama's tensor names, rows as the checkpoint has them, Llama 3's scaling
    as `rope_freqs`."""
    model, llama, _ = tiny
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    path = _write_gguf(tmp_path / "e.gguf", model, arch="exaone",
                       rope_freqs=_llama3_rope_freqs(head_dim, 10000.0, LLAMA3_SCALING))
    cfg = open_checkpoint(path).config()
    assert (cfg.family, cfg.num_kv_heads, cfg.rope_scaling.rope_type) == ("llama", 2, "factors")
    ids = np.random.default_rng(5).integers(0, model.config.vocab_size, 120).tolist()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(_ours(path, ids), ref, atol=2e-4 * np.abs(ref).max(), rtol=0)


def test_exaone_defaults_and_refusals():
    from jaxserve.config import ModelConfig

    base = {"architectures": ["ExaoneForCausalLM"], "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 128}
    cfg = ModelConfig.from_hf(base)  # ExaoneConfig's defaults: 32 layers, MHA, 4x MLP, eps 1e-6, tied
    assert (cfg.num_layers, cfg.num_kv_heads, cfg.intermediate_size, cfg.rms_norm_eps, cfg.tie_word_embeddings) == (
        32, 4, 256, 1e-6, True)
    with pytest.raises(UnsupportedModelError, match="EXAONE with activation_function 'gelu'"):
        ModelConfig.from_hf({**base, "activation_function": "gelu"})
