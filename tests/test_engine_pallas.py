"""The whole engine on the Pallas attention kernels against the `xla` backend.

A tiny random-weight Llama served by `LLMEngine` twice, once per backend: chunked prefills, a prefill that
reuses cached prefix pages, mixed prefill + decode steps and on-device decode loops must give the same
greedy tokens. On the CPU the generic kernel runs in interpret mode; on a GPU (bench/gpu_engine.sh) the kernels
are compiled, through the Triton lowering (`pallas`) and on the Mosaic GPU kernels (`pallas_mosaic`, in bfloat16
with 64-wide heads, the shapes they take). Also keeps the SmolLM2 shapes of the deviceless sm_90 engine compile in step with the bundled GGUF.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import ModelConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.model_loading import LoadedModel
from jaxserve.engine_args import EngineArgs
from jaxserve.models.inputs import KVCache
from jaxserve.models.params import ParamInfo, Params, declare_params
from jaxserve.sampling_params import SamplingParams
from tests.fake_model import VOCAB, fake_tokenizer
from tests.gpu_compile.test_compile_engine import RC, SMOLLM2

# Power-of-two head_dim (the Pallas kernel's requirement), GQA group 2, two layers so the layer offset into
# the merged page pool is exercised.
CFG = ModelConfig(
    family="llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0, max_position_embeddings=256,
    tie_word_embeddings=True,
)
PAGE_SIZE = 8
NUM_PAGES = 40
ARGS = EngineArgs(
    max_num_seqs=4, max_num_batched_tokens=16, max_model_len=96, page_size=PAGE_SIZE,
    kv_cache_memory_bytes=NUM_PAGES * KVCache.bytes_per_page(CFG, PAGE_SIZE, jnp.float32),
    num_scheduler_steps=4, dtype="float32", warmup=False, compile_cache_dir=None,
)


GPU = jax.default_backend() == "gpu"
# The Mosaic GPU kernels' shapes: bfloat16, head_dim a multiple of 64.
CFG_BF16 = dataclasses.replace(CFG, head_dim=64)
ARGS_BF16 = ARGS.replace(dtype="bfloat16", kv_cache_memory_bytes=NUM_PAGES * KVCache.bytes_per_page(
    CFG_BF16, PAGE_SIZE, jnp.bfloat16))


def numpy_params(cfg: ModelConfig, seed: int, scale: float) -> Params:
    """Random weights from the parameter declaration, drawn by numpy (no XLA compile for the init)."""
    rng = np.random.default_rng(seed)

    def draw(info: ParamInfo) -> jax.Array:
        if info.init == "normal":
            return jnp.asarray(rng.normal(0.0, scale, info.shape).astype(np.float32))
        return jnp.full(info.shape, 1.0 if info.init == "ones" else 0.0, jnp.float32)

    return jax.tree.map(draw, declare_params(cfg), is_leaf=lambda x: isinstance(x, ParamInfo))


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    # A larger scale than a trained model's keeps the logits peaked, so greedy picks are not near-ties.
    params = numpy_params(CFG, seed=3, scale=0.3)
    return LoadedModel("tiny", "tiny-llama", CFG, params, fake_tokenizer(), jnp.float32, 0.0)


def _prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(2, VOCAB, n).tolist()


# Fewer output tokens for the runs on the interpreted Mosaic GPU kernels, whose interpreter is slow at run time:
# the same chunked, cached, mixed and batched decode steps, shorter decode loops.
SHORT = dict(a=5, b=6, c=4, d=3, e=3)


def serve(loaded: LoadedModel, backend: str, args: EngineArgs = ARGS, max_tokens: dict[str, int] | None = None,
          engines: list | None = None, logprobs: dict | None = None) -> tuple[dict[str, list[int]], list[tuple[int, int]]]:
    """Greedy outputs per request, and (prefill rows, decode rows) of every step the engine ran; `max_tokens`
    overrides the requests' output lengths; `engines` gets the engine; `logprobs` gets each request's top-2
    logprobs at every position."""
    engine = LLMEngine(args.replace(attention_backend=backend), loaded=loaded, progress=False)
    if engines is not None:
        engines.append(engine)
    assert engine.runner.cfg.backend == backend
    steps: list[tuple[int, int]] = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        plan = schedule()
        decodes = sum(s.is_decode for s in plan.scheduled)
        steps.append((len(plan.scheduled) - decodes, decodes))
        return plan

    engine.scheduler.schedule = recording_schedule
    greedy = dict(temperature=0.0, ignore_eos=True, logprobs=None if logprobs is None else 2)
    shared = _prompt(19, 0)  # two full pages that a later request finds in the prefix cache
    first = {
        "a": (shared, 9),  # a 19-token prompt: chunked over two 16-token steps
        "b": (_prompt(5, 1), 12),
        "c": (_prompt(2, 2), 7),
    }
    later = {
        "d": (shared[:16] + _prompt(6, 3), 6),  # prefill after a cached 16-token prefix
        "e": (_prompt(11, 4), 5),  # joins while the others decode: a mixed prefill + decode step
    }
    if max_tokens:
        first = {rid: (prompt, max_tokens[rid]) for rid, (prompt, _) in first.items()}
        later = {rid: (prompt, max_tokens[rid]) for rid, (prompt, _) in later.items()}
    for rid, (prompt, n) in first.items():
        engine.add_request(rid, prompt, SamplingParams(max_tokens=n, **greedy))
    final: dict[str, list[int]] = {}
    for i in range(200):
        if i == 4:
            for rid, (prompt, n) in later.items():
                engine.add_request(rid, prompt, SamplingParams(max_tokens=n, **greedy))
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.outputs[0].token_ids
                if logprobs is not None:
                    logprobs[out.request_id] = out.outputs[0].logprobs
        if i >= 4 and not engine.has_unfinished_requests():
            break
    engine.check_integrity()
    assert {rid: len(t) for rid, t in final.items()} == {
        rid: n for rid, (_, n) in (first | later).items()
    }
    return final, steps


def assert_same_outputs(loaded: LoadedModel, backend: str, args: EngineArgs = ARGS,
                        max_tokens: dict[str, int] | None = None, near_tie: float | None = None) -> None:
    """The greedy tokens of `backend` are the xla backend's. With `near_tie` (bfloat16 on a GPU, whose products
    round otherwise than XLA's), a request's tokens may part from the xla backend's at one position where its
    top two logprobs lie within `near_tie` of each other and the kernel picked the second: tokens after that
    are not compared (they continue another text)."""
    ref_lps: dict = {}
    ref, ref_steps = serve(loaded, "xla", args, max_tokens, logprobs=ref_lps if near_tie else None)
    got, steps = serve(loaded, backend, args, max_tokens)
    assert steps == ref_steps, "the schedule depends only on host state; it must not differ by backend"
    assert any(p and d for p, d in steps), f"no mixed prefill + decode step in {steps}"
    assert any(p == 0 and d > 1 for p, d in steps), f"no batched decode step in {steps}"
    assert_outputs_agree(ref, got, ref_lps, near_tie, backend)


def assert_outputs_agree(ref: dict[str, list[int]], got: dict[str, list[int]], ref_lps: dict, near_tie: float | None,
                         backend: str) -> None:
    """`got` is `ref` token for token, or (with `near_tie`) parts from it once per request where `ref`'s top two
    logprobs (`ref_lps`) lie within `near_tie` and `got` took the second, with half the tokens or more compared."""
    compared = 0
    for rid in ref:
        part = next((i for i, (a, b) in enumerate(zip(got[rid], ref[rid], strict=True)) if a != b), None)
        if part is None or not near_tie:
            assert got[rid] == ref[rid], f"request {rid}: {backend} {got[rid]} != xla {ref[rid]}"
            compared += len(ref[rid])
            continue
        top = {lp.rank: (tid, lp.logprob) for tid, lp in ref_lps[rid][part].items() if lp.rank in (1, 2)}
        gap = top[1][1] - top[2][1]
        assert got[rid][part] == top[2][0] and gap < near_tie, (
            f"request {rid} parts from xla at token {part}: {backend} {got[rid]} != xla {ref[rid]} "
            f"(xla's top two there: {top}, {gap:.3f} apart)")
        compared += part
    total = sum(len(t) for t in ref.values())
    assert compared >= total // 2, f"only {compared} of {total} tokens before the outputs part"


def test_near_tie_comparison_refuses_what_is_no_near_tie():
    """The bfloat16 comparison lets a request part at a near-tie only: not where the top two lie far apart, not
    to a third token, not before half the tokens."""
    from jaxserve.outputs import Logprob

    def lps(*tops):  # per position: (top-1 id, its logprob, top-2 id, its logprob)
        return [{a: Logprob(la, 1), b: Logprob(lb, 2)} for a, la, b, lb in tops]

    ref = {"a": [5, 6, 7, 8]}
    sure = (5, -0.1, 9, -3.0)
    near = {"a": lps(sure, sure, (7, -0.70, 3, -0.72), sure)}  # a 0.02 tie at the third token
    assert_outputs_agree(ref, {"a": [5, 6, 7, 8]}, {}, None, "k")
    assert_outputs_agree(ref, {"a": [5, 6, 3, 2]}, near, 0.1, "k")  # parts there, to the second token
    far = {"a": lps(sure, sure, (7, -0.1, 3, -2.0), sure)}
    early = {"a": lps((5, -0.70, 9, -0.72), sure, sure, sure)}  # a tie at the first token: nothing compared
    for got, lp in (({"a": [5, 6, 3, 2]}, far), ({"a": [5, 6, 4, 2]}, near), ({"a": [9, 6, 7, 8]}, early),
                    ({"a": [5, 6, 3, 2]}, None)):
        with pytest.raises(AssertionError):
            assert_outputs_agree(ref, got, lp or {}, 0.1 if lp else None, "k")


@pytest.mark.parametrize("backend", ["pallas"] if GPU else ["pallas_interpret"])
def test_pallas_engine_matches_xla(loaded, backend):
    assert_same_outputs(loaded, backend)


# The Mosaic GPU kernels under the engine on the GPU only (bench/gpu_engine.sh): interpreted they take a minute on
# 2 cores; on the CPU they are checked against the oracle per kernel and through the backend's dispatch, mixed
# batches included (tests/test_engine_pallas_mosaic.py, tests/test_kernels_mosaic_*.py), and the engine's step on
# them compiles for sm_90 (tests/gpu_compile).
@pytest.mark.parametrize("backend", ["pallas", "pallas_mosaic"] if GPU else ["pallas_interpret"])
def test_pallas_engine_matches_xla_bfloat16(backend):
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), numpy_params(CFG_BF16, seed=3, scale=0.3))
    loaded = LoadedModel("tiny", "tiny-llama", CFG_BF16, params, fake_tokenizer(), jnp.bfloat16, 0.0)
    # On a GPU the xla backend's bfloat16 products round otherwise (its probabilities stay float32): a near-tie
    # may pick the other of two tokens.
    assert_same_outputs(loaded, backend, ARGS_BF16, SHORT if "mosaic" in backend else None,
                        near_tie=0.1)


@pytest.mark.parametrize("backend", ["pallas"] if GPU else ["pallas_interpret"])
def test_pallas_engine_matches_xla_fp8_cache(loaded, backend):
    """`--kv-cache-dtype fp8`: the kernels read float8 pages (upcast in the kernel) as the xla backend does,
    here on per-layer scales calculated at start-up (folded into q and the output; scale 1 is the kernel
    tests' case)."""
    assert_same_outputs(loaded, backend, ARGS.replace(kv_cache_dtype="fp8", calculate_kv_scales=True))


def drafted_matches_xla(loaded: LoadedModel, backend: str) -> None:
    """Speculative decoding on a kernel backend with drafts verified as chunks (each drafted request one
    sequence of its token and drafts, through the prefill kernels): the xla backend's greedy tokens without
    drafts."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
            "draft_verification": "chunks"}
    ref, _ = serve(loaded, "xla")
    engines: list = []
    got, _ = serve(loaded, backend, ARGS.replace(speculative_config=spec), engines=engines)
    assert got == ref
    assert engines[0].drafter.chunked and engines[0].drafter.counters.spec_num_accepted_tokens > 0


@pytest.mark.skipif(not GPU, reason="on the GPU only (bench/gpu_engine.sh): 50 s in the interpreter; the chunked "
                    "form's outputs are checked on the CPU in tests/test_speculative.py")
def test_pallas_engine_matches_xla_with_chunked_drafts(loaded):
    drafted_matches_xla(loaded, "pallas")


def draft_model_matches_xla(loaded: LoadedModel, backend: str, tmp_path) -> None:
    """Speculative decoding with a draft model on a kernel backend (the model drafting for itself, written out as a
    checkpoint and read back): its loop and lockstep steps on the kernels, the xla backend's greedy tokens without
    drafts, nearly every draft accepted."""
    from jaxserve.loader.export import export_hf

    export_hf(str(tmp_path), loaded.config, loaded.params, loaded.tokenizer)
    ref, _ = serve(loaded, "xla")
    engines: list = []
    spec = {"model": str(tmp_path), "num_speculative_tokens": 3}
    got, _ = serve(loaded, backend, ARGS.replace(speculative_config=spec, max_num_seqs=8), engines=engines)
    assert got == ref
    counters = engines[0].drafter.counters
    assert engines[0].draft.rcfg.backend == backend
    assert counters.spec_num_draft_tokens > 10
    assert counters.spec_num_accepted_tokens > 0.9 * counters.spec_num_draft_tokens


@pytest.mark.skipif(not GPU, reason="on the GPU only (bench/gpu_engine.sh): slow in the interpreter; the draft "
                    "model's outputs are checked on the CPU in tests/test_draft_model.py, its steps compiled for sm_90")
def test_pallas_engine_with_a_draft_model_matches_xla(loaded, tmp_path):
    draft_model_matches_xla(loaded, "pallas", tmp_path)


@pytest.mark.skipif(not GPU, reason="on the GPU only: the interpreted Mosaic kernels take 35 s on 2 cores, and "
                    "their float8 pages are checked at the kernel level (tests/test_engine_pallas_mosaic.py, "
                    "tests/test_kernels_mosaic_*.py)")
def test_mosaic_engine_matches_tensor_core_generic_kernel_on_fp8_cache(monkeypatch):
    """Float8 pages under bfloat16 queries on the Mosaic GPU kernels (upcast in SMEM), against the generic kernel
    in its tensor-core form: both multiply bfloat16 probabilities by V, so they agree token for token. (Against
    the xla backend, whose probabilities stay float32, this random model's greedy tokens part after 3-7
    tokens on either tensor-core kernel alike: near-ties, not a kernel's error.)"""
    import pallas_kernels
    from jaxserve.engine import compiled_steps

    compiled_steps.clear()  # the patched tuning is read when the steps are traced

    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), numpy_params(CFG_BF16, seed=3, scale=0.3))
    loaded = LoadedModel("tiny", "tiny-llama", CFG_BF16, params, fake_tokenizer(), jnp.bfloat16, 0.0)
    args = ARGS_BF16.replace(kv_cache_dtype="fp8", calculate_kv_scales=True)
    mosaic, mosaic_steps = serve(loaded, "pallas_mosaic", args, SHORT)
    monkeypatch.setattr(pallas_kernels, "AttentionTuning",
                        functools.partial(pallas_kernels.AttentionTuning, pad_rows_to_mma=True))
    generic, generic_steps = serve(loaded, "pallas", args, SHORT)
    compiled_steps.clear()
    assert mosaic_steps == generic_steps and any(p and d for p, d in mosaic_steps)
    assert mosaic == generic


