"""`--tokenizer` (`EngineArgs.tokenizer`): the tokenizer and chat template from a path apart from the model's, as
vLLM's flag: a model served with the tokenizer of a directory of tokenizer files alone (its own chat template
used), the bundled GGUF's tokenizer read from the file and from an HF copy, another model's refused by its size."""

from __future__ import annotations

import json

import pytest

from jaxserve.engine_args import EngineArgs
from jaxserve.llm import LLM
from jaxserve.loader import tokenizer_at
from jaxserve.sampling_params import SamplingParams
from jaxserve.tokenizer import Tokenizer

ARGS = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
            kv_cache_memory_bytes=1 << 20, warmup=False, progress=False)


def test_the_model_served_with_a_tokenizer_from_elsewhere(tiny_llama, tmp_path):
    other = tmp_path / "tokenizer"  # tokenizer files alone, with a chat template of their own
    Tokenizer.from_hf_dir(tiny_llama).save_hf(other)
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}t5 {{ m['content'] }}{% endfor %}"
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = LLM(tiny_llama, **ARGS).generate({"prompt_token_ids": [5, 7, 9]}, params)[0].outputs[0].token_ids
    llm = LLM(tiny_llama, tokenizer=str(other), **ARGS)
    assert llm.get_tokenizer().chat_template == config["chat_template"]
    out = llm.chat([{"role": "user", "content": "t7 t9"}], params)[0]
    assert out.prompt_token_ids == [5, 7, 9] and out.outputs[0].token_ids == want


def test_a_gguf_files_tokenizer_and_its_hf_copy(smollm_path, tmp_path):
    from jaxserve.loader import GGUFFile

    cfg = GGUFFile(smollm_path).config()
    own = Tokenizer.from_gguf(smollm_path)
    own.save_hf(tmp_path / "copy")
    text = "Hello, world! The numbers 1, 22 and 333 <|im_start|>user\n"
    for path in (smollm_path, str(tmp_path / "copy")):
        got = tokenizer_at(path, cfg)
        assert got.encode(text) == own.encode(text) and got.chat_template == own.chat_template, path


def test_another_models_tokenizer_is_refused(tiny_llama, smollm_path, tmp_path):
    from jaxserve.engine.model_loading import load_model

    with pytest.raises(ValueError, match=r"the tokenizer at .* has 49152 tokens; the model's vocabulary has 160"):
        load_model(EngineArgs(model=tiny_llama, tokenizer=smollm_path, dtype="float32"), progress=False)
    with pytest.raises(FileNotFoundError, match="neither an HF directory nor a GGUF file"):
        load_model(EngineArgs(model=tiny_llama, tokenizer=str(tmp_path / "nowhere"), dtype="float32"), progress=False)


def test_the_flag():
    import argparse

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    assert EngineArgs.from_cli_args(parser.parse_args(["--tokenizer", "/some/dir"])).tokenizer == "/some/dir"
