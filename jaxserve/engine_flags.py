"""The engine's command-line flags (`EngineArgs.add_cli_args`), vLLM's names where vLLM has the setting."""

from __future__ import annotations

import argparse

from jaxserve.engine_args import (
    BACKEND_CHOICES,
    FORMAT_CHOICES,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    LOGPROBS_MODES,
    MAMBA_CACHE_DTYPES,
    MOE_RUNNER_CHOICES,
    EngineArgs,
)
from jaxserve.media_args import add_image_args


def add_engine_flags(parser: argparse.ArgumentParser, with_model: bool = True) -> argparse.ArgumentParser:
    """Add the engine's flags to `parser` (the model as an optional positional), defaults from `EngineArgs()`."""
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
    g.add_argument("--load-format", choices=list(LOAD_FORMATS), default=d.load_format,
                   help="auto (or safetensors) = the model's weights; mistral = a Mistral-format directory's "
                        "consolidated weights and params.json; dummy = random weights of its shapes (config "
                        "and tokenizer from the model, which then needs no weight files): for benchmarks")
    g.add_argument("--config-format", choices=list(FORMAT_CHOICES), default=d.config_format,
                   help="hf: config.json; mistral: params.json (a directory with both: auto reads config.json)")
    g.add_argument("--tokenizer-mode", choices=list(FORMAT_CHOICES), default=d.tokenizer_mode,
                   help="hf: tokenizer.json (or the other HF files); mistral: tekken.json or tokenizer.model.vN "
                        "with its instruct format's template (auto: Mistral's in a Mistral-format directory)")
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
    g.add_argument("--max-mamba-cache-size", type=int, default=d.max_mamba_cache_size,
                   help="a hybrid (Mamba) model's prefix cache: how many prompts' Mamba states it keeps beside their "
                        "pages (default: --max-num-seqs; 0 turns its prefix caching off)")
    g.add_argument("--mamba-cache-dtype", choices=list(MAMBA_CACHE_DTYPES),
                   default=d.mamba_cache_dtype, help="a hybrid model's Mamba states (auto: the model's dtype)")
    g.add_argument("--mamba-ssm-cache-dtype", choices=list(MAMBA_CACHE_DTYPES),
                   default=d.mamba_ssm_cache_dtype, help="its SSM states apart (auto: as --mamba-cache-dtype)")
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
    g.add_argument("--enforce-eager", action="store_true",
                   help="taken for vLLM's commands; no effect (the steps are compiled XLA programs: no CUDA graphs)")
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
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="split a MoE model's experts whole over the tensor-parallel devices (vLLM's flag) instead "
                        "of each expert's width")
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
