"""Speculative decoding with a model's multi-token prediction layer (`engine.mtp`), DeepSeek-V3's (latent attention)
and GLM-4.5's (grouped-query attention), each with its experts; DeepSeek-V3.2's (its own indexer choosing the keys)
and GLM-4.7-Flash's drafts against the reference.

Tiny random checkpoints saved from transformers' config classes with one more decoder layer, whose tensors become the
MTP layer's, plus its `enorm`, `hnorm`, `eh_proj` and `shared_head` under `model.layers.{num_hidden_layers}.` (as the
released checkpoints keep them). The reference is transformers' own decoder layer of that index run in torch as the
MTP module runs (vLLM's rule: the embedding of the next token and the model's normed hidden state, the embedding
zeroed at position 0; further drafts from the layer's own output). Every draft the engine proposes, through batched
and chunked prefill, decodes verifying drafts, and a prefix cache hit, equals the reference's for the context it had;
the outputs equal decoding without drafts; drafts are taken."""

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
from jaxserve.loader.keymap import CheckpointError  # noqa: E402
from jaxserve.sampling_params import SamplingParams  # noqa: E402
from jaxserve.speculative_config import SpeculativeConfig  # noqa: E402
from tests.modelrun import drain  # noqa: E402
from tests.test_draft_model import _with_tokenizer  # noqa: E402
from tests.test_dsa import _TINY as DSA_TINY  # noqa: E402
from tests.test_mla import FAMILIES as MLA  # noqa: E402
from tests.test_model_families import save_tiny_hf  # noqa: E402
from tests.test_moe import FAMILIES as MOE  # noqa: E402

FAMILIES = {"deepseek_v3": MLA["deepseek_v3"], "glm4_moe": MOE["glm4_moe"],
            # (their drafts against the reference only: DeepSeek Sparse Attention's layer, GLM-4.7-Flash's)
            "deepseek_v32": ("DeepseekV32Config", DSA_TINY),
            "glm4_moe_lite": ("Glm4MoeLiteConfig", {**{k: v for k, v in MLA["deepseek_v3"][1].items()
                                                      if k not in ("first_k_dense_replace", "rope_parameters")}})}
MORE = ["deepseek_v3", "glm4_moe"]  # the families the other tests run
SCALE = 0.3  # the decoder layers' output projections scaled: each token's embedding leads its residual stream
ARGS = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=16, max_model_len=96, page_size=8,
            kv_cache_memory_bytes=1 << 20, warmup=False)
SPEC = {"method": "mtp", "num_speculative_tokens": 3}


