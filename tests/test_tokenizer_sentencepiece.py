"""An HF directory whose tokenizer is SentencePiece's `tokenizer.model` (`jaxserve.tokenizer_sentencepiece`): as the
Llama and Gemma classes and as the model's own settings it encodes and decodes as transformers' tokenizer of the same
directory (BPE and unigram models; `legacy`, `add_prefix_space`, `add_bos_token`; special, user-defined and added
tokens), the model's own settings as SentencePiece itself; what it cannot read is refused, named."""

from __future__ import annotations

import io
import itertools
import json
import shutil

import pytest

from jaxserve.tokenizer import Tokenizer
from jaxserve.tokenizer_sentencepiece import read_model_proto

spm = pytest.importorskip("sentencepiece")
transformers = pytest.importorskip("transformers")

CORPUS = ["The quick brown fox jumps over the lazy dog.", "Serving large language models on JAX, page by page.",
          "Ünïcödé café — naïve 東京 and 大阪", "12345 67890 3.14159 2024-12-05", "def f(x):\n    return x * 2\n",
          "Hello world! It's a test: one, two, three.", "tokens, pages, prefixes and radix trees", "  spaced   out  "]
TEXTS = ["Hello world  x", " lead and trail ", "Ünïcödé café — naïve 東京 🚀", "<tool> run 12345", "a<tool>b <s>c</s> d",
         "x\n\n\ty  z", "<extra>hi <extra> there", "  ", ""]


def _train(path, kind: str, **options) -> None:
    buf = io.BytesIO()
    settings = dict(vocab_size=420, hard_vocab_limit=False, model_type=kind, byte_fallback=True, user_defined_symbols=["<tool>"],
                    character_coverage=1.0, split_digits=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
                    normalization_rule_name="identity", remove_extra_whitespaces=False, minloglevel=2)
    settings.update(options)
    spm.SentencePieceTrainer.train(sentence_iterator=iter(CORPUS * 4), model_writer=buf, **settings)
    path.mkdir()
    (path / "tokenizer.model").write_bytes(buf.getvalue())


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("spm")
    _train(root / "bpe", "bpe")
    _train(root / "unigram", "unigram")
    # SentencePiece's default normalization: NFKC through a precompiled map, extra spaces removed.
    _train(root / "nfkc", "bpe", normalization_rule_name="nmt_nfkc", remove_extra_whitespaces=True)
    _train(root / "plain", "unigram", add_dummy_prefix=False, byte_fallback=False)
    return root


def _dir(tmp_path, model, config: dict):
    d = tmp_path / "tok"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir()
    shutil.copy(model / "tokenizer.model", d)
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


def _check_equal(d, texts=TEXTS) -> None:
    ref, ours = transformers.AutoTokenizer.from_pretrained(d), Tokenizer.from_hf_dir(d)
    for text in texts:
        want = ref(text)["input_ids"]
        got = ours.encode(text, add_special_tokens=True)
        assert got == want, (json.loads((d / "tokenizer_config.json").read_text()), text)
        assert ours.decode(got, skip_special_tokens=False) == ref.decode(want), text
        assert ours.decode(got) == ref.decode(want, skip_special_tokens=True), text


@pytest.mark.parametrize("kind", ["bpe", "unigram"])
@pytest.mark.parametrize("cls", ["LlamaTokenizer", "LlamaTokenizerFast", "GemmaTokenizer", None])
def test_a_sentencepiece_dir_encodes_and_decodes_as_transformers(models, tmp_path, kind, cls):
    n = len(read_model_proto(models / kind / "tokenizer.model").pieces)
    for legacy, prefix, bos in itertools.product([None, True, False], [None, False], [None, True]):
        config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_eos_token": bos is True,
                  "added_tokens_decoder": {str(n): {"content": "<extra>", "special": True}}}
        config.update({k: v for k, v in [("tokenizer_class", cls), ("legacy", legacy), ("add_prefix_space", prefix),
                                         ("add_bos_token", bos)] if v is not None})
        _check_equal(_dir(tmp_path, models / kind, config))


