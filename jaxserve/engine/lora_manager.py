"""LoRA adapters in an engine: PEFT adapter directories read into the parameters' adapter slots.

An engine started with `enable_lora` holds `max_loras` slots of rank `max_lora_rank` in every layer
(`models/lora.py`). Adapters named by `lora_modules` load at start-up, and a request's `LoRARequest` with
a path loads another on first use; any number are known, and a request's adapter takes a slot when it
runs (`LoraManager`). An adapter's requests share cached prefixes only with each other, under a cache
namespace (`lora_cache_salt`: the adapter's name, as vLLM keys them) joined to the request's salt, because
its KV differs from the base model's. Unloading an adapter drops its cached pages, so a later adapter of
the same name never reads them.

A PEFT directory holds `adapter_config.json` and `adapter_model.safetensors`. Read: LoRA on the
attention and MLP projections of a dense model (q/k/v/o, gate/up/down) and of a MoE model's dense first layers, and on
the attention, the experts (`engine.lora_experts`: per expert, or on the fused expert parameters as
`target_parameters`; split over devices as the experts are), the router (`mlp.gate`, as a module or as
`target_parameters`) and the shared expert (`shared_expert` / `shared_experts` gate/up/down, Qwen2-MoE's
`shared_expert_gate`) of its MoE layers; any rank up to `max_lora_rank`, scale `lora_alpha / r` (or `/ sqrt(r)` with
`use_rslora`), per module where `rank_pattern` / `alpha_pattern` say; fused projections as the ones they pack (Phi-3's
`qkv_proj` and `gate_up_proj`, GLM-4's `gate_up_proj`, Granite MoE's shared `input_linear`; its `output_linear`,
router and experts too; GPT-2's and GPTBigCode's `c_attn`, GPT-NeoX's `query_key_value`); GPT-2's, GPTBigCode's,
GPT-NeoX's and GPT-J's projections under their own names; an attention output gate's own projection in the query
projection's slot (`lora_gate`).
Refused by name: DoRA, biases, `modules_to_save`, `fan_in_fan_out` (but on GPT-2's Conv1D), other targets (embeddings,
the LM head).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import math
import os
import re
from typing import Any

import jax
import numpy as np

from jaxserve.config import INTERLEAVED_ROPE_FAMILIES, ModelConfig
from jaxserve.engine.lora_experts import ExpertTensors, fused_parameters
from jaxserve.engine.lora_gate import SEPARATE_GATE, adapter_rows, gate_tensor, query_rows, write_gates
from jaxserve.loader.falcon_keys import falcon_folded
from jaxserve.loader.gpt2_keys import own_adapter_key, qkv_adapter_rows
from jaxserve.loader.keymap import halfsplit_rows
from jaxserve.loader.mamba_keys import hybrid_adapter_key
from jaxserve.loader.mimo_keys import mimo_adapter_matrix
from jaxserve.loader.mla_keys import kv_rows, q_rows
from jaxserve.lora_request import LORA_SALT_PREFIX, LoRARequest, in_lora_namespace, lora_cache_salt
from jaxserve.models.lora import (
    SLOT_AXIS,
    LoraLayer,
    attention_targets,
    dense_targets,
    empty_lora,
    lora_shapes,
    moe_targets,
    target_dims,
)

logger = logging.getLogger(__name__)
_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.|gpt_neox\.|transformer\.)?(?:language_model\.)?(?:model\.)?"
                  r"(?:layers|h|blocks)\.(\d+)\.(?:(?:self_attn|self_attention|attention|attn|mlp|block_sparse_moe|"
                  r"feed_forward|ffn)\.)?"
                  r"((?:shared_experts?\.|shared_mlp\.)?\w+)\.lora_([AB])\.weight$")
# Modules under another name (Granite MoE's shared MLP and router, StarCoder2's and Phi's MLPs, Phi's `dense`), and
# fused projections as the targets they pack (B's rows in this order; one A): Phi-3's qkv_proj and gate_up_proj.
_ALIASES = {"shared_mlp.output_linear": "shared.down_proj", "router": "gate", "c_fc": "up_proj", "c_proj": "down_proj",
            "fc1": "up_proj", "fc2": "down_proj", "dense": "o_proj", "query_key_value": "qkv_proj",  # (GPT-NeoX's)
            "dense_h_to_4h": "up_proj", "dense_4h_to_h": "down_proj", "out_proj": "o_proj", "fc_in": "up_proj",
            "fc_out": "down_proj", "Wqkv": "qkv_proj"}  # (GPT-J's; MPT's)
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
          "shared_mlp.input_linear": ("shared.gate_proj", "shared.up_proj")}


class LoRAError(ValueError):
    """A LoRA adapter that cannot be served, or a request for one that is not there."""


def read_adapter(path: str, cfg: ModelConfig, max_rank: int, dtype: Any, kv_repeat: int = 1) -> dict[str, np.ndarray]:
    """A PEFT adapter directory as `LoraLayer` field arrays for one slot ([L, ...] of `lora_shapes`: each A
    in its place among the down projections of its input, ranks zero-padded, the scale folded into B).
    `kv_repeat` > 1 (tensor parallelism over fewer KV heads than devices) repeats each KV head's columns of
    the k and v B's as the sharding plan repeats the KV heads of the weights. A MoE model's experts' tensors:
    `engine.lora_experts`."""
    from safetensors.numpy import load_file

    cfg_file, weights = os.path.join(path, "adapter_config.json"), os.path.join(path, "adapter_model.safetensors")
    for f in (cfg_file, weights):
        if not os.path.isfile(f):
            raise LoRAError(f"LoRA adapter {path!r} has no {os.path.basename(f)} (a PEFT adapter directory has "
                            "adapter_config.json and adapter_model.safetensors)")
    with open(cfg_file, encoding="utf-8") as f:
        ac = json.load(f)
    if ac.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"adapter {path!r} is a {ac.get('peft_type')} adapter; only LORA is served")
    for key in ("use_dora", "fan_in_fan_out"):  # (GPT-2's Conv1D: PEFT sets fan_in_fan_out, its A and B as ever)
        if ac.get(key) and (key, cfg.family) != ("fan_in_fan_out", "gpt2"):
            raise LoRAError(f"adapter {path!r} sets {key}; it is not supported")
    if ac.get("bias", "none") != "none":
        raise LoRAError(f"adapter {path!r} trains biases (bias {ac['bias']!r}); only bias 'none' is supported")
    for key in ("modules_to_save", "lora_bias", "layer_replication",
                "trainable_token_indices", "alora_invocation_tokens", "use_qalora"):
        if ac.get(key):
            raise LoRAError(f"adapter {path!r} sets {key}; it is not supported")
    rank = _ranks(ac, path, max_rank)
    dims, L = target_dims(cfg), cfg.num_layers
    out = read_shapes(cfg, max_rank, dtype)
    seen: set = set()
    moe = moe_targets(cfg)  # a MoE layer's targets: the attention's, its router's and shared expert's (and experts)
    experts_read = ExpertTensors(out, fused_parameters(ac, cfg, path, LoRAError), cfg, rank, max_rank, seen, path,
                                 LoRAError)
    gates: dict[str, np.ndarray] = {}  # (an attention gate's own projection: in q_proj's slot, after its pair)
    for name, w in load_file(weights).items():
        if experts_read.take(name, w):
            continue
        if gate_tensor(cfg, name):
            gates[name] = w
            continue
        m = _KEY.match(hybrid_adapter_key(name, cfg) if cfg.mamba is not None else own_adapter_key(name, cfg))
        layer, module, which = (int(m.group(1)), re.sub(r"^shared_experts?\.", "shared.", m.group(2)), m.group(3)) \
            if m else (0, "", "")
        module = _ALIASES.get(module, module)
        w = mimo_adapter_matrix(module, which, layer, w, cfg)  # (MiMo-V2-Flash's k, v and o: as its weights are held)
        w = qkv_adapter_rows(module, which, w, cfg)  # (GPT-NeoX's fused q, k and v: each head's rows together)
        parts = _FUSED.get(module, (module,))
        if not moe and module.startswith("shared"):  # a dense Granite 4.0's MLP is its shared MLP
            parts = tuple(p.removeprefix("shared.") for p in parts)
        targets = attention_targets(cfg) | moe if moe and layer >= cfg.first_dense_layers else dense_targets(cfg)
        if not all(p in targets for p in parts):
            raise LoRAError(f"adapter {path!r}: tensor {name!r} is not LoRA on a projection jaxserve serves "
                            f"({', '.join(dense_targets(cfg))} of a dense model or layer; "
                            f"{', '.join(attention_targets(cfg))}, the experts, router (gate) and shared expert of a "
                            "MoE layer" + (f"; {cfg.family}'s: {', '.join(targets)}" if moe else "") + ")")
        if layer >= L:
            raise LoRAError(f"adapter {path!r}: tensor {name!r} names layer {layer}; the model has {L}")
        own = dims if cfg.gemma4 is None else target_dims(cfg, layer)  # (Gemma 4's layers differ)
        k, outs = own[parts[0]][0], [adapter_rows(cfg, p, own[p][1]) for p in parts]
        r, scale = rank(name.removeprefix("base_model.model.").rsplit(".lora_", 1)[0])
        want = (r, k) if which == "A" else (sum(outs), r)
        if tuple(w.shape) != want:
            raise LoRAError(f"adapter {path!r}: tensor {name!r} has shape {tuple(w.shape)}, expected {want}")
        w = w.astype(np.float32)
        for part, rows in zip(parts, np.split(w, np.cumsum(outs)[:-1]) if which == "B" else [w] * len(parts),
                              strict=True):
            a_field, place, b_field = targets[part]
            if which == "A":  # in its place among the down projections of the same input
                out[a_field][layer, :k, place * max_rank: place * max_rank + r] = rows.T
                continue
            if cfg.kv_lora_rank and part in ("q_proj", "q_b_proj", "kv_a_proj_with_mqa"):  # rotary rows half-split
                rows = kv_rows(rows, cfg) if part == "kv_a_proj_with_mqa" else q_rows(rows, cfg)
            elif cfg.family in INTERLEAVED_ROPE_FAMILIES and part in ("q_proj", "k_proj"):  # as the model's were read
                rows = halfsplit_rows(rows, cfg)
            elif part == "q_proj" and cfg.family in SEPARATE_GATE:  # (the gate channels after each query: its own)
                rows = query_rows(cfg, rows)
            if cfg.falcon is not None:  # (its multipliers, folded into its weights, fold into the deltas' B alike)
                where = "self_attn" if part in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                rows = falcon_folded(f"model.layers.{layer}.{where}.{part}.weight", rows, cfg)
            out[b_field][layer, :r, :rows.shape[0]] = rows.T * scale
        seen.add((layer, module, which))
    experts_read.finish()
    if gates:  # (after every q_proj pair)
        write_gates(gates, out, cfg, rank, max_rank, seen, path, attention_targets(cfg)["q_proj"], LoRAError)
    unpaired = sorted({(ly, mod) for ly, mod, _ in seen if {(ly, mod, "A"), (ly, mod, "B")} - seen})
    if unpaired:
        raise LoRAError(f"adapter {path!r}: layer {unpaired[0][0]} {unpaired[0][1]} has lora_A or lora_B alone")
    if not seen:
        raise LoRAError(f"adapter {path!r} holds no LoRA weights")
    if kv_repeat > 1 and cfg.gemma4 is not None:
        raise LoRAError("LoRA adapters on Gemma 4 over more devices than its KV heads are not supported")
    if kv_repeat > 1 and not cfg.kv_lora_rank:
        for f in ("b_k", "b_v"):
            b = out[f].reshape(L, max_rank, cfg.num_kv_heads, cfg.head_dim)
            out[f] = np.repeat(b, kv_repeat, axis=2).reshape(L, max_rank, -1)
    return out


def _ranks(ac: dict[str, Any], path: str, max_rank: int) -> Any:
    """`rank(key)`: the (rank, scale) of the module or parameter PEFT names `key` ("model.layers.0.self_attn.q_proj"):
    `r` and `lora_alpha`, or the first of `rank_pattern`'s and `alpha_pattern`'s keys (regular expressions) to match the
    end of the key, as PEFT picks them (its conversion of fused experts writes them: the gate_up_proj rank 2 r)."""
    r, rslora = ac.get("r"), bool(ac.get("use_rslora"))
    ranks, alphas = ac.get("rank_pattern") or {}, ac.get("alpha_pattern") or {}
    for given in (r, *ranks.values()):
        if not isinstance(given, int) or isinstance(given, bool) or given < 1:
            raise LoRAError(f"adapter {path!r}: adapter_config.json gives rank {given!r}; a positive integer is needed")

    def pick(pattern: dict[str, Any], key: str, default: Any) -> Any:
        return next((v for p, v in pattern.items() if re.match(rf"(.*\.)?({p})$", key)), default)

    def rank(key: str) -> tuple[int, float]:
        rk = pick(ranks, key, r)
        if rk > max_rank:
            raise LoRAError(f"adapter {path!r} has rank {rk}, above max_lora_rank {max_rank}, at {key} (raise "
                            "--max-lora-rank)")
        return rk, float(pick(alphas, key, ac.get("lora_alpha", r))) / (math.sqrt(rk) if rslora else rk)

    return rank


def read_shapes(cfg: ModelConfig, max_rank: int, dtype: Any) -> dict[str, np.ndarray]:
    """Zeroed arrays of one adapter's `read_adapter` shapes."""
    return {f: np.zeros((cfg.num_layers, *shape), dtype) for f, shape in lora_shapes(cfg, max_rank).items()}


