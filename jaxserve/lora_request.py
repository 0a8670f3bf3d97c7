"""`LoRARequest`: which LoRA adapter a request runs with (vLLM's class, with its fields)."""

from __future__ import annotations

from dataclasses import dataclass


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
