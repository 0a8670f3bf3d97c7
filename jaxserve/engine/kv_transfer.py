"""The KV handoff of prefill/decode disaggregation (L3): three explicit contracts and the engine-side moves.

Contracts:
  1. `TransferMeta`, the control metadata: which request, which token ids the pages hold, the
     sender's page ids, the layout and dtype, the model, the sender and when the pin expires.
  2. `KVPayload`, the data: the keys and values of those pages, `[layers, pages, page_size,
     kv_heads, head_dim]` each, with a SHA-256 over both. It travels as one byte string
     (`encode` / `decode`) through a `KVTransport`, an interface (HTTP in `server.pd`; RDMA or
     NIXL could implement the same two calls).
  3. `Readiness`, checked by the receiver before the pages enter its cache: the payload belongs
     to the transfer, every page is there, the layout and dtype match the receiver's pool, and the
     checksum matches. Only then are the pages written; otherwise the request recomputes.

Engine-side moves, each run on the engine thread (`AsyncEngine.call_on_engine`): the sender
`pin_prompt`s the finished prefill's full pages (a radix-cache lock, so they are neither evicted
nor reused), `read_pages` when the receiver asks, and `unpin`s on acknowledgement or timeout. The
receiver `import_pages` into fresh pages of its pool, inserts them into its prefix cache under the
same token ids (so the request's admission finds them as a prefix hit) and holds a lock on them
until `release_import`, once the request has been admitted and holds its own references.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from jaxserve.rope import prompt_cache_salt

if TYPE_CHECKING:
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.engine.radix_cache import RadixNode

LAYOUT_AXES = "layer,page,slot,kv_head,head_dim"


_SCALES_DIGESTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def scales_digest(engine: LLMEngine) -> str:
    """What identifies the float8 KV scales `engine` writes its pages with; "" when it uses none. The
    scales are fixed once the engine is built: read from the device once, not per transfer."""
    if engine in _SCALES_DIGESTS:
        return _SCALES_DIGESTS[engine]
    digest = ""
    if np.dtype(engine.kv_dtype).itemsize == 1 and engine.model.config.kv_cache_scales:
        import jax

        params = engine.runner.params
        layers = params.layers if isinstance(params.layers, tuple) else (  # per layer, or stacked
            (params.dense_layers, params.layers) if params.dense_layers is not None else (params.layers,))
        k, v = jax.device_get(([lp.k_scale for lp in layers], [lp.v_scale for lp in layers]))
        values = np.concatenate([np.ravel(np.asarray(x, np.float32)) for x in (*k, *v)])
        digest = hashlib.sha256(values.tobytes()).hexdigest()[:16]
    _SCALES_DIGESTS[engine] = digest
    return digest


class TransferError(RuntimeError):
    """A transfer that cannot complete (unreachable sender, truncated or corrupt payload, expired pin)."""


@dataclass(frozen=True)
class KVLayout:
    """How a pool's pages are laid out: the receiver's must equal the sender's."""

    num_layers: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    axes: str = LAYOUT_AXES
    scales: str = ""
    """A digest of the per-layer float8 scales the pages are stored with ("": none, scale 1)."""
    value_dim: int | None = None
    """A value's dims where they differ from a key's (an MLA model's pages hold no values: 0)."""

    @classmethod
    def of_engine(cls, engine: LLMEngine) -> KVLayout:
        """The layout of `engine`'s KV pool."""
        kv = engine.runner.kv
        k = kv.k  # [L, num_pages, page_size, Hkv, D]
        v_dim = int(kv.v.shape[4])
        return cls(int(k.shape[0]), int(k.shape[2]), int(k.shape[3]), int(k.shape[4]), str(np.dtype(kv.dtype)),
                   scales=scales_digest(engine), value_dim=None if v_dim == k.shape[4] else v_dim)

    def page_shape(self, num_pages: int, values: bool = False) -> tuple[int, ...]:
        """The shape of `num_pages` pages of keys (of values with `values`)."""
        dim = self.value_dim if values and self.value_dim is not None else self.head_dim
        return (self.num_layers, num_pages, self.page_size, self.num_kv_heads, dim)


