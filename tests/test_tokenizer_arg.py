"""`--tokenizer` (`EngineArgs.tokenizer`): the tokenizer and chat template from a path apart from the model's, as
vLLM's flag: the bundled GGUF model served with the tokenizer of an HF directory (written from its own, then given
another chat template), another model's tokenizer refused by its size."""

from __future__ import annotations

import json
import os

import pytest

from jaxserve.engine_args import EngineArgs
from jaxserve.llm import LLM
from jaxserve.sampling_params import SamplingParams
from tests.conftest import REAL_ENGINE_ARGS

MESSAGES = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory, smollm_path):
    from jaxserve.tokenizer import Tokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    Tokenizer.from_gguf(smollm_path).save_hf(path)
    return str(path)


def test_the_model_served_with_a_tokenizer_from_elsewhere(smollm_path, tokenizer_dir, tmp_path):
    args = dict(**{**REAL_ENGINE_ARGS, "max_num_seqs": 4}, warmup=False, progress=False)
    params = SamplingParams(temperature=0, max_tokens=12)
    own = LLM(smollm_path, **args)
    want = own.chat(MESSAGES, params)[0]
    other = LLM(smollm_path, tokenizer=tokenizer_dir, **args)
    got = other.chat(MESSAGES, params)[0]
    assert other.get_tokenizer() is not own.get_tokenizer()
    assert (got.prompt_token_ids, got.outputs[0].token_ids, got.outputs[0].text) == \
        (want.prompt_token_ids, want.outputs[0].token_ids, want.outputs[0].text)
    # Its own chat template: the prompt as that template writes it.
    with open(os.path.join(tokenizer_dir, "tokenizer_config.json")) as f:
        config = json.load(f)
    config["chat_template"] = "{% for m in messages %}<|im_start|>Q: {{ m['content'] }}\nA:{% endfor %}"
    changed = tmp_path / "changed"
    changed.mkdir()
    for name in os.listdir(tokenizer_dir):
        (changed / name).write_bytes(open(os.path.join(tokenizer_dir, name), "rb").read())
    (changed / "tokenizer_config.json").write_text(json.dumps(config))
    llm = LLM(smollm_path, tokenizer=str(changed), **args)
    out = llm.chat(MESSAGES, params)[0]
    assert out.prompt_token_ids == llm.get_tokenizer().encode("<|im_start|>Q: Name a colour.\nA:")


def test_another_models_tokenizer_is_refused(tokenizer_dir, tmp_path):
    from jaxserve.engine.model_loading import load_model
    from tests.test_draft_model import _with_tokenizer
    from tests.test_model_families import save_tiny_hf

    pytest.importorskip("transformers")
    save_tiny_hf("LlamaConfig", tmp_path / "tiny")
    tiny = _with_tokenizer(str(tmp_path / "tiny"))
    with pytest.raises(ValueError, match=r"the tokenizer at .* has 49152 tokens; the model's vocabulary has 160"):
        load_model(EngineArgs(model=tiny, tokenizer=tokenizer_dir, dtype="float32"), progress=False)
    with pytest.raises(FileNotFoundError, match="neither an HF directory nor a GGUF file"):
        load_model(EngineArgs(model=tiny, tokenizer=str(tmp_path / "nowhere"), dtype="float32"), progress=False)


def test_the_flag():
    import argparse

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    assert EngineArgs.from_cli_args(parser.parse_args(["--tokenizer", "/some/dir"])).tokenizer == "/some/dir"
