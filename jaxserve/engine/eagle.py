"""Speculative decoding with an EAGLE or EAGLE-3 head: `--speculative-config '{"method": "eagle3", "model": <head>,
"num_speculative_tokens": k}'` (vLLM's methods and keys; "eagle" for EAGLE heads). A head whose config.json names
itself EAGLE-3 (`LlamaForCausalLMEagle3`, speculators' `Eagle3Speculator`) is read as one when the config names only
the model, as vLLM reads speculators' checkpoints. `models.eagle` describes the heads.

The head drafts as the model's own multi-token prediction layer does (`mtp.MtpDraft`, whose lockstep and drafting
steps run it): the target's steps keep their hidden states on the device (EAGLE-3: those entering its chosen layers,
side by side, `RunnerConfig.hidden_layers`); after every step the head runs over the step's rows with each row's
next token, writing its KV pool of the target's pages and giving each sampling row's first draft with the step;
drafts 2..k run the head on its own output. Outputs are the target's own (the drafts are verified as any others).

A head is trained on its model's hidden states: the config's hidden width and vocabulary must be the served model's
(a head for another model is refused by name)."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any

from jaxserve.config import ModelConfig
from jaxserve.engine.mtp import MtpDraft, _steps
from jaxserve.engine_args import EngineArgs
from jaxserve.models.eagle import EagleConfig, eagle_config, eagle_forward, eagle_kind, load_eagle_params


def eagle_method(model: str) -> str | None:
    """"eagle3" or "eagle" when `model` is a directory whose config.json names an EAGLE-3 or EAGLE head, else None."""
    path = os.path.join(model, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return eagle_kind(json.load(f))


def load_eagle(args: EngineArgs, target: Any, method: str) -> EagleDraft:
    """The head `args.speculative_config` names, drafting by `method` ("eagle" or "eagle3") for the `target` (a
    `LoadedModel`), ready to `start`."""
    if target.vision is not None:
        raise ValueError(f"speculative method {method!r} is not supported with an image-text model; use method "
                         "'ngram', or no speculative config")
    spec = args.speculative_config
    ecfg, params = _read(spec.model, method, target.config, target.params, target.dtype)
    loaded = dataclasses.replace(target, params=params, config=ecfg.model, name=f"{spec.model} ({method} head)",
                                 vision=None, plan=None, path=spec.model)
    draft = EagleDraft(loaded, target.config.vocab_size, spec.num_speculative_tokens, args)
    draft.target_cfg, draft.ecfg, draft.method, draft.hidden_layers = target.config, ecfg, method, ecfg.aux_layers
    return draft


def _read(path: str, method: str, target: ModelConfig, target_params: Any, dtype: Any) -> tuple[EagleConfig, Any]:
    """The head at `path` (an HF-format directory: config.json, and safetensors or a `pytorch_model.bin` as the EAGLE
    releases ship): its config and weights."""
    from jaxserve.loader import HFDirectory
    from jaxserve.loader.torch_bin import read_torch_file

    if not os.path.isdir(path):
        raise ValueError(f"speculative method {method!r} reads the head from a directory (config.json and "
                         f"safetensors or pytorch_model.bin); {path!r} is not one")
    ckpt = HFDirectory(path, weights=False)
    ecfg = eagle_config(ckpt.hf_config, method, target, path)
    bin_file = os.path.join(path, "pytorch_model.bin")
    if os.path.isfile(bin_file) and not any(f.endswith(".safetensors") for f in os.listdir(path)):
        tensors = read_torch_file(bin_file).items()
    else:
        tensors = HFDirectory(path).stored_tensors()
    return ecfg, load_eagle_params(tensors, ecfg, target_params, dtype)


def eagle_layer(p: Any, kv: Any, inputs: Any, prev: Any, from_target: bool, ecfg: EagleConfig, backend: str):
    """The head as the drafting steps run it (`mtp._follow`, `mtp._draft_loop`)."""
    return eagle_forward(p, kv, inputs, prev, ecfg, backend, from_target)


class EagleDraft(MtpDraft):
    """An EAGLE or EAGLE-3 head as the engine's drafter."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.ecfg: EagleConfig | None = None
        self.method = "eagle3"

    def build_steps(self, rep: Any) -> tuple[Callable, Callable | None]:
        static = (("ecfg", self.ecfg), ("backend", self.rcfg.backend))
        return _steps(eagle_layer, static, self.cfg.vocab_size, self.num_speculative_tokens, self.rcfg.max_num_seqs,
                      rep)

    @property
    def hidden_width(self) -> int:
        return self.ecfg.hidden_width

    def lay_out(self, params: Any) -> Any:
        return self.replicated(params)  # (its layers are always unstacked: `models.eagle`)

    def reload(self, target_params: Any = None) -> None:
        _, params = _read(self.loaded.path, self.method, self.target_cfg, target_params, self.loaded.dtype)
        self.params = self.lay_out(params)
        self.loaded = dataclasses.replace(self.loaded, params=self.params)
