"""GGUF files as llama.cpp writes them. Quantized tensor types (legacy, K-, I-, ternary and MXFP4 quants,
F16, BF16), mixed as a downloaded GGUF mixes them: every tensor as jaxserve reads it equals transformers'
reading of the same file, and so do the logits (the quantized blocks are random bytes, kept small so that
no block scale is huge or not finite). Llama 3.1's rope scaling, which a GGUF stores as per-frequency
divisors (`rope_freqs.weight`): the logits equal the HF model's with its `rope_scaling`."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

import jax.numpy as jnp  # noqa: E402

from jaxserve.config import UnsupportedModelError  # noqa: E402
from jaxserve.loader import load_params, open_checkpoint  # noqa: E402
from jaxserve.loader.gguf_file import SUPPORTED_TYPES  # noqa: E402
from tests.modelrun import prompt_logits  # noqa: E402

HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM, VOCAB, LAYERS = 256, 512, 4, 2, 64, 256, 4  # K-quant rows: 256s
MATRICES = {"attn_q": (HEADS * HEAD_DIM, HIDDEN), "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
            "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN), "attn_output": (HIDDEN, HEADS * HEAD_DIM),
            "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}


def _add(writer, rng, name: str, shape: tuple[int, int], kind: str) -> None:
    qtype = gguf.GGMLQuantizationType[kind]
    if kind == "F16":
        writer.add_tensor(name, (0.1 * rng.standard_normal(shape)).astype(np.float16))
        return
    if kind == "BF16":
        writer.add_tensor(name, gguf.quants.quantize((0.1 * rng.standard_normal(shape)).astype(np.float32), qtype),
                          raw_dtype=qtype)
        return
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    # Bytes below 0x20: every float16 scale they form is finite and below 2**-7.
    raw = rng.integers(0, 0x20, (shape[0], shape[1] // block * nbytes), dtype=np.uint8)
    if kind == "MXFP4":  # each block leads with a power-of-two exponent byte: near 2**0, not 2**-100
        raw[:, ::nbytes] = rng.integers(120, 128, raw[:, ::nbytes].shape)
    writer.add_tensor(name, raw, raw_dtype=qtype)


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    """A 4-layer llama GGUF whose 30 matrices take every supported type but F32 (the norms') in turn."""
    path = tmp_path_factory.mktemp("gguf") / "mixed.gguf"
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_embedding_length(HIDDEN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_feed_forward_length(FFN)
    w.add_block_count(LAYERS)
    w.add_context_length(128)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"t{i}" for i in range(VOCAB)])
    w.add_token_scores([0.0] * VOCAB)
    w.add_token_types([1] * VOCAB)
    kinds = [k for k in SUPPORTED_TYPES if k != "F32"]
    slots = ["token_embd.weight", *(f"blk.{i}.{m}.weight" for i in range(LAYERS) for m in MATRICES), "output.weight"]
    assert len(slots) >= len(kinds)
    types = {}
    for i, name in enumerate(slots):
        kind = kinds[i % len(kinds)]
        shape = (VOCAB, HIDDEN) if not name.startswith("blk.") else MATRICES[name.split(".")[2]]
        _add(w, rng, name, shape, kind)
        types[name] = kind
        if name.startswith("blk.") and name.endswith("attn_q.weight"):
            layer = name.split(".")[1]
            for norm in ("attn_norm", "ffn_norm"):
                w.add_tensor(f"blk.{layer}.{norm}.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    w.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert set(types.values()) == set(kinds)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    return str(path), model, types


def test_every_tensor_reads_as_transformers_reads_it(mixed_gguf):
    path, model, types = mixed_gguf
    ckpt = open_checkpoint(path)
    reference = {k: v.numpy() for k, v in model.state_dict().items()}
    seen = set()
    for name, array in ckpt.tensors(ckpt.config()):
        np.testing.assert_allclose(array, reference[name], rtol=1e-6, atol=1e-7, err_msg=name)
        assert np.abs(array).max() > 1e-3, name  # no type decoded to (near) zero
        seen.add(name)
    assert seen == set(reference) - {"model.rotary_emb.inv_freq"}


def test_header_equals_the_gguf_packages_reader(mixed_gguf, tmp_path):
    """`GGUFHeader` parses what `gguf.GGUFReader` does: every value type, every tensor type's bytes and place."""
    from jaxserve.loader.gguf_header import GGUFFormatError, GGUFHeader

    path = str(tmp_path / "values.gguf")
    w = gguf.GGUFWriter(path, "llama")
    for i, kind in enumerate(("uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64")):
        getattr(w, f"add_{kind}")(f"v.{kind}", i + 1)
    w.add_float32("v.f32", 0.25)
    w.add_float64("v.f64", -1.5)
    w.add_bool("v.bool", True)
    w.add_string("v.str", "héllo ✓")
    w.add_array("v.ints", [1, -2, 3])
    w.add_array("v.floats", [0.5, 1.5])
    w.add_array("v.bools", [True, False])
    w.add_array("v.strs", ["a", "", "✓"])
    w.add_array("v.nested", [[1, 2], [3]])
    w.add_tensor("x.weight", np.arange(6, dtype=np.float32).reshape(2, 3))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for file in (path, mixed_gguf[0]):
        ours, theirs = GGUFHeader(file), gguf.GGUFReader(file)
        nested = ours.values.pop("v.nested", None)  # (the gguf package's contents() flattens it)
        assert ours.values == {k: f.contents() for k, f in theirs.fields.items()
                               if not k.startswith("GGUF.") and k != "v.nested"}
        assert nested in (None, [[1, 2], [3]])
        assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
        for a, b in zip(ours.tensors, theirs.tensors, strict=True):
            assert (a.tensor_type, a.shape, a.n_bytes, a.data_offset) == (b.tensor_type, tuple(b.shape.tolist()),
                                                                           b.n_bytes, b.data_offset), a.name
            assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data), a.name
    values = GGUFHeader(path).values
    assert (values["v.strs"], values["v.uint64"], values["v.nested"]) == (["a", "", "✓"], 7, [[1, 2], [3]])
    with open(path, "rb") as f:
        head = f.read()
    for cut in (30, len(head) // 2):
        (tmp_path / "cut.gguf").write_bytes(head[:cut])
        with pytest.raises(GGUFFormatError, match="cannot parse the GGUF header at byte"):
            GGUFHeader(tmp_path / "cut.gguf")


def test_logits_equal_transformers(mixed_gguf):
    path, model, _ = mixed_gguf
    ckpt = open_checkpoint(path)
    cfg = ckpt.config()
    params = load_params(ckpt, cfg, jnp.float32, progress=False)
    ids = np.random.default_rng(1).integers(0, VOCAB, 24).tolist()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    ours = prompt_logits(cfg, params, ids)
    assert np.abs(ours - ref).max() <= 1e-5 * np.abs(ref).max()


LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 32}  # a short original context: every regime in 8 pairs


