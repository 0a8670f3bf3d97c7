"""Sequence classification models (`*ForSequenceClassification` checkpoints) on the pooling engine.

Such a checkpoint is a decoder-only backbone plus a score head, `score.weight` [num_labels, hidden]:
HF's `LlamaForSequenceClassification` (and its Qwen2, Qwen3 and Mistral twins) applies the head to
the final-normed hidden state of the last token. Served with `--runner pooling`, the engine pools
that hidden state (last-token pooling, not normalized) as it pools an embedding, and
`ClassifierHead` turns it into the class scores on the host: one [num_labels, hidden] product per
request. Probabilities are a softmax over the labels, or a sigmoid per label when the config says
`problem_type: multi_label_classification` or there is a single label (a cross-encoder's relevance
score), as sentence-transformers and vLLM apply them.

A model with one label is a cross-encoder (a reranker): `/score` and `/rerank` give it each pair as
one input, the tokenizer's pair encoding of (text_1, text_2) or a score template's rendering of it
(`cross_encoder_prompt`), and its sigmoid is the pair's score.

A causal LM serves as a classifier through `--hf-overrides` (vLLM's keys): `architectures` naming a
`*ForSequenceClassification` and `classifier_from_token` listing the tokens whose LM-head logits are
the labels; two tokens make a one-label reranker, as Qwen3-Reranker is served (`_from_tokens`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

_HEAD = "score.weight"
_HEAD_BIAS = "score.bias"


@dataclass(frozen=True)
class ClassifierHead:
    """A classification model's score head and its labels."""

    weight: np.ndarray  # [num_labels, hidden] float64
    bias: np.ndarray | None  # [num_labels] float64
    labels: tuple[str, ...]
    activation: Literal["softmax", "sigmoid"]

    @property
    def num_labels(self) -> int:
        return self.weight.shape[0]

    @property
    def is_cross_encoder(self) -> bool:
        """One label: a relevance score for a pair of texts."""
        return self.num_labels == 1

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """The head's raw scores for one pooled hidden state [hidden]."""
        out = self.weight @ np.asarray(hidden, np.float64)
        return out + self.bias if self.bias is not None else out

    def scores(self, hidden: np.ndarray, activation: bool = True) -> list[float]:
        """The class probabilities (or raw logits without `activation`) for one pooled hidden state."""
        z = self.logits(hidden)
        if activation:
            if self.activation == "sigmoid":
                z = 1.0 / (1.0 + np.exp(-z))
            else:
                z = np.exp(z - z.max())
                z = z / z.sum()
        return z.astype(np.float32).tolist()


def cross_encoder_prompt(tokenizer: Any, query: str, document: str, template: str | None = None) -> list[int]:
    """A cross-encoder's input for one pair: the tokenizer's pair encoding of the two texts, or, with a score
    template (a chat template, as vLLM takes one with `--chat-template`), the template rendered over the
    messages `{"role": "query"}` and `{"role": "document"}`, tokenized as it stands."""
    if template is None:
        return tokenizer.encode_pair(query, document)
    pair = [{"role": "query", "content": query}, {"role": "document", "content": document}]
    text = tokenizer.apply_chat_template(pair, add_generation_prompt=False, chat_template=template)
    return tokenizer.encode(text, add_special_tokens=False)


