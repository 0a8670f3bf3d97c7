"""Sleep mode and weight updates: an engine that gives its device memory back between uses and takes new
weights without restarting (vLLM's sleep mode, SGLang's `update_weights_from_disk`).

Reinforcement-learning rollouts share the accelerators between a trainer and the engine: the engine
sleeps while the trainer steps, then wakes with the trainer's new weights. Each call runs between engine
steps and refuses while requests are in flight (finish or abort them first), so no request ever sees two
sets of weights or loses its KV.

- `sleep(level=1)`: the KV cache's pages are freed on the device (the prefix cache is emptied first: its
  KV is gone, and a router hears `AllBlocksCleared`); the weights are copied to host memory and freed on
  the device. `level=2` frees the weights without a copy (new ones are about to come).
- `wake_up(tags=None)`: "weights" back onto the device (from the host copy; after level 2, read again
  from the engine's checkpoint unless `load_weights` gave new ones), "kv_cache" allocated again (zeroed);
  no tags: both. Waking the weights alone lets new ones load before the KV cache takes its memory again.
- `load_weights(source=None)`: the weights of a checkpoint (default: the engine's own), or tensors in
  memory named as in an HF checkpoint (a trainer's, in the same process), replace the engine's through
  the same loading path as at start-up (each tensor into its shards, KV scales, LoRA slots, the runner's
  layout).
  The new weights must have the old ones' every shape, dtype and layout, so the compiled steps serve
  them as they are (nothing recompiles); a checkpoint of another shape is refused, naming the first
  array that differs. The prefix cache is emptied (its KV came from the old weights), and LoRA adapters
  in slots are placed again. A draft model (speculative decoding) sleeps and wakes with the engine's weights
  and KV cache; weight updates leave its weights as they are.

While asleep (weights or KV cache off the device) the engine refuses requests (`EngineSleepingError`).
The engine accepts `sleep` only when started with `enable_sleep_mode` (vLLM's flag), which is also what
opens the server's `/sleep`, `/wake_up`, `/is_sleeping` and `/update_weights_from_disk`. One process's
engine only: a multi-host engine refuses (its hosts would have to act in lockstep).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.engine.errors import EngineError
from jaxserve.engine.kv_scales import with_kv_cache_dtype
from jaxserve.engine.lora_manager import with_lora_slots
from jaxserve.engine.model_loading import load_model, shard_model
from jaxserve.loader import load_params

logger = logging.getLogger(__name__)
TAGS = ("weights", "kv_cache")


class EngineSleepingError(EngineError):
    """A request came while the engine sleeps."""


class EngineBusyError(EngineError):
    """A sleep or weight update came while requests are in flight."""


def prepare_model(loaded: Any, args: Any, mesh: Any = None) -> tuple[Any, Any]:
    """A loaded model made ready to serve, as `args` asks: laid out over the devices (of `mesh`, when given),
    with its KV cache dtype (float8 scales measured when asked) and its LoRA adapter slots. Returns the model
    and the KV dtype."""
    loaded = dataclasses.replace(loaded, config=dataclasses.replace(loaded.config, moe_runner=args.moe_runner_backend))
    model, kv_dtype = with_kv_cache_dtype(shard_model(loaded, args, mesh=mesh), args)
    if args.enable_lora:  # zeroed adapter slots in every layer, filled by `LoraManager`
        model = with_lora_slots(model, args.max_loras, args.max_lora_rank)
    if model.vision is not None:  # an image-text model's vision side: each engine its own, on its first device (of
        # this process: on a cluster each process encodes the images process 0 sends it)
        mine = [d for d in model.plan.mesh.devices.flat if d.process_index == jax.process_index()] if model.plan else []
        device = mine[0] if mine else jax.local_devices()[0]
        model = dataclasses.replace(model, vision=model.vision.on(device))
    return model, kv_dtype


def _index_key(index: tuple[slice, ...]) -> tuple:
    return tuple((s.start, s.stop, s.step) for s in index)


@dataclasses.dataclass
class _HostArray:
    """A device array's data in host memory, one copy of each distinct shard, and where it goes back (to
    its devices as it was placed: an array left uncommitted to a device comes back uncommitted, or the
    steps would compile again for it)."""

    shape: tuple[int, ...]
    sharding: jax.sharding.Sharding
    committed: bool
    shards: dict[tuple, np.ndarray]

    @classmethod
    def of(cls, x: jax.Array) -> _HostArray:
        shards: dict[tuple, np.ndarray] = {}
        for s in x.addressable_shards:
            shards.setdefault(_index_key(s.index), np.asarray(s.data))
        return cls(x.shape, x.sharding, x.committed, shards)

    def to_device(self) -> jax.Array:
        if not self.committed:
            return jax.device_put(next(iter(self.shards.values())))
        return jax.make_array_from_callback(self.shape, self.sharding, lambda i: self.shards[_index_key(i)])


@dataclasses.dataclass
class _Spec:
    """A device array's shape, dtype and placement, to check new weights against and to allocate again."""

    shape: tuple[int, ...]
    dtype: Any
    sharding: jax.sharding.Sharding
    committed: bool

    @classmethod
    def of(cls, x: jax.Array) -> _Spec:
        return cls(x.shape, x.dtype, x.sharding, x.committed)

    def zeros(self) -> jax.Array:
        if not self.committed:
            return jnp.zeros(self.shape, self.dtype)
        return jax.jit(lambda: jnp.zeros(self.shape, self.dtype), out_shardings=self.sharding)()


