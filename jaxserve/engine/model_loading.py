"""Loading a model for the engine: config, weights on the device, tokenizer, KV pool size."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.config import GRANITE_MOE_FAMILIES, ModelConfig, UnsupportedModelError
from jaxserve.engine.classifier import classification_architecture
from jaxserve.engine_args import EngineArgs
from jaxserve.generation_config import sampling_defaults
from jaxserve.loader import (
    GGUFFile,
    checkpoint_eos_ids,
    checkpoint_tokenizer,
    load_params,
    load_vision,
    model_display_name,
    open_checkpoint,
    resolve_model,
    tokenizer_at,
)
from jaxserve.loader.quantized_keys import projection_modules
from jaxserve.models.llama import forward
from jaxserve.models.params import Params, declare_params
from jaxserve.models.quantized import METHODS, quantize_layers
from jaxserve.models.random_weights import random_params
from jaxserve.quantization import CheckpointQuantization, keepable, parse_quantization
from jaxserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

@dataclass
class LoadedModel:
    path: str
    name: str
    config: ModelConfig
    params: Params
    tokenizer: Tokenizer | None  # (None: loaded without one, `EngineArgs.skip_tokenizer_init`)
    dtype: Any
    load_seconds: float
    forward_fn: Callable = forward
    """The model step `forward(params, kv, inputs, cfg, backend) -> (logits, kv)`."""
    plan: Any = None
    """The `sharding.ShardingPlan` when the model spans several devices (None on one device)."""
    sampling_defaults: dict[str, Any] = dataclasses.field(default_factory=dict)
    """What a request that leaves a sampling field out gets (`jaxserve.generation_config`)."""
    vision: Any = None
    """An image-text model's `multimodal.ImageEncoder` (None: a text model, or images turned off)."""
    eos_ids: tuple[int, ...] = ()
    """Without a tokenizer, the ids that end generation, read from the checkpoint (`loader.checkpoint_eos_ids`)."""


def resolve_dtype(args: EngineArgs) -> Any:
    chosen = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}.get(args.dtype)  # ("auto": by the backend)
    return chosen or (jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)


def resolve_attention_backend(args: EngineArgs, head_dim: int | None = None) -> str:
    """The attention backend: "auto" is XLA on the CPU and for heads the kernels do not read (`head_dim` not a multiple
    of 16; they read others in power-of-two parts); on Hopper the Mosaic GPU kernels (`pallas_mosaic`; on an H200,
    8k-token decode at 93% of the copy bandwidth against the generic kernel's 14%, 8k prefill at 73% of the bf16 matmul
    rate against 32%) but over float8 pages (the generic kernel, until the Mosaic ragged kernel's float8 form has run
    on a GPU); on other GPUs the generic kernel (`pallas`)."""
    if args.attention_backend != "auto":
        return args.attention_backend
    if jax.default_backend() == "cpu" or head_dim is not None and head_dim % 16:
        return "xla"
    hopper = all(getattr(d, "compute_capability", "").split(".")[0] == "9" for d in jax.local_devices())
    return "pallas_mosaic" if hopper and not args.kv_cache_dtype.startswith("fp8") else "pallas"


def resolve_kv_cache_dtype(args: EngineArgs, model_dtype: Any) -> Any:
    """The KV pages' dtype: the model's for "auto", else the named one (vLLM's "fp8" is float8_e4m3fn)."""
    named = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn,
             "fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}
    return jnp.dtype(model_dtype if args.kv_cache_dtype == "auto" else named[args.kv_cache_dtype])