@pytest.mark.parametrize("kind", ["bpe", "unigram", "nfkc", "plain"])
def test_without_a_class_the_models_own_settings_encode_as_sentencepiece(models, tmp_path, kind):
    processor = spm.SentencePieceProcessor(model_file=str(models / kind / "tokenizer.model"))
    d = _dir(tmp_path, models / kind, {"add_bos_token": True})
    _check_equal(d, TEXTS + ["ｆｕｌｌ　ｗｉｄｔｈ ①②", "tabs\tand\u00a0nbsp"])
    ours = Tokenizer.from_hf_dir(d)
    assert ours.bos_token == "<s>" and ours.eos_token_ids == (2,)
    for text in [t for t in TEXTS if "<" not in t] + ["ｆｕｌｌ　ｗｉｄｔｈ ①②", "x <tool>y"]:
        ids = processor.encode(text)
        assert ours.encode(text) == ids, text
        if processor.unk_id() not in ids:  # SentencePiece spells an unknown piece " ⁇ "
            assert ours.decode(ids) == processor.decode(ids), text


def test_added_tokens_take_their_stated_ids(models, tmp_path):
    n = len(read_model_proto(models / "unigram" / "tokenizer.model").pieces)
    # An entry at a piece's id renames the piece (a fine-tune's chat roles over unused pieces); one past the model
    # comes next; the special flag is the config's.
    config = {"tokenizer_class": "LlamaTokenizer", "added_tokens_decoder": {
        "5": {"content": "<|im_start|>", "special": True}, str(n): {"content": "<|im_end|>", "special": True}}}
    tok = Tokenizer.from_hf_dir(_dir(tmp_path, models / "unigram", config))
    assert tok.encode("<|im_start|>hi<|im_end|>")[0] == 5 and tok.encode("<|im_end|>") == [n]
    assert tok.decode([5, n]) == "" and tok.decode([5, n], skip_special_tokens=False) == "<|im_start|><|im_end|>"
    config["added_tokens_decoder"] = {str(n + 3): {"content": "<far>", "special": True}}
    with pytest.raises(ValueError, match=f"added token '<far>' has id {n + 3}"):
        Tokenizer.from_hf_dir(_dir(tmp_path, models / "unigram", config))


def test_what_it_cannot_read_is_refused_by_name(models, tmp_path):
    with pytest.raises(ValueError, match="SentencePiece tokenizer.model of class 'T5Tokenizer' is not supported"):
        Tokenizer.from_hf_dir(_dir(tmp_path, models / "bpe", {"tokenizer_class": "T5Tokenizer"}))
    d = _dir(tmp_path, models / "bpe", {})
    # Llama 3's original tokenizer.model is tiktoken's text format.
    (d / "tokenizer.model").write_text("IQ== 0\nIg== 1\nIw== 2\n")
    with pytest.raises(ValueError, match="is not a SentencePiece model"):
        Tokenizer.from_hf_dir(d)
    (d / "tokenizer.model").write_bytes((models / "bpe" / "tokenizer.model").read_bytes()[:-7])
    with pytest.raises(ValueError, match="is not a SentencePiece model: a protobuf (field|varint) runs past the end"):
        Tokenizer.from_hf_dir(d)
    (d / "tokenizer.model").unlink()
    with pytest.raises(FileNotFoundError, match="nor tokenizer.model"):
        Tokenizer.from_hf_dir(d)


@pytest.mark.parametrize("name", ["tokenizer.model.v1", "mistral_instruct_tokenizer_240323.model.v3"])
def test_mistrals_tokenizer_models(tmp_path, name):
    """Mistral 7B's SentencePiece models (32000 pieces; v3 with its control tokens) as Llama-class directories, and as
    the model's own settings against SentencePiece."""
    mistral_common = pytest.importorskip("mistral_common")
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(f"{mistral_common.__path__[0]}/data/{name}", model / "tokenizer.model")
    texts = ["[INST] What is 2+2? [/INST] 4</s>", "def f(x):\n    return x*2\n", "Ünïcödé 東京 🚀  twice  ", " lead"]
    for legacy in (True, False):
        config = {"tokenizer_class": "LlamaTokenizerFast", "add_bos_token": True, "legacy": legacy,
                  "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
        _check_equal(_dir(tmp_path, model, config), texts)
    d = _dir(tmp_path, model, {})
    _check_equal(d, texts)
    processor, ours = spm.SentencePieceProcessor(model_file=str(model / "tokenizer.model")), Tokenizer.from_hf_dir(d)
    for text in texts[1:]:  # (SentencePiece never reads control tokens from text; transformers and jaxserve do)
        assert ours.encode(text) == processor.encode(text), text
