"""Speculative decoding with EAGLE-3 and EAGLE heads (`engine.eagle`, `models.eagle`).

A tiny random Llama target (saved from transformers) and heads written here in the released checkpoints' formats: an
EAGLE-3 head as the EAGLE-3 releases write it (`LlamaForCausalLMEagle3`, `midlayer.*`, `d2t` over a draft vocabulary
of part of the target's ids, its own embedding); one as speculators writes it (`Eagle3Speculator`, the decoder's
config under `transformer_layer_config`, `layers.0.*`, no embedding: the target's; its residual the normed hidden
state); an EAGLE head (one Llama layer without its input norm, `fc` with its bias) in a `pytorch_model.bin`, as
the EAGLE releases ship; and one as speculators writes it (`EagleSpeculator`: `fusion_fc`, `transformer.*`, with its
`layernorms`: the embedding's, the layer's input norm and one before the head). The reference runs each head in torch from transformers' Llama attention, MLP and rotary
embedding over the target's hidden states as transformers gives them (`output_hidden_states`: the states entering
each layer). The head's outputs over a context equal the reference's; every draft the engine proposes, through
batched and chunked prefills, decodes verifying drafts and a prefix cache hit, equals the reference's for the context
it had; outputs equal decoding without drafts; drafts are taken."""

from __future__ import annotations

import functools
import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.numpy import load_file, save_file  # noqa: E402

from jaxserve.engine.eagle import EagleDraft  # noqa: E402
from jaxserve.engine.llm_engine import LLMEngine  # noqa: E402
from jaxserve.engine_args import EngineArgs  # noqa: E402
from jaxserve.loader.keymap import CheckpointError  # noqa: E402
from jaxserve.speculative_config import SpeculativeConfig  # noqa: E402
from tests.test_draft_model import _with_tokenizer  # noqa: E402
from tests.test_model_families import save_tiny_hf  # noqa: E402
from tests.test_mtp import (  # noqa: E402
    ARGS,
    PROMPTS,
    _same,
    _serve,
    _serve_all,
    check_drafts,
    save_repeating,
    sleep_and_wake,
)

LAYERS = 5  # the target's
HEADS = ("eagle3", "eagle3_speculators", "eagle", "eagle_speculators")


def _target(path):
    """The target: a tiny Llama that mostly repeats its last token (`test_mtp.save_repeating`)."""
    model = save_repeating("LlamaConfig", path, num_hidden_layers=LAYERS)
    _with_tokenizer(str(path))
    return model


