"""LoRA on a MoE model's experts (`engine.lora_experts`): PEFT's adapter on the fused expert parameters
(`target_parameters`, with attention targets beside them) gives PEFT's prompt logprobs and greedy tokens; the same
weights written per expert (as PEFT writes them for models whose experts are modules) give the same tokens; an
adapter request, another adapter's and the base model's share one batch; what cannot be served is refused, named."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from jaxserve.engine.llm_engine import LLMEngine  # noqa: E402
from jaxserve.engine.lora_manager import LoRAError  # noqa: E402
from jaxserve.engine_args import EngineArgs  # noqa: E402
from jaxserve.sampling_params import SamplingParams  # noqa: E402
from tests.fake_model import save_fake_tokenizer  # noqa: E402
from tests.test_lora import (  # noqa: E402
    GLM4_MOE,
    PEFT_ARGS,
    VOCAB,
    _adapter,
    adapter_equals_peft,
    hf_prompt_logprobs,
    prompt,
    run,
)
from tests.test_mimo import TINY as MIMO  # noqa: E402
from tests.test_model_families import save_tiny_hf  # noqa: E402

X, F = 8, 32  # experts, their width
QWEN2_MOE = dict(num_experts=X, num_experts_per_tok=2, moe_intermediate_size=F, shared_expert_intermediate_size=40,
                 norm_topk_prob=False)
FUSED = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """(base directory, {adapter: (path, its PEFT model)}, the base HF model)."""
    import transformers

    root = tmp_path_factory.mktemp("lora_experts")
    base = str(root / "base")
    save_tiny_hf("Qwen2MoeConfig", base, vocab_size=VOCAB, **QWEN2_MOE)
    save_fake_tokenizer(base)
    specs = {"experts": dict(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"], target_parameters=FUSED),
             # down_proj listed first: PEFT before 0.22 nests it innermost (0.22 in no fixed order)
             "down": dict(r=2, lora_alpha=6, target_modules=[], target_parameters=FUSED[::-1])}
    adapters = {}
    for seed, (name, spec) in enumerate(specs.items()):
        hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        adapters[name] = (str(root / name), _adapter(hf, str(root / name), seed + 20, **spec))
    return base, adapters, transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()


def _per_expert(fused: str, out: str, r: int) -> None:
    """The adapter at `fused` written per expert (`layers.N.mlp.experts.E.gate_proj.lora_A.weight` ...)."""
    from safetensors.numpy import load_file, save_file

    cfg = json.load(open(os.path.join(fused, "adapter_config.json")))
    tensors, weights = {}, load_file(os.path.join(fused, "adapter_model.safetensors"))
    for name, w in weights.items():
        if ".experts." not in name:
            tensors[name] = w
            continue
        head, tail = name.split(".experts.")
        # (told by A's input, as PEFT 0.22 saves target_parameters in no fixed order: which is nested in which)
        param = "down_proj" if weights[name.replace("lora_B", "lora_A")].shape[1] == F else "gate_up_proj"
        which = tail[-len("lora_A.weight"):]
        for e in range(X):
            if which.startswith("lora_A"):
                parts = {"gate_proj": w.reshape(X, r, -1)[e], "up_proj": w.reshape(X, r, -1)[e]} \
                    if param == "gate_up_proj" else {"down_proj": w.reshape(X, r, -1)[e]}
            else:
                b = w.reshape(w.shape[0], r, X)[:, :, e]
                parts = {"gate_proj": b[:F], "up_proj": b[F:]} if param == "gate_up_proj" else {"down_proj": b}
            for module, t in parts.items():
                tensors[f"{head}.experts.{e}.{module}.{which}"] = np.ascontiguousarray(t)
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "adapter_model.safetensors"))
    json.dump({**cfg, "target_parameters": None, "target_modules": [*cfg["target_modules"], "gate_proj", "up_proj",
                                                                    "down_proj"]},
              open(os.path.join(out, "adapter_config.json"), "w"))


def test_expert_adapters_equal_peft_in_one_batch(moe, tmp_path):
    base, adapters, hf_base = moe
    _per_expert(adapters["experts"][0], str(tmp_path / "per_expert"), r=4)
    engine = LLMEngine(EngineArgs(model=base, lora_modules=(("experts", adapters["experts"][0]),
                                                            ("down", adapters["down"][0]),
                                                            ("per_expert", str(tmp_path / "per_expert"))), **PEFT_ARGS),
                       progress=False)
    layers = engine.runner.params.layers  # (unrolled on the CPU)
    assert (layers[0] if isinstance(layers, tuple) else layers).lora.ae_gate_up is not None
    ids = prompt(40, 3)
    p = SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=0, ignore_eos=True)
    out = run(engine, {"a": (ids, p, "experts"), "d": (ids, p, "down"), "base": (ids, p, None)})
    for rid, model in {"a": adapters["experts"][1], "d": adapters["down"][1], "base": hf_base}.items():
        got = np.array([e[t].logprob for e, t in zip(out[rid].prompt_logprobs[1:], ids[1:], strict=True)])
        np.testing.assert_allclose(got, hf_prompt_logprobs(model, ids), atol=3e-5, err_msg=rid)
        with torch.no_grad():
            greedy = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, min_new_tokens=6,
                                    pad_token_id=0)[0, len(ids):].tolist()
        assert out[rid].outputs[0].token_ids == greedy, rid
    assert len({tuple(out[r].outputs[0].token_ids) for r in out}) == 3
    alone = run(engine, {"pe": (ids, p, "per_expert")})["pe"]
    assert alone.outputs[0].token_ids == out["a"].outputs[0].token_ids
    np.testing.assert_allclose([e[t].logprob for e, t in zip(alone.prompt_logprobs[1:], ids[1:], strict=True)],
                               [e[t].logprob for e, t in zip(out["a"].prompt_logprobs[1:], ids[1:], strict=True)],
                               atol=1e-5)
    engine.check_integrity()


def test_a_glm4_moe_adapter_on_its_experts_down_projections(tmp_path):
    """GLM-4.5 (a dense first layer stacked apart, shared experts, grouped sigmoid routing): PEFT turns
    `target_modules=["down_proj"]` into the experts' `down_proj` alone (`target_parameters`); PEFT's logprobs."""
    import transformers

    base = str(tmp_path / "glm")
    save_tiny_hf("Glm4MoeConfig", base, vocab_size=VOCAB, **GLM4_MOE)
    save_fake_tokenizer(base)
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = _adapter(hf, str(tmp_path / "down"), 4, r=2, lora_alpha=4, target_modules=["down_proj"])
    assert json.load(open(tmp_path / "down" / "adapter_config.json"))["target_parameters"] == ["down_proj"]
    engine = LLMEngine(EngineArgs(model=base, lora_modules=(("down", str(tmp_path / "down")),), layer_loop="scan",
                                  **PEFT_ARGS), progress=False)
    ids = prompt(30, 5)
    out = run(engine, {"a": (ids, SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=0, ignore_eos=True),
                             "down")})["a"]
    got = np.array([e[t].logprob for e, t in zip(out.prompt_logprobs[1:], ids[1:], strict=True)])
    np.testing.assert_allclose(got, hf_prompt_logprobs(model, ids), atol=3e-5)


# Adapters on a MoE model's every other linear layer (the layer loop each runs). Qwen2-MoE: PEFT's "all-linear" (the attention, the shared expert
# and its sigmoid gate), the router and the fused experts named as parameters. GLM-4.5: PEFT moves the usual list's
# gate/up/down to the fused experts (gate_up_proj at rank 2 r: `rank_pattern`), the sigmoid router's weight named as a
# parameter; the dense first layer's MLP and the shared experts' projections added as adapters of transformers 4's
# modules hold them (`_module_lora`).
EVERY_LINEAR = {
    "qwen2_moe": ("Qwen2MoeConfig", QWEN2_MOE, "unroll", dict(target_modules="all-linear",
                                                    target_parameters=[*FUSED, "mlp.gate.weight"])),
    "glm4_moe": ("Glm4MoeConfig", GLM4_MOE, "scan", dict(target_modules=["q_proj", "v_proj", "gate_proj", "up_proj",
                                                                          "down_proj"],
                                                 target_parameters=["mlp.gate.weight"])),
    # MiMo-V2-Flash: its attention held uniform (`test_lora`), its dense first layer, router and experts.
    "mimo_v2_flash": ("MiMoV2FlashConfig", MIMO, "unroll", dict(target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        target_parameters=["mlp.gate.weight", *FUSED])),
}


def _module_lora(model, path: str, modules: list[str], seed: int) -> None:
    """LoRA pairs on `modules` (of the PEFT `model`'s base, "model.layers.0.mlp.gate_proj") added to the adapter at
    `path` at its rank and alpha, and merged into `model`'s weights (W + alpha / r B A: LoRA's effect on a linear
    layer), so `model` stays the reference. A module PEFT adapted itself is left as it is (PEFT 0.22 keeps the
    dense layers' and shared experts' projections among `target_modules` beside the experts' fused parameters)."""
    from safetensors.numpy import load_file, save_file

    cfg = json.load(open(os.path.join(path, "adapter_config.json")))
    tensors = load_file(os.path.join(path, "adapter_model.safetensors"))
    rng, r = np.random.default_rng(seed), cfg["r"]
    for name in modules:
        linear = model.get_submodule("base_model.model." + name)
        if hasattr(linear, "lora_A"):
            continue
        a = rng.normal(0, 0.2, (r, linear.in_features)).astype(np.float32)
        b = rng.normal(0, 0.2, (linear.out_features, r)).astype(np.float32)
        tensors[f"base_model.model.{name}.lora_A.weight"], tensors[f"base_model.model.{name}.lora_B.weight"] = a, b
        with torch.no_grad():
            linear.weight += torch.from_numpy(b @ a) * (cfg["lora_alpha"] / r)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))


