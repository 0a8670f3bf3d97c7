"""`LoRARequest`: which LoRA adapter a request runs with (vLLM's class, with its fields)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

LORA_SALT_PREFIX = "lora:"


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter by name: one the engine was started with (`--lora-modules name=path`), or, with
    `lora_path`, a PEFT adapter directory the engine loads into a free adapter slot on first use.
    `lora_int_id` is kept for vLLM compatibility; jaxserve names adapters by `lora_name`."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")


def lora_cache_salt(lora_name: str, cache_salt: str | None = None) -> str:
    """The prefix-cache namespace of an adapter's requests: `lora:NAME`, or `lora:NAME|SALT` with the request's
    own salt. Its KV differs from the base model's, so it is cached apart; like vLLM, the namespace is the
    adapter's name, so a router hashes an adapter request's pages as its worker does."""
    return f"{LORA_SALT_PREFIX}{lora_name}|{cache_salt}" if cache_salt else f"{LORA_SALT_PREFIX}{lora_name}"


def in_lora_namespace(lora_name: str, salt: str | None) -> bool:
    """Whether a cache salt is one of `lora_name`'s namespaces (with or without a request's own salt)."""
    own = lora_cache_salt(lora_name)
    return salt is not None and (salt == own or salt.startswith(own + "|"))


def check_lora_args(args: Any) -> tuple[tuple[str, str], ...]:
    """`EngineArgs`' LoRA fields checked; returns its `lora_modules` as (name, path) pairs ("name=path" strings
    split)."""
    modules = []
    for m in args.lora_modules:
        if isinstance(m, str):
            name, sep, path = m.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"lora module {m!r} must be name=path")
            m = (name, path)
        modules.append(tuple(m))
    for name in ("max_loras", "max_lora_rank"):
        if not isinstance(getattr(args, name), int) or getattr(args, name) <= 0:
            raise ValueError(f"{name} must be a positive integer, got {getattr(args, name)!r}")
    cpu = args.max_cpu_loras
    if cpu is not None and (not isinstance(cpu, int) or cpu < args.max_loras):
        raise ValueError(f"max_cpu_loras must be an integer >= max_loras ({args.max_loras}), got {cpu!r}")
    if not args.enable_lora and modules:
        raise ValueError("lora_modules needs enable_lora (--enable-lora)")
    if args.enable_lora and args.is_pooling:
        raise ValueError("LoRA adapters (enable_lora) are not served with runner 'pooling'")
    return tuple(modules)
