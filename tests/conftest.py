"""Shared fixtures: the bundled SmolLM2 (ours and HF's), tiny random HF checkpoints."""

from __future__ import annotations

import gc
import os
import shutil
import tempfile

# Under pytest-xdist two workers share the two cores: torch's (and BLAS's) OpenMP threads, one per core in
# each worker, would oversubscribe them and spin against each other (a transformers reference ran 2-3x
# slower), so each worker's OpenMP runs one thread. Set before torch or numpy is imported.
_XDIST_WORKER = "PYTEST_XDIST_WORKER" in os.environ
if _XDIST_WORKER:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import jax  # noqa: E402
import pytest  # noqa: E402

# Compiled executables are reused across test runs (and across processes) on this machine: the child processes
# the tests start (sharded, multi-process, multi-host) read the same cache through the environment. Every compile is
# kept, the quick ones too: in six engine-heavy files (114 tests) 1,641 of 1,663 compiles load so, against 453 when
# only those of 0.5 s and more were kept, and XLA's part fell from 112 s to 83 s (tracing alike: 55 s, 58 s).
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.expanduser("~/.cache/jaxserve/jax-tests"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

# The engine configuration of every test that serves the bundled model through the engine (in process,
# over HTTP, disaggregated): one set of shapes, so its step functions compile once for the whole suite
# and the other engines load them from the compilation cache. 45 MiB is 64 pages of 16 float32 tokens.
# One compiled layer for all (the CPU's default unrolls them): a third of the compile time, a quarter of the
# load time; `test_engine_real` checks that the default's tokens are these.
REAL_ENGINE_ARGS = dict(max_num_seqs=32, max_num_batched_tokens=128, max_model_len=256, num_scheduler_steps=4,
                        dtype="float32", kv_cache_memory_bytes=45 * 1024 * 1024, layer_loop="scan")

CHAT_PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "List three prime numbers."}],
    [{"role": "user", "content": "Translate 'good morning' into Spanish."}],
    [{"role": "user", "content": "Explain photosynthesis in one sentence."},
     {"role": "assistant", "content": "Plants turn light, water and CO2 into sugar and oxygen."},
     {"role": "user", "content": "And what is chlorophyll?"}],
    [{"role": "user", "content": "def add(a, b):\n    return a + b\n\nWhat does this Python code do?"}],
    [{"role": "user", "content": "How many legs does a spider have? Answer with a number: 8 or 6?"}],
    [{"role": "user", "content": "Give me a short motivational quote 🚀 about learning."}],
]


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_code():
    """After a test file, once the process holds more than half the memory mappings Linux allows it, drops
    every compiled executable from memory (later tests load theirs from the compilation cache). On the CPU
    each executable's kernels take mappings of their own, and the suite's thousands of shapes would pass
    the limit (`vm.max_map_count`), past which loading one more crashes the process."""
    yield
    from jaxserve.engine.compiled_steps import memory_mappings

    counts = memory_mappings()
    if counts is not None and counts[0] > counts[1] // 2:
        # The caches hold the executables whoever holds their functions; one collection after frees the rest (one
        # before as well freed no more: three tiny engines' 7,725 mappings to 561 either way, in 0.54 s against 0.37).
        jax.clear_caches()
        gc.collect()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    """A directory of a tiny random Llama (transformers' config class) with a word-level tokenizer's files."""
    pytest.importorskip("transformers")
    from tests.test_draft_model import _with_tokenizer
    from tests.test_model_families import save_tiny_hf

    path = tmp_path_factory.mktemp("tiny_llama")
    save_tiny_hf("LlamaConfig", path)
    return _with_tokenizer(str(path))


@pytest.fixture(scope="session")
def smollm_path() -> str:
    from jaxserve.loader import bundled_model_path

    return bundled_model_path()


@pytest.fixture(scope="session")
def smollm_f32(smollm_path):
    """(config, float32 params) of the bundled model."""
    import jax.numpy as jnp

    from jaxserve.loader import load_params, open_checkpoint

    ckpt = open_checkpoint(smollm_path)
    cfg = ckpt.config()
    return cfg, load_params(ckpt, cfg, jnp.float32, progress=False)


@pytest.fixture(scope="session")
def hf_smollm(smollm_path):
    """transformers' model and tokenizer on the same GGUF, dequantized to float32."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.set_num_threads(1 if _XDIST_WORKER else 2)
    # transformers' own reading of the GGUF (its dequantization and its tokenizer conversion, ~25 s) is kept on
    # disk as it wrote it, keyed by the file and transformers' version, and read back in a second.
    stat = os.stat(smollm_path)
    cache = os.path.expanduser("~/.cache/jaxserve")
    saved = os.path.join(cache, f"hf-smollm2-{transformers.__version__}-{stat.st_size}-{int(stat.st_mtime)}")
    if not os.path.isdir(saved):
        os.makedirs(cache, exist_ok=True)
        d, f = os.path.split(smollm_path)
        tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=f)
        model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
        tmp = tempfile.mkdtemp(dir=cache)
        # Its weights are float32 already: saved as plain weights (transformers refuses to save a "gguf" model).
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        try:
            os.rename(tmp, saved)  # whole or not at all: another worker may be writing the same
        except OSError:
            shutil.rmtree(tmp)
    tok = transformers.AutoTokenizer.from_pretrained(saved)
    model = transformers.AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32)
    model.eval()
    return model, tok


@pytest.fixture(scope="session")
def chat_prompt_ids(hf_smollm) -> list[list[int]]:
    _, tok = hf_smollm
    out = []
    for conv in CHAT_PROMPTS:
        ids = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        out.append(list(ids))
    return out



# The files that take longest (seconds of one worker, measured in CI), longest first. Two workers take whole files
# from the front of the queue as they run dry, so a long file left for the end keeps one worker busy while the other
# idles: these go first, then the rest by their number of tests, most first (pytest-xdist's own order, which
# `.ci/run` turns off with --no-loadscope-reorder so that this one holds). A file missing here only runs later.
SLOW_FIRST = ("test_sharding.py", "test_moe.py", "test_speculative.py", "test_engine_real.py", "test_lora.py",
              "test_kernels_mosaic_ws.py", "test_kernels_mosaic_ragged.py", "test_mtp.py", "test_multihost.py",
              "test_engine_pallas_mosaic.py", "test_eagle.py", "test_hybrid.py", "test_server_real.py",
              "test_mtp_qwen3_next.py", "test_mla.py", "test_quantized.py", "test_gemma4.py", "test_draft_model.py",
              "test_engine_qwen2_vl.py", "test_dsa.py", "test_model_parity.py", "test_multihost_serve.py",
              "test_pd.py", "test_phi.py", "test_gpt2.py", "test_starcoder2.py", "test_gpt_neox.py")


def pytest_collection_modifyitems(config, items) -> None:
    counts: dict[str, int] = {}
    for item in items:
        counts[item.path.name] = counts.get(item.path.name, 0) + 1
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: (0, rank[item.path.name]) if item.path.name in rank else (1, -counts[item.path.name]))