class Reference:
    """A head in torch: transformers' Llama attention (EAGLE-3: its q/k/v reading 2E), MLP and rotary embedding."""

    def __init__(self, target, method: str, w: dict[str, np.ndarray], layer_cfg: dict, aux=(), before=False):
        self.target, self.method, self.aux, self.before = target, method, aux, before
        self.w = {k: torch.from_numpy(np.asarray(v)) for k, v in w.items()}
        cfg = transformers.LlamaConfig(**layer_cfg)
        self.eps = cfg.rms_norm_eps
        layer = transformers.models.llama.modeling_llama.LlamaDecoderLayer(cfg, layer_idx=0)
        if method == "eagle3":
            attn = layer.self_attn
            for name in ("q_proj", "k_proj", "v_proj"):
                old = getattr(attn, name)
                setattr(attn, name, torch.nn.Linear(2 * cfg.hidden_size, old.out_features, bias=False))
        prefix = "midlayer." if "midlayer.self_attn.q_proj.weight" in self.w else "layers.0."
        state = {k[len(prefix):]: v for k, v in self.w.items() if k.startswith(prefix)}
        self.input_norm = method == "eagle3" or "input_layernorm.weight" in state  # (speculators' `layernorms`)
        if not self.input_norm:
            state["input_layernorm.weight"] = torch.ones(cfg.hidden_size)  # (unused: no input norm)
        layer.load_state_dict({k: v for k, v in state.items() if k != "hidden_norm.weight"})
        self.layer, self.rotary = layer.eval(), transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(cfg)
        self.prefix, self.more = prefix, []
        for i in range(1, cfg.num_hidden_layers):  # further layers: Llama's
            more = transformers.models.llama.modeling_llama.LlamaDecoderLayer(cfg, layer_idx=i)
            more.load_state_dict({k[len(f"layers.{i}."):]: v for k, v in self.w.items() if k.startswith(f"layers.{i}.")})
            self.more.append(more.eval())

    def _norm(self, x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * w

    def _run(self, rows):
        """The head over rows of (token, hidden state) at positions 0..n-1, causal: its outputs [n, E]."""
        ids = torch.tensor([t for t, _ in rows])
        prev = torch.stack([h for _, h in rows])
        n = len(rows)
        pos = torch.arange(n)[None]
        rot = self.rotary(prev[None], pos)
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        layer = self.layer
        if self.method == "eagle3":
            emb = self.w.get("embed_tokens.weight", self.target.model.embed_tokens.weight)[ids]
            hidden = self._norm(prev, self.w[self.prefix + "hidden_norm.weight"])
            x = torch.cat([layer.input_layernorm(emb), hidden], -1)
            attn = layer.self_attn(x[None], position_embeddings=rot, attention_mask=mask)[0][0]
            r = (hidden if self.before else prev) + attn  # (`norm_before_residual`: the normed hidden state)
        else:
            emb = self.target.model.embed_tokens.weight[ids]
            if "embedding_layernorm.weight" in self.w:  # a HASS head's norms of both halves; speculators' of one
                emb = self._norm(emb, self.w["embedding_layernorm.weight"])
            if "hidden_states_layernorm.weight" in self.w:
                prev = self._norm(prev, self.w["hidden_states_layernorm.weight"])
            r = torch.cat([emb, prev], -1) @ self.w["fc.weight"].T + self.w["fc.bias"]
            a = layer.input_layernorm(r) if self.input_norm else r
            r = r + layer.self_attn(a[None], position_embeddings=rot, attention_mask=mask)[0][0]
        x = r + layer.mlp(layer.post_attention_layernorm(r))
        for more in self.more:
            out = more(x[None], attention_mask=mask, position_ids=pos, position_embeddings=rot)
            x = (out[0] if isinstance(out, tuple) else out)[0]
        return x

    def _draft(self, out):
        if self.method == "eagle":
            if "pre_lm_head_layernorm.weight" in self.w:  # (speculators' `layernorms`)
                out = self._norm(out, self.w["pre_lm_head_layernorm.weight"])
            return int(torch.argmax(out @ self.target.lm_head.weight.T))
        d = int(torch.argmax(self._norm(out, self.w["norm.weight"]) @ self.w["lm_head.weight"].T))
        return d + int(self.w["d2t"][d]) if "d2t" in self.w else d

    def rows(self, context: list[int]) -> list[tuple]:
        """The head's inputs at the positions of `context` but its last: (the next token, the hidden state read)."""
        with torch.no_grad():
            out = self.target.model(torch.tensor([context[:-1]]), output_hidden_states=True)
        if self.method == "eagle3":
            h = torch.cat([out.hidden_states[j][0] for j in self.aux], -1) @ self.w["fc.weight"].T
        else:
            h = out.last_hidden_state[0]  # normed
        return [(context[i + 1], h[i]) for i in range(len(context) - 1)]

    def drafts(self, context: list[int], k: int) -> list[int]:
        """The k drafts after `context` (its last token not yet computed by the target)."""
        rows = self.rows(context)
        with torch.no_grad():
            drafts = []
            for _ in range(k):
                g = self._run(rows)[-1]
                drafts.append(self._draft(g))
                rows.append((drafts[-1], g))
            return drafts


def save_head(kind: str, path, target, layers: int = 1, hass: bool = False, layernorms: bool = True,
              aux: tuple[int, ...] | None = None) -> Reference:
    """A head of `kind` (`HEADS`) for `target` at `path`, of `layers` decoder layers (`hass`: an EAGLE head with
    HASS' norms of the embedding and the hidden state; `layernorms`: speculators' EAGLE head with its norms): it
    mostly drafts the token it reads again (its `fc` passes the hidden state entering the target's last layer, led by
    the token's embedding; `aux`: the target's layers an EAGLE-3 head reads, by default three of `_target`'s five)."""
    E, V = target.config.hidden_size, target.config.vocab_size
    rng = np.random.default_rng({"eagle3": 7, "eagle3_speculators": 8, "eagle": 9, "eagle_speculators": 10}[kind])
    layer_cfg = dict(hidden_size=E, intermediate_size=80, num_attention_heads=4, num_key_value_heads=2,
                     rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=256, vocab_size=V,
                     num_hidden_layers=layers)
    Hq, Hkv, D = 4, 2, E // 4
    r = lambda *shape, s=0.15: (s * rng.standard_normal(shape)).astype(np.float32)  # noqa: E731
    norm = lambda: (1 + 0.2 * rng.standard_normal(E)).astype(np.float32)  # noqa: E731
    method = "eagle3" if kind.startswith("eagle3") else "eagle"
    width = 2 * E if method == "eagle3" else E
    layer = {"self_attn.q_proj.weight": r(Hq * D, width), "self_attn.k_proj.weight": r(Hkv * D, width),
             "self_attn.v_proj.weight": r(Hkv * D, width), "self_attn.o_proj.weight": r(E, Hq * D, s=0.05),
             "mlp.gate_proj.weight": r(80, E), "mlp.up_proj.weight": r(80, E), "mlp.down_proj.weight": r(E, 80, s=0.01),
             "post_attention_layernorm.weight": norm()}
    embed = target.model.embed_tokens.weight.detach().numpy()
    if method == "eagle3":
        layer.update({"input_layernorm.weight": norm(), "hidden_norm.weight": norm()})
        aux = aux or ((1, 3, LAYERS - 1) if kind == "eagle3" else (2, 3, LAYERS - 1))
        fc = np.concatenate([r(E, E, s=0.02), r(E, E, s=0.02), np.eye(E, dtype=np.float32)], 1)
        keep = np.asarray([i for i in range(V) if not 20 <= i < 38])  # (ids the target writes here kept)
        w = {"fc.weight": fc, "norm.weight": norm(), "lm_head.weight": embed[keep].copy(),
             "d2t": (keep - np.arange(len(keep))).astype(np.int64), "t2d": np.isin(np.arange(V), keep)}
        if kind == "eagle3":
            w["embed_tokens.weight"] = (embed + r(V, E, s=0.02)).astype(np.float32)
            w.update({f"midlayer.{k}": v for k, v in layer.items()})
            config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", **layer_cfg,
                      "draft_vocab_size": len(keep), "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux)}}
        else:
            w.update({f"layers.0.{k}": v for k, v in layer.items()})
            config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                      "transformer_layer_config": {"model_type": "llama", **layer_cfg}, "draft_vocab_size": len(keep),
                      "norm_before_residual": True, "target_hidden_size": E, "eagle_aux_hidden_state_layer_ids": aux,
                      "speculators_config": {"algorithm": "eagle3", "num_speculative_tokens": 3}}
    else:
        aux = ()
        fc = np.concatenate([np.eye(E), r(E, E, s=0.005)], 1).astype(np.float32)  # (the hidden state: normed)
        w = {"fc.weight": fc, "fc.bias": r(E, s=0.01), **{f"layers.0.{k}": v for k, v in layer.items()}}
        config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **layer_cfg, "add_para_norm": hass}
        if hass:
            w.update({"embedding_layernorm.weight": norm(), "hidden_states_layernorm.weight": norm()})
        if kind == "eagle_speculators":  # (its tensors saved under speculators' names below)
            config = {"architectures": ["EagleSpeculator", "LlamaDecoderLayer"], "speculators_model_type": "eagle",
                      "transformer_layer_architecture": "LlamaDecoderLayer", "layernorms": layernorms,
                      "fusion_bias": True, "transformer_layer_config": {"model_type": "llama", **layer_cfg},
                      "speculators_config": {"algorithm": "eagle", "num_speculative_tokens": 3}}
            if layernorms:
                w.update({"embedding_layernorm.weight": norm(), "layers.0.input_layernorm.weight": norm(),
                          "pre_lm_head_layernorm.weight": norm()})
    for i in range(1, layers):
        w.update({f"layers.{i}.{k}": r(*v.shape) if v.ndim == 2 else norm() for k, v in layer.items()
                  if k != "hidden_norm.weight"})
        w.update({f"layers.{i}.{k}": r(E, Hq * D if "q" in k else Hkv * D).T.copy() for k in (
            "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")})
        w[f"layers.{i}.input_layernorm.weight"] = norm()
    os.makedirs(path, exist_ok=True)
    if kind == "eagle":  # (as the EAGLE releases ship it)
        torch.save({k: torch.from_numpy(v) for k, v in w.items()}, os.path.join(path, "pytorch_model.bin"))
    elif kind == "eagle_speculators":
        renamed = {"fc.": "fusion_fc.", "layers.0.": "transformer."}
        save_file({next((new + k[len(old):] for old, new in renamed.items() if k.startswith(old)), k): v
                   for k, v in w.items()}, os.path.join(path, "model.safetensors"))
    else:
        save_file(w, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return Reference(target, method, w, layer_cfg, aux, before=kind == "eagle3_speculators")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("eagle_target")
    return str(path), _target(path)


@pytest.fixture(scope="module", params=HEADS)
def head(request, target, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    ref = save_head(request.param, path, target[1])
    return request.param, path, ref


def _spec(kind: str, path: str, k: int = 3) -> dict:
    return {"method": "eagle3" if kind.startswith("eagle3") else "eagle", "model": path, "num_speculative_tokens": k}


@functools.cache
def _plain(path: str) -> dict[str, list[int]]:
    return _serve(LLMEngine(EngineArgs(model=path, **ARGS), progress=False), PROMPTS)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_forward_keeps_the_hidden_states_entering_layers(target, family, tmp_path):
    """`forward(aux_layers=...)`: the hidden states entering the named layers, side by side, as transformers' hidden
    states give them (layer 0's: the embeddings), in order and repeated as named: scanned, unrolled, and looped over
    groups of layers (Gemma 2's windowed and global layers)."""
    import jax

    from jaxserve.engine.model_loading import load_model
    from jaxserve.models.inputs import KVCache, ModelInputs
    from jaxserve.models.llama import forward
    from jaxserve.models.unstack import unstack_layers
    from tests.test_model_families import FAMILIES

    path, model = target
    if family == "gemma2":
        path = str(tmp_path)
        model = save_tiny_hf(FAMILIES[family][0], path, num_hidden_layers=LAYERS, **FAMILIES[family][1])
        _with_tokenizer(path)
    loaded = load_model(EngineArgs(model=path, dtype="float32"), progress=False)
    assert loaded.config.uniform_layers is (family == "llama")
    prompt = list(range(3, 20))
    with torch.no_grad():
        hs = model.model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    layers = (3, 0, LAYERS - 1, 3)
    want = np.concatenate([hs[j][0].numpy() for j in layers], -1)
    inputs = ModelInputs.build([(prompt, 0, [1, 2, 3])], 8)
    step = jax.jit(functools.partial(forward, return_hidden=True, aux_layers=layers), static_argnums=(3, 4))
    layouts = [loaded.params] if family == "gemma2" else [loaded.params, unstack_layers(loaded.params),
                                                          unstack_layers(loaded.params, fuse=True)]
    for params in layouts:
        kv = KVCache.allocate(loaded.config, 8, 8, np.float32, as_bits=True)
        logits, _, last, aux = step(params, kv, inputs, loaded.config, "xla")
        np.testing.assert_allclose(np.asarray(aux)[:len(prompt)], want, rtol=1e-4, atol=1e-4)
        plain = jax.jit(forward, static_argnums=(3, 4))(params, kv, inputs, loaded.config, "xla")[0]
        np.testing.assert_allclose(np.asarray(logits), np.asarray(plain), rtol=1e-5, atol=1e-5)


def test_head_outputs_equal_the_reference(target, head):
    """The head over a context, from the hidden states the target's forward keeps: its outputs at every position
    (within 1e-4) and its drafts (ids of the target's vocabulary) equal the reference's."""
    _same_outputs(target, head)


@pytest.mark.parametrize("kind", ["eagle3_speculators", "eagle"])
def test_heads_of_two_layers(target, kind, tmp_path):
    """Heads of two decoder layers (the second a Llama layer over the first's outputs): the reference's outputs."""
    _same_outputs(target, (kind, str(tmp_path), save_head(kind, str(tmp_path), target[1], layers=2)))


def test_a_hass_head(target, tmp_path):
    """An EAGLE head trained by HASS (`add_para_norm`: the embedding and the hidden state normed before `fc`)."""
    _same_outputs(target, ("eagle", str(tmp_path), save_head("eagle", str(tmp_path), target[1], hass=True)))


def test_a_speculators_eagle_head_without_its_norms(target, tmp_path):
    """speculators' EAGLE head with `layernorms` false: the EAGLE releases' head under speculators' names."""
    ref = save_head("eagle_speculators", str(tmp_path), target[1], layernorms=False)
    _same_outputs(target, ("eagle_speculators", str(tmp_path), ref))


def _same_outputs(target, head):
    import jax.numpy as jnp

    from jaxserve.engine.eagle import _read
    from jaxserve.engine.model_loading import load_model
    from jaxserve.models.eagle import eagle_forward
    from jaxserve.models.inputs import KVCache, ModelInputs
    from jaxserve.models.llama import forward

    kind, path, ref = head
    loaded = load_model(EngineArgs(model=target[0], dtype="float32"), progress=False)
    ecfg, params = _read(path, _spec(kind, path)["method"], loaded.config, loaded.params, jnp.float32)
    context = [*range(3, 20), 7, 7]
    n = len(context) - 1
    inputs = ModelInputs.build([(context[:-1], 0, [1, 2, 3])], 8, all_logits=True)
    kv = KVCache.allocate(loaded.config, 8, 8, np.float32, as_bits=True)
    _, _, last, *aux = forward(loaded.params, kv, inputs, loaded.config, "xla", return_hidden=True,
                               aux_layers=ecfg.aux_layers)
    head_kv = KVCache.allocate(ecfg.model, 8, 8, np.float32, as_bits=True)
    head_inputs = ModelInputs.build([(context[1:], 0, [1, 2, 3])], 8, all_logits=True)
    ids, _, out = eagle_forward(params, head_kv, head_inputs, aux[0] if aux else last, ecfg, "xla", True)
    with torch.no_grad():
        want = ref._run(ref.rows(context))
        drafts = [ref._draft(want[i]) for i in range(n)]
    np.testing.assert_allclose(np.asarray(out)[:n], want.numpy(), rtol=1e-4, atol=1e-4)
    assert np.asarray(ids)[:n].tolist() == drafts


# (the releases' EAGLE head drafts through the engine as speculators' does: its outputs are checked above)
@pytest.mark.parametrize("head", ["eagle3", "eagle3_speculators", "eagle_speculators"], indirect=True)
def test_drafts_equal_the_reference_and_outputs_the_targets(target, head, monkeypatch):
    kind, path, ref = head
    # (speculators' configs named by the model alone, as vLLM reads them)
    spec = {"model": path, "num_speculative_tokens": 3} if kind.endswith("_speculators") else _spec(kind, path)
    engine = LLMEngine(EngineArgs(model=target[0], speculative_config=spec, enable_prefix_caching=True, **ARGS),
                       progress=False)
    assert isinstance(engine.draft, EagleDraft) and engine.runner.cfg.keep_hidden
    assert engine.runner.cfg.hidden_layers == ref.aux
    check_drafts(engine, EagleDraft, monkeypatch, _plain(target[0]), ref.drafts, 3)


@pytest.mark.parametrize("head", ["eagle3"], indirect=True)
@pytest.mark.parametrize("k", [1, 2])
def test_warmed_up_sampled_and_preempted(target, head, k):
    """Warmed up with compiles refused after, greedy, seeded and penalized requests with logprobs, in a pool small
    enough to preempt: the outputs of decoding without drafts. One draft a step (k = 1) runs no drafting loop."""
    from jaxserve.loader import HFDirectory
    from jaxserve.models.inputs import KVCache

    kind, path, _ = head
    page = KVCache.bytes_per_page(HFDirectory(target[0], weights=False).config(), ARGS["page_size"], np.float32)
    args = {**ARGS, "warmup": True, "strict_compile": True, "kv_cache_memory_bytes": 20 * page}
    prompts = [PROMPTS[0], PROMPTS[2], [9, 8, 7, 6, 5, 4, 3]]
    want = _serve_all(LLMEngine(EngineArgs(model=target[0], **args), progress=False), prompts)
    engine = LLMEngine(EngineArgs(model=target[0], speculative_config=_spec(kind, path, k), **args), progress=False)
    assert (engine.draft._draft is None) is (k == 1)
    engine.drafter.costs = None  # (every draft the step has room for verified: on the CPU the costs draft little)
    _same(want, _serve_all(engine, prompts))
    assert engine.num_preemptions > 0
    assert engine.drafter.counters.spec_num_accepted_tokens > 5
    assert engine.draft.compilations_after_warmup == 0 and engine.runner.compilations_after_warmup == 0
    engine.check_integrity()


@pytest.mark.parametrize("head", ["eagle"], indirect=True)
def test_sleeps_and_wakes_with_the_engine(target, head):
    """Sleep mode frees the head's weights and pool with the model's; awake (from the host copy at level 1, read
    again at level 2), it drafts as before."""
    kind, path, _ = head
    engine = LLMEngine(EngineArgs(model=target[0], speculative_config=_spec(kind, path), enable_sleep_mode=True,
                                  **ARGS), progress=False)
    want = _serve(engine, PROMPTS)
    assert want == _plain(target[0])
    sleep_and_wake(engine, want)


def test_config_and_refusals(target, tmp_path):
    path, model = target
    head = str(tmp_path / "head")
    save_head("eagle3", head, model)
    assert SpeculativeConfig.parse({"method": "eagle3", "model": head}).method == "eagle3"
    with pytest.raises(ValueError, match="speculative method 'eagle3' needs the draft model"):
        SpeculativeConfig(method="eagle3")
    with pytest.raises(ValueError, match="'eagle' takes no quantization"):
        SpeculativeConfig(method="eagle", model=head, quantization="fp8")

    def engine(spec_head: str, method: str = "eagle3") -> LLMEngine:
        return LLMEngine(EngineArgs(model=path, speculative_config={"method": method, "model": spec_head}, **ARGS),
                         progress=False)

    with pytest.raises(ValueError, match="is an EAGLE-3 head; use speculative method 'eagle3', not 'eagle'"):
        engine(head, "eagle")

    def edited(name: str, tensors=None, **changes) -> str:
        import shutil

        out = str(tmp_path / name)
        shutil.copytree(head, out)
        with open(os.path.join(out, "config.json")) as f:
            config = json.load(f)
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump({**config, **changes}, f)
        if tensors is not None:
            weights = os.path.join(out, "model.safetensors")
            save_file(tensors(load_file(weights)), weights)
        return out

    default = engine(edited("default", eagle_config={}))
    assert default.runner.cfg.hidden_layers == (2, LAYERS // 2, LAYERS - 3)  # (vLLM's choice: here layer 2 thrice)
    assert _serve(default, PROMPTS[:1]) == {"0": _plain(path)["0"]}
    with pytest.raises(ValueError, match="reads hidden states 32 wide; the served model's are 64"):
        engine(edited("narrow", target_hidden_size=32))
    with pytest.raises(ValueError, match="vocabulary of 100 ids; the served model's has 160"):
        engine(edited("vocab", vocab_size=100))
    with pytest.raises(ValueError, match=rf"eagle_aux_hidden_state_layer_ids \[1, 9\] must be layers of the served "
                                         rf"model \(0 to {LAYERS}\)"):
        engine(edited("aux", eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 9]}))
    with pytest.raises(CheckpointError, match=r"fc.weight has shape \(64, 128\), expected \(64, 192\)"):
        engine(edited("fc", tensors=lambda t: {**t, "fc.weight": t["fc.weight"][:, :128]}))
    with pytest.raises(CheckpointError, match="missing layers.0.mlp.up_proj.weight"):
        engine(edited("layer", tensors=lambda t: {k: v for k, v in t.items() if k != "midlayer.mlp.up_proj.weight"}))
    with pytest.raises(CheckpointError, match="d2t does not map its"):
        engine(edited("d2t", tensors=lambda t: {**t, "d2t": t["d2t"] + 200}))
    with pytest.raises(ValueError, match="reads the head from a directory"):
        engine(os.path.join(head, "model.safetensors"))