def _llama3_rope_freqs(head_dim: int, base: float, s: dict) -> np.ndarray:
    """The divisors llama.cpp's converter writes as `rope_freqs.weight` for Llama 3.1's scaling."""
    low_wavelen = s["original_max_position_embeddings"] / s["low_freq_factor"]
    high_wavelen = s["original_max_position_embeddings"] / s["high_freq_factor"]
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * base ** (i / head_dim)
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(s["factor"])
        else:
            smooth = ((s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"])
                      / (s["high_freq_factor"] - s["low_freq_factor"]))
            factors.append(1 / ((1 - smooth) / s["factor"] + smooth))
    return np.array(factors, np.float32)


def _llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order (rotary pairs interleaved), as its converter writes them."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_LLAMA_CPP_NAMES = {"embed_tokens": "token_embd", "norm": "output_norm", "input_layernorm": "attn_norm",
                    "post_attention_layernorm": "ffn_norm", "q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v",
                    "o_proj": "attn_output", "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down",
                    "q_norm": "attn_q_norm", "k_norm": "attn_k_norm", "qkv_proj": "attn_qkv", "gate_up_proj": "ffn_up"}
_LLAMA_CPP_GEMMA_NAMES = {**_LLAMA_CPP_NAMES, "post_attention_layernorm": "post_attention_norm",
                          "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
_LLAMA_CPP_OLMO2_NAMES = {**_LLAMA_CPP_NAMES, "post_attention_layernorm": "post_attention_norm",
                          "post_feedforward_layernorm": "post_ffw_norm"}


def shaped_writer(path, arch: str, c) -> Any:
    """A GGUF writer for `arch` at `path` holding the shape of HF config `c` (as every converter writes it)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_embedding_length(c.hidden_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    return w


def written(w, path) -> str:
    """GGUF writer `w`'s file, written whole at `path`."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _write_gguf(path, model, arch: str = "llama", rope_freqs: np.ndarray | None = None,
                vocab: tuple[list[str], list[int], list[float]] | None = None) -> str:
    """`model` (an HF Llama, Gemma, Gemma 2, Gemma 3 or Phi-3) as an F32 GGUF, as llama.cpp's converter writes one:
    Llama's Q/K rows in its rotary order, Gemma's norms stored as 1 + w, Phi-3's fused projections as they are,
    the metadata its architecture reads."""
    c = model.config
    gemma = arch.startswith("gemma")
    w = shaped_writer(path, arch, c)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    rope = getattr(c, "rope_parameters", None) or {}
    global_rope = rope.get("full_attention", rope)
    w.add_rope_freq_base(global_rope.get("rope_theta", getattr(c, "rope_theta", 10000.0)))
    if arch == "phi3":
        w.add_rope_dimension_count(int(c.hidden_size // c.num_attention_heads * rope.get("partial_rotary_factor", 1.0)))
        if c.sliding_window:
            w.add_sliding_window(c.sliding_window)
        if rope.get("rope_type") == "longrope":  # as llama.cpp's converter writes LongRoPE
            original = rope.get("original_max_position_embeddings") or c.original_max_position_embeddings
            factor = c.max_position_embeddings / original
            w.add_uint32("phi3.rope.scaling.original_context_length", original)
            w.add_float32("phi3.rope.scaling.attn_factor", math.sqrt(1 + math.log(factor) / math.log(original)))
            w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], np.float32))
            w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], np.float32))
    if arch == "granite":  # its scalars, as llama.cpp's converter writes them
        w.add_embedding_scale(c.embedding_multiplier)
        w.add_residual_scale(c.residual_multiplier)
        w.add_attention_scale(c.attention_multiplier)
        w.add_logit_scale(c.logits_scaling)
    if gemma:
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
        if getattr(c, "sliding_window", None):
            w.add_sliding_window(c.sliding_window)
        if getattr(c, "attn_logit_softcapping", None):
            w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        if getattr(c, "final_logit_softcapping", None):
            w.add_final_logit_softcapping(c.final_logit_softcapping)
        if global_rope.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(global_rope["factor"])
    if vocab is None:
        w.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    else:  # a SentencePiece vocabulary, as Gemma's converter writes it (no space prefix, BOS added)
        w.add_tokenizer_model("llama")
        w.add_token_list(vocab[0])
        w.add_token_types(vocab[1])
        w.add_token_scores(vocab[2])
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_add_space_prefix(False)
        w.add_add_bos_token(True)
    names = _LLAMA_CPP_GEMMA_NAMES if gemma and arch != "gemma" else _LLAMA_CPP_OLMO2_NAMES if arch == "olmo2" \
        else _LLAMA_CPP_NAMES
    for name, p in model.state_dict().items():
        if "rotary_emb" in name or (gemma and name == "lm_head.weight"):
            continue
        parts = name.split(".")
        a = p.numpy().astype(np.float32)
        if parts[-2] == "q_proj" and arch in ("llama", "granite", "smollm3"):
            a = _llama_cpp_permute(a, c.num_attention_heads)
        elif parts[-2] == "k_proj" and arch in ("llama", "granite", "smollm3"):
            a = _llama_cpp_permute(a, c.num_key_value_heads)
        elif gemma and name.endswith("norm.weight"):
            a = a + 1.0
        if name == "lm_head.weight":
            key = "output.weight"
        elif parts[1] == "layers":
            key = f"blk.{parts[2]}.{names[parts[-2]]}.weight"
        else:
            key = f"{names[parts[-2]]}.weight"
        w.add_tensor(key, a)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs)
    return written(w, path)