@dataclass(frozen=True)
class TransferMeta:
    """Contract 1, the control metadata of one transfer."""

    transfer_id: str
    request_id: str
    token_ids: tuple[int, ...]
    """The tokens whose KV the pages hold: `len(page_ids) * page_size` of them, a prefix of the prompt."""
    page_ids: tuple[int, ...]
    """The sender's pages, in order (informative: the receiver writes into its own)."""
    layout: KVLayout
    model: str
    sender: str
    cache_salt: str | None = None
    prompt_tokens: int = 0
    first_token: int | None = None
    """The token the prefill sampled (the decode side recomputes the last prompt token's logits)."""
    expires_at: float = 0.0
    """Unix time after which the sender frees the pages whether or not they were acknowledged."""

    def to_json(self) -> dict[str, Any]:
        """A JSON object."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> TransferMeta:
        """Parse `to_json`'s output; TransferError if a field is missing or malformed."""
        try:
            fields = dict(obj)
            fields["layout"] = KVLayout(**fields["layout"])
            fields["token_ids"] = tuple(int(t) for t in fields["token_ids"])
            fields["page_ids"] = tuple(int(p) for p in fields["page_ids"])
            return cls(**fields)
        except (KeyError, TypeError, ValueError) as e:
            raise TransferError(f"malformed transfer metadata: {e}") from e


def payload_checksum(k: np.ndarray, v: np.ndarray) -> str:
    """SHA-256 over the keys' bytes then the values' (C order)."""
    h = hashlib.sha256()
    h.update(np.ascontiguousarray(k).tobytes())
    h.update(np.ascontiguousarray(v).tobytes())
    return h.hexdigest()


@dataclass(frozen=True)
class KVPayload:
    """Contract 2, the pages' data: keys and values `[layers, pages, page_size, kv_heads, head_dim]`."""

    meta: TransferMeta
    k: np.ndarray
    v: np.ndarray
    checksum: str
    """As computed by the sender; the receiver recomputes it (`check_ready`)."""

    @classmethod
    def build(cls, meta: TransferMeta, k: np.ndarray, v: np.ndarray) -> KVPayload:
        """A payload with its checksum."""
        return cls(meta, k, v, payload_checksum(k, v))

    def encode(self) -> bytes:
        """`[8-byte header length][header JSON][keys][values]`; the header holds the metadata and checksum."""
        header = json.dumps({"meta": self.meta.to_json(), "checksum": self.checksum, "shape": list(self.k.shape),
                             "v_shape": list(self.v.shape), "dtype": str(self.k.dtype)}).encode()
        return struct.pack("<Q", len(header)) + header + self.k.tobytes() + self.v.tobytes()

    @classmethod
    def decode(cls, data: bytes) -> KVPayload:
        """Parse `encode`'s output; TransferError if it is truncated or malformed (a cut transfer)."""
        if len(data) < 8:
            raise TransferError(f"payload of {len(data)} bytes has no header")
        (n,) = struct.unpack("<Q", data[:8])
        if len(data) < 8 + n:
            raise TransferError("payload header is truncated")
        try:
            header = json.loads(data[8 : 8 + n])
            meta = TransferMeta.from_json(header["meta"])
            dtype = _dtype(header["dtype"])
            shape = tuple(int(x) for x in header["shape"])
            v_shape = tuple(int(x) for x in header.get("v_shape", shape))
        except (KeyError, TypeError, ValueError) as e:
            raise TransferError(f"malformed payload header: {e}") from e
        size, v_size = int(np.prod(shape)) * dtype.itemsize, int(np.prod(v_shape)) * dtype.itemsize
        body = data[8 + n :]
        if len(body) != size + v_size:
            raise TransferError(f"payload has {len(body)} bytes of KV, expected {size + v_size} (transfer cut?)")
        k = np.frombuffer(body[:size], dtype).reshape(shape)
        v = np.frombuffer(body[size:], dtype).reshape(v_shape)
        return cls(meta, k, v, str(header["checksum"]))