@pytest.mark.parametrize("family", list(EVERY_LINEAR))
def test_router_shared_expert_and_dense_layer_adapters_equal_peft(tmp_path, family):
    """An adapter on a MoE model's router, shared expert and dense first layer's MLP (beside its attention and
    experts) gives PEFT's prompt logprobs and greedy tokens, in one batch with the base model (GLM-4.5 scanned: its
    dense first layer in its own stack)."""
    import transformers

    config_cls, settings, loop, targets = EVERY_LINEAR[family]
    base = str(tmp_path / family)
    save_tiny_hf(config_cls, base, vocab_size=VOCAB, **settings)
    save_fake_tokenizer(base)
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    path = str(tmp_path / "all")
    model = _adapter(hf, path, 7, r=4, lora_alpha=8, **targets)
    if family == "glm4_moe":
        assert json.load(open(os.path.join(path, "adapter_config.json")))["rank_pattern"] == {r".*\.gate_up_proj": 8}
        _module_lora(model, path, [f"model.layers.{i}.mlp.{m}_proj" for i in (0,) for m in ("gate", "up", "down")]
                     + [f"model.layers.{i}.mlp.shared_experts.{m}_proj" for i in (1, 2) for m in ("gate", "up", "down")],
                     8)
    from safetensors.numpy import load_file

    names = set(load_file(os.path.join(path, "adapter_model.safetensors")))
    wanted = {"qwen2_moe": ("1.mlp.gate.", "shared_expert.up_proj", "shared_expert_gate", "experts.lora_A"),
              "glm4_moe": ("1.mlp.gate.", "experts.base_layer.lora_A", "0.mlp.gate_proj", "shared_experts.up_proj"),
              "mimo_v2_flash": ("1.mlp.gate.", "experts", "0.mlp.gate_proj", "o_proj")}[family]
    assert all(any(w in n for n in names) for w in wanted), sorted(names)
    engine = LLMEngine(EngineArgs(model=base, lora_modules=(("all", path),), layer_loop=loop, **PEFT_ARGS),
                       progress=False)
    adapter_equals_peft(engine, model, "all", 11, atol=3e-5)
    engine.check_integrity()