def _ours(path: str, ids: list[int]) -> np.ndarray:
    ckpt = open_checkpoint(path)
    cfg = ckpt.config()
    return prompt_logits(cfg, load_params(ckpt, cfg, jnp.float32, progress=False), ids)


def assert_gguf_equals_hf(w, path, cfg, model) -> None:
    """GGUF writer `w`'s file, written at `path`, reads as `cfg` (but for its float32 eps) and gives the torch
    `model`'s logits of a random prompt."""
    gguf_path = written(w, path)
    got = open_checkpoint(gguf_path).config()
    assert dataclasses.replace(got, rms_norm_eps=cfg.rms_norm_eps) == cfg  # (the file's eps a float32)
    ids = np.random.default_rng(9).integers(0, model.config.vocab_size, 30).tolist()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(_ours(gguf_path, ids), ref, atol=1e-4 * np.abs(ref).max(), rtol=0)


def test_llama31_rope_freqs_equal_the_hf_rope_scaling(tmp_path):
    """A Llama with Llama 3.1's rope scaling, written as llama.cpp writes it (rope_freqs.weight): over 120
    positions (past the original context of 32) the logits are the HF model's; without the tensor they are
    not (the divisors matter)."""
    from tests.test_model_families import save_tiny_hf

    model = save_tiny_hf("LlamaConfig", tmp_path / "hf", tie_word_embeddings=False, max_position_embeddings=256,
                         rope_scaling=LLAMA3_SCALING, rope_theta=10000.0)
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    freqs = _llama3_rope_freqs(head_dim, 10000.0, LLAMA3_SCALING)
    assert 1.0 in freqs and 8.0 in freqs and ((freqs > 1) & (freqs < 8)).any()  # all three regimes
    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, 120).tolist()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    scaled = _ours(_write_gguf(tmp_path / "scaled.gguf", model, rope_freqs=freqs), ids)
    np.testing.assert_allclose(scaled, ref, atol=2e-4 * np.abs(ref).max(), rtol=0)
    plain = _ours(_write_gguf(tmp_path / "plain.gguf", model), ids)
    assert np.abs(plain - ref).max() > 100 * np.abs(scaled - ref).max()
    ckpt = open_checkpoint(str(tmp_path / "scaled.gguf"))
    with pytest.raises(UnsupportedModelError, match="rope frequency factors .* have no HF config form"):
        ckpt.config().to_hf()


