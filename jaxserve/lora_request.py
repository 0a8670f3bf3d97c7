"""`LoRARequest`: which LoRA adapter a request runs with (vLLM's class, with its fields)."""

from __future__ import annotations

from dataclasses import dataclass

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