def model_config(model_path: str | None, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """An HF model directory's config.json with `overrides` (`--hf-overrides`) applied; {} for a GGUF file."""
    path = os.path.join(model_path, "config.json") if model_path and os.path.isdir(model_path) else None
    if path is None or not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return {**json.load(f), **(overrides or {})}


def classification_architecture(config: Mapping[str, Any]) -> str | None:
    """The `*ForSequenceClassification` architecture an HF config names, or None."""
    archs = config.get("architectures") or ()
    return next((a for a in archs if str(a).endswith("ForSequenceClassification")), None)


def read_classifier(model_path: str, config: Mapping[str, Any], hidden_size: int,
                    tokenizer: Any) -> ClassifierHead:
    """The score head and labels of a `*ForSequenceClassification` model directory (`config`: its HF config,
    overrides applied): its `score` tensor, or the LM head's rows of `classifier_from_token`."""
    arch = classification_architecture(config)
    if config.get("classifier_from_token"):
        return _from_tokens(model_path, config, hidden_size, tokenizer)
    tensors = _read_rows(model_path, (_HEAD, _HEAD_BIAS))
    if _HEAD not in tensors:
        raise ValueError(f"{arch} checkpoint {model_path!r} has no {_HEAD!r} tensor (its classification head)")
    weight = tensors[_HEAD].astype(np.float64)
    id2label = config.get("id2label") or {}
    n = len(id2label) or int(config.get("num_labels", weight.shape[0]))
    if weight.shape != (n, hidden_size):
        raise ValueError(f"{arch} checkpoint {model_path!r}: {_HEAD} has shape {weight.shape}, expected "
                         f"({n}, {hidden_size}) for {n} labels")
    labels = tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(n))
    bias = tensors.get(_HEAD_BIAS)
    multi = config.get("problem_type") == "multi_label_classification"
    return ClassifierHead(weight, None if bias is None else bias.astype(np.float64).reshape(n), labels,
                          "sigmoid" if multi or n == 1 else "softmax")


def _from_tokens(model_path: str, config: Mapping[str, Any], hidden_size: int, tokenizer: Any) -> ClassifierHead:
    """A causal LM used as a classifier (vLLM's `classifier_from_token` and `method`): each label is the LM
    head's logit of one token ("no_post_processing", the default for one token or three and more); or two
    tokens ("no", "yes") make one label, the second's logit minus the first's, whose sigmoid is the second
    token's probability against the first ("from_2_way_softmax", the default for two): how Qwen3-Reranker
    scores a pair."""
    tokens = config["classifier_from_token"]
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ValueError(f"classifier_from_token must be a list of tokens, got {tokens!r}")
    method = config.get("method") or ("from_2_way_softmax" if len(tokens) == 2 else "no_post_processing")
    if method not in ("from_2_way_softmax", "no_post_processing") or (
            method == "from_2_way_softmax" and len(tokens) != 2):
        raise ValueError(f"method {method!r} with {len(tokens)} classifier_from_token tokens is not supported "
                         "(from_2_way_softmax takes two; no_post_processing any number)")
    if tokenizer is None:
        raise ValueError("classifier_from_token names its labels' tokens as text: it needs the tokenizer, which "
                         "skip_tokenizer_init leaves out")
    ids = [tokenizer.token_to_id(t) for t in tokens]
    if None in ids:
        raise ValueError(f"classifier_from_token: {tokens[ids.index(None)]!r} is not a token of the model's "
                         "vocabulary")
    rows = None
    for name in ("lm_head.weight", "model.embed_tokens.weight", "embed_tokens.weight"):  # untied, then tied
        rows = _read_rows(model_path, (name,), ids).get(name)
        if rows is not None:
            break
    if rows is None or rows.shape != (len(ids), hidden_size):
        raise ValueError(f"checkpoint {model_path!r} has no LM head (or embedding) to read classifier_from_token "
                         "rows from")
    rows = rows.astype(np.float64)
    if method == "from_2_way_softmax":
        return ClassifierHead((rows[1] - rows[0])[None], None, (tokens[1],), "sigmoid")
    return ClassifierHead(rows, None, tuple(tokens), "sigmoid" if len(tokens) == 1 else "softmax")


def _read_rows(model_path: str, names: tuple[str, ...], rows: list[int] | None = None) -> dict[str, np.ndarray]:
    """The named tensors (or just their `rows`), from whichever of the checkpoint's safetensors files holds
    them; only the rows asked for are read."""
    from safetensors import safe_open

    from jaxserve.loader.hf_dir import HFDirectory

    found: dict[str, np.ndarray] = {}
    for file in HFDirectory(model_path).files:
        with safe_open(file, framework="numpy") as f:
            for name in set(names) & set(f.keys()) - set(found):
                value = (np.stack([f.get_slice(name)[r] for r in rows]) if rows is not None
                         else f.get_tensor(name))
                found[name] = np.asarray(value, np.float32)
    return found