def _dtype(name: str) -> np.dtype:
    import jax.numpy as jnp  # knows bfloat16 and the other ml_dtypes names

    return np.dtype(jnp.dtype(name))


@dataclass(frozen=True)
class Readiness:
    """Contract 3: whether the decode side may use the payload, and if not, why."""

    ok: bool
    reason: str = ""


def check_ready(meta: TransferMeta, payload: KVPayload, local: KVLayout) -> Readiness:
    """Every page present, in the receiver's layout and dtype, with a matching checksum."""
    if payload.meta.transfer_id != meta.transfer_id:
        return Readiness(False, f"payload of transfer {payload.meta.transfer_id}, expected {meta.transfer_id}")
    if meta.layout != local:
        return Readiness(False, f"layout {meta.layout} differs from this pool's {local}")
    shape, v_shape = local.page_shape(len(meta.page_ids)), local.page_shape(len(meta.page_ids), values=True)
    if payload.k.shape != shape or payload.v.shape != v_shape:
        return Readiness(False, f"pages of shape {payload.k.shape}/{payload.v.shape}, expected {shape}/{v_shape}")
    if str(payload.k.dtype) != local.dtype or str(payload.v.dtype) != local.dtype:
        return Readiness(False, f"dtype {payload.k.dtype}, expected {local.dtype}")
    if len(meta.token_ids) != len(meta.page_ids) * local.page_size:
        return Readiness(False, f"{len(meta.token_ids)} token ids for {len(meta.page_ids)} pages")
    if payload_checksum(payload.k, payload.v) != payload.checksum:
        return Readiness(False, "checksum mismatch")
    return Readiness(True)


class KVTransport(Protocol):
    """Moves a payload from the sender to the receiver; HTTP today, any byte mover tomorrow."""

    async def fetch(self, source: str, timeout: float) -> KVPayload:
        """The payload at `source` (raises TransferError on any failure)."""
        ...

    async def acknowledge(self, source: str) -> None:
        """Tell the sender the pages arrived (or are no longer wanted): it may free them."""
        ...


# -- engine-side moves (call on the engine thread) ------------------------------------------------


@dataclass
class Pin:
    """Sender-side: a finished prefill's full pages, locked in the prefix cache."""

    node: RadixNode
    pages: tuple[int, ...]
    token_ids: tuple[int, ...]
    released: bool = False


def pin_prompt(engine: LLMEngine, token_ids: list[int], salt: str | None) -> Pin | None:
    """Lock the cached full pages of `token_ids[:-1]` (what a receiver can reuse); None if none are cached."""
    cache = engine.scheduler.cache
    if cache is None:
        return None
    # A request always computes its last prompt token, so only pages before it are worth moving.
    salt = prompt_cache_salt(engine.long_rope_context, len(token_ids), salt)  # the namespace its request used
    match = cache.match_prefix(token_ids[:-1], salt, record=False)
    if match.num_tokens == 0:
        return None
    cache.lock(match.last_node)
    return Pin(match.last_node, tuple(match.pages), tuple(token_ids[: match.num_tokens]))


def read_pages(engine: LLMEngine, pin: Pin) -> tuple[np.ndarray, np.ndarray]:
    """The keys and values of a pin's pages, `[L, pages, page_size, Hkv, D]` each, as host arrays."""
    import jax

    if pin.released:
        raise TransferError("the pages were already released")
    kv = engine.runner.kv
    idx = np.asarray(pin.pages, np.int32)
    # Pages kept as their bits go out as the dtype they hold (the same bytes).
    dtype = np.dtype(kv.dtype)
    return (np.asarray(jax.device_get(kv.k[:, idx])).view(dtype),
            np.asarray(jax.device_get(kv.v[:, idx])).view(dtype))