def enable_compile_cache(path: str | None) -> None:
    """Keep compiled executables on disk so later starts skip most of the warmup compile."""
    if not path or jax.config.jax_compilation_cache_dir:
        return
    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def load_model(args: EngineArgs, progress: bool = True) -> LoadedModel:
    """Read the checkpoint named by `args.model` (None = bundled SmolLM2) onto the default device."""
    t0 = time.perf_counter()
    if args.num_processes > 1:
        from sharding.distributed import initialize_distributed

        initialize_distributed(args.coordinator_address, args.num_processes, args.process_id)
    path = resolve_model(args.model)
    dummy = args.load_format == "dummy"
    ckpt = open_checkpoint(path, weights=not dummy, overrides=args.hf_overrides, fmt=args.checkpoint_format)
    cfg = ckpt.config()
    kept, weight_quant = check_quantization(args.quantization, path, getattr(ckpt, "hf_config", {}), cfg,
                                            gguf_quantized=isinstance(ckpt, GGUFFile) and ckpt.quantized)
    if kept and dummy:  # random float weights, then held as the checkpoint's would be
        kept, weight_quant = None, kept
    cfg = dataclasses.replace(cfg, weight_quant=kept)
    arch = classification_architecture(getattr(ckpt, "hf_config", {}))
    if arch and not args.is_pooling:
        raise UnsupportedModelError(f"{path} is a sequence classification model ({arch}): it classifies, it does not "
                                    "generate; serve it with --runner pooling (runner='pooling')")
    if args.is_pooling and not cfg.tie_word_embeddings:
        # An embedding model never reads its vocabulary head: leave it unloaded (embedding checkpoints often
        # ship without one); the unused logits of the step read the embedding instead and are compiled away.
        cfg = dataclasses.replace(cfg, tie_word_embeddings=True)
    dtype = resolve_dtype(args)
    tokenizer = None if args.skip_tokenizer_init else checkpoint_tokenizer(path, ckpt, args.tokenizer_mode) \
        if args.tokenizer is None else tokenizer_at(args.tokenizer, cfg, args.tokenizer_mode)
    plan = _parallel_plan(args, cfg)
    if dummy:
        params = random_params(plan.model_cfg if plan else cfg, dtype, args.seed, plan and plan.param_shardings())
        logger.info("random weights (--load-format dummy) of %s's shapes", path)
    elif args.converted_checkpoint_dir:
        params = _converted_params(args.converted_checkpoint_dir, path, ckpt, cfg, plan, dtype, progress)
    else:
        params = _convert(ckpt, cfg, plan, dtype, progress)
    if weight_quant:
        params, cfg, plan = quantize_model(params, cfg, plan, weight_quant)
    elif kept:
        logger.info("the checkpoint's quantized weights are held as stored (%s): %.1f MiB per device", kept,
                    params_bytes(params) / 2**20)
    vision = _image_encoder(args, ckpt, cfg, dtype, path, tokenizer)
    loaded = LoadedModel(path, model_display_name(path), cfg, params, tokenizer, dtype, time.perf_counter() - t0,
                         sampling_defaults=sampling_defaults(path, args.generation_config,
                                                             args.override_generation_config), vision=vision,
                         eos_ids=checkpoint_eos_ids(path, ckpt) if tokenizer is None else ())
    return _with_plan(loaded, plan) if plan else loaded