def test_smollm2_compile_shapes_match_bundled_gguf():
    """The SmolLM2 config compiled by tests/gpu_compile/test_compile_engine.py is the bundled model's."""
    pytest.importorskip("gguf")
    from jaxserve.loader import bundled_model_path, open_checkpoint

    try:
        path = bundled_model_path()
    except FileNotFoundError:
        pytest.skip("the bundled SmolLM2 is not installed")
    assert open_checkpoint(path).config() == SMOLLM2


def test_compiled_runner_config_is_the_engine_default():
    """The deviceless compile covers the default engine's buckets: tokens 16..512, sequences 1..64."""
    assert RC.token_buckets == (16, 32, 64, 128, 256, 512)
    assert RC.seq_buckets == (1, 4, 8, 16, 32, 64)
    assert RC.pages_per_seq == 512 and RC.backend == "pallas"
    assert 200_000 < RC.num_pages < 300_000  # ~90 GB of bfloat16 KV on an H200


def test_auto_backend_is_the_mosaic_kernels_on_hopper(monkeypatch):
    """`auto`: XLA on the CPU; on Hopper GPUs the Mosaic GPU kernels, but the generic kernel over float8 pages; on
    other GPUs (or a mix) the generic kernel; XLA for heads the kernels do not read (not a multiple of 16); a named
    backend as named."""
    from types import SimpleNamespace

    from jaxserve.engine.model_loading import resolve_attention_backend

    def on(platform: str, *capabilities: str) -> None:
        monkeypatch.setattr(jax, "default_backend", lambda: platform)
        monkeypatch.setattr(jax, "local_devices", lambda: [SimpleNamespace(compute_capability=c) for c in capabilities])

    auto = EngineArgs()
    on("cpu")
    assert resolve_attention_backend(auto) == "xla"
    on("gpu", "9.0", "9.0")
    assert resolve_attention_backend(auto) == "pallas_mosaic"
    assert resolve_attention_backend(auto.replace(kv_cache_dtype="fp8")) == "pallas"
    assert resolve_attention_backend(auto.replace(attention_backend="pallas")) == "pallas"
    assert resolve_attention_backend(auto, head_dim=72) == "xla" and resolve_attention_backend(auto, 96) == "pallas_mosaic"
    assert resolve_attention_backend(auto.replace(attention_backend="pallas"), head_dim=72) == "pallas"
    for capabilities in (("8.0",), ("10.0",), ("9.0", "8.9")):
        on("gpu", *capabilities)
        assert resolve_attention_backend(auto) == "pallas"
    on("gpu", "8.0")
    assert resolve_attention_backend(auto.replace(attention_backend="pallas_mosaic")) == "pallas_mosaic"
