"""Gemma 4 GGUF files (llama.cpp's "gemma4"), written as llama.cpp's converter writes them: the windowed and the
full-attention layers' head widths, KV heads and rotary bases under their own keys, the layers' kinds as a pattern,
the full layers' proportional rotary embedding as frequency divisors (`rope_freqs`), no value projection where the
full layers' keys are their values, norms stored as they are. Each form (31B's, the MoE form's, E2B's per-layer inputs,
shared keys and double-wide MLPs) gives the HF checkpoint's config and transformers' logits, and transformers reads
the same file back to the model's weights; the vocabulary ("gemma4": SentencePiece pieces with merges) tokenizes as
transformers reads it, and `LLM` serves the file with the HF model's greedy tokens."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from jaxserve.errors import UnsupportedModelError  # noqa: E402
from jaxserve.loader import HFDirectory, open_checkpoint  # noqa: E402
from tests.test_gemma4 import SMALL, TINY  # noqa: E402
from tests.test_gguf_models import _ours, written  # noqa: E402
from tests.test_model_families import hf_logits, random_prompt, rel_err, save_tiny_hf  # noqa: E402

MOE = dict(TINY, enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=24)
FORMS = {"31b": TINY, "moe": MOE, "e2b": SMALL}
# The vocabulary's control tokens beyond <unk>, <s>, </s>: Gemma 4's turn markers.
TURN = ["<|turn>", "<turn|>"]


def write_gemma4_gguf(path, model, settings: dict, vocab: tuple[list[str], list[int], list[str]] | None = None,
                      rope_freqs: np.ndarray | None = None) -> str:
    """`model` (a transformers Gemma 4 text model of `settings`) as an F32 GGUF, as llama.cpp's converter writes one;
    `vocab`: (tokens, their kinds, merges); `rope_freqs`: other divisors than the config's (a check that they count)."""
    c = model.config
    n, shared, ffn = c.num_hidden_layers, c.num_kv_shared_layers, c.intermediate_size
    full_dim, full_kv = settings["global_head_dim"], settings.get("num_global_key_value_heads")
    types = list(c.layer_types)
    w = gguf.GGUFWriter(str(path), "gemma4")
    w.add_block_count(n)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length([ffn if i < n - shared else 2 * ffn for i in range(n)] if c.use_double_wide_mlp else ffn)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv([settings["num_key_value_heads"] if t == "sliding_attention" else full_kv for t in types]
                        if full_kv is not None else settings["num_key_value_heads"])
    w.add_key_length(full_dim)
    w.add_value_length(full_dim)
    w.add_key_length_swa(settings["head_dim"])
    w.add_value_length_swa(settings["head_dim"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_sliding_window(c.sliding_window)
    w.add_sliding_window_pattern([t == "sliding_attention" for t in types])
    w.add_shared_kv_layers(shared)
    w.add_embedding_length_per_layer_input(c.hidden_size_per_layer_input or 0)
    rope = c.rope_parameters
    w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    w.add_rope_dimension_count(full_dim)
    w.add_rope_dimension_count_swa(settings["head_dim"])
    w.add_final_logit_softcapping(c.final_logit_softcapping)
    if c.enable_moe_block:
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.top_k_experts)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    if vocab is None:
        w.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    else:  # (scores all -1000, the merge order in the merges; no space prefix, BOS said to be added)
        w.add_tokenizer_model("gemma4")
        w.add_token_list(vocab[0])
        w.add_token_scores([-1000.0] * len(vocab[0]))
        w.add_token_types(vocab[1])
        w.add_token_merges(vocab[2])
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        w.add_add_space_prefix(False)
        w.add_add_bos_token(True)
    pairs = int(full_dim * rope["full_attention"]["partial_rotary_factor"] / 2)
    w.add_tensor("rope_freqs.weight", rope_freqs if rope_freqs is not None else
                 np.array([1.0] * pairs + [1e30] * (full_dim // 2 - pairs), np.float32))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, n)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if name.endswith("router.scale"):
            key = f"blk.{layer}.ffn_gate_inp.scale"
        elif name.endswith("router.per_expert_scale"):
            key = f"blk.{layer}.ffn_down_exps.scale"
        else:  # (buffers and packed experts named as parameters first)
            hf = name + ".weight" if name.endswith(("layer_scalar", "gate_up_proj", "down_proj")) else name
            key = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        assert key is not None, name
        w.add_tensor(key, t.numpy().astype(np.float32))  # (no norm shifted, no rows permuted)
    return written(w, path)


@pytest.mark.parametrize("form", list(FORMS))
def test_gemma4_gguf_reads_as_its_checkpoint(tmp_path, form):
    settings = FORMS[form]
    model = save_tiny_hf("Gemma4TextConfig", tmp_path / "hf", **settings)
    path = write_gemma4_gguf(tmp_path / f"{form}.gguf", model, settings)
    cfg = open_checkpoint(path).config()
    want = HFDirectory(tmp_path / "hf").config()
    assert cfg.rms_norm_eps == pytest.approx(want.rms_norm_eps)  # (a float32 in the file)
    assert dataclasses.replace(cfg, rms_norm_eps=want.rms_norm_eps) == want
    ids = random_prompt()
    ref = hf_logits(model, ids)
    assert rel_err(_ours(path, ids), ref) < 1e-4
    if form == "31b":  # the file's divisors are the full layers' rotary embedding: every pair turned, logits move
        ones = np.ones(settings["global_head_dim"] // 2, np.float32)
        turned = write_gemma4_gguf(tmp_path / "turned.gguf", model, settings, rope_freqs=ones)
        assert rel_err(_ours(turned, ids), ref) > 1e-3


def test_gemma4_gguf_refusals(tmp_path):
    model = save_tiny_hf("Gemma4TextConfig", tmp_path / "hf", **TINY)
    uneven = np.array([1.0, 1.0, 2.0] + [1e30] * 13, np.float32)
    path = write_gemma4_gguf(tmp_path / "t.gguf", model, TINY, rope_freqs=uneven)
    with pytest.raises(UnsupportedModelError, match="rope_freqs must turn the leading pairs"):
        open_checkpoint(path).config()


def _gemma4_vocab(tmp_path) -> tuple[list[str], list[int], list[str]]:
    """A SentencePiece vocabulary (`test_tokenizer.spm_vocab`'s) with Gemma 4's turn markers, and its merges."""
    import json

    from jaxserve.tokenizer import Tokenizer
    from tests.test_tokenizer import _spm_gguf, spm_vocab

    tokens, types, _ = spm_vocab()
    plain = Tokenizer.from_gguf(_spm_gguf(tmp_path / "plain.gguf", add_space_prefix=False, merges=True))
    merges = [" ".join(m) for m in json.loads(plain.backend.to_str())["model"]["merges"]]
    return tokens + TURN, types + [3, 3], merges


def test_llm_serves_a_gemma4_gguf_with_its_vocabulary(tmp_path):
    """E2B's form with MLPs of one width (a file whose config transformers reads: one KV head count, one MLP width):
    the "gemma4" vocabulary tokenizes as transformers reads it (no BOS added: Gemma 4's chat template writes it),
    <turn|> and (a user-defined token in the files) <|tool_response> end generation, as Gemma 4's generation config
    has them, and `LLM` gives the HF model's greedy tokens and transformers' text of them."""
    from jaxserve import LLM, SamplingParams
    from jaxserve.tokenizer import Tokenizer
    from tests.test_tokenizer import SPM_TEXTS

    vocab = _gemma4_vocab(tmp_path)
    n = len(vocab[0])
    settings = dict(SMALL, use_double_wide_mlp=False, vocab_size=n, vocab_size_per_layer_input=n)
    model = save_tiny_hf("Gemma4TextConfig", tmp_path / "hf", **settings)
    path = write_gemma4_gguf(tmp_path / "g.gguf", model, settings, vocab=vocab)
    ours = Tokenizer.from_gguf(path)
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="g.gguf")
    assert not ours.add_bos_token and ours.eos_token_ids == (2, vocab[0].index("<turn|>"))
    tool = write_gemma4_gguf(tmp_path / "tool.gguf", model, settings, vocab=(
        vocab[0] + ["<|tool_response>"], vocab[1] + [4], vocab[2]))  # (the tokenizer's alone read)
    assert Tokenizer.from_gguf(tool).eos_token_ids == (2, vocab[0].index("<turn|>"), len(vocab[0]))
    for text in [*SPM_TEXTS, "<|turn>user\nhello world<turn|>"]:
        assert ours.encode(text, add_special_tokens=True) == ref.encode(text), text
        ids = ours.encode(text)
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False), text
    prompt = "the quick brown fox jumps over"
    ids = ref.encode(prompt)
    greedy = []
    with torch.no_grad():
        for _ in range(10):
            greedy.append(int(model(torch.tensor([ids + greedy])).logits[0, -1].argmax()))
    llm = LLM(path, max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32, kv_cache_memory_bytes=1 << 20,
              dtype="float32", compile_cache_dir=None, warmup=False, progress=False)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                skip_special_tokens=False), use_tqdm=False)[0]
    assert out.prompt_token_ids == ids and out.outputs[0].token_ids == greedy
    assert out.outputs[0].text == ref.decode(greedy, skip_special_tokens=False)