def _image_encoder(args: EngineArgs, ckpt: Any, cfg: ModelConfig, dtype: Any, path: str, tokenizer: Any) -> Any:
    """An image-text model's vision side on the default device, unless images are turned off (limit 0)."""
    from jaxserve.engine.multimodal import ImageEncoder
    from jaxserve.engine.multimodal_gemma4 import Gemma4ImageEncoder
    from jaxserve.engine.multimodal_idefics3 import Idefics3ImageEncoder
    from jaxserve.engine.multimodal_internvl import InternVLImageEncoder
    from jaxserve.engine.multimodal_onevision import OnevisionImageEncoder
    from jaxserve.engine.multimodal_pixtral import PixtralImageEncoder, pixtral_config
    from jaxserve.engine.multimodal_qwen import QwenImageEncoder
    from jaxserve.images import ImageProcessor, preprocessor_config
    from jaxserve.images_gemma4 import Gemma4ImageProcessor
    from jaxserve.images_idefics3 import Idefics3ImageProcessor
    from jaxserve.images_internvl import InternVLImageProcessor
    from jaxserve.images_pixtral import PixtralImageProcessor
    from jaxserve.images_qwen2 import QwenImageProcessor
    from jaxserve.models.vision_towers import tower_of

    found = tower_of(ckpt.hf_config) if hasattr(ckpt, "hf_config") else None
    if found is None or (args.limit_mm_per_prompt or {}).get("image") == 0 or args.is_pooling:
        return None
    tower, vcfg = found
    unused: dict[str, Any] = {}
    if args.load_format == "dummy":
        params = tower.random(vcfg, dtype, args.seed)
    else:
        vcfg, params = load_vision(ckpt, cfg, dtype, unused)
    # Each tower's encoder and image processor (the model directory's settings under --mm-processor-kwargs; for
    # Pixtral, resizing to whole merged patches).
    kind = tower.name if tower.name != "llava" else "idefics3" if vcfg.projector == "shuffle" else \
        "llava" if vcfg.max_crops is None else "onevision"
    settings = preprocessor_config(path, args.mm_processor_kwargs, tower.name)
    encoder, processor = {
        "pixtral": (PixtralImageEncoder, lambda: PixtralImageProcessor.from_dict(settings, vcfg.spatial_merge_size)),
        "qwen2_vl": (QwenImageEncoder, lambda: QwenImageProcessor.from_dict(settings)),
        "gemma4": (Gemma4ImageEncoder, lambda: Gemma4ImageProcessor.from_dict(settings)),
        "internvl": (InternVLImageEncoder, lambda: InternVLImageProcessor.from_dict(
            settings, vcfg.image_size, (args.mm_processor_kwargs or {}).get("crop_to_patches", True))),
        "llava": (ImageEncoder, lambda: ImageProcessor.from_dict(settings)),
        "onevision": (OnevisionImageEncoder, lambda: ImageProcessor.from_dict(settings)),
        "idefics3": (Idefics3ImageEncoder, lambda: Idefics3ImageProcessor.from_dict(settings, vcfg.image_size)),
    }[kind]
    if tower.name == "pixtral":  # its row breaks' and end's ids are the tokenizer's
        vcfg = pixtral_config(vcfg, tokenizer)
    made = encoder(vcfg, params, processor(), args.allowed_local_media_path, int(args.mm_processor_cache_gb * 2**30),
                   dict(ckpt.hf_config), unused, tokenizer)
    if kind in ("qwen2_vl", "internvl", "onevision", "idefics3") and (args.limit_mm_per_prompt or {}).get("video") != 0:
        from jaxserve.videos import FrameVideoProcessor
        from jaxserve.videos_idefics3 import SmolVLMVideoProcessor
        from jaxserve.videos_qwen2 import QwenVideoProcessor, video_processor_config

        video = video_processor_config(path, args.mm_processor_kwargs) or {}
        made.video_frames = (args.media_io_kwargs or {}).get("video", {}).get("num_frames")
        if kind == "idefics3":  # SmolVLM2's (its settings' video_sampling); Idefics3's and SmolVLM's take images only
            if "video_sampling" in video or str(video.get("video_processor_type")).startswith("SmolVLMVideo"):
                made.take_videos(SmolVLMVideoProcessor.from_dict(video, vcfg.image_size))
        else:
            made.video_processor = QwenVideoProcessor.from_dict(video, qwen3=vcfg.variant == "qwen3_vl") \
                if kind == "qwen2_vl" else FrameVideoProcessor.from_dict(video, vcfg.image_size, middle=kind == "internvl")
    return made


def _convert(ckpt: Any, cfg: ModelConfig, plan: Any, dtype: Any, progress: bool) -> Params:
    return load_params(ckpt, cfg, dtype, place=plan.place if plan else None, progress=progress)


def checkpoint_source(path: str) -> dict[str, Any]:
    """What identifies an original checkpoint to a converted copy of it: its name and its weights' bytes."""
    path = os.path.normpath(path)
    if os.path.isdir(path):
        size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
    else:
        size = os.path.getsize(path)
    return {"name": os.path.basename(path), "bytes": size}


