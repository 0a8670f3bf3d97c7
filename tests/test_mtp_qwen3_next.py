"""Speculative decoding with Qwen3-Next's multi-token prediction layer (`engine.mtp`; vLLM's `qwen3_next_mtp`) on
the hybrid model: its drafts verified as chunks, a request's DeltaNet states put back when a draft is rejected.

A tiny random Qwen3-Next saved with one more layer (an attention layer with experts), whose tensors become the MTP
layer's `mtp.layers.0.*`, plus its `mtp.fc`, `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden` and `mtp.norm` (as
the released checkpoints keep them). The reference is transformers' own decoder layer of that index run in torch as
the MTP module runs (the next token's embedding and the model's normed hidden state, each normed by 1 + w, through
`fc`; further drafts from the layer's own output; the model's head). Every draft the engine proposes equals the
reference's for the context it had; the outputs equal decoding without drafts; drafts are taken and rejected."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.numpy import load_file, save_file  # noqa: E402

from jaxserve.engine.llm_engine import LLMEngine  # noqa: E402
from jaxserve.engine.mtp import MtpDraft  # noqa: E402
from jaxserve.engine_args import EngineArgs  # noqa: E402
from tests.test_draft_model import _with_tokenizer  # noqa: E402
from tests.test_model_families import save_tiny_hf  # noqa: E402
from tests.test_mtp import ARGS, PROMPTS, SCALE, Reference, _same, _serve, _serve_all, check_drafts  # noqa: E402
from tests.test_qwen3_next import MOE, TINY  # noqa: E402

SPEC = {"method": "qwen3_next_mtp", "num_speculative_tokens": 3}


class QwenReference(Reference):
    """Qwen3-Next's MTP module in torch: the target's first `n` layers, transformers' layer `n` as the MTP layer."""

    def __init__(self, full, n: int, mtp: dict[str, np.ndarray]):
        cfg = full.config
        self.full, self.n, self.eps = full, n, cfg.rms_norm_eps
        short = type(cfg)(**{**cfg.to_dict(), "num_hidden_layers": n, "layer_types": cfg.layer_types[:n]})
        self.target = transformers.AutoModelForCausalLM.from_config(short, attn_implementation="eager").eval()
        self.target.load_state_dict(full.state_dict(), strict=False)
        self.w = {k: torch.from_numpy(v) for k, v in mtp.items()}

    def _norm(self, x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + w)

    def _input(self, token: int, position: int, prev):
        e = self.full.model.embed_tokens.weight[token]  # (not zeroed at position 0)
        x = torch.cat([self._norm(e, self.w["pre_fc_norm_embedding.weight"]),
                       self._norm(prev, self.w["pre_fc_norm_hidden.weight"])])
        return x @ self.w["fc.weight"].T

    def _head(self, g):
        return self._norm(g, self.w["norm.weight"]) @ self.full.lm_head.weight.T  # (the model's head)


def save_qwen3_next_with_mtp(path) -> QwenReference:
    """A tiny Qwen3-Next with its MTP layer at `path` (config `mtp_num_hidden_layers` 1), built to mostly repeat its
    last token (its head its embedding, its layers' outputs scaled down) and its MTP layer to mostly draft the token
    it is given again; its reference."""
    n = TINY["num_hidden_layers"]
    kinds = TINY["layer_types"] + ["full_attention"]
    full = save_tiny_hf("Qwen3NextConfig", path, seed=3, tie_word_embeddings=False,
                        **{**TINY, **MOE, "num_hidden_layers": n + 1, "layer_types": kinds})
    with torch.no_grad():
        full.lm_head.weight.copy_(full.model.embed_tokens.weight)
        for name, p in full.model.layers.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj", "down_proj.weight", "out_proj.weight")):
                p.mul_(SCALE / 6)
    full.save_pretrained(path, safe_serialization=True)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    E = full.config.hidden_size
    rng = np.random.default_rng(4)
    mtp = {"pre_fc_norm_embedding.weight": (0.2 * rng.standard_normal(E)).astype(np.float32),
           "pre_fc_norm_hidden.weight": np.zeros(E, np.float32),
           "fc.weight": np.concatenate([np.eye(E), 0.02 * rng.standard_normal((E, E))], 1).astype(np.float32),
           "norm.weight": (0.05 * rng.standard_normal(E)).astype(np.float32)}
    prefix = f"model.layers.{n}."
    tensors = {("mtp.layers.0." + k[len(prefix):] if k.startswith(prefix) else k): v for k, v in tensors.items()}
    tensors.update({f"mtp.{k}": v for k, v in mtp.items()})
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config.update(num_hidden_layers=n, layer_types=kinds[:n], mtp_num_hidden_layers=1)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    _with_tokenizer(str(path))
    return QwenReference(full, n, mtp)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_next_mtp")
    return str(path), save_qwen3_next_with_mtp(path)