def with_lora_slots(loaded: Any, num_slots: int, rank: int) -> Any:
    """`loaded` (a `LoadedModel`) with zeroed adapter slots in every layer of its parameters; over a mesh
    they are replicated (a rank-r delta is small beside its projection: the partitioner slices it to each
    device's heads or MLP columns, and sums the partial products of o and down)."""
    params = loaded.params
    if (cfg := loaded.config).moe_layer_step > 1 or cfg.mamba is not None and not cfg.attention_layers:
        why = "its experts in every other layer" if cfg.moe_layer_step > 1 else "Mamba layers, no attention or MLP"
        raise LoRAError(f"LoRA adapters on {cfg.family} ({why}) are not supported")
    lora = empty_lora(loaded.config, num_slots, rank, loaded.dtype)
    if loaded.plan is not None:  # each device (of every process) gets its own copy
        sh = loaded.plan.replicated()
        lora = jax.tree.map(
            lambda x: jax.make_array_from_callback(x.shape, sh, lambda i, h=np.asarray(x): h[i]), lora)
    if params.dense_layers is not None and loaded.config.mamba is None:  # the dense first layers' slots apart
        # (Gemma 4's full-attention layers'; a hybrid model's slots, every layer's, stay in `layers`: its
        # `dense_layers` hold MLPs alone)
        rows = _dense_rows(loaded.config)
        params = dataclasses.replace(params, dense_layers=dataclasses.replace(
            params.dense_layers, lora=jax.tree.map(lambda x: x[rows], lora)))
        lora = jax.tree.map(lambda x: x[~rows], lora)
    params = dataclasses.replace(params, layers=dataclasses.replace(params.layers, lora=lora))
    return dataclasses.replace(loaded, params=params)


