"""`jaxserve convert MODEL --to-hf DIR`: the served weights as an HF directory that loads back identically."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxserve import cli  # noqa: E402
from jaxserve.loader import load_params, open_checkpoint  # noqa: E402
from jaxserve.models.params import param_paths  # noqa: E402
from jaxserve.tokenizer import Tokenizer  # noqa: E402
from tests.modelrun import prompt_logits  # noqa: E402
from tests.test_model_families import FAMILIES, VOCAB, hf_logits, random_prompt, rel_err, save_tiny_hf  # noqa: E402

CHAT_TEMPLATE = (
    "{% for m in messages %}<s> {{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<s> assistant : {% endif %}"
)
WORDS = ["hello", "world", "the", "sea", "is", "blue", "user", "assistant", "system", ":"]


def write_tiny_tokenizer(path) -> None:
    """A word-level tokenizer over VOCAB ids (specials, a few words, filler) with a chat template."""
    import tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for w in WORDS:
        vocab[w] = len(vocab)
    while len(vocab) < VOCAB:
        vocab[f"w{len(vocab)}"] = len(vocab)
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.decoder = tokenizers.decoders.WordPiece()  # joins words with spaces
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.save(os.path.join(path, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<unk>", "chat_template": CHAT_TEMPLATE}
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)


def make_source(path, family: str):
    model = save_tiny_hf(FAMILIES[family][0], path, **FAMILIES[family][1])
    write_tiny_tokenizer(path)
    return model


def convert(src, out, *extra: str) -> None:
    assert cli.main(["convert", str(src), "--to-hf", str(out), *extra]) == 0


def load_f32(path):
    ckpt = open_checkpoint(str(path))
    cfg = ckpt.config()
    return cfg, load_params(ckpt, cfg, jnp.float32, progress=False)


@pytest.mark.parametrize("family", ["llama", "llama_untied_bias", "qwen2", "qwen3", "mistral", "granite", "glm4",
                                    "olmo2", "olmo3", "exaone4_global", "cohere", "apertus"])
def test_convert_hf_dir_round_trip(tmp_path, family):
    src, out = tmp_path / "src", tmp_path / "out"
    model = make_source(src, family)
    convert(src, out)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):
        assert (out / name).is_file(), name
    # Our loader reads back exactly the weights and config it served.
    cfg_src, params_src = load_f32(src)
    cfg_out, params_out = load_f32(out)
    assert cfg_out == cfg_src
    flat_src, flat_out = param_paths(params_src), param_paths(params_out)
    assert flat_src.keys() == flat_out.keys()
    for key in flat_src:
        np.testing.assert_array_equal(np.asarray(flat_out[key]), np.asarray(flat_src[key]), err_msg=key)
    # transformers reads the output as the same model it built.
    ids = random_prompt(24)
    again = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    assert type(again) is type(model)
    assert rel_err(hf_logits(again, ids), hf_logits(model, ids)) < 1e-6


@pytest.mark.parametrize("family", ["granitemoe", "granitemoehybrid", "granitemoehybrid_dense", "glm4_moe",
                                    "ernie4_5_moe", "ernie4_5", "dots1", "gpt_oss", "olmoe"])
def test_convert_moe_writes_the_sources_tensors(tmp_path, family):
    """Granite MoE's experts, split per expert at load, are written back fused (one tensor per kind), Granite
    4.0's shared MLP (a shared expert, or a dense model's MLP) too, gpt-oss's experts packed input-major with
    gate and up interleaved, their biases too; GLM-4.5's and ERNIE 4.5's dense first layer,
    stacked apart, and their routers' biases are written where they came from, ERNIE's q and k rows in their
    interleaved rotary order; transformers reads the output as the model it built."""
    from safetensors import safe_open

    from tests.test_model_families import FAMILIES as DENSE_FAMILIES
    from tests.test_moe import FAMILIES as MOE_FAMILIES

    src, out = tmp_path / "src", tmp_path / "out"
    config_cls, overrides = {**MOE_FAMILIES, **DENSE_FAMILIES}[family]
    model = save_tiny_hf(config_cls, src, **overrides)
    write_tiny_tokenizer(src)
    convert(src, out)
    with safe_open(str(out / "model.safetensors"), "numpy") as f, safe_open(str(src / "model.safetensors"), "numpy") as g:
        assert sorted(f.keys()) == sorted(g.keys())
        for key in g.keys():
            np.testing.assert_array_equal(f.get_tensor(key), g.get_tensor(key), err_msg=key)
    again = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = random_prompt(24)
    assert rel_err(hf_logits(again, ids), hf_logits(model, ids)) < 1e-6


def test_converted_logits_and_tokenizer(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    make_source(src, "llama")
    convert(src, out)
    ids = random_prompt()
    cfg, params = load_f32(out)
    ours_out = prompt_logits(cfg, params, ids)
    ours_src = prompt_logits(*load_f32(src), ids)
    np.testing.assert_array_equal(ours_out, ours_src)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert rel_err(ours_out, hf_logits(hf, ids)) < 1e-4

    ours_tok = Tokenizer.from_hf_dir(out)
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    text = "hello world the sea is blue"
    assert ours_tok.encode(text) == hf_tok.encode(text, add_special_tokens=False) == [3, 4, 5, 6, 7, 8]
    assert (ours_tok.bos_token_id, tuple(ours_tok.eos_token_ids)) == (1, (2,))
    conv = [{"role": "user", "content": "hello world"}]
    expected = hf_tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
    assert expected == "<s> user : hello world </s> <s> assistant : "
    assert ours_tok.apply_chat_template(conv, add_generation_prompt=True) == expected
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)


def test_convert_to_bfloat16(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    make_source(src, "qwen3")
    convert(src, out, "--dtype", "bfloat16")
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="numpy") as f:
        embed = f.get_tensor("model.embed_tokens.weight")
    assert str(embed.dtype) == "bfloat16"
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    _, params_src = load_f32(src)
    want = np.asarray(params_src.embed.astype(jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_array_equal(np.asarray(embed, np.float32), want)


def test_convert_with_calculated_kv_scales(tmp_path):
    """`convert --calculate-kv-scales` writes the scales `serve --calculate-kv-scales` would measure, next to
    unchanged weights, so the converted directory serves a float8 cache on them without measuring."""
    from jaxserve.engine.kv_scales import measure_kv_amax, scales_from_amax
    from jaxserve.engine.model_loading import load_model
    from jaxserve.engine_args import EngineArgs

    src, out = tmp_path / "src", tmp_path / "out"
    make_source(src, "qwen2")
    convert(src, out, "--calculate-kv-scales")
    assert json.loads((out / "config.json").read_text())["quantization_config"]["kv_cache_scheme"]["num_bits"] == 8
    cfg, params = load_f32(out)
    cfg_src, params_src = load_f32(src)
    assert cfg.kv_cache_scales and not cfg_src.kv_cache_scales
    k_max, v_max, _ = measure_kv_amax(load_model(EngineArgs(model=str(src), dtype="float32"), progress=False), 16)
    np.testing.assert_allclose(np.asarray(params.layers.k_scale), scales_from_amax(k_max, jnp.float8_e4m3fn),
                               rtol=1e-6)
    np.testing.assert_allclose(np.asarray(params.layers.v_scale), scales_from_amax(v_max, jnp.float8_e4m3fn),
                               rtol=1e-6)
    flat, flat_src = param_paths(params), param_paths(params_src)
    assert set(flat) - set(flat_src) == {"layers.k_scale", "layers.v_scale"}
    for key in flat_src:
        np.testing.assert_array_equal(np.asarray(flat[key]), np.asarray(flat_src[key]), err_msg=key)


@pytest.mark.slow
def test_convert_bundled_gguf(tmp_path, smollm_path, smollm_f32):
    """The real SmolLM2: the converted directory gives our logits exactly and transformers' within 1e-4."""
    out = tmp_path / "smollm2-hf"
    convert(smollm_path, out)
    cfg_gguf, params_gguf = smollm_f32
    ckpt = open_checkpoint(str(out))
    cfg = ckpt.config()
    assert cfg == cfg_gguf
    params = load_params(ckpt, cfg, jnp.float32, progress=False)

    tok = Tokenizer.from_hf_dir(out)
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    text = "The capital of France is Paris. 東京 🚀"
    assert tok.encode(text) == hf_tok.encode(text, add_special_tokens=False)
    conv = [{"role": "user", "content": "What is 2 + 2?"}]
    ids = tok.encode_chat(conv, add_generation_prompt=True)
    hf_ids = hf_tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
    hf_ids = hf_ids["input_ids"] if hasattr(hf_ids, "keys") else hf_ids
    assert ids == list(hf_ids)

    ours = prompt_logits(cfg, params, ids)
    np.testing.assert_array_equal(ours, prompt_logits(cfg_gguf, params_gguf, ids))
    torch.set_num_threads(2)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ref = hf_logits(hf, ids)
    err = rel_err(ours, ref)
    print(f"SmolLM2 converted: relative error {err:.2e}")
    assert err < 1e-4
    assert (ours.argmax(-1) == ref.argmax(-1)).all()
