"""Engine arguments: one typed, validated configuration, with its command-line flags."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from jaxserve.json_options import json_object
from jaxserve.lora_request import check_lora_args
from jaxserve.media_args import add_image_args, image_limits, media_io_options
from jaxserve.pooling_params import PoolerConfig
from jaxserve.speculative_config import SpeculativeConfig

DType = Literal["auto", "float32", "bfloat16"]
# vLLM's names: "fp8" is float8_e4m3fn (3 mantissa bits, finite up to 448); "fp8_e5m2" trades precision for range.
KVCacheDType = Literal["auto", "float32", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"]
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
BackendChoice = Literal["auto", "xla", "pallas", "pallas_mosaic", "pallas_interpret", "pallas_mosaic_interpret"]
BACKEND_CHOICES = ("auto", "xla", "pallas", "pallas_mosaic", "pallas_interpret", "pallas_mosaic_interpret")
Policy = Literal["fcfs", "priority"]
LoadFormat = Literal["auto", "dummy"]
Runner = Literal["auto", "generate", "pooling"]
LayerLoopChoice = Literal["auto", "scan", "unroll"]
MOE_RUNNER_CHOICES = ("auto", "xla", "pallas")
LogprobsMode = Literal["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]
LOGPROBS_MODES: tuple[str, ...] = LogprobsMode.__args__  # type: ignore[attr-defined]


@dataclass(frozen=True)
class EngineArgs:
    """Everything that shapes an engine; names follow vLLM's flags where they exist."""

    model: str | None = None  # a GGUF file or HF directory; None = the bundled SmolLM2
    tokenizer: str | None = None  # the tokenizer's HF directory or GGUF file (None: the model's own)
    # vLLM's: no tokenizer at all. Prompts are token ids, outputs token ids without text; what needs the tokenizer
    # (text prompts, chat, stop strings, bad words, structured outputs) is refused, named.
    skip_tokenizer_init: bool = False
    # vLLM's: prompts may be embeddings [N, hidden] (`engine.prompt_embeds`; over HTTP, `prompt_embeds`).
    enable_prompt_embeds: bool = False
    dtype: DType = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    long_prefill_token_threshold: int | None = None
    page_size: int = 16
    kv_cache_dtype: KVCacheDType = "auto"  # "auto": the model's dtype
    # Per-layer float8 KV scales measured at start-up (`jaxserve.engine.kv_scales`), replacing the
    # checkpoint's (or 1.0).
    calculate_kv_scales: bool = False
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    # Decode tokens per host round trip. On this project's 2-core CPU, 8 saved 5% of a batch-1 step and
    # nothing at 32 (bench/offline.py), while streaming in bursts of 8 tokens; 1 streams every token.
    num_scheduler_steps: int = 1
    # Schedule and dispatch step N+1 before step N's outputs are detokenized, so the host's text work
    # overlaps the device (outputs are identical either way).
    async_scheduling: bool = True
    scheduling_policy: Policy = "fcfs"
    attention_backend: BackendChoice = "auto"
    # How a step runs the decoder layers: "unroll" compiles each layer on its own (on the CPU, SmolLM2's batch-1
    # decode step in 60% of the time, for 3x the compile time), "scan" one layer for all; "auto" unrolls on
    # the CPU with the xla backend and scans elsewhere.
    layer_loop: LayerLoopChoice = "auto"
    # The MoE experts' grouped matmuls (SGLang's --moe-runner-backend): "pallas", the Pallas grouped-matmul kernel;
    # "xla", `jax.lax.ragged_dot`; "auto", the kernel under a Pallas attention backend, ragged_dot under xla.
    moe_runner_backend: str = "auto"
    seed: int = 0
    # vLLM's, taken so its launch commands and `LLM(...)` calls run: jaxserve runs no code a checkpoint ships (a model
    # it does not implement is refused by name); prefills are always chunked (`max_num_batched_tokens` a step).
    trust_remote_code: bool = False
    enable_chunked_prefill: bool | None = None
    strict_compile: bool = False
    # vLLM's sleep mode: the engine may free its KV cache and weights on the device and take them back
    # (`jaxserve.engine.memory`); also opens the server's /sleep, /wake_up and /update_weights_from_disk.
    enable_sleep_mode: bool = False
    warmup: bool = True
    max_logprobs: int = 20
    # What sampled tokens' logprobs report (vLLM's `--logprobs-mode`): "raw_logprobs" the model's distribution;
    # "processed_logprobs" the one the token was drawn from (after logit_bias, penalties, bad words, the
    # grammar, temperature, top-k/top-p/min-p: filtered tokens -inf); the "_logits" forms the values before
    # normalization (`jaxserve.engine.sampler`). Prompt logprobs stay raw.
    logprobs_mode: LogprobsMode = "raw_logprobs"
    compile_cache_dir: str | None = "~/.cache/jaxserve/xla"
    tensor_parallel_size: int = 1  # devices that split heads, MLP width and vocabulary
    expert_parallel_size: int = 1  # devices that split the experts of a MoE model
    data_parallel_size: int = 1  # engine replicas, each on its own tensor x expert slice of the devices
    coordinator_address: str | None = None  # host:port of process 0, for a multi-host cluster
    num_processes: int = 1  # processes (hosts) in the cluster
    process_id: int = 0  # this process's rank in the cluster
    converted_checkpoint_dir: str | None = None  # converted weights: saved by the first start, restored by later ones
    # "dummy": random weights of the model's shapes (config and tokenizer still read from `model`), for
    # benchmarks and checks where the real weights are not at hand; an HF directory then needs no weight files.
    load_format: LoadFormat = "auto"
    # Speculative decoding (n-gram drafts, a draft model or the model's multi-token prediction layer; see
    # jaxserve/engine/speculative.py). A JSON object or a mapping is parsed into a `SpeculativeConfig`.
    speculative_config: SpeculativeConfig | None = None
    # "pooling": the model computes embeddings (`jaxserve.engine.pooling_engine`), not generations;
    # "auto" = "generate".
    runner: Runner = "auto"
    # How an embedding is pooled (a JSON object or a mapping, parsed into a `PoolerConfig`); runner pooling only.
    pooler_config: PoolerConfig | None = None
    # Keys of an HF model directory's config.json to override (a JSON object or a mapping), as vLLM's
    # `--hf-overrides`: e.g. a causal LM served as a reranker (`jaxserve.engine.classifier`).
    hf_overrides: Mapping[str, Any] | None = None
    # The model's sampling defaults (`jaxserve.generation_config`), as vLLM's `--generation-config`: "auto" reads
    # the model directory's generation_config.json, "vllm" none, a directory its own; `override_generation_config`
    # (a JSON object or a mapping) sets fields over them.
    generation_config: str = "auto"
    override_generation_config: Mapping[str, Any] | None = None
    # vLLM's `--quantization`: the method the checkpoint's own quantization_config names ("fp8", "compressed-tensors")
    # or the form its weights are held in ("fp8", "int8"), checked against it (None takes the checkpoint's), or for
    # an unquantized checkpoint "fp8", "int8" or "experts_int8": its projections quantized at load and kept so in
    # memory (`jaxserve.models.quantized`).
    quantization: str | None = None
    # LoRA adapters (`jaxserve.engine.lora_manager`): `max_loras` slots of rank `max_lora_rank` (adapters in one
    # batch), the adapters of `lora_modules` ((name, PEFT directory) pairs, or "name=path" strings) from start-up.
    enable_lora: bool = False
    lora_modules: tuple[tuple[str, str], ...] = ()
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # adapters whose weights stay in host memory (None: max_loras)
    # Images per prompt, as vLLM's `--limit-mm-per-prompt` ({"image": n}, a JSON object or a mapping; None: no
    # limit); 0 serves an image-text model as text, its vision tower unloaded (`jaxserve.engine.multimodal`).
    limit_mm_per_prompt: Mapping[str, int] | None = None
    allowed_local_media_path: str | None = None  # the directory local image files (paths, file:// URLs) come from
    mm_processor_cache_gb: float = 4.0  # images' embeddings kept by their pixels' hash (a chat resends its images)
    # The image processor's settings over its preprocessor_config.json's, as vLLM's `--mm-processor-kwargs` (e.g.
    # Qwen2-VL's {"max_pixels": ...}: fewer tokens an image); the settings each processor takes (`images.py`).
    mm_processor_kwargs: Mapping[str, Any] | None = None
    media_io_kwargs: Mapping[str, Any] | None = None  # vLLM's `--media-io-kwargs` ({"video": {"num_frames": n}})

    def __post_init__(self) -> None:
        if self.speculative_config is not None and not isinstance(self.speculative_config, SpeculativeConfig):
            object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        if self.pooler_config is not None and not isinstance(self.pooler_config, PoolerConfig):
            object.__setattr__(self, "pooler_config", PoolerConfig.parse(self.pooler_config))
        if self.hf_overrides is not None:
            object.__setattr__(self, "hf_overrides", dict(json_object(
                self.hf_overrides, "hf_overrides", '{"architectures": ["Qwen3ForSequenceClassification"]}')))
        if self.override_generation_config is not None:
            object.__setattr__(self, "override_generation_config", dict(json_object(
                self.override_generation_config, "override_generation_config", '{"temperature": 0.5}')))
        if not self.mm_processor_cache_gb >= 0:
            raise ValueError(f"mm_processor_cache_gb must be >= 0, got {self.mm_processor_cache_gb!r}")
        if self.limit_mm_per_prompt is not None:
            object.__setattr__(self, "limit_mm_per_prompt", image_limits(self.limit_mm_per_prompt))
        if self.media_io_kwargs is not None:
            object.__setattr__(self, "media_io_kwargs", media_io_options(self.media_io_kwargs))
        if self.mm_processor_kwargs is not None:
            object.__setattr__(self, "mm_processor_kwargs", dict(json_object(
                self.mm_processor_kwargs, "mm_processor_kwargs", '{"max_pixels": 1003520}')))
        self._check_runner()
        if self.enable_prompt_embeds and self.num_processes > 1:
            raise ValueError("enable_prompt_embeds is served by one process (num_processes 1)")
        if self.skip_tokenizer_init and (self.tokenizer is not None or self.calculate_kv_scales):
            raise ValueError("skip_tokenizer_init leaves the tokenizer out; " + (
                f"a tokenizer was given too ({self.tokenizer!r})" if self.tokenizer is not None else
                "calculate_kv_scales tokenizes its calibration texts"))
        object.__setattr__(self, "lora_modules", check_lora_args(self))
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")

        def positive(name: str) -> None:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        for name in ("max_num_seqs", "max_num_batched_tokens", "page_size", "num_scheduler_steps",
                     "tensor_parallel_size", "expert_parallel_size", "data_parallel_size", "num_processes"):
            positive(name)
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"process_id must be in [0, num_processes={self.num_processes}), got {self.process_id}")
        if self.num_processes > 1 and not self.coordinator_address:
            raise ValueError("num_processes > 1 needs coordinator_address (host:port of process 0)")
        if self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        for name in ("max_model_len", "kv_cache_memory_bytes"):
            if getattr(self, name) is not None:
                positive(name)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"dtype must be one of auto, float32, bfloat16, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.calculate_kv_scales and not self.kv_cache_dtype.startswith("fp8"):
            raise ValueError(f"calculate_kv_scales needs a float8 KV cache (kv_cache_dtype fp8, fp8_e4m3 or "
                             f"fp8_e5m2), got kv_cache_dtype {self.kv_cache_dtype!r}")
        if self.attention_backend not in BACKEND_CHOICES:
            raise ValueError(f"attention_backend must be one of {', '.join(BACKEND_CHOICES)}, "
                             f"got {self.attention_backend!r}")
        if self.enable_chunked_prefill is False:
            raise ValueError("enable_chunked_prefill false is not supported: jaxserve always chunks prompts into "
                             "steps of max_num_batched_tokens (raise it to max_model_len for whole-prompt steps)")
        if self.moe_runner_backend not in MOE_RUNNER_CHOICES:
            raise ValueError(f"moe_runner_backend must be one of {', '.join(MOE_RUNNER_CHOICES)}, "
                             f"got {self.moe_runner_backend!r}")
        if self.layer_loop not in ("auto", "scan", "unroll"):
            raise ValueError(f"layer_loop must be auto, scan or unroll, got {self.layer_loop!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto or dummy, got {self.load_format!r}")
        if self.load_format == "dummy" and self.converted_checkpoint_dir:
            raise ValueError("load_format 'dummy' makes random weights; it cannot be combined with "
                             "converted_checkpoint_dir, which saves or restores real ones")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be fcfs or priority, got {self.scheduling_policy!r}")

    def _check_runner(self) -> None:
        if self.runner not in ("auto", "generate", "pooling"):
            raise ValueError(f"runner must be auto, generate or pooling, got {self.runner!r}")
        if self.runner != "pooling":
            if self.pooler_config is not None:
                raise ValueError("pooler_config applies to embedding models; add runner 'pooling' (--runner pooling)")
            return
        for name, why in (("speculative_config", "speculative decoding"),
                          ("converted_checkpoint_dir", "a converted checkpoint (it holds the generating model)")):
            if getattr(self, name):
                raise ValueError(f"runner 'pooling' computes embeddings; {why} ({name}) does not apply")
        if self.num_processes > 1:
            raise ValueError("runner 'pooling' runs on one host (its devices split by -tp/-dp); a cluster of "
                             "num_processes > 1 serves generation only")

    @property
    def is_pooling(self) -> bool:
        """Whether the engine computes embeddings instead of generating."""
        return self.runner == "pooling"

    def pooler_config_for(self, model_path: str | None) -> PoolerConfig | None:
        """The whole pooler config of a pooling engine over the model at `model_path`; None when generating.
        A sequence classification model's head reads the last token's hidden state, unnormalized."""
        if not self.is_pooling:
            return None
        from jaxserve.engine.classifier import classification_architecture, model_config

        asked = self.pooler_config or PoolerConfig()
        arch = classification_architecture(model_config(model_path, self.hf_overrides))
        if arch is None:
            return asked.resolve(model_path)
        if asked.pooling_type not in (None, "LAST") or asked.normalize:
            raise ValueError(f"{arch} classifies the last token's hidden state as it is: pooler config "
                             f"{asked.pooling_type or 'LAST'} pooling{', normalized' if asked.normalize else ''} "
                             "does not apply to it")
        return PoolerConfig("LAST", False)

    def replace(self, **changes) -> EngineArgs:
        return dataclasses.replace(self, **changes)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, with_model: bool = True) -> argparse.ArgumentParser:
        """Add the engine's flags to `parser` (the model as an optional positional)."""
        d = EngineArgs()
        if with_model:
            parser.add_argument("model", nargs="?", default=None,
                                help="a GGUF file or an HF model directory (default: the bundled SmolLM2-135M-Instruct)")
        g = parser.add_argument_group("engine")
        g.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default=d.dtype,
                       help="weight and activation dtype; auto = float32 on the CPU, bfloat16 on GPUs")
        g.add_argument("--max-model-len", type=int, default=None,
                       help="longest prompt + output in tokens (default: the model's context length, "
                            "capped by the KV cache)")
        g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                       help="most sequences running at once")
        g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                       help="token budget of one step (prefill chunks are cut to fit)")
        g.add_argument("--long-prefill-token-threshold", type=int, default=None,
                       help="largest prefill chunk one request gets per step (default: the token budget)")
        g.add_argument("--compile-cache-dir", default=d.compile_cache_dir,
                       help="where compiled executables are kept between runs ('' turns it off)")
        g.add_argument("--converted-checkpoint-dir", default=None, metavar="PATH",
                       help="keep the converted weights here: the first start converts the checkpoint and saves "
                            "them, later starts restore them straight into each device's shards (orbax)")
        g.add_argument("--tokenizer", default=None, metavar="PATH",
                       help="the tokenizer (and chat template) from this HF directory or GGUF file instead of the "
                            "model's: e.g. a GGUF model served with its original tokenizer")
        g.add_argument("--enable-prompt-embeds", action="store_true",
                       help="take prompts given as embeddings (vLLM's `prompt_embeds`: a base64 torch.save'd "
                            "[tokens, hidden] tensor over HTTP, an array in Python)")
        g.add_argument("--skip-tokenizer-init", action="store_true",
                       help="load no tokenizer: prompts are token ids and outputs token ids without text (for a "
                            "client that tokenizes itself); text prompts, chat, stop strings are refused")
        g.add_argument("--load-format", choices=["auto", "dummy"], default=d.load_format,
                       help="auto = the model's weights; dummy = random weights of its shapes (config and "
                            "tokenizer from the model, which then needs no weight files): for benchmarks")
        g.add_argument("--block-size", "--page-size", dest="page_size", type=int, default=d.page_size,
                       help="tokens per KV page (a power of two)")
        g.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default=d.kv_cache_dtype,
                       help="dtype of the KV cache; auto = the model's dtype; fp8 (= fp8_e4m3) or fp8_e5m2 stores one "
                            "byte per element (values saturate at the format's range; per-layer scales from the "
                            "checkpoint, from --calculate-kv-scales, or 1.0)")
        g.add_argument("--calculate-kv-scales", action="store_true",
                       help="measure per-layer float8 KV scales on built-in text at start-up (largest |K| and |V| "
                            "to a quarter of the format's range), replacing the checkpoint's")
        g.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                       help="bytes of KV cache (default: a fraction of device memory, or 2 GiB on the CPU)")
        g.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                       help="fraction of accelerator memory jaxserve may use for weights and KV cache")
        g.add_argument("--max-logprobs", type=int, default=d.max_logprobs,
                       help="the most logprobs a request may ask for per token (top logprobs computed on the device)")
        g.add_argument("--logprobs-mode", choices=list(LOGPROBS_MODES), default=d.logprobs_mode,
                       help="what sampled tokens' logprobs report: raw_logprobs (the model's distribution), "
                            "processed_logprobs (the distribution the token was drawn from, after penalties, "
                            "temperature and top-k/top-p/min-p), or the logits of either")
        g.add_argument("--enable-sleep-mode", action="store_true",
                       help="allow sleep (KV cache and weights freed on the device, taken back on wake-up) and "
                            "weight updates from disk without a restart: POST /sleep, /wake_up, "
                            "/update_weights_from_disk, GET /is_sleeping")
        g.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false",
                       help="turn the radix-tree prefix cache off")
        g.add_argument("--num-scheduler-steps", type=int, default=d.num_scheduler_steps,
                       help="decode steps run on the device per host round trip (tokens stream in "
                            "bursts of this size; raise it where the host step costs more than the device step)")
        g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=d.async_scheduling,
                       help="dispatch the next step before detokenizing this one's outputs (host work overlaps "
                            "the device; outputs are identical either way)")
        g.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default=d.scheduling_policy,
                       help="fcfs, or priority (lower value first, FCFS within a priority)")
        g.add_argument("--attention-backend", choices=list(BACKEND_CHOICES),
                       default=d.attention_backend,
                       help="auto = plain XLA on the CPU, pallas_mosaic (attention on the Mosaic GPU kernels) on "
                            "Hopper GPUs unless the KV cache is fp8, pallas (the generic kernel, through Triton) on "
                            "other GPUs; the *_interpret forms run the kernels in their CPU "
                            "interpreters (for checking, slow)")
        g.add_argument("--layer-loop", choices=["auto", "scan", "unroll"], default=d.layer_loop,
                       help="unroll: each decoder layer compiled on its own (faster CPU steps at small batches, "
                            "3x the compile time at start); scan: one compiled layer for all; auto: unroll on "
                            "the CPU with the xla backend (weights not quantized), else scan")
        g.add_argument("--moe-runner-backend", choices=list(MOE_RUNNER_CHOICES), default=d.moe_runner_backend,
                       help="the MoE experts' matmuls: pallas (the grouped-matmul kernel; through Triton on a GPU, "
                            "its interpreter on the CPU), xla (jax.lax.ragged_dot), auto (pallas under a Pallas "
                            "attention backend, else xla)")
        g.add_argument("--speculative-config", default=None, metavar="JSON",
                       help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
                            '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' (drafts from the context) or '
                            '\'{"model": "<draft model>", "num_speculative_tokens": 4}\' (drafts from a smaller '
                            'model of the same vocabulary) or \'{"method": "mtp", "num_speculative_tokens": 1}\' '
                            '(from the model\'s multi-token prediction layer: DeepSeek-V3, GLM-4.5) or '
                            '\'{"method": "eagle3", "model": "<EAGLE-3 head>"}\' ("eagle": an EAGLE head) or '
                            '\'{"method": "suffix"}\' (from the request\'s tokens and earlier responses); verified in '
                            'one step, outputs unchanged')
        g.add_argument("--runner", choices=["auto", "generate", "pooling"], default=d.runner,
                       help="generate (auto), or pooling: serve the model's embeddings on /v1/embeddings")
        g.add_argument("--pooler-config", default=None, metavar="JSON",
                       help='embedding pooling with --runner pooling, e.g. \'{"pooling_type": "LAST", "normalize": true}\' '
                            "(LAST, MEAN or CLS; default: the model's sentence-transformers config, else LAST, "
                            "normalized)")
        g.add_argument("--hf-overrides", default=None, metavar="JSON",
                       help="keys of the model's config.json to override, e.g. to serve Qwen3-Reranker: "
                            '\'{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": '
                            '["no", "yes"], "is_original_qwen3_reranker": true}\' (with --runner pooling)')
        g.add_argument("--generation-config", default=d.generation_config, metavar="auto|vllm|DIR",
                       help="sampling defaults for requests that leave a field out: 'auto' from the model's "
                            "generation_config.json, 'vllm' the API's own, or a directory's generation_config.json")
        g.add_argument("--override-generation-config", default=None, metavar="JSON",
                       help='sampling defaults set over the generation config\'s, e.g. \'{"temperature": 0.5}\'')
        g.add_argument("--quantization", "-q", default=None, metavar="METHOD",
                       help="a quantized checkpoint's own method (fp8, compressed-tensors, gptq, awq; float8 and "
                            "int8 weights scaled per tensor or channel held as stored, others dequantized), or for an "
                            "unquantized one fp8, int8 (every projection) or experts_int8 (a MoE model's experts): "
                            "weights quantized at load, one scale per output channel, kept so in memory")
        g.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (PEFT directories)")
        g.add_argument("--lora-modules", nargs="+", default=(), metavar="NAME=PATH",
                       help="LoRA adapters loaded at start-up; a request names one as its model")
        g.add_argument("--max-loras", type=int, default=d.max_loras,
                       help="LoRA adapter slots: adapters in one batch (any number may be known)")
        g.add_argument("--max-lora-rank", type=int, default=d.max_lora_rank, help="largest LoRA rank served")
        g.add_argument("--max-cpu-loras", type=int, default=None,
                       help="LoRA adapters whose weights stay in host memory (default: --max-loras); others are "
                            "read from their paths again when they take a slot")
        g.add_argument("--seed", type=int, default=d.seed, help="seed for requests that give none")
        g.add_argument("--trust-remote-code", action="store_true",
                       help="taken for vLLM's commands; no effect (jaxserve runs no code a checkpoint ships)")
        g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                       help="taken for vLLM's commands: prefills are always chunked (--no-enable-chunked-prefill "
                            "is refused)")
        g.add_argument("--strict-compile", action="store_true",
                       help="raise if anything compiles after warmup")
        g.add_argument("--no-warmup", dest="warmup", action="store_false",
                       help="skip compiling every shape bucket at start (first requests compile instead)")
        add_image_args(parser)
        p = parser.add_argument_group("parallelism")
        p.add_argument("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size,
                       help="devices that split attention heads, MLP width and vocabulary")
        p.add_argument("--expert-parallel-size", "-ep", type=int, default=d.expert_parallel_size,
                       help="devices that split the experts of a mixture-of-experts model")
        p.add_argument("--data-parallel-size", "-dp", type=int, default=d.data_parallel_size,
                       help="engine replicas, each on its own tensor x expert slice of the devices")
        p.add_argument("--coordinator-address", default=None,
                       help="host:port of process 0 when several hosts form one cluster (jax.distributed)")
        p.add_argument("--num-processes", type=int, default=d.num_processes,
                       help="number of processes (hosts) in the cluster")
        p.add_argument("--process-id", type=int, default=d.process_id, help="this process's rank in the cluster")
        return parser

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(ns).items() if k in names})