def unpin(engine: LLMEngine, pin: Pin) -> bool:
    """Release a pin (idempotent); True if this call released it."""
    if pin.released:
        return False
    pin.released = True
    engine.scheduler.cache.unlock(pin.node)
    return True


@dataclass
class Imported:
    """Receiver-side: imported pages, locked in the prefix cache until the request holds them."""

    node: RadixNode | None
    num_tokens: int
    pages_written: int
    released: bool = False


def import_pages(engine: LLMEngine, payload: KVPayload) -> Imported | None:
    """Write a checked payload's pages into fresh pages of the pool and cache them; None if the pool is full (or
    the engine has a draft model, whose KV of the pages the payload lacks: the request recomputes).

    Pages already cached here (same tokens, same salt) are kept and not overwritten.
    """
    meta = payload.meta
    sched = engine.scheduler
    cache, pool = sched.cache, sched.pool
    if cache is None or getattr(engine, "draft", None) is not None:  # a draft model's KV of them is not sent
        return None
    ids = list(meta.token_ids)
    salt = prompt_cache_salt(engine.long_rope_context, meta.prompt_tokens, meta.cache_salt)  # as `add_request`'s
    match = cache.match_prefix(ids, salt, record=False)
    have = len(match.pages)
    held = None if match.last_node.is_root else match.last_node
    if held is not None:
        cache.lock(held)  # our eviction below must not take the prefix we keep
    need = len(meta.page_ids) - have
    if need <= 0:
        return Imported(held, match.num_tokens, 0)
    if pool.num_free < need:
        cache.evict(need - pool.num_free)
    if pool.num_free < need:
        if held is not None:
            cache.unlock(held)
        return None
    new = pool.allocate(need)
    # Pad the page count to a power of two (padding writes go to the reserved page 0), so the
    # scatter compiles once per size class, not once per prompt length.
    size = 1 << (need - 1).bit_length()
    idx = np.zeros(size, np.int32)
    idx[:need] = new
    k = np.zeros(meta.layout.page_shape(size), payload.k.dtype)
    v = np.zeros(meta.layout.page_shape(size, values=True), payload.v.dtype)
    k[:, :need], v[:, :need] = payload.k[:, have:], payload.v[:, have:]
    stored = engine.runner.kv.k.dtype  # the pool's own element type (raw bits for narrow pages on the CPU)
    engine.runner.kv = _write_pages(engine.runner.kv, idx, k.view(stored), v.view(stored))
    result = cache.insert(ids, list(match.pages) + new, salt)
    pool.decref(new)  # the cache holds them now
    cache.lock(result.last_node)
    if held is not None:
        cache.unlock(held)
    return Imported(result.last_node, len(ids), need)


def _write_pages(kv: Any, idx: np.ndarray, k: np.ndarray, v: np.ndarray) -> Any:
    """`kv` with pages `idx` overwritten by `k`, `v` (`[L, len(idx), page_size, Hkv, D]`); donates `kv`.

    Jitted with the pool donated, like the model steps, so the pool keeps its buffer and placement
    and the steps' compiled executables still apply.
    """
    global _WRITE_PAGES
    if _WRITE_PAGES is None:
        import jax

        def write(kv, idx, k, v):
            return dataclasses.replace(kv, k=kv.k.at[:, idx].set(k), v=kv.v.at[:, idx].set(v))

        _WRITE_PAGES = jax.jit(write, donate_argnums=(0,))
    return _WRITE_PAGES(kv, idx, k, v)


_WRITE_PAGES = None


def release_import(engine: LLMEngine, imported: Imported) -> None:
    """Drop the import's lock (idempotent): the pages stay cached, evictable like any other."""
    if imported.released or imported.node is None:
        return
    imported.released = True
    cache = engine.scheduler.cache
    if cache.is_attached(imported.node):
        cache.unlock(imported.node)