def _converted_params(directory: str, path: str, ckpt: Any, cfg: ModelConfig, plan: Any, dtype: Any,
                      progress: bool) -> Params:
    """Restore the converted weights saved in `directory`, or convert the checkpoint and save them there."""
    from sharding.checkpoint import restore_params, save_params, saved_info
    from sharding.distributed import broadcast_message

    directory = os.path.abspath(os.path.expanduser(directory))
    run_cfg = plan.model_cfg if plan else cfg
    source = checkpoint_source(path)
    # Every process must take the same path (both enter collectives): process 0's directory decides.
    saved = broadcast_message(saved_info(directory) is not None)
    t0 = time.perf_counter()
    if saved:
        params = restore_params(directory, plan, dtype, cfg=run_cfg, source=source)
        logger.info("restored converted weights from %s in %.2f s (conversion of %s skipped)", directory,
                    time.perf_counter() - t0, path)
        return params
    params = _convert(ckpt, cfg, plan, dtype, progress)
    t1 = time.perf_counter()
    save_params(directory, params, run_cfg, source=source)
    logger.info("converted %s in %.2f s and saved the converted weights to %s in %.2f s", path, t1 - t0,
                directory, time.perf_counter() - t1)
    return params


def _parallel_plan(args: EngineArgs, cfg: ModelConfig, mesh: Any = None) -> Any:
    if mesh is None and args.tensor_parallel_size * args.expert_parallel_size == 1:
        return None
    from sharding import ParallelConfig, ShardingRules, make_mesh, make_plan

    mesh = mesh if mesh is not None else make_mesh(ParallelConfig(args.tensor_parallel_size, args.expert_parallel_size))
    whole = args.enable_expert_parallel and cfg.num_experts  # the experts whole over the tensor-parallel devices
    plan = make_plan(cfg, mesh, ShardingRules().replace(experts="model", expert_mlp=None) if whole else None)
    logger.info("sharding: %s", plan.describe())
    return plan


def _with_plan(loaded: LoadedModel, plan: Any) -> LoadedModel:
    forward_fn = functools.partial(loaded.forward_fn, layout=plan.layout())
    return dataclasses.replace(loaded, config=plan.model_cfg, forward_fn=forward_fn, plan=plan)


def shard_model(loaded: LoadedModel, args: EngineArgs, mesh: Any = None) -> LoadedModel:
    """Lay a loaded single-device (or host) model out over `mesh` (default: from the parallel sizes in
    `args`); returns `loaded` itself when it already has a plan or one device is asked for."""
    if loaded.plan is not None:
        return loaded
    plan = _parallel_plan(args, loaded.config, mesh)
    if plan is None:
        return loaded
    return _with_plan(dataclasses.replace(loaded, params=plan.shard_params(loaded.params)), plan)


