"""Speculative decoding's configuration (vLLM's `--speculative-config` keys)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from jaxserve.json_options import json_object

METHODS = ("ngram", "draft_model", "mtp", "eagle", "eagle3", "suffix")
MTP_ALIASES = ("deepseek_mtp", "glm4_moe_mtp", "qwen3_next_mtp")  # vLLM's model-specific names of method "mtp"


@dataclass(frozen=True)
class SpeculativeConfig:
    """How drafts are proposed and verified.

    `method` "ngram" looks the drafts up in the request's own context (`speculative.NgramIndex`);
    "draft_model" has a smaller model of the same vocabulary write them (`draft_model.DraftModel`), and is
    what a config naming a `model` means when it names no method (an EAGLE checkpoint's config is read as one);
    "mtp" has the model's own multi-token prediction layer write them (`engine.mtp`: DeepSeek-V3's, GLM-4.5's);
    "eagle" and "eagle3" an EAGLE or EAGLE-3 draft head reading the model's hidden states (`engine.eagle`);
    "suffix" looks the drafts up in the request's tokens and in earlier requests' responses
    (`suffix_decoding.SuffixDecoding`)."""

    method: Literal["ngram", "draft_model", "mtp", "eagle", "eagle3", "suffix"] | None = None
    model: str | None = None
    """The draft model (as `EngineArgs.model` names one: a directory, a GGUF file, a bundled name; an EAGLE
    head's directory)."""
    num_speculative_tokens: int | None = None
    """Most drafts per request per step (default 4; "suffix": `suffix_decoding_max_tree_depth`)."""
    prompt_lookup_max: int = 4
    """Longest context suffix looked up ("ngram")."""
    prompt_lookup_min: int = 2
    """Shortest context suffix looked up ("ngram")."""
    quantization: str | None = None
    """The draft model's weight quantization (as `EngineArgs.quantization`; "draft_model")."""
    draft_tensor_parallel_size: int = 1
    """Devices the draft model is split over: 1, the draft whole on each device of the target's ("draft_model")."""
    suffix_decoding_max_tree_depth: int = 24
    """Longest context suffix matched plus drafts after it ("suffix")."""
    suffix_decoding_max_cached_requests: int = 10000
    """Finished requests' responses kept to draft from ("suffix"; 0: the request's own tokens only)."""
    suffix_decoding_max_spec_factor: float = 1.0
    """Drafts per token of the match, at most ("suffix")."""
    suffix_decoding_min_token_prob: float = 0.1
    """Least estimated probability of a draft, from the share of the matches it continues ("suffix")."""
    draft_verification: Literal["rows", "chunks"] = "rows"
    """How a step verifies a request's token and drafts: "rows", one-token sequences of the decode step (each
    reads the request's KV; the decode kernels split long contexts across the GPU); "chunks", one sequence of
    several query tokens in a mixed step (the KV read once; the prefill kernels). On the CPU rows measure
    7-9% cheaper; on a GPU, `bench/README.md` says what is measured."""

    @property
    def chunked(self) -> bool:
        """Drafts are verified as chunks (`draft_verification == "chunks"`)."""
        return self.draft_verification == "chunks"

    def __post_init__(self) -> None:
        if self.method is None:
            object.__setattr__(self, "method", "draft_model" if self.model else "ngram")
        if self.method in MTP_ALIASES:
            object.__setattr__(self, "method", "mtp")
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be 'ngram' (prompt lookup), 'suffix' (suffix decoding), "
                             f"'draft_model' (a smaller model), 'mtp' (the model's multi-token prediction layer) or "
                             f"'eagle' / 'eagle3' (an EAGLE draft head), got {self.method!r}")
        if self.num_speculative_tokens is None:
            object.__setattr__(self, "num_speculative_tokens",
                               self.suffix_decoding_max_tree_depth if self.method == "suffix" else 4)
        if self.method == "mtp" and (self.model is not None or self.quantization is not None):
            raise ValueError("speculative method 'mtp' drafts with the served model's own multi-token prediction "
                             "layer and takes no model or quantization")
        if self.method in ("draft_model", "eagle", "eagle3") and not (isinstance(self.model, str) and self.model):
            raise ValueError(f"speculative method {self.method!r} needs the draft model: add \"model\": <path or "
                             "name>")
        if self.method in ("eagle", "eagle3") and self.quantization is not None:
            raise ValueError(f"speculative method {self.method!r} takes no quantization (the head is held as read)")
        if self.method in ("ngram", "suffix") and (self.model is not None or self.quantization is not None):
            raise ValueError(f"speculative method {self.method!r} drafts from tokens already seen and takes no model "
                             "or quantization; for a draft model use method 'draft_model'")
        for name, least in (("suffix_decoding_max_tree_depth", 1), ("suffix_decoding_max_cached_requests", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"speculative {name} must be an integer >= {least}, got {value!r}")
        if not (isinstance(self.suffix_decoding_max_spec_factor, int | float)
                and self.suffix_decoding_max_spec_factor > 0):
            raise ValueError(f"speculative suffix_decoding_max_spec_factor must be a positive number, got "
                             f"{self.suffix_decoding_max_spec_factor!r}")
        if not (isinstance(self.suffix_decoding_min_token_prob, int | float)
                and 0 <= self.suffix_decoding_min_token_prob <= 1):
            raise ValueError(f"speculative suffix_decoding_min_token_prob must be within [0, 1], got "
                             f"{self.suffix_decoding_min_token_prob!r}")
        if self.draft_tensor_parallel_size != 1:
            raise ValueError(f"speculative draft_tensor_parallel_size must be 1 (the draft model whole on each device "
                             f"of the target's), got {self.draft_tensor_parallel_size!r}")
        if self.draft_verification not in ("rows", "chunks"):
            raise ValueError(f"speculative draft_verification must be 'rows' or 'chunks', got "
                             f"{self.draft_verification!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative {name} must be a positive integer, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")

    @classmethod
    def parse(cls, value: str | Mapping[str, Any]) -> SpeculativeConfig:
        """From a JSON object (the command line) or a mapping; unknown keys are named."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**json_object(value, "speculative config", '{"method": "ngram", "num_speculative_tokens": 4} or '
                                 '{"model": "<draft model>", "num_speculative_tokens": 4}', known))
