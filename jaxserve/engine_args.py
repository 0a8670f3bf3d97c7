"""Engine arguments: one typed, validated configuration, with its command-line flags."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from jaxserve.engine.scheduler_config import SchedulerConfig
from jaxserve.json_options import json_object
from jaxserve.lora_request import check_lora_args
from jaxserve.media_args import image_limits, media_io_options
from jaxserve.pooling_params import PoolerConfig
from jaxserve.speculative_config import SpeculativeConfig

DType = Literal["auto", "float32", "bfloat16"]
# vLLM's names: "fp8" is float8_e4m3fn (3 mantissa bits, finite up to 448); "fp8_e5m2" trades precision for range.
KVCacheDType = Literal["auto", "float32", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"]
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
BackendChoice = Literal["auto", "xla", "pallas", "pallas_mosaic", "pallas_interpret", "pallas_mosaic_interpret"]
BACKEND_CHOICES = ("auto", "xla", "pallas", "pallas_mosaic", "pallas_interpret", "pallas_mosaic_interpret")
Policy = Literal["fcfs", "priority"]
LoadFormat = Literal["auto", "safetensors", "mistral", "dummy"]
LOAD_FORMATS: tuple[str, ...] = LoadFormat.__args__  # type: ignore[attr-defined]
FORMAT_CHOICES = ("auto", "hf", "mistral")  # --tokenizer-mode, --config-format
Runner = Literal["auto", "generate", "pooling"]
LayerLoopChoice = Literal["auto", "scan", "unroll"]
MOE_RUNNER_CHOICES = ("auto", "xla", "pallas")
MAMBA_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")  # a hybrid model's states (auto: the model's)
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
    max_mamba_cache_size: int | None = None  # a hybrid model's prefix cache: states kept (None: max_num_seqs; 0: off)
    mamba_cache_dtype: str = "float32"  # a hybrid model's states (auto: the model's dtype), vLLM's flag
    mamba_ssm_cache_dtype: str = "auto"  # ... its SSM states apart (auto: as mamba_cache_dtype)
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
    # it does not implement is refused by name); prefills are always chunked (`max_num_batched_tokens` a step); its
    # steps are compiled XLA programs, with no CUDA graphs to leave out (`enforce_eager`).
    trust_remote_code: bool = False
    enable_chunked_prefill: bool | None = None
    enforce_eager: bool = False
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
    # vLLM's --enable-expert-parallel: a MoE model's experts split whole over the tensor-parallel devices (each holds
    # num_experts / tensor_parallel_size of them) instead of each expert's width split over them.
    enable_expert_parallel: bool = False
    data_parallel_size: int = 1  # engine replicas, each on its own tensor x expert slice of the devices
    coordinator_address: str | None = None  # host:port of process 0, for a multi-host cluster
    num_processes: int = 1  # processes (hosts) in the cluster
    process_id: int = 0  # this process's rank in the cluster
    converted_checkpoint_dir: str | None = None  # converted weights: saved by the first start, restored by later ones
    # "dummy": random weights of the model's shapes (config and tokenizer still read from `model`), for
    # benchmarks and checks where the real weights are not at hand; an HF directory then needs no weight files.
    load_format: LoadFormat = "auto"
    # vLLM's flags for a directory holding both formats (Mistral's releases): "mistral" reads params.json and the
    # consolidated weights (config_format or load_format), Mistral's tokenizer file (tokenizer_mode); "hf" the HF
    # files; "auto" the HF ones where there are both. load_format "safetensors": as "auto" (a directory's weights).
    tokenizer_mode: str = "auto"
    config_format: str = "auto"
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
        if self.max_mamba_cache_size is not None and not (isinstance(self.max_mamba_cache_size, int)
                                                          and self.max_mamba_cache_size >= 0):
            raise ValueError(f"max_mamba_cache_size must be an integer >= 0, got {self.max_mamba_cache_size!r}")
        for name in ("mamba_cache_dtype", "mamba_ssm_cache_dtype"):
            if getattr(self, name) not in MAMBA_CACHE_DTYPES:
                raise ValueError(f"{name} must be {', '.join(MAMBA_CACHE_DTYPES[:-1])} or {MAMBA_CACHE_DTYPES[-1]}, "
                                 f"got {getattr(self, name)!r}")
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
        if self.enable_expert_parallel and self.expert_parallel_size > 1:
            raise ValueError("enable_expert_parallel splits the experts over the tensor-parallel devices; "
                             "expert_parallel_size adds devices of its own: give one of them")
        if self.enable_chunked_prefill is False:
            raise ValueError("enable_chunked_prefill false is not supported: jaxserve always chunks prompts into "
                             "steps of max_num_batched_tokens (raise it to max_model_len for whole-prompt steps)")
        if self.moe_runner_backend not in MOE_RUNNER_CHOICES:
            raise ValueError(f"moe_runner_backend must be one of {', '.join(MOE_RUNNER_CHOICES)}, "
                             f"got {self.moe_runner_backend!r}")
        if self.layer_loop not in ("auto", "scan", "unroll"):
            raise ValueError(f"layer_loop must be auto, scan or unroll, got {self.layer_loop!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}")
        for name in ("tokenizer_mode", "config_format"):
            if getattr(self, name) not in FORMAT_CHOICES:
                raise ValueError(f"{name} must be one of {', '.join(FORMAT_CHOICES)}, got {getattr(self, name)!r}")
        if self.load_format == "mistral" and self.config_format == "hf":
            raise ValueError("load_format 'mistral' reads params.json's model: config_format 'hf' contradicts it")
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

    def scheduler_config(self, max_model_len: int, states: Any = None) -> SchedulerConfig:
        """The scheduler's limits for an engine of `max_model_len` tokens (and a hybrid model's state slots: `states`,
        an `engine.hybrid.StateLayout`)."""
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=max(self.max_num_batched_tokens, self.max_num_seqs),
            max_model_len=max_model_len, page_size=self.page_size, policy=self.scheduling_policy,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            enable_prefix_caching=self.enable_prefix_caching, max_loras=self.max_loras if self.enable_lora else None,
            num_state_slots=states.running if states else 0, num_state_snapshots=states.snapshots if states else 0,
            first_snapshot_slot=states.first_snapshot if states else 0)

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
        """Add the engine's flags to `parser` (the model as an optional positional): `jaxserve.engine_flags`."""
        from jaxserve.engine_flags import add_engine_flags

        return add_engine_flags(parser, with_model)

    @property
    def checkpoint_format(self) -> str | None:
        """A model directory's format as the flags name it ("hf", "mistral"), or None to tell it by its files."""
        if "mistral" in (self.config_format, self.load_format):
            return "mistral"
        return "hf" if self.config_format == "hf" else None

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(ns).items() if k in names})
