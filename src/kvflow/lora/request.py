"""`LoRARequest`: which adapter a request runs with, named as vLLM names it (same module path).

`lora_int_id` is the adapter's identity inside the engine: its device slot, its host cache entry
and its prefix-cache key. One id names one adapter (name and path) for the engine's whole life,
so blocks cached under an id can never be served to another adapter.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""  # a directory with adapter_config.json and adapter_model.safetensors
    base_model_name: str | None = None  # informational, as in vLLM

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string; got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1; got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str):
            raise ValueError(f"lora_path must be a string; got {type(self.lora_path).__name__}")
