"""Mistral's own format: tekken tokenizer files against mistral_common's encoder, the chat template of each
instruct version against mistral_common's prompts (token for token), and a `params.json` + consolidated
checkpoint read as the HF Mistral model it was made from (logits against transformers)."""

from __future__ import annotations

import copy
import dataclasses
import json
import os

import numpy as np
import pytest

mistral_common = pytest.importorskip("mistral_common")
torch = pytest.importorskip("torch")

from mistral_common.protocol.instruct.request import ChatCompletionRequest  # noqa: E402
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer  # noqa: E402
from mistral_common.tokens.tokenizers.tekken import Tekkenizer  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

from jaxserve.loader import checkpoint_tokenizer, open_checkpoint  # noqa: E402
from jaxserve.loader.mistral_dir import MistralDirectory  # noqa: E402
from jaxserve.tokenizer import Tokenizer  # noqa: E402
from tests.test_model_families import hf_logits, ours_logits, random_prompt, rel_err, save_tiny_hf  # noqa: E402

TEKKEN = os.path.join(os.path.dirname(mistral_common.__file__), "data", "tekken_240911.json")  # Mistral Nemo's
TEXTS = ["Hello, world!", "  leading spaces,\ttabs\n\nand newlines\r\n", "Ünïcödé: 日本語のテキスト, ЖЖЖ, 123456 3.14159",
         "def f(x):\n    return x**2  # comment", "emoji 🤖🚀 and 'quotes' 's 're", "a" * 300, "https://example.com/?q=1&b=2",
         "   ", "", "MixedCASEWords andCamelCase HTTPServer", "\u00a0non-breaking\u2009spaces"]
SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]", "[PREFIX]", "[MIDDLE]",
            "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]"] + [
    f"<SPECIAL_{i}>" for i in range(20, 32)] + ["[ARGS]", "[CALL_ID]", "[THINK]", "[/THINK]"]


@pytest.fixture(scope="module")
def tekken_files(tmp_path_factory) -> dict[str, str]:
    """The packaged file's first 4000 tokens (quicker to read for both encoders; every byte among them) as v3, v7,
    v11 and v13 files (the later ones list their special tokens)."""
    root = tmp_path_factory.mktemp("tekken")
    data = json.loads(open(TEKKEN, encoding="utf-8").read())
    data.pop("image", None)
    data["vocab"] = data["vocab"][:4000]
    data["config"] = {**data["config"], "num_vocab_tokens": 4000, "default_vocab_size": 5000}
    files = {}
    for v in ("v3", "v7", "v11", "v13"):
        files[v] = str(root / f"tekken_{v}.json")
        versioned = {**data, "config": {**data["config"], "version": v}}
        if v != "v3":
            versioned["special_tokens"] = [{"rank": i, "token_str": s, "is_control": True} for i, s in enumerate(SPECIALS)]
        with open(files[v], "w", encoding="utf-8") as f:
            json.dump(versioned, f)
    return files


@pytest.fixture(scope="module")
def tekken() -> Tokenizer:
    return Tokenizer.from_tekken(TEKKEN)