def check_quantization(method: str | None, path: str, hf_config: dict[str, Any], cfg: ModelConfig | None = None,
                       gguf_quantized: bool = False) -> tuple[str | None, str | None]:
    """`--quantization` (vLLM's) against the checkpoint: (the form its own quantized weights are held in, None
    where they are dequantized at load; the method quantizing an unquantized checkpoint's weights at load). A
    quantized checkpoint's float8 and int8 weights with a scale per tensor or channel are held so (`kept_form`),
    but float8 on the CPU only when asked for by name (the CPU has no float8 arithmetic: 4x slower than float).
    Weights dequantized at load (MXFP4, 4-bit, ...) may be held as one of `METHODS` instead, each quantized on the
    host as it is read, so the float model never exists whole: so are a GGUF file's llama.cpp block quants
    (`gguf_quantized`: some tensor is stored quantized; `--quantization gguf` names them)."""
    config = hf_config.get("quantization_config") or ({"quant_method": "gguf"} if gguf_quantized else {})
    own = config.get("quant_method")
    quant = parse_quantization(config) if own != "gguf" else None  # (llama.cpp's block quants: the file's reader's)
    quantized = quant is not None or own == "gguf"
    named_own = method is not None and own is not None and method.removesuffix("_marlin") == own  # vLLM's aliases
    if not quantized and (method in (None, *METHODS) or named_own):
        return None, None if named_own else method
    form = kept_form(quant, cfg) if quant is not None and cfg is not None else None
    if quantized and method is None and form == "fp8" and jax.default_backend() == "cpu":
        logger.info("the checkpoint's float8 weights are dequantized at load on the CPU (--quantization fp8 keeps "
                    "them in float8)")
        return None, None
    if quantized and (method in (None, form) or named_own):
        if form is None:
            logger.info("the checkpoint's quantized weights (%s) are dequantized at load to the model's dtype", own)
        return form, None
    if quantized and form is None and method in METHODS:  # (gpt-oss-120b's MXFP4 experts as int8 or fp8)
        logger.info("the checkpoint's quantized weights (%s) are dequantized and quantized again as %s, tensor by "
                    "tensor as they load", own, method)
        return method, None
    has = f"its weights are quantized with {own!r}" if quantized else "its weights are not quantized"
    raise UnsupportedModelError(
        f"quantization {method!r} does not match {path}: {has}. jaxserve reads fp8, compressed-tensors, gptq, awq, "
        "mxfp4, bitsandbytes and gguf "
        f"checkpoints (float8 and int8 weights with a scale per tensor or channel held so, others dequantized to "
        f"the model's dtype) and quantizes an unquantized checkpoint's weights at load with {', '.join(METHODS)}; "
        "leave --quantization out to serve the checkpoint as it is")


def kept_form(quant: CheckpointQuantization, cfg: ModelConfig) -> str | None:
    """The in-memory form (`models.quantized.METHODS`) that holds a quantized checkpoint's projections exactly:
    "fp8" or "int8" when every projection is stored so (`quantization.keepable`), "experts_int8" when a MoE
    model's experts are int8 (the rest dequantized); None for any other checkpoint (its weights are dequantized)."""
    if cfg.family in GRANITE_MOE_FAMILIES:  # (its experts are fused tensors, not linear modules)
        return None
    forms: dict[str, set[str | None]] = {}
    for module, field in projection_modules(cfg).items():
        forms.setdefault(field, set()).add(keepable(quant.scheme(module)))
    held = set().union(*forms.values()) if forms else {None}
    if len(held) == 1 and None not in held:
        return held.pop()
    experts = [v for f, v in forms.items() if f.startswith("we_")]
    if experts and all(v == {"int8"} for v in experts):
        return "experts_int8"
    return None


def quantize_model(params: Params, cfg: ModelConfig, plan: Any, method: str) -> tuple[Params, ModelConfig, Any]:
    """Freshly loaded float `params` with their projections quantized by `method` where they lie (each float
    weight released as it goes); the config and plan that describe them."""
    before = params_bytes(params)
    cfg = dataclasses.replace(cfg, weight_quant=method)  # refuses a method the model cannot take, by name
    shardings = None
    if plan is not None:
        plan = plan.with_weight_quant(method)
        shardings = plan.param_shardings()
    declared = declare_params(plan.model_cfg if plan else cfg)
    params = dataclasses.replace(params, **{  # (a model's dense first layers, a hybrid's attention layers apart too)
        name: quantize_layers(getattr(params, name), getattr(declared, name),
                              None if shardings is None else getattr(shardings, name), release=True)
        for name in ("layers", "dense_layers", "attn_layers", "mlp_layers") if getattr(params, name) is not None})
    logger.info("weights quantized at load (%s): %.1f -> %.1f MiB per device", method, before / 2**20,
                params_bytes(params) / 2**20)
    return params, cfg, plan


def params_bytes(params: Params) -> int:
    """Bytes of weights on one device (all of them on a single device; one shard of each when sharded)."""
    return sum(x.addressable_shards[0].data.nbytes if hasattr(x, "addressable_shards") else x.size * x.dtype.itemsize
               for x in jax.tree.leaves(params))
