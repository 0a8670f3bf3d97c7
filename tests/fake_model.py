"""A model whose outputs can be checked by hand: the next token is always (last token + 1) mod V.

It runs the real engine (scheduler, runner buckets, device decode loop, sampling, detokenizer)
around a trivial forward, so engine-loop tests need no weights and compile in seconds.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import tokenizers

from jaxserve.config import ModelConfig
from jaxserve.engine.model_loading import LoadedModel
from jaxserve.models.params import init_params
from jaxserve.tokenizer import Tokenizer

VOCAB = 64
EOS = 1


def counting_forward(params, kv, inputs, cfg, backend):
    """Logits that put all mass on (last token + 1) mod V; the KV pool is left as is."""
    last = inputs.token_ids[inputs.logits_indices]
    nxt = (last + 1) % cfg.vocab_size
    logits = jax.nn.one_hot(nxt, cfg.vocab_size, dtype=jnp.float32) * 30.0 - 15.0
    return logits + 0.0 * params.final_norm[0], kv


def fake_tokenizer() -> Tokenizer:
    vocab = {"<pad>": 0, "<eos>": EOS} | {f"t{i}": i for i in range(2, VOCAB)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    backend.add_special_tokens([tokenizers.AddedToken("<eos>", special=True)])
    return Tokenizer(backend, bos_token_id=None, eos_token_ids=[EOS], pad_token_id=0)


def save_fake_tokenizer(path: str) -> None:
    """`fake_tokenizer()`'s tokenizer.json and a tokenizer_config.json (EOS "<eos>") into the model directory `path`."""
    fake_tokenizer()._backend.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<eos>"}, f)


def fake_loaded_model() -> LoadedModel:
    cfg = ModelConfig(family="llama", vocab_size=VOCAB, hidden_size=8, intermediate_size=16, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=4, max_position_embeddings=1024,
                      tie_word_embeddings=True)
    params = init_params(cfg, jax.random.PRNGKey(0))
    return LoadedModel("fake", "fake-counter", cfg, params, fake_tokenizer(), jnp.float32, 0.0,
                       forward_fn=counting_forward)


def text(ids: list[int]) -> str:
    """The text the engine streams for `ids` after a prompt (word-level tokens are space-joined)."""
    return "".join(f" t{i}" for i in ids)