def _delete(tree: Any) -> None:
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array) and not x.is_deleted():
            x.delete()


def check_same_layout(new: Any, old: Any) -> None:
    """ValueError naming the first array of `new` whose shape, dtype or sharding is not `old`'s."""
    new_flat, new_tree = jax.tree_util.tree_flatten_with_path(new)
    old_flat, old_tree = jax.tree_util.tree_flatten_with_path(old)
    if new_tree != old_tree:
        raise ValueError("the new weights are not laid out as the engine's (another architecture or "
                         "configuration); load a checkpoint of the served model's shapes")
    for (path, a), (_, b) in zip(new_flat, old_flat, strict=True):
        name = jax.tree_util.keystr(path)
        if a.shape != b.shape or a.dtype != b.dtype:
            raise ValueError(f"the new weights' {name} is {a.dtype}{list(a.shape)}, the engine's "
                             f"{b.dtype}{list(b.shape)}; load a checkpoint of the served model's shapes")
        if getattr(a, "sharding", None) is not None and not a.sharding.is_equivalent_to(b.sharding, len(a.shape)):
            raise ValueError(f"the new weights' {name} is laid out over the devices as {a.sharding}, the "
                             f"engine's as {b.sharding}")


class _Tensors:
    """Tensors in memory, named as in an HF checkpoint, read as a checkpoint's are (`loader.load_params`)."""

    def __init__(self, named: Mapping[str, Any] | Iterable[tuple[str, Any]]):
        self.named = named

    def tensors(self, cfg: Any) -> Iterator[tuple[str, np.ndarray]]:
        pairs = self.named.items() if isinstance(self.named, Mapping) else self.named
        for name, array in pairs:
            yield name, np.asarray(array, np.float32)


def _vision_params(encoder: Any, source: Any, dtype: Any) -> Any:
    """An image-text engine's new vision weights from tensors in memory (None for a text model); they must be
    there with the decoder's."""
    if encoder is None:
        return None
    from jaxserve.models.vision_towers import tower_for

    tower = tower_for(encoder.cfg)
    pairs = source.items() if isinstance(source, Mapping) else source
    tensors = list(_Tensors([(n, a) for n, a in pairs if tower.is_tensor(n)]).tensors(None))
    if not tensors:
        raise ValueError("an image-text model's new weights need its vision tower's and projector's tensors too")
    device = next(iter(jax.tree.leaves(encoder.params)[0].devices()))
    with jax.default_device(device):
        return tower.load(encoder.cfg, tensors, dtype, None)