def test_drafts_equal_the_reference_and_outputs_the_targets(tiny, monkeypatch):
    """Batched and chunked prefills, decodes verifying drafts as chunks (a rejected draft's request's states put
    back), a prefix cache hit: every proposal the reference's, the outputs those of decoding without drafts."""
    path, ref = tiny
    want = _serve(LLMEngine(EngineArgs(model=path, **ARGS), progress=False), PROMPTS)
    engine = LLMEngine(EngineArgs(model=path, speculative_config=SPEC, enable_prefix_caching=True, **ARGS),
                       progress=False)
    assert engine.runner.cfg.keep_hidden and engine.draft.cfg.num_layers == 1 and engine.draft.cfg.mamba is None
    assert engine.args.speculative_config.chunked
    check_drafts(engine, MtpDraft, monkeypatch, want, ref.drafts, SPEC["num_speculative_tokens"])
    stats = engine.drafter.counters
    assert stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens  # (some rejected: states put back)
    assert sorted(engine.scheduler.states.free) == list(range(1, 1 + ARGS["max_num_seqs"]))


def test_warmed_up_sampled_and_preempted(tiny):
    """Warmed up with compiles refused after, greedy, seeded and penalized requests with logprobs, in a pool small
    enough to preempt: the outputs of decoding without drafts."""
    path, _ = tiny
    from jaxserve.engine.hybrid import state_layout
    from jaxserve.loader import HFDirectory
    from jaxserve.models.inputs import KVCache

    cfg = HFDirectory(path, weights=False).config()
    spec = {**SPEC, "num_speculative_tokens": 2}
    states = state_layout(cfg, EngineArgs(model=path, speculative_config=spec, **ARGS), np.float32).bytes
    # (its pages: 14 beside the states, target's and MTP layer's; preempted with these prompts)
    pages = 14 * (KVCache.bytes_per_page(cfg, ARGS["page_size"], np.float32) * 2)
    args = {**ARGS, "warmup": True, "strict_compile": True, "kv_cache_memory_bytes": states + pages}
    prompts = [PROMPTS[0], PROMPTS[2], [9, 8, 7, 6, 5, 4, 3]]
    want = _serve_all(LLMEngine(EngineArgs(model=path, **args), progress=False), prompts)
    engine = LLMEngine(EngineArgs(model=path, speculative_config=spec, **args), progress=False)
    engine.drafter.costs = None  # (every draft the step has room for verified: on the CPU the costs draft little)
    _same(want, _serve_all(engine, prompts))
    assert engine.num_preemptions > 0 and engine.drafter.counters.spec_num_accepted_tokens > 10
    assert engine.draft.compilations_after_warmup == 0 and engine.runner.compilations_after_warmup == 0
    engine.check_integrity()


def test_an_eagle3_head_drafts_for_the_hybrid_model(tiny, tmp_path, monkeypatch):
    """An EAGLE-3 head on the hybrid model: its steps keep the hidden states entering three of its layers (DeltaNet
    and attention layers alike), the head drafts from them, drafts verified as chunks: every proposal the torch
    reference's (transformers' hidden states of the Qwen3-Next model), the outputs those of decoding without drafts."""
    from jaxserve.engine.eagle import EagleDraft
    from tests.test_eagle import save_head

    path, ref = tiny
    head = save_head("eagle3", str(tmp_path / "head"), ref.target, aux=(0, 2, 3))  # (DeltaNet layers, attention's)
    want = _serve(LLMEngine(EngineArgs(model=path, **ARGS), progress=False), PROMPTS)
    engine = LLMEngine(EngineArgs(model=path, speculative_config={"method": "eagle3", "model": str(tmp_path / "head"),
                                                                 "num_speculative_tokens": 3},
                                  enable_prefix_caching=True, **ARGS), progress=False)
    assert engine.runner.cfg.hidden_layers == head.aux == (0, 2, 3) and engine.args.speculative_config.chunked
    check_drafts(engine, EagleDraft, monkeypatch, want, head.drafts, 3, accepted=5)  # (9 taken of 49)