class Reference:
    """The target (transformers, its first `n` layers) and its MTP layer (transformers' layer `n`) in torch."""

    def __init__(self, full, n: int, mtp: dict[str, np.ndarray]):
        self.full, self.n = full, n
        cfg = full.config
        d = {k: v[:n] if k.endswith("layer_types") and isinstance(v, list) else v for k, v in cfg.to_dict().items()}
        self.target = transformers.AutoModelForCausalLM.from_config(
            type(cfg)(**{**d, "num_hidden_layers": n}), attn_implementation="eager").eval()
        self.target.load_state_dict(full.state_dict(), strict=False)
        self.w = {k: torch.from_numpy(v) for k, v in mtp.items()}
        self.eps = cfg.rms_norm_eps

    def _norm(self, x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * w

    def _layer(self, x):
        """The MTP layer's decoder layer over rows x [L, E] at positions 0..L-1, causal."""
        L = x.shape[0]
        pos = torch.arange(L)[None]
        emb = self.full.model.rotary_emb(x[None], pos)
        mask = torch.full((L, L), float("-inf")).triu(1)[None, None]
        out = self.full.model.layers[self.n](x[None], attention_mask=mask, position_ids=pos, position_embeddings=emb)
        return (out[0] if isinstance(out, tuple) else out)[0]

    def _input(self, token: int, position: int, prev):
        e = self.w["embed_tokens.weight"][token] * (0.0 if position == 0 else 1.0)
        x = torch.cat([self._norm(e, self.w["enorm.weight"]), self._norm(prev, self.w["hnorm.weight"])])
        return x @ self.w["eh_proj.weight"].T

    def _head(self, g):
        """The MTP layer's logits of its output g."""
        return self._norm(g, self.w["shared_head.norm.weight"]) @ self.w["shared_head.head.weight"].T

    def drafts(self, context: list[int], k: int) -> list[int]:
        """The k drafts after `context` (its last token not yet computed by the target)."""
        with torch.no_grad():
            h = self.target.model(torch.tensor([context[:-1]])).last_hidden_state[0]  # normed
            rows = [self._input(context[i + 1], i, h[i]) for i in range(len(context) - 1)]
            out = []
            for _ in range(k):
                g = self._layer(torch.stack(rows))[-1]
                out.append(int(torch.argmax(self._head(g))))
                rows.append(self._input(out[-1], len(rows), g))
            return out


def save_repeating(cls: str, path, **overrides):
    """A tiny model of `transformers.<cls>` saved at `path` that mostly repeats its last token: its head is its
    embedding (untied), its final norm's weights ones, its layers' output projections scaled down; the model."""
    model = save_tiny_hf(cls, path, seed=3, tie_word_embeddings=False, **overrides)
    with torch.no_grad():
        model.model.norm.weight.fill_(1.0)
        model.lm_head.weight.copy_(model.model.embed_tokens.weight)
        for name, p in model.model.layers.named_parameters():
            if "o_proj" in name or "down_proj" in name:
                p.mul_(SCALE)
    model.save_pretrained(path, safe_serialization=True)
    return model


def save_with_mtp(family: str, path) -> Reference:
    """A tiny checkpoint of `family` with one MTP layer (config `num_nextn_predict_layers` 1) at `path`; its reference.

    Built so that drafts are often right: the model's head is its embedding (untied) and its layers' outputs are
    scaled down, so it mostly repeats its last token; the MTP layer's head is the model's and its `eh_proj` passes
    the next token's embedding (with some of the hidden state), so it mostly drafts that token again."""
    cls, overrides = FAMILIES[family]
    n = overrides["num_hidden_layers"]
    full = save_repeating(cls, path, **{**overrides, "num_hidden_layers": n + 1})
    tensors = load_file(os.path.join(path, "model.safetensors"))
    E = full.config.hidden_size
    rng = np.random.default_rng(4)
    mtp = {"enorm.weight": (1 + 0.2 * rng.standard_normal(E)).astype(np.float32),
           "hnorm.weight": np.ones(E, np.float32),
           "eh_proj.weight": np.concatenate([np.eye(E), 0.3 * rng.standard_normal((E, E))], 1).astype(np.float32),
           "shared_head.norm.weight": (1 + 0.05 * rng.standard_normal(E)).astype(np.float32),
           "shared_head.head.weight": tensors["lm_head.weight"].copy(),
           "embed_tokens.weight": tensors["model.embed_tokens.weight"].copy()}
    tensors.update({f"model.layers.{n}.{k}": v for k, v in mtp.items()})
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config.update(num_hidden_layers=n, num_nextn_predict_layers=1)
    for key in ("mlp_layer_types", "layer_types", "indexer_types"):  # (per decoder layer, where the config lists them)
        if isinstance(config.get(key), list):
            config[key] = config[key][:n]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    _with_tokenizer(str(path))
    return Reference(full, n, mtp)


@pytest.fixture(scope="module", params=list(FAMILIES))
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, str(path), save_with_mtp(request.param, path)


PROMPTS = [[5, 9, 13, 2, 7], list(range(3, 40)), [11, 4] * 9]  # a short prompt, one of three chunks, one of two


def _serve(engine: LLMEngine, prompts, max_tokens: int = 24, prefix: str = "") -> dict[str, list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(f"{prefix}{i}", p, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return {rid: list(out.outputs[0].token_ids) for rid, out in drain(engine).items()}


def test_drafts_equal_the_reference_and_outputs_the_targets(tiny, monkeypatch):
    family, path, ref = tiny
    want = _serve(LLMEngine(EngineArgs(model=path, **ARGS), progress=False), PROMPTS)
    engine = LLMEngine(EngineArgs(model=path, speculative_config=SPEC, enable_prefix_caching=True, **ARGS),
                       progress=False)
    assert engine.runner.cfg.keep_hidden and engine.draft.cfg.num_layers == 1
    # (the tiny DeepSeek-V3.2 and GLM-4.7-Flash models repeat their tokens less: fewer of their drafts are right)
    check_drafts(engine, MtpDraft, monkeypatch, want, ref.drafts, SPEC["num_speculative_tokens"],
                 accepted=10 if family in MORE else 5)


def check_drafts(engine: LLMEngine, drafter: type, monkeypatch, want: dict, reference, most: int,
                 accepted: int = 10) -> None:
    """`PROMPTS` served by `engine`, then the second again (its pages from the prefix cache): the outputs `want`
    (decoding without drafts), and every proposal of its `drafter` (1 to `most` drafts) what `reference(context,
    k)` drafts for the context it had; more than `accepted` drafts taken."""
    proposed = []
    propose = drafter.propose

    def watch(self, rows):
        got = propose(self, rows)
        proposed.extend((rid, position, got[rid].tolist()) for rid, _, position, _, _ in rows if rid in got)
        return got

    monkeypatch.setattr(drafter, "propose", watch)
    assert _serve(engine, PROMPTS) == want
    again = _serve(engine, PROMPTS[1:2], prefix="again")
    assert again["again0"] == want["1"]
    full = {**{rid: PROMPTS[int(rid)] + out for rid, out in want.items()}, "again0": PROMPTS[1] + want["1"]}
    assert {rid for rid, *_ in proposed} == set(full)
    for rid, position, drafts in proposed:
        assert 1 <= len(drafts) <= most
        assert drafts == reference(full[rid][:position + 1], len(drafts)), (rid, position)
    stats = engine.drafter.counters
    assert stats.spec_num_draft_tokens > 40 and stats.spec_num_accepted_tokens > accepted, stats
    engine.check_integrity()


PARAMS = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
          SamplingParams(temperature=0.8, seed=5, max_tokens=24, n=2, ignore_eos=True),
          SamplingParams(temperature=0, max_tokens=20, logprobs=2, frequency_penalty=0.4, ignore_eos=True)]


def _serve_all(engine: LLMEngine, prompts) -> dict:
    for i, p in enumerate(prompts):
        for j, sp in enumerate(PARAMS):
            engine.add_request(f"{i}/{j}", p, sp)
    return {rid: [(list(o.token_ids), o.finish_reason, o.logprobs) for o in out.outputs]
            for rid, out in drain(engine).items()}


def _same(want: dict, got: dict) -> None:
    assert want.keys() == got.keys()
    for rid, outs in want.items():
        for (ids, why, lps), (ids2, why2, lps2) in zip(outs, got[rid], strict=True):
            assert (ids2, why2) == (ids, why), rid
            for a, b in zip(lps or [], lps2 or [], strict=True):
                assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)


@pytest.mark.parametrize("tiny", MORE, indirect=True)
@pytest.mark.parametrize("k", [1, 2])
def test_warmed_up_sampled_and_preempted(tiny, k):
    """Warmed up with compiles refused after (every bucket of the layer's steps compiled), greedy, seeded and
    penalized requests with logprobs, in a pool small enough to preempt: the outputs of decoding without drafts.
    One draft a step (k = 1) runs no drafting loop."""
    family, path, _ = tiny
    from jaxserve.loader import HFDirectory
    from jaxserve.models.inputs import KVCache

    page = KVCache.bytes_per_page(HFDirectory(path, weights=False).config(), ARGS["page_size"], np.float32)
    args = {**ARGS, "warmup": True, "strict_compile": True, "kv_cache_memory_bytes": 20 * page}
    prompts = [PROMPTS[0], PROMPTS[2], [9, 8, 7, 6, 5, 4, 3]]
    want = _serve_all(LLMEngine(EngineArgs(model=path, **args), progress=False), prompts)
    engine = LLMEngine(EngineArgs(model=path, speculative_config={**SPEC, "num_speculative_tokens": k}, **args),
                       progress=False)
    assert (engine.draft._draft is None) is (k == 1)
    engine.drafter.costs = None  # (every draft the step has room for verified: on the CPU the costs draft little)
    got = _serve_all(engine, prompts)
    _same(want, got)
    assert engine.num_preemptions > 0
    assert engine.drafter.counters.spec_num_accepted_tokens > 10
    assert engine.draft.compilations_after_warmup == 0 and engine.runner.compilations_after_warmup == 0
    engine.check_integrity()


@pytest.mark.parametrize("tiny", MORE, indirect=True)
def test_sleeps_and_wakes_with_the_engine(tiny):
    """Sleep mode frees the layer's weights and pool with the model's; awake (its weights from the host copy at level
    1, read again from the checkpoint at level 2), it drafts as before."""
    _, path, _ = tiny
    engine = LLMEngine(EngineArgs(model=path, speculative_config=SPEC, enable_sleep_mode=True, **ARGS),
                       progress=False)
    sleep_and_wake(engine, _serve(engine, PROMPTS))


def sleep_and_wake(engine: LLMEngine, want: dict) -> None:
    """Sleep levels 1 and 2, each followed by waking: the drafter's weights and pool freed while asleep, and awake,
    `PROMPTS` served as `want` with drafts taken as before."""
    import jax

    drafted = engine.drafter.counters.spec_num_accepted_tokens
    for level, tags in ((1, None), (2, ["weights"])):
        held = jax.tree.leaves((engine.draft.params, engine.draft.kv))
        engine.memory.sleep(level)
        assert all(x.is_deleted() for x in held), "the drafter's weights and pool freed on the device"
        engine.memory.wake_up(tags)
        if tags:
            engine.memory.wake_up(["kv_cache"])
        assert _serve(engine, PROMPTS) == want, level
        assert engine.drafter.counters.spec_num_accepted_tokens >= 2 * drafted - 3


@pytest.mark.parametrize("tiny", MORE, indirect=True)
def test_config_and_refusals(tiny, tmp_path):
    _, path, _ = tiny
    for method in ("mtp", "deepseek_mtp", "glm4_moe_mtp"):
        assert SpeculativeConfig.parse({"method": method, "num_speculative_tokens": 1}).method == "mtp"
    with pytest.raises(ValueError, match="'mtp' drafts with the served model's own .* takes no model"):
        SpeculativeConfig(method="mtp", model=path)
    with pytest.raises(ValueError, match="'mtp' .*, got 'medusa'"):
        SpeculativeConfig(method="medusa")
    import shutil

    def edited(name: str, **changes) -> str:
        target = str(tmp_path / name)
        shutil.copytree(path, target)
        with open(os.path.join(target, "config.json")) as f:
            config = json.load(f)
        with open(os.path.join(target, "config.json"), "w") as f:
            json.dump({**config, **changes}, f)
        return target

    with pytest.raises(ValueError, match="num_nextn_predict_layers or mtp_num_hidden_layers is 0"):
        LLMEngine(EngineArgs(model=edited("none", num_nextn_predict_layers=0), speculative_config=SPEC, **ARGS),
                  progress=False)
    n = json.load(open(os.path.join(path, "config.json")))["num_hidden_layers"]
    with pytest.raises(CheckpointError, match=rf"missing the MTP layer's model.layers.{n - 1}.enorm.weight"):
        LLMEngine(EngineArgs(model=edited("fewer", num_hidden_layers=n - 1), speculative_config=SPEC, **ARGS),
                  progress=False)
    bare = edited("bare")
    weights = os.path.join(bare, "model.safetensors")
    save_file({k: v for k, v in load_file(weights).items() if not k.startswith(f"model.layers.{n}.")}, weights)
    with pytest.raises(CheckpointError, match=rf"no multi-token prediction weights \(model.layers.{n}\.\*\)"):
        LLMEngine(EngineArgs(model=bare, speculative_config=SPEC, **ARGS), progress=False)
    llama = str(tmp_path / "llama")
    save_tiny_hf("LlamaConfig", llama)
    with pytest.raises(ValueError, match="jaxserve reads for DeepSeek-V3 and V3.2, GLM-4.5, .* checkpoints; llama.s are not read"):
        LLMEngine(EngineArgs(model=_with_tokenizer(llama), speculative_config=SPEC, **ARGS), progress=False)


@pytest.mark.parametrize("tiny", ["glm4_moe"], indirect=True)
def test_a_gguf_files_nextn_block_drafts_as_the_directory(tiny, tmp_path, monkeypatch):
    """GLM-4.5 as llama.cpp writes it (F32: the MTP layer as block `blk.N` with its `nextn.*` tensors): the same
    drafts, step for step, and outputs as the HF directory it was written from."""
    from tests.test_gguf_models import _write_moe_gguf

    _, path, _ = tiny
    gguf = _write_moe_gguf(tmp_path / "glm.gguf", path, "glm4moe")
    proposed: list[list] = []
    propose = MtpDraft.propose

    def watch(self, rows):
        got = propose(self, rows)
        proposed[-1].extend((rid, position, got[rid].tolist()) for rid, _, position, _, _ in rows if rid in got)
        return got

    monkeypatch.setattr(MtpDraft, "propose", watch)
    import jax.numpy as jnp

    from jaxserve.engine.model_loading import LoadedModel, load_model
    from jaxserve.loader import load_params
    from jaxserve.loader.gguf_file import GGUFFile

    file = GGUFFile(gguf)
    cfg = file.config()
    tokenizer = load_model(EngineArgs(model=path, load_format="dummy"), progress=False).tokenizer
    loaded = LoadedModel(gguf, "glm", cfg, load_params(file, cfg, jnp.float32, progress=False), tokenizer,
                         jnp.float32, 0.0)
    outputs = []
    for model in (path, loaded):
        proposed.append([])
        engine = LLMEngine(EngineArgs(model=path if model is path else gguf, speculative_config=SPEC, **ARGS),
                           loaded=None if model is path else model, progress=False)
        assert engine.draft.cfg.num_layers == 1
        outputs.append(_serve(engine, PROMPTS))
    assert outputs[0] == outputs[1]
    assert len(proposed[0]) > 10 and proposed[0] == proposed[1]