class LoraManager:
    """The engine's adapters: those it knows (name to path, their weights kept on the host), and which of them
    hold the `max_loras` device slots.

    The scheduler runs requests of at most `max_loras` adapters at once (vLLM's `--max-loras`: adapters in
    one batch, not adapters known); a request of another adapter waits its turn in the queue. When an
    admitted request's adapter holds no slot, it takes a free one, or the least recently used slot whose
    adapter no running request uses."""

    def __init__(self, engine: Any, max_loras: int, max_rank: int, modules: tuple[tuple[str, str], ...] = (),
                 max_cpu_loras: int | None = None):
        self.engine = engine
        self.max_rank = max_rank
        self.slots: list[str | None] = [None] * max_loras
        self.paths: dict[str, str] = {}
        """Every known adapter, name to path (served as models)."""
        self.max_cpu_loras = max_cpu_loras or max_loras
        # Host copies of the most recently used adapters' weights (at most max_cpu_loras, vLLM's
        # `--max-cpu-loras`); another known adapter is read from its path again when it takes a slot.
        self._weights: collections.OrderedDict[str, dict[str, np.ndarray]] = collections.OrderedDict()
        self._last_use: dict[str, int] = {}
        self._uses = 0
        self.on_change: Any = None
        """Called as `on_change(name, path)` after an adapter is loaded, `(name, None)` after one is unloaded
        (a multi-host cluster's process 0 sends the change to the other processes)."""
        for name, path in modules:
            self.load(name, path)

    def load(self, name: str, path: str) -> None:
        """Read the adapter at `path` under `name` (into a slot, while one is free)."""
        if name in self.paths:
            raise LoRAError(f"a LoRA adapter named {name!r} is already loaded (from {self.paths[name]!r})")
        self._keep(name, self._read(path))
        self.paths[name] = path
        logger.info("LoRA adapter %r from %s", name, path)
        if None in self.slots:
            self._place(name, self.slots.index(None))
        if self.on_change is not None:
            self.on_change(name, path)

    def _read(self, path: str) -> dict[str, np.ndarray]:
        e, plan = self.engine, self.engine.model.plan
        return read_adapter(path, plan.source_cfg if plan else e.model.config, self.max_rank,
                            np.dtype(e.model.dtype), plan.kv_repeat if plan else 1)

    def _keep(self, name: str, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Hold `name`'s host weights as the most recently used, dropping the least recent beyond the limit."""
        self._weights[name] = weights
        self._weights.move_to_end(name)
        while len(self._weights) > self.max_cpu_loras:
            self._weights.popitem(last=False)
        return weights

    def _host_weights(self, name: str) -> dict[str, np.ndarray]:
        weights = self._weights.get(name)
        if weights is None:
            logger.info("LoRA adapter %r read again from %s", name, self.paths[name])
        return self._keep(name, weights if weights is not None else self._read(self.paths[name]))

    def _place(self, name: str, slot: int) -> None:
        e = self.engine
        e.runner.params = _set_slot(e.runner.params, slot, self._host_weights(name), e.model.config)
        e.model = dataclasses.replace(e.model, params=e.runner.params)
        self.slots[slot] = name

    def place_all(self) -> None:
        """Each slot's adapter placed again (the engine's weights were replaced, their slots zeroed)."""
        for slot, name in enumerate(self.slots):
            if name is not None:
                self._place(name, slot)

    def slot_for(self, request: Any) -> int:
        """The slot of a running request's adapter (-1: none), placing the adapter there first if it holds
        none. The scheduler runs at most `max_loras` adapters at once, so a slot is always found."""
        name = request.lora_name
        if name is None:
            return -1
        self._uses += 1
        self._last_use[name] = self._uses
        if name in self.slots:
            return self.slots.index(name)
        running = {r.lora_name for r in self.engine.scheduler.running}
        idle = [i for i, held in enumerate(self.slots) if held not in running]
        if not idle:
            raise RuntimeError(f"LoRA adapter {name!r} runs while all {len(self.slots)} slots serve running "
                               "requests of other adapters: the scheduler admitted more than max_loras adapters")
        slot = min(idle, key=lambda i: -1 if self.slots[i] is None else self._last_use.get(self.slots[i], 0))
        if self.slots[slot] is not None:
            logger.info("LoRA adapter %r leaves slot %d for %r", self.slots[slot], slot, name)
        self._place(name, slot)
        return slot

    def unload(self, name: str) -> None:
        """Forget `name` (its slot zeroed); refused while a queued or running request uses it."""
        if name not in self.paths:
            raise LoRAError(f"LoRA adapter {name!r} is not loaded (loaded: {', '.join(self.paths) or 'none'})")
        sched = self.engine.scheduler
        users = sum(1 for r in (*sched.running, *sched.waiting) if r.lora_name == name)
        if users:
            raise LoRAError(f"LoRA adapter {name!r} is in use by {users} request(s); unload it when they end")
        cache = sched.cache  # its cached KV goes with it: a later adapter of that name must not read it
        if cache is not None and not cache.drop_salts(lambda salt: in_lora_namespace(name, salt)):
            raise LoRAError(f"LoRA adapter {name!r} has cached pages in use (a KV transfer); unload it later")
        if name in self.slots:
            slot = self.slots.index(name)
            e = self.engine
            e.runner.params = _set_slot(e.runner.params, slot, read_shapes(e.model.config, self.max_rank,
                                                                           np.dtype(e.model.dtype)), e.model.config)
            e.model = dataclasses.replace(e.model, params=e.runner.params)
            self.slots[slot] = None
        for registry in (self.paths, self._weights, self._last_use):
            registry.pop(name, None)
        logger.info("LoRA adapter %r unloaded", name)
        if self.on_change is not None:
            self.on_change(name, None)

    def request_fields(self, lora: LoRARequest | str | None, cache_salt: str | None) -> dict[str, Any]:
        """A request's `Request` fields for its adapter (loaded first if a path is given): its name and its
        cache salt."""
        if lora is None:
            return {"cache_salt": cache_salt}
        name = lora if isinstance(lora, str) else lora.lora_name
        if name not in self.paths:
            path = None if isinstance(lora, str) else lora.lora_path
            if path is None:
                known = ", ".join(self.paths) or "none"
                raise LoRAError(f"LoRA adapter {name!r} is not loaded (loaded: {known}); give its lora_path")
            self.load(name, path)
        return {"lora_name": name, "cache_salt": lora_cache_salt(name, cache_salt)}


def _dense_rows(cfg: ModelConfig) -> np.ndarray:
    """Which layers' slots `Params.dense_layers` holds (its dense first layers, Gemma 4's full-attention ones)."""
    return np.array([cfg.dense_layer(i) for i in range(cfg.num_layers)])


def _set_slot(params: Any, slot: int, arrays: dict[str, np.ndarray], cfg: ModelConfig) -> Any:
    """`params` with adapter slot `slot` of every layer set to `arrays` (stacked or per-layer layouts; each field's
    slots at its `SLOT_AXIS`)."""
    def put(old: jax.Array, f: str, stacked: bool, host: np.ndarray) -> jax.Array:
        new = old.at[(slice(None),) * (SLOT_AXIS.get(f, 0) + stacked) + (slot,)].set(host.astype(old.dtype))
        # Over a mesh, kept on its layout: the step's input layouts are fixed.
        return jax.device_put(new, old.sharding) if isinstance(old.sharding, jax.sharding.NamedSharding) else new

    if isinstance(params.layers, tuple):
        layers = tuple(dataclasses.replace(lp, lora=LoraLayer(**{
            f: put(getattr(lp.lora, f), f, False, arrays[f][i]) for f in arrays})) for i, lp in enumerate(params.layers))
        return jax.block_until_ready(dataclasses.replace(params, layers=layers))

    def stack(layers: Any, rows: np.ndarray) -> Any:  # the stack of layers `rows`
        return dataclasses.replace(layers, lora=LoraLayer(**{
            f: put(getattr(layers.lora, f), f, True, arrays[f][rows]) for f in arrays}))

    dense = params.dense_layers  # a model's dense layers, stacked apart, with their slots (not a hybrid's)
    dense = None if dense is None or dense.lora is None else dense
    rows = _dense_rows(cfg) if dense is not None else np.zeros(cfg.num_layers, bool)
    return jax.block_until_ready(dataclasses.replace(
        params, dense_layers=params.dense_layers if dense is None else stack(dense, rows),
        layers=stack(params.layers, ~rows)))


def lora_fields(manager: LoraManager | None, lora: LoRARequest | str | None, cache_salt: str | None) -> dict:
    """`Request` fields for a request's adapter; names the problem when the engine serves none."""
    if cache_salt is not None and cache_salt.startswith(LORA_SALT_PREFIX):
        raise ValueError(f"cache_salt {cache_salt!r}: salts beginning {LORA_SALT_PREFIX!r} are LoRA adapters' "
                         "cache namespaces")
    if manager is None:
        if lora is not None:
            raise LoRAError("this engine serves no LoRA adapters; start it with enable_lora (--enable-lora)")
        return {"cache_salt": cache_salt}
    return manager.request_fields(lora, cache_salt)