def test_tekken_encodes_and_decodes_as_mistral_common(tekken):
    ref = Tekkenizer.from_file(TEKKEN)
    assert tekken.vocab_size == ref.n_words == 131072
    for text in TEXTS:
        ids = tekken.encode(text)
        assert ids == ref.encode(text, bos=False, eos=False), text
        assert tekken.decode(ids) == ref.decode(ids) == text
    assert tekken.encode("Hi", add_special_tokens=True) == ref.encode("Hi", bos=True, eos=False)
    assert (tekken.bos_token_id, tekken.eos_token_ids, tekken.token_to_id("[INST]")) == (1, (2,), 3)
    assert tekken.decode([1, 3, *tekken.encode("Hi"), 4], skip_special_tokens=False) == "<s>[INST]Hi[/INST]"


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Weather in Paris?"}]
TOOL_CHAT = CHAT + [
    {"role": "assistant", "tool_calls": [{"id": "abc123def", "type": "function",
                                          "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "abc123def", "name": "get_weather", "content": "sunny"},
    {"role": "user", "content": "Thanks"}]
TWO_CALLS = [{"role": "user", "content": "A"}, {"role": "user", "content": "B"},
             {"role": "assistant", "content": "Let me check.", "tool_calls": [
                 {"id": "aaaaaaaaa", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                 {"id": "bbbbbbbbb", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
             {"role": "tool", "tool_call_id": "aaaaaaaaa", "name": "f", "content": "1"},
             {"role": "tool", "tool_call_id": "bbbbbbbbb", "name": "f", "content": "2"},
             {"role": "assistant", "content": "Done."}, {"role": "user", "content": "C"}]


@pytest.mark.parametrize("version", ["v3", "v7", "v11", "v13"])
def test_chat_template_encodes_as_mistral_common(tekken_files, version):
    """Each instruct version's prompts, token for token: the system prompt, tools and their place, calls and their
    results, user messages back to back (v3 refuses an assistant message with text and calls)."""
    ours = Tokenizer.from_tekken(tekken_files[version])
    ref = MistralTokenizer.from_file(tekken_files[version])
    for messages, tools in ((CHAT, None), (TOOL_CHAT, TOOLS[:1]), (TWO_CALLS, TOOLS[1:])):
        if version == "v3" and messages is TWO_CALLS:
            continue
        want = ref.encode_chat_completion(ChatCompletionRequest(messages=messages, tools=tools)).tokens
        sent = copy.deepcopy(messages)  # as the server hands them to templates: arguments as objects
        for m in sent:
            for call in m.get("tool_calls") or []:
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        assert ours.encode_chat(sent, tools=tools) == want, (version, messages[-1])


SENTENCEPIECE = {v: os.path.join(os.path.dirname(mistral_common.__file__), "data", f"mistral_instruct_tokenizer_{d}.model.{v}")
                 for v, d in (("v2", "240216"), ("v3", "240323"), ("v7", "241114"))}


@pytest.mark.parametrize("version", ["v3", "v7"])
def test_sentencepiece_files_encode_as_mistral_common(tmp_path, version):
    """Mistral's SentencePiece tokenizer files (`tokenizer.model.v3`: Mistral 7B v0.3, Codestral; `.v7`: Mistral
    Large 2): text, and each instruct prompt token for token; found as a Mistral directory's tokenizer (its newest)."""
    from jaxserve.loader import tokenizer_at
    from jaxserve.tokenizer_sentencepiece import mistral_tokenizer_file
    from tests.test_sharding_worker import dense_config

    ref = MistralTokenizer.from_file(SENTENCEPIECE[version])
    (tmp_path / "params.json").write_text("{}")
    for name, v in (("tokenizer.model.v2", "v2"), (f"tokenizer.model.{version}", version)):
        os.symlink(SENTENCEPIECE[v], tmp_path / name)
    assert mistral_tokenizer_file(tmp_path).name == f"tokenizer.model.{version}"
    ours = tokenizer_at(str(tmp_path), dataclasses.replace(dense_config(), vocab_size=32768))
    inner = ref.instruct_tokenizer.tokenizer
    assert ours.vocab_size == inner.n_words and (ours.bos_token_id, ours.eos_token_ids) == (1, (2,))
    for text in TEXTS:
        assert ours.encode(text, add_special_tokens=True) == inner.encode(text, bos=True, eos=False), text
        assert ours.decode(ours.encode(text)) == inner.decode(inner.encode(text, bos=False, eos=False)), text
    for messages, tools in ((CHAT, None), (TOOL_CHAT, TOOLS[:1]), (TWO_CALLS[:2], TOOLS[1:])):
        want = ref.encode_chat_completion(ChatCompletionRequest(messages=messages, tools=tools)).tokens
        sent = copy.deepcopy(messages)
        for m in sent:
            for call in m.get("tool_calls") or []:
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        assert ours.encode_chat(sent, tools=tools) == want, (version, messages[-1])
    with pytest.raises(ValueError, match="Mistral's instruct formats before v3 .* are not rendered"):
        Tokenizer.from_tekken(tmp_path / "tokenizer.model.v2")


def _consolidated(path, model, heads: int, kv_heads: int) -> None:
    """`model`'s weights as Mistral writes them: its own names, q and k rows back in interleaved rotary pairs
    (the inverse of transformers' `permute`), and params.json."""
    cfg = model.config
    state = {k: v.float().numpy() for k, v in model.state_dict().items()}
    out = {"tok_embeddings.weight": state["model.embed_tokens.weight"], "norm.weight": state["model.norm.weight"],
           "output.weight": state["lm_head.weight"]}

    def interleaved(w, h):
        rows, cols = w.shape
        return w.reshape(h, 2, rows // h // 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols)

    names = {"self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk", "self_attn.v_proj": "attention.wv",
             "self_attn.o_proj": "attention.wo", "mlp.gate_proj": "feed_forward.w1", "mlp.down_proj": "feed_forward.w2",
             "mlp.up_proj": "feed_forward.w3", "input_layernorm": "attention_norm",
             "post_attention_layernorm": "ffn_norm"}
    for i in range(cfg.num_hidden_layers):
        for hf, ours in names.items():
            w = state[f"model.layers.{i}.{hf}.weight"]
            w = interleaved(w, heads) if ours == "attention.wq" else interleaved(w, kv_heads) if ours == "attention.wk" else w
            out[f"layers.{i}.{ours}.weight"] = np.ascontiguousarray(w)
    out["vision_encoder.patch_conv.weight"] = np.zeros((4, 3, 2, 2), np.float32)  # not read: params.json names none
    save_file(out, str(path / "consolidated.safetensors"))
    params = {"dim": cfg.hidden_size, "n_layers": cfg.num_hidden_layers, "head_dim": cfg.head_dim,
              "hidden_dim": cfg.intermediate_size, "n_heads": heads, "n_kv_heads": kv_heads,
              "norm_eps": cfg.rms_norm_eps, "vocab_size": cfg.vocab_size, "rope_theta": cfg.rope_parameters["rope_theta"],
              "max_seq_len": 256}
    (path / "params.json").write_text(json.dumps(params))


def test_consolidated_checkpoint_is_the_hf_model(tmp_path, tekken_files):
    """A Mistral-format directory (params.json, consolidated.safetensors, tekken.json) gives the logits of the HF
    model its weights came from; its tokenizer is the tekken file's, with the chat template of its version."""
    hf_dir, path = tmp_path / "hf", tmp_path / "mistral"
    path.mkdir()
    model = save_tiny_hf("MistralConfig", hf_dir, head_dim=16, rope_theta=1e6)
    _consolidated(path, model, heads=4, kv_heads=2)
    (path / "tekken.json").symlink_to(tekken_files["v7"])
    ckpt = open_checkpoint(str(path))
    assert isinstance(ckpt, MistralDirectory) and ckpt.config().family == "mistral"
    ids = random_prompt()
    ours, _ = ours_logits(path, ids)
    assert rel_err(ours, hf_logits(model, ids)) < 1e-4
    tok = checkpoint_tokenizer(str(path), ckpt)
    chat = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(chat) == "<s>[SYSTEM_PROMPT]S[/SYSTEM_PROMPT][INST]Hi[/INST]"
    (path / "params.json").write_text(json.dumps({**json.loads((path / "params.json").read_text()),
                                                   "moe": {"num_experts": 8}}))
    with pytest.raises(ValueError, match=r"Mistral params.json options \['moe'\] are not supported"):
        open_checkpoint(str(path))


def test_a_directory_with_both_formats_reads_the_one_the_flags_name(tmp_path, tekken_files):
    """Mistral's releases ship the HF files beside their own: config.json and tokenizer.json by default, params.json
    and tekken.json with vLLM's `--config-format mistral` / `--load-format mistral` / `--tokenizer-mode mistral`
    (taken with underscores too, as vLLM's model cards write them)."""
    import argparse

    from jaxserve.cli import build_parser, dashed_flags
    from jaxserve.engine_args import EngineArgs
    from jaxserve.loader import CheckpointError, HFDirectory
    from tests.fake_model import save_fake_tokenizer

    path = tmp_path / "both"
    path.mkdir()
    model = save_tiny_hf("MistralConfig", path, head_dim=16, rope_theta=1e6)
    save_fake_tokenizer(str(path))
    _consolidated(path, model, heads=4, kv_heads=2)
    (path / "tekken.json").symlink_to(tekken_files["v7"])
    hf, mistral = open_checkpoint(str(path)), open_checkpoint(str(path), fmt="mistral")
    assert type(hf) is HFDirectory and isinstance(mistral, MistralDirectory)
    assert mistral.config().num_layers == hf.config().num_layers
    fake, tekken = 64, Tokenizer.from_tekken(tekken_files["v7"]).vocab_size  # tokenizer.json's, tekken.json's
    assert checkpoint_tokenizer(str(path), hf).vocab_size == fake
    assert checkpoint_tokenizer(str(path), hf, "mistral").vocab_size == tekken != fake
    assert checkpoint_tokenizer(str(path), mistral).vocab_size == tekken
    assert checkpoint_tokenizer(str(path), mistral, "hf").vocab_size == fake
    with pytest.raises(CheckpointError, match="has no params.json: it is not a Mistral-format directory"):
        open_checkpoint(str(tmp_path), fmt="mistral")
    with pytest.raises(FileNotFoundError, match="tokenizer_mode mistral: .* has no tekken.json"):
        checkpoint_tokenizer(str(tmp_path), hf, "mistral")
    ns = build_parser().parse_args(dashed_flags(["serve", str(path), "--tokenizer_mode", "mistral",
                                                 "--config_format=mistral", "--load_format", "mistral"]))
    args = EngineArgs.from_cli_args(ns)
    assert (args.tokenizer_mode, args.checkpoint_format) == ("mistral", "mistral")
    assert EngineArgs(config_format="hf").checkpoint_format == "hf" and EngineArgs().checkpoint_format is None
    with pytest.raises(ValueError, match="config_format 'hf' contradicts it"):
        EngineArgs(load_format="mistral", config_format="hf")
    with pytest.raises(SystemExit):
        EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(["--tokenizer-mode", "slow"])