GEMMA = {
    # Gemma (1): Llama's layers, Gemma's (1 + w) norms, embeddings scaled, a tanh-GELU gated MLP; tied.
    "gemma": ("GemmaConfig", {"head_dim": 16}),
    # The even layer windowed, the odd global; soft-caps small enough that tanh bends the logits.
    "gemma2": ("Gemma2Config", {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8,
                                "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0}),
    # Six layers: five windowed on the local rotary base llama.cpp fixes (10000), the sixth global on its
    # own base with linear scaling; q/k norms.
    "gemma3": ("Gemma3TextConfig", {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8,
                                    "num_hidden_layers": 6, "rope_parameters": {
                                        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                        "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                           "rope_theta": 1000000.0}}}),
}


@pytest.mark.parametrize("arch", list(GEMMA))
def test_gemma_gguf_logits_equal_the_hf_model(tmp_path, arch):
    """A Gemma / Gemma 2 / Gemma 3 model written as llama.cpp writes it: jaxserve's config and logits from the GGUF
    are the HF model's; transformers reads the same file back to the HF model's weights (so the file is laid
    out as llama.cpp's converter lays it out)."""
    from tests.test_model_families import save_tiny_hf

    config_cls, overrides = GEMMA[arch]
    model = save_tiny_hf(config_cls, tmp_path / "hf", **overrides)
    path = _write_gguf(tmp_path / f"{arch}.gguf", model, arch)
    cfg = open_checkpoint(path).config()
    hf = model.config
    assert cfg.family == arch and cfg.layer_types == (tuple(hf.layer_types) if arch != "gemma" else None)
    assert (cfg.attn_logit_softcap, cfg.final_logit_softcap) == (getattr(hf, "attn_logit_softcapping", None),
                                                                  getattr(hf, "final_logit_softcapping", None))
    ids = np.random.default_rng(4).integers(0, hf.vocab_size, 40).tolist()  # past the window of 8
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(_ours(path, ids), ref, atol=1e-4 * np.abs(ref).max(), rtol=0)
    # transformers reads the file's tensors back to the HF model's (its config fills what GGUF leaves out
    # with Gemma's defaults, so the weights are compared, not its logits); it reads no "gemma" file.
    if arch == "gemma":
        return
    read = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=f"{arch}.gguf",
                                                             dtype=torch.float32)
    theirs, want = read.state_dict(), model.state_dict()
    for name, tensor in want.items():
        if "rotary_emb" not in name and name != "lm_head.weight":
            np.testing.assert_allclose(theirs[name].numpy(), tensor.numpy(), atol=1e-6, err_msg=name)


MOE = {  # (HF config class and overrides, llama.cpp's architecture)
    "mixtral": (("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 48}),
                "llama"),
    "qwen2_moe": (("Qwen2MoeConfig", {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                      "shared_expert_intermediate_size": 40, "norm_topk_prob": False}), "qwen2moe"),
    "qwen3_moe": (("Qwen3MoeConfig", {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                      "norm_topk_prob": True, "head_dim": 16}), "qwen3moe"),
    # GLM-4.5: DeepSeek-V3's experts (sigmoid scores with a bias, chosen in groups, a shared expert, a dense
    # first layer), q/k/v biases, half the head rotated; a multi-token prediction block after the model's.
    "glm4_moe": (("Glm4MoeConfig", {"num_experts_per_tok": 2, "n_routed_experts": 8, "moe_intermediate_size": 32,
                                    "n_shared_experts": 1, "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1,
                                    "routed_scaling_factor": 2.5, "attention_bias": True, "num_hidden_layers": 3,
                                    "head_dim": 16}), "glm4moe"),
    # MiniMax-M2: q and k normed over all their heads, half of each head rotated (`rope.dimension_count`), sigmoid
    # scores with a bias for choosing (`exp_probs_b`), experts as wide as the MLP under Mixtral's names
    "minimax_m2": (("MiniMaxM2Config", {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32,
                                        "head_dim": 16, "rotary_dim": 8}), "minimax-m2"),
    # OLMoE: q and k normed over all heads, the top-k weights not renormalized (nothing in the file says so)
    "olmoe": (("OlmoeConfig", {"num_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32,
                               "norm_topk_prob": False, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
              "olmoe"),
}
_LLAMA_CPP_MOE = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}


def _write_moe_gguf(path, hf_dir, arch: str, stacked: bool = True) -> str:
    """The HF mixture-of-experts checkpoint in `hf_dir` as llama.cpp writes it: each projection's experts in
    one tensor (`stacked`), or one tensor per expert as older Mixtral files have them."""
    from jaxserve.loader import HFDirectory

    ckpt = HFDirectory(str(hf_dir))
    cfg = ckpt.config()
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (("embedding_length", cfg.hidden_size), ("attention.head_count", cfg.num_heads),
                       ("attention.head_count_kv", cfg.num_kv_heads), ("block_count", cfg.num_layers + (arch == "glm4moe")),
                       ("context_length", cfg.max_position_embeddings), ("feed_forward_length", cfg.intermediate_size),
                       ("attention.key_length", cfg.head_dim), ("attention.value_length", cfg.head_dim),
                       ("expert_count", cfg.num_experts), ("expert_used_count", cfg.num_experts_per_tok)):
        w.add_uint32(f"{arch}.{key}", value)
    if arch != "llama":
        w.add_uint32(f"{arch}.expert_feed_forward_length", cfg.moe_intermediate_size)
    if cfg.shared_expert_intermediate_size and arch != "glm4moe":
        w.add_uint32(f"{arch}.expert_shared_feed_forward_length", cfg.shared_expert_intermediate_size)
    if arch == "minimax-m2":  # (as llama.cpp's converter writes MiniMax-M2's: its rotary dims, sigmoid gating)
        w.add_uint32(f"{arch}.rope.dimension_count", cfg.rotary_dim)
        w.add_uint32(f"{arch}.expert_gating_func", 2)
    if arch == "glm4moe":  # (as llama.cpp's converter writes GLM-4.5's)
        for key, value in (("expert_shared_count", cfg.shared_expert_intermediate_size // cfg.moe_intermediate_size),
                           ("leading_dense_block_count", cfg.first_dense_layers), ("expert_group_count", cfg.expert_groups),
                           ("expert_group_used_count", cfg.expert_topk_groups), ("rope.dimension_count", cfg.rotary_dim),
                           ("nextn_predict_layers", 1)):
            w.add_uint32(f"{arch}.{key}", value)
        w.add_float32(f"{arch}.expert_weights_scale", cfg.routed_scaling_factor)
        w.add_bool(f"{arch}.expert_weights_norm", cfg.norm_topk_prob)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_float32(f"{arch}.rope.freq_base", cfg.rope_theta)
    w.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    from jaxserve.loader.family_names import family_name

    tensors = {family_name(k, cfg): v for k, v in ckpt.tensors(cfg)}  # (Hunyuan's modules under the names read)
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    shared = {"shared_expert.gate_proj": "ffn_gate_shexp", "shared_expert.up_proj": "ffn_up_shexp",
              "shared_expert.down_proj": "ffn_down_shexp", "shared_expert_gate": "ffn_gate_inp_shexp",
              "shared_experts.gate_proj": "ffn_gate_shexp", "shared_experts.up_proj": "ffn_up_shexp",
              "shared_experts.down_proj": "ffn_down_shexp"}
    names = {**_LLAMA_CPP_NAMES, "post_attention_layernorm": "post_attention_norm"} if arch == "glm4moe" else \
        _LLAMA_CPP_NAMES
    nextn = {"enorm", "hnorm", "eh_proj", "embed_tokens", "shared_head"}  # a multi-token prediction layer's own
    mtp = f"model.layers.{cfg.num_layers}.enorm.weight" in tensors
    for name, a in tensors.items():
        parts = name.split(".")
        if parts[1] == "layers" and parts[3] in nextn:
            w.add_tensor(f"blk.{parts[2]}.nextn.{'_'.join(parts[3:-1])}.{parts[-1]}", a)
        elif name == "lm_head.weight":
            w.add_tensor("output.weight", a)
        elif parts[1] != "layers":
            w.add_tensor({"embed_tokens": "token_embd", "norm": "output_norm"}[parts[1]] + ".weight", a)
        elif "experts" in parts:
            layer, expert, kind = parts[2], int(parts[parts.index("experts") + 1]), _LLAMA_CPP_MOE[parts[-2]]
            if stacked:
                experts.setdefault((layer, kind), {})[expert] = a
            else:
                w.add_tensor(f"blk.{layer}.ffn_{kind}.{expert}.weight", a)
        elif parts[-1] == "e_score_correction_bias":
            w.add_tensor(f"blk.{parts[2]}.exp_probs_b.bias", a)
        elif parts[-2] == "gate" and parts[-3] in ("mlp", "block_sparse_moe"):
            w.add_tensor(f"blk.{parts[2]}.ffn_gate_inp.weight", a)
        elif ".".join(parts[4:-1]) in shared:
            w.add_tensor(f"blk.{parts[2]}.{shared['.'.join(parts[4:-1])]}.weight", a.reshape(-1) if a.shape[0] == 1 else a)
        else:
            key = names[parts[-2]]
            if arch == "llama" and parts[-2] in ("q_proj", "k_proj"):
                a = _llama_cpp_permute(a, cfg.num_heads if parts[-2] == "q_proj" else cfg.num_kv_heads)
            w.add_tensor(f"blk.{parts[2]}.{key}.{parts[-1]}", a)
    for (layer, kind), by_expert in experts.items():
        w.add_tensor(f"blk.{layer}.ffn_{kind}_exps.weight", np.stack([by_expert[j] for j in sorted(by_expert)]))
    if arch == "glm4moe" and not mtp:  # a multi-token prediction block after the model's (its layer's, and its own)
        last = f"model.layers.{cfg.num_layers - 1}."
        w.add_tensor(f"blk.{cfg.num_layers}.attn_q.weight", tensors[f"{last}self_attn.q_proj.weight"])
        w.add_tensor(f"blk.{cfg.num_layers}.nextn.eh_proj.weight", np.ones((cfg.hidden_size, 2 * cfg.hidden_size),
                                                                           np.float32))
    return written(w, path)


@pytest.mark.parametrize("family", list(MOE))
def test_moe_gguf_logits_equal_the_hf_model(tmp_path, family):
    """Mixtral (llama.cpp's "llama" with experts; stacked experts and, as older files, one tensor per expert),
    Qwen2-MoE (with its gated shared expert), Qwen3-MoE and OLMoE from GGUF: the config the HF model has, and
    its logits."""
    from jaxserve.loader import HFDirectory
    from tests.test_model_families import save_tiny_hf

    (config_cls, overrides), arch = MOE[family]
    model = save_tiny_hf(config_cls, tmp_path / "hf", **overrides)
    want = HFDirectory(str(tmp_path / "hf")).config()
    ids = np.random.default_rng(5).integers(0, want.vocab_size, 24).tolist()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    for stacked in (True, False) if family == "mixtral" else (True,):
        path = _write_moe_gguf(tmp_path / f"{family}-{stacked}.gguf", tmp_path / "hf", arch, stacked)
        cfg = open_checkpoint(path).config()
        assert cfg.rms_norm_eps == pytest.approx(want.rms_norm_eps, rel=1e-6)  # GGUF stores it in float32
        assert dataclasses.replace(cfg, rms_norm_eps=want.rms_norm_eps) == want
        np.testing.assert_allclose(_ours(path, ids), ref, atol=1e-4 * np.abs(ref).max(), rtol=0)


@pytest.mark.parametrize("family,arch,extra", [("hunyuan_v1_dense", "hunyuan-dense", {}),
                                               ("hunyuan_v1_moe", "hunyuan-moe", {"num_experts": 4, "moe_topk": 2})])
def test_hunyuan_gguf_logits_equal_the_hf_model(tmp_path, family, arch, extra):
    """Hunyuan's files as llama.cpp's converter writes them (the NTK-alpha base folded into `rope.freq_base`; the
    q/k norms, router and shared MLP under llama.cpp's names; the experts' top-k as `expert_used_count`): the HF
    model's config and logits."""
    from jaxserve.loader import HFDirectory
    from tests.test_hunyuan import FAMILIES, ROPE
    from tests.test_model_families import save_tiny_hf

    model = save_tiny_hf(FAMILIES[family][0], tmp_path / "hf", head_dim=16, rope_parameters=ROPE, **extra)
    want = HFDirectory(str(tmp_path / "hf")).config()
    ids = np.random.default_rng(5).integers(0, want.vocab_size, 24).tolist()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    path = _write_moe_gguf(tmp_path / f"{family}.gguf", tmp_path / "hf", arch)
    cfg = open_checkpoint(path).config()
    assert dataclasses.replace(cfg, rms_norm_eps=want.rms_norm_eps, rope_theta=want.rope_theta) == want
    assert cfg.rope_theta == pytest.approx(want.rope_theta, rel=1e-6)  # (the file's float32)
    np.testing.assert_allclose(_ours(path, ids), ref, atol=1e-4 * np.abs(ref).max(), rtol=0)


def test_granite_gguf_logits_equal_the_hf_model(tmp_path):
    """Granite as llama.cpp writes it (Llama's rotary row order, its four scalars as metadata): the HF model's
    config and logits."""
    from tests.test_model_families import FAMILIES, save_tiny_hf

    config_cls, overrides = FAMILIES["granite"]
    model = save_tiny_hf(config_cls, tmp_path / "hf", **{**overrides, "attention_bias": False, "mlp_bias": False})
    path = _write_gguf(tmp_path / "granite.gguf", model, "granite")
    cfg = open_checkpoint(path).config()
    assert cfg.family == "granite" and (cfg.embedding_multiplier, cfg.attention_multiplier, cfg.residual_multiplier,
                                        cfg.logits_scaling) == pytest.approx((12.0, 0.125, 0.22, 8.0))
    ids = np.random.default_rng(7).integers(0, model.config.vocab_size, 30).tolist()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(_ours(path, ids), ref, atol=1e-4 * np.abs(ref).max(), rtol=0)


def test_olmo2_gguf_logits_equal_the_hf_model(tmp_path):
    """OLMo 2 as llama.cpp writes it (its norms after attention and after the MLP under Gemma's names, q and k
    normed over all heads, rotary pairs as HF's): the HF model's config and logits."""
    from jaxserve.loader import HFDirectory
    from tests.test_model_families import FAMILIES, save_tiny_hf

    model = save_tiny_hf(FAMILIES["olmo2"][0], tmp_path / "hf", **FAMILIES["olmo2"][1])
    path = _write_gguf(tmp_path / "olmo2.gguf", model, "olmo2")
    cfg, want = open_checkpoint(path).config(), HFDirectory(str(tmp_path / "hf")).config()
    assert cfg.rms_norm_eps == pytest.approx(want.rms_norm_eps, rel=1e-6)  # GGUF stores it in float32
    assert dataclasses.replace(cfg, rms_norm_eps=want.rms_norm_eps) == want
    ids = np.random.default_rng(9).integers(0, model.config.vocab_size, 30).tolist()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(_ours(path, ids), ref, atol=1e-4 * np.abs(ref).max(), rtol=0)


def test_smollm3_gguf_logits_equal_the_hf_model(tmp_path):
    """SmolLM3 as llama.cpp writes it (Llama's rotary row order, nothing saying which layers are unrotated: every
    4th, as llama.cpp reads it): the HF model's logits."""
    from tests.test_model_families import save_tiny_hf

    model = save_tiny_hf("SmolLM3Config", tmp_path / "hf", num_hidden_layers=4, pad_token_id=0, bos_token_id=1,
                         eos_token_id=2, tie_word_embeddings=False)
    assert model.config.no_rope_layers == [1, 1, 1, 0]
    path = _write_gguf(tmp_path / "smollm3.gguf", model, "smollm3")
    cfg = open_checkpoint(path).config()
    assert cfg.family == "smollm3" and cfg.no_rope_layers == (1, 1, 1, 0)
    ids = np.random.default_rng(8).integers(0, model.config.vocab_size, 30).tolist()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(_ours(path, ids), ref, atol=1e-4 * np.abs(ref).max(), rtol=0)


@pytest.mark.parametrize("family", ["phi3", "phi3_longrope"])
def test_phi3_gguf_logits_equal_the_hf_model(tmp_path, family):
    """Phi-3 as llama.cpp writes it (fused attn_qkv, gate and up together in ffn_up, rotary pairs as HF's; a
    sliding window, or (as Phi-4-mini) LongRoPE's factor tensors over a partial rotary dimension): the HF model's
    logits, LongRoPE's within its original context (the short factors) and past it (the long ones)."""
    from tests.test_model_families import FAMILIES, save_tiny_hf

    config_cls, overrides = FAMILIES[family]
    model = save_tiny_hf(config_cls, tmp_path / "hf", tie_word_embeddings=False, **overrides)
    path = _write_gguf(tmp_path / "phi3.gguf", model, "phi3")
    cfg = open_checkpoint(path).config()
    assert (cfg.sliding_window, cfg.max_position_embeddings, cfg.rotary_dims) == (
        (8, 256, 16) if family == "phi3" else (None, 256, 8))
    for n in (30, 60) if family == "phi3_longrope" else (30,):
        ids = np.random.default_rng(6).integers(0, model.config.vocab_size, n).tolist()
        with torch.no_grad():
            ref = model(torch.tensor([ids])).logits[0].numpy()
        np.testing.assert_allclose(_ours(path, ids), ref, atol=1e-4 * np.abs(ref).max(), rtol=0)


def test_llm_serves_a_gemma_gguf_with_its_sentencepiece_vocabulary(tmp_path):
    """`LLM` on a Gemma 3 GGUF that carries its SentencePiece vocabulary: the prompt is tokenized as
    transformers tokenizes it (BOS first), the greedy tokens are the HF model's, and the text streamed back is
    transformers' decoding of them (byte-fallback pieces included)."""
    from jaxserve import LLM, SamplingParams
    from tests.test_model_families import save_tiny_hf
    from tests.test_tokenizer import spm_vocab

    vocab = spm_vocab("gemma3")
    config_cls, overrides = GEMMA["gemma3"]
    model = save_tiny_hf(config_cls, tmp_path / "hf", vocab_size=len(vocab[0]), **overrides)
    _write_gguf(tmp_path / "g.gguf", model, "gemma3", vocab=vocab)
    ref_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="g.gguf")
    prompt = "the quick brown fox jumps over"
    ids = ref_tok.encode(prompt)
    assert ids[0] == 1
    greedy = []
    with torch.no_grad():
        for _ in range(12):
            greedy.append(int(model(torch.tensor([ids + greedy])).logits[0, -1].argmax()))
    llm = LLM(str(tmp_path / "g.gguf"), max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32,
              kv_cache_memory_bytes=1 << 20, dtype="float32", compile_cache_dir=None, progress=False)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                skip_special_tokens=False), use_tqdm=False)[0]
    assert out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == greedy
    assert out.outputs[0].text == ref_tok.decode(greedy, skip_special_tokens=False)
