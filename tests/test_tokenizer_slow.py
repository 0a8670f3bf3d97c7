"""An HF directory whose tokenizer is `vocab.json` + `merges.txt` (no `tokenizer.json`, `jaxserve.tokenizer_slow`):
read as GPT-2's and as Qwen2's tokenizer, it encodes and decodes as transformers' tokenizer of the same directory,
its added tokens at their ids; what it cannot read is refused, named."""

from __future__ import annotations

import json

import pytest

from jaxserve.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = ["Hello, world! It's 2024: 1234567 apples.", "  leading spaces\n\n\ttabs and\r\nnewlines  ",
         "Ünïcödé café — naïve 東京 𝔘 🚀🚀", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
         "don't I'll we've they're IT'S", "(hello) _world $100 #tag\n\n\n  x", "x" * 50 + " " + "12" * 20]


def _slow_dir(path, smollm_path, cls: str, added: dict[int, tuple[str, bool]]):
    """SmolLM2's vocabulary and merges written as a slow tokenizer's files, of tokenizer class `cls`, with `added`
    tokens (id: (content, special)) in tokenizer_config.json."""
    model = json.loads(Tokenizer.from_gguf(smollm_path).backend.to_str())["model"]
    path.mkdir()
    (path / "vocab.json").write_text(json.dumps(model["vocab"], ensure_ascii=False))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    (path / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    decoder = {str(i): {"content": c, "special": s, "normalized": False, "lstrip": False, "rstrip": False,
                        "single_word": False} for i, (c, s) in added.items()}
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": cls, "added_tokens_decoder": decoder, "eos_token": "<|im_end|>", "bos_token": None,
         "model_max_length": 8192, "clean_up_tokenization_spaces": False}))
    return path


@pytest.mark.parametrize("cls", ["GPT2Tokenizer", "Qwen2Tokenizer"])
def test_a_slow_bpe_encodes_as_transformers(smollm_path, tmp_path, cls):
    vocab = len(json.loads(Tokenizer.from_gguf(smollm_path).backend.to_str())["model"]["vocab"])
    # SmolLM2's own specials (in its vocabulary) and two new ones after it, one special and one not.
    added = {0: ("<|endoftext|>", True), 1: ("<|im_start|>", True), 2: ("<|im_end|>", True),
             vocab: ("<tool>", True), vocab + 1: ("plainword", False)}
    path = _slow_dir(tmp_path / "slow", smollm_path, cls, added)
    ours = Tokenizer.from_hf_dir(path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(path))
    assert ours.eos_token_ids == (2,) and ours.vocab_size == vocab + 2
    for text in [*TEXTS, "a <tool> b plainword c"]:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == theirs.encode(text, add_special_tokens=False), text
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids, skip_special_tokens=False), text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    assert ours.encode("<tool>", add_special_tokens=False) == [vocab]


def test_what_it_cannot_read_is_refused(smollm_path, tmp_path):
    path = _slow_dir(tmp_path / "llama", smollm_path, "LlamaTokenizer", {})
    with pytest.raises(ValueError, match="class 'LlamaTokenizer' is not supported"):
        Tokenizer.from_hf_dir(path)
    vocab = len(json.loads((path / "vocab.json").read_text()))
    gap = _slow_dir(tmp_path / "gap", smollm_path, "Qwen2Tokenizer", {vocab + 3: ("<late>", True)})
    with pytest.raises(ValueError, match=f"added token '<late>' has id {vocab + 3}"):
        Tokenizer.from_hf_dir(gap)
    (tmp_path / "none").mkdir()
    with pytest.raises(FileNotFoundError, match="nor vocab.json with merges.txt"):
        Tokenizer.from_hf_dir(tmp_path / "none")
