"""Choosing the attention and KV-write implementations by backend name."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Literal

from pallas_kernels.kv_write import write_kv, write_kv_reference
from pallas_kernels.kv_write_triton import triton_available, write_kv_triton
from pallas_kernels.ragged_paged_attention import (
    AttentionTuning,
    ragged_paged_attention,
    ragged_paged_attention_reference,
)

BackendName = Literal["xla", "pallas", "pallas_interpret", "pallas_mosaic", "pallas_mosaic_interpret"]
KVWriteImpl = Literal["auto", "xla", "pallas", "triton"]


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    """The two kernels the model calls, with the signatures of the references.

    `attention(q, k_pages, v_pages, block_tables, seq_lens, query_start_loc, *, sm_scale, soft_cap=None,
    sliding_window=None) -> out` and `write_kv(k_pages, v_pages, k_new, v_new, slot_mapping) -> (k, v)`.
    """

    name: BackendName
    attention: Callable
    write_kv: Callable
    write_kv_impl: str


def attention_backend(
    name: BackendName, *, kv_write: KVWriteImpl = "auto", tuning: AttentionTuning = AttentionTuning()
) -> AttentionBackend:
    """`xla`: the references (CPU default); `pallas`: GPU kernels; `pallas_interpret`: the kernels on the CPU;
    `pallas_mosaic`: attention on the Mosaic GPU kernels (Hopper); `pallas_mosaic_interpret`: those in Mosaic
    GPU's CPU interpreter.

    With `pallas`, the KV write goes through `jax_triton` when it imports, else the XLA scatter (`auto`).
    """
    if name == "xla":
        attention, interpret = ragged_paged_attention_reference, None
    elif name == "pallas":
        attention, interpret = (
            functools.partial(ragged_paged_attention, interpret=False, tuning=tuning),
            False,
        )
    elif name in ("pallas_mosaic", "pallas_mosaic_interpret"):
        tuning = dataclasses.replace(tuning, decode_lowering="mosaic", prefill_lowering="mosaic")
        interpret = name == "pallas_mosaic_interpret"
        attention = functools.partial(ragged_paged_attention, interpret=interpret, tuning=tuning)
    elif name == "pallas_interpret":
        attention, interpret = functools.partial(ragged_paged_attention, interpret=True, tuning=tuning), True
    else:
        raise ValueError(
            f"unknown attention backend {name!r}; expected 'xla', 'pallas', 'pallas_interpret', 'pallas_mosaic' "
            "or 'pallas_mosaic_interpret'"
        )

    if kv_write == "auto":
        kv_write = (
            "triton"
            if name in ("pallas", "pallas_mosaic") and triton_available()
            else ("pallas" if name.endswith("_interpret") else "xla")
        )
    if kv_write == "xla":
        writer = write_kv_reference
    elif kv_write == "pallas":
        if interpret is None:
            raise ValueError("kv_write='pallas' needs a Pallas backend ('pallas' or 'pallas_interpret')")
        writer = functools.partial(write_kv, interpret=interpret)
    elif kv_write == "triton":
        if not triton_available():
            raise ValueError("kv_write='triton' needs jax_triton, which needs JAX's CUDA plugin")
        writer = write_kv_triton
    else:
        raise ValueError(f"unknown kv_write {kv_write!r}; expected 'auto', 'xla', 'pallas' or 'triton'")
    return AttentionBackend(name=name, attention=attention, write_kv=writer, write_kv_impl=kv_write)