def test_what_experts_cannot_take_is_refused(moe, tmp_path):
    import transformers

    from jaxserve.engine.lora_manager import read_adapter
    from jaxserve.loader import open_checkpoint

    base, adapters, _ = moe
    cfg = open_checkpoint(base, weights=False).config()
    read = lambda path, c=cfg, **kw: read_adapter(path, c, 8, np.float32, **kw)  # noqa: E731
    assert read(adapters["down"][0])["be_down"].any()
    # A parameter named twice (PEFT 0.22: "mlp.experts.down_proj" as given, "down_proj" from "all-linear") is one.
    twice = str(tmp_path / "twice")
    shutil.copytree(adapters["down"][0], twice)
    with open(os.path.join(twice, "adapter_config.json")) as f:
        ac = json.load(f)
    assert sorted(ac["target_parameters"]) == sorted(FUSED), ac["target_parameters"]
    ac["target_parameters"] += ["down_proj", "gate_up_proj", "gate.weight"]
    with open(os.path.join(twice, "adapter_config.json"), "w") as f:
        json.dump(ac, f)
    once, again = read(adapters["down"][0]), read(twice)
    assert once.keys() == again.keys() and all(np.array_equal(once[k], again[k]) for k in once)
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    _adapter(hf, str(tmp_path / "q"), 3, r=2, target_modules=[],
             target_parameters=["mlp.experts.down_proj", "self_attn.q_proj.weight"])
    with pytest.raises(LoRAError, match="name other parameters than the experts' gate_up_proj and down_proj"):
        read(str(tmp_path / "q"))
    dense = str(tmp_path / "dense")
    save_tiny_hf("LlamaConfig", dense, vocab_size=VOCAB)
    with pytest.raises(LoRAError, match="adapts experts; llama's model has none"):
        read(adapters["experts"][0], open_checkpoint(dense, weights=False).config())


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_latent_attention_adapters_equal_peft(tmp_path, family):
    """PEFT's "all-linear" adapter on DeepSeek-V2 (queries projected directly) and -V3 (a query bottleneck: q_a_proj
    normed, then q_b_proj): the latent attention's projections, `kv_b_proj` (applied through the absorbed key and value
    up-projections), the output projection, the router and the experts give PEFT's prompt logprobs and greedy tokens,
    in one batch with the base model, whose own are transformers'."""
    import transformers

    from tests.test_mla import FAMILIES

    config_cls, settings = FAMILIES[family]
    base = str(tmp_path / family)
    save_tiny_hf(config_cls, base, vocab_size=VOCAB, **settings)
    save_fake_tokenizer(base)
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    path = str(tmp_path / "all")
    model = _adapter(hf, path, 5, r=4, lora_alpha=8, target_modules="all-linear")
    from safetensors.numpy import load_file

    names = set(load_file(os.path.join(path, "adapter_model.safetensors")))
    wanted = ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "experts.lora_A", "mlp.gate."]
    wanted += ["q_a_proj", "q_b_proj"] if family == "deepseek_v3" else ["self_attn.q_proj"]
    assert all(any(w in n for n in names) for w in wanted), sorted(names)
    loop = "unroll" if family == "deepseek_v2" else "scan"
    engine = LLMEngine(EngineArgs(model=base, lora_modules=(("all", path),), layer_loop=loop, **PEFT_ARGS),
                       progress=False)
    out = adapter_equals_peft(engine, model, "all", 13, atol=3e-5)
    ids, base_model = prompt(40, 13), transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    got = np.array([e[t].logprob for e, t in zip(out["base"].prompt_logprobs[1:], ids[1:], strict=True)])
    np.testing.assert_allclose(got, hf_prompt_logprobs(base_model.eval(), ids), atol=3e-5)
    engine.check_integrity()