class EngineMemory:
    """The sleep state of one engine (see the module docstring)."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.weights: Literal["device", "host", "discarded"] = "device"
        self.kv_on_device = True
        self._host: Any = None  # the weights' `_HostArray` tree, at level 1
        self._params_spec: Any = None  # the weights' shapes, dtypes and shardings, while off the device
        self._kv_spec: Any = None  # the KV cache's, while freed
        self._draft_host: Any = None  # a draft model's weights' `_HostArray` tree, at level 1

    @property
    def asleep(self) -> bool:
        return self.weights != "device" or not self.kv_on_device

    def check_serving(self) -> None:
        if self.asleep:
            raise EngineSleepingError("the engine is sleeping (its weights or KV cache are off the device); "
                                      "wake it up first (LLM.wake_up, or POST /wake_up)")

    def _check_idle(self, what: str) -> None:
        e = self.engine
        if jax.process_count() > 1:
            raise EngineError(f"{what} is not supported on a multi-host engine")
        if e.has_unfinished_requests():
            raise EngineBusyError(f"{what} needs an idle engine: {e.num_requests} request(s) are in flight "
                                  "(let them finish or abort them first)")

    def _reset_prefix_cache(self, what: str) -> None:
        if not self.engine.reset_prefix_cache():
            raise EngineBusyError(f"{what} needs the prefix cache emptied, and some of its pages are held "
                                  "(a KV transfer in progress); retry when it ends")

    def sleep(self, level: int = 1) -> None:
        e = self.engine
        if not e.args.enable_sleep_mode:
            raise EngineError("sleep mode is off: start the engine with enable_sleep_mode (--enable-sleep-mode)")
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (weights kept in host memory) or 2 (weights dropped), "
                             f"not {level!r}")
        self._check_idle("sleep")
        t0 = time.perf_counter()
        if self.kv_on_device:
            self._reset_prefix_cache("sleep")
            pools = (e.runner.kv, e.draft.kv if e.draft else None)  # a draft model's pool of the same pages too
            self._kv_spec = jax.tree.map(_Spec.of, pools)
            _delete(jax.block_until_ready(pools))
            self.kv_on_device = False
        if self.weights == "device":
            params = self._weights()
            self._params_spec = jax.tree.map(_Spec.of, params)
            if level == 1:
                self._host = jax.tree.map(_HostArray.of, params)
                self._draft_host = jax.tree.map(_HostArray.of, e.draft.params) if e.draft else None
            _delete((params, e.draft.params if e.draft else None))
            self.weights = "host" if level == 1 else "discarded"
        elif self.weights == "host" and level == 2:
            self._host, self._draft_host, self.weights = None, None, "discarded"
        logger.info("engine asleep (level %d) in %.2f s", level, time.perf_counter() - t0)

    def wake_up(self, tags: list[str] | tuple[str, ...] | None = None) -> None:
        tags = TAGS if tags is None else tuple(tags)
        unknown = [t for t in tags if t not in TAGS]
        if unknown:
            raise ValueError(f"unknown wake-up tags {unknown}; the tags are {list(TAGS)}")
        e = self.engine
        t0 = time.perf_counter()
        if "weights" in tags and self.weights == "host":
            self._use_params(jax.tree.map(_HostArray.to_device, self._host))
        elif "weights" in tags and self.weights == "discarded":
            self.load_weights(None)
        if "kv_cache" in tags and not self.kv_on_device:
            e.runner.kv, draft_kv = jax.tree.map(_Spec.zeros, self._kv_spec)
            if e.draft:
                e.draft.kv = draft_kv
            self.kv_on_device, self._kv_spec = True, None
        logger.info("engine woke (%s) in %.2f s", ", ".join(tags), time.perf_counter() - t0)

    def load_weights(self, source: str | Mapping[str, Any] | Iterable[tuple[str, Any]] | None = None) -> None:
        """New weights from a checkpoint directory or file (`source` a path; None: the served checkpoint, read
        again), or from tensors in memory: a mapping or pairs of HF parameter names and arrays (numpy or JAX,
        unquantized), as a trainer in the same process holds them (quantized as at load when the engine's
        weights are: `--quantization fp8`)."""
        e = self.engine
        self._check_idle("a weight update")
        t0 = time.perf_counter()
        vision = None
        if source is None or isinstance(source, (str, os.PathLike)):
            args = e.args if source is None else dataclasses.replace(e.args, model=str(source),
                                                                     converted_checkpoint_dir=None)
            if args.quantization is None and e.model.config.weight_quant:  # held as the served weights are
                args = dataclasses.replace(args, quantization=e.model.config.weight_quant)
            mesh = None
            if e.args.data_parallel_size > 1:  # read on the host, then laid out on this replica's own devices
                args = args.replace(tensor_parallel_size=1, expert_parallel_size=1, data_parallel_size=1)
                mesh = e.model.plan.mesh
            loaded, what = load_model(args, progress=False), f"the checkpoint at {args.model or 'the bundled model'}"
        else:  # each tensor straight into its place (its shards, over several devices) as a checkpoint's would go
            source = source if isinstance(source, Mapping) else list(source)  # read twice: decoder, vision side
            plan = e.model.plan
            cfg = plan.source_cfg if plan is not None else e.model.config
            # (float projections of a model held quantized are quantized as they come, as at load)
            params = load_params(_Tensors(source), cfg, e.model.dtype, place=plan.place if plan else None,
                                 progress=False)
            loaded, mesh, what = dataclasses.replace(e.model, params=params), None, "the given tensors"
            vision = _vision_params(e.images, source, e.model.dtype)
        model, kv_dtype = prepare_model(loaded, e.args, mesh)
        if model.config != e.model.config:
            raise ValueError(f"{what} are not the served model's configuration; weights of the same architecture "
                             "and shapes are needed")
        if jnp.dtype(kv_dtype) != jnp.dtype(e.kv_dtype):
            raise ValueError(f"the new weights give a {kv_dtype} KV cache, the engine's is {e.kv_dtype}")
        if vision is None and model.vision is not None:
            vision = model.vision.params
        params = (e.runner.layout(model.params), vision)
        check_same_layout(params, self._params_spec if self.weights != "device" else self._weights())
        if self.kv_on_device:
            self._reset_prefix_cache("a weight update")
        if self.weights == "device":
            _delete(self._weights())
        self._use_params(params)
        logger.info("weights from %s loaded in %.2f s", what, time.perf_counter() - t0)

    def _weights(self) -> tuple[Any, Any]:
        """The weights on the device: the decoder's (as the runner holds them) and the vision side's (or None)."""
        e = self.engine
        return e.runner.params, e.images.params if e.images is not None else None

    def _use_params(self, weights: tuple[Any, Any]) -> None:
        e = self.engine
        params, vision = weights
        if e.images is not None:  # images' embeddings from the old weights are forgotten
            e.images.use_params(vision)
        e.runner.params = params
        e.model = dataclasses.replace(e.model, params=params)
        if self.weights != "device" and e.draft:  # a draft model's too: its host copy, or its checkpoint again
            if self._draft_host is not None:
                e.draft.params = jax.tree.map(_HostArray.to_device, self._draft_host)
            else:
                e.draft.reload(params)
        self.weights, self._host, self._params_spec, self._draft_host = "device", None, None, None
        if e.loras is not None:  # the adapters in slots, placed again over the new weights
            e.loras.place_all()
