"""Float8 KV cache scales measured on the model's own keys and values (`--calculate-kv-scales`).

A float8 page holds K / k_scale and V / v_scale, one scale per layer (`LayerParams.k_scale`). Scale
1.0 suits a model whose keys and values stay well inside the format's range (SmolLM2's reach 19 and
10, against float8_e4m3fn's 448); a model whose activations reach past it would saturate. These scales
come from one forward pass over built-in text at start-up, into a float32 cache: each layer's largest
|K| and |V| is mapped to a quarter of the format's largest value, which leaves room for inputs that
reach past what the calibration text did. Checkpoint scales (`self_attn.k_scale`) are replaced.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.engine.model_loading import LoadedModel, resolve_kv_cache_dtype
from jaxserve.engine_args import EngineArgs
from jaxserve.models.inputs import KVCache, ModelInputs

logger = logging.getLogger("jaxserve.engine")

HEADROOM = 4.0
"""The calibration's largest |K| (or |V|) maps to the format's largest value / HEADROOM."""

CALIBRATION_TEXTS = (
    "The committee met on Tuesday to review the budget for the coming year. After a long discussion, the "
    "members agreed to fund the new library wing and to postpone the repairs to the sports hall.",
    "def merge(a, b):\n    out = []\n    while a and b:\n        out.append(a.pop(0) if a[0] < b[0] else "
    "b.pop(0))\n    return out + a + b\n\nprint(merge([1, 4, 9], [2, 3, 10]))",
    "Q: What is 17 * 23? A: 17 * 23 = 391. Q: And 391 / 17? A: 23. Table: 2024-01-05, 3.14159, 2.71828, "
    "1e-9, 6.022e23, #FF8800, 192.168.0.1, ISBN 978-3-16-148410-0.",
    "La réunion a commencé à neuf heures. Die Sitzung begann um neun Uhr. 会议在九点开始。Встреча началась в "
    "девять часов. 会議は九時に始まりました。",
    "Write a short story about a lighthouse keeper who finds a message in a bottle, in three paragraphs, "
    "with dialogue, and end it with a question.",
)


def calibration_ids(loaded: LoadedModel) -> list[list[int]]:
    """The calibration texts as the model sees requests: in its chat template when it has one."""
    tok = loaded.tokenizer
    if tok.chat_template:
        return [tok.encode_chat([{"role": "user", "content": t}]) for t in CALIBRATION_TEXTS]
    return [tok.encode(t, add_special_tokens=True) for t in CALIBRATION_TEXTS]


def measure_kv_amax(loaded: LoadedModel, page_size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Each attention layer's largest |K| and |V| (float32, [L] each) over the calibration text, and its token
    count."""
    cfg, plan = loaded.config, loaded.plan
    seqs, next_page = [], 1  # page 0 is the padding tokens' page
    for ids in calibration_ids(loaded):
        n = -(-len(ids) // page_size)
        seqs.append((ids, 0, list(range(next_page, next_page + n))))
        next_page += n
    tokens = sum(len(ids) for ids, _, _ in seqs)
    slots = len(seqs) + 1 if cfg.mamba is not None else 0  # (a hybrid model's Mamba states: sequence i in slot i + 1)
    inputs = ModelInputs.build(seqs, page_size, num_tokens=-(-tokens // 64) * 64, num_seqs=len(seqs),
                               pages_per_seq=max(len(p) for _, _, p in seqs),
                               state_slots=list(range(1, slots)) if slots else None)
    kv = (plan.allocate_kv if plan else functools.partial(KVCache.allocate, cfg))(
        next_page, page_size, jnp.float32, False, slots)

    def amax(params, kv, inputs):
        _, kv = loaded.forward_fn(params, kv, inputs, cfg, "xla")
        return (jnp.max(jnp.abs(kv.k[:, 1:]), axis=(1, 2, 3, 4)),
                jnp.max(jnp.abs(kv.v[:, 1:]), axis=(1, 2, 3, 4)))

    replicated = plan.replicated() if plan else None
    k_max, v_max = jax.jit(amax, out_shardings=replicated)(loaded.params, kv, inputs)
    return np.asarray(k_max, np.float32), np.asarray(v_max, np.float32), tokens


def scales_from_amax(amax: np.ndarray, kv_dtype) -> np.ndarray:
    """Per-layer scales that map `amax` to the format's largest value / HEADROOM (a layer that stayed
    at zero keeps scale 1)."""
    top = float(jnp.finfo(kv_dtype).max)
    amax = np.asarray(amax, np.float32)
    return np.where(amax > 0, amax * HEADROOM / top, 1.0).astype(np.float32)


def with_kv_scales(loaded: LoadedModel, k_scale: np.ndarray, v_scale: np.ndarray) -> LoadedModel:
    """`loaded` whose layers carry these scales (its config and sharding plan then declare them)."""
    cfg = dataclasses.replace(loaded.config, kv_cache_scales=True)
    plan = loaded.plan
    if plan is not None:
        plan = dataclasses.replace(plan, model_cfg=cfg,
                                   source_cfg=dataclasses.replace(plan.source_cfg, kv_cache_scales=True))

    def place(host: np.ndarray) -> jax.Array:
        return jax.device_put(host, plan.sharding(("layers",)[:host.ndim])) if plan else jax.device_put(host)

    layers, dense = loaded.params.layers, loaded.params.dense_layers
    if loaded.params.attn_layers is not None:  # a hybrid model's: on its attention layers' own stack
        attn = dataclasses.replace(loaded.params.attn_layers, k_scale=place(k_scale), v_scale=place(v_scale))
        return dataclasses.replace(loaded, config=cfg, params=dataclasses.replace(loaded.params, attn_layers=attn),
                                   plan=plan)
    if isinstance(layers, tuple):  # per-layer params (`unstack_layers`)
        layers = tuple(dataclasses.replace(lp, k_scale=place(k_scale[i]), v_scale=place(v_scale[i]))
                       for i, lp in enumerate(layers))
    else:  # stacked: a MoE model's dense layers apart (`Params.dense_layers`: its first ones, or Llama 4 Maverick's)
        rows = np.array([dense is not None and cfg.dense_layer(i) for i in range(cfg.num_layers)])
        layers = dataclasses.replace(layers, k_scale=place(k_scale[~rows]), v_scale=place(v_scale[~rows]))
        if dense is not None:
            dense = dataclasses.replace(dense, k_scale=place(k_scale[rows]), v_scale=place(v_scale[rows]))
    params = dataclasses.replace(loaded.params, layers=layers, dense_layers=dense)
    return dataclasses.replace(loaded, config=cfg, params=params, plan=plan)


def calculate_kv_scales(loaded: LoadedModel, kv_dtype, page_size: int) -> LoadedModel:
    """`loaded` with per-layer float8 KV scales measured on the calibration text."""
    if loaded.config.kv_lora_rank:
        raise ValueError(f"--calculate-kv-scales is not supported for {loaded.config.family}: its pages hold "
                         "latents, which a float8 cache stores unscaled")
    t0 = time.perf_counter()
    k_max, v_max, tokens = measure_kv_amax(loaded, page_size)
    k_scale, v_scale = scales_from_amax(k_max, kv_dtype), scales_from_amax(v_max, kv_dtype)
    logger.info("KV cache scales calculated over %d tokens in %.1f s: |K| max %.3g-%.3g (k_scale %.3g-%.3g), "
                "|V| max %.3g-%.3g (v_scale %.3g-%.3g)", tokens, time.perf_counter() - t0, k_max.min(),
                k_max.max(), k_scale.min(), k_scale.max(), v_max.min(), v_max.max(), v_scale.min(), v_scale.max())
    return with_kv_scales(loaded, k_scale, v_scale)


def with_kv_cache_dtype(loaded: LoadedModel, args: EngineArgs) -> tuple[LoadedModel, jnp.dtype]:
    """The KV cache dtype `args` asks for, and the model, with its float8 scales calculated when asked."""
    kv_dtype = resolve_kv_cache_dtype(args, loaded.dtype)
    if args.calculate_kv_scales:
        loaded = calculate_kv_scales(loaded, kv_dtype, args.page_size)
    return loaded, kv_dtype
