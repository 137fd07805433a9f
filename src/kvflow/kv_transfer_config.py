"""KV transfer between engines (disaggregated prefill/decode): vLLM's `kv_transfer_config`.

`{"kv_connector": "SharedStorageConnector", "kv_role": "kv_producer", "kv_connector_extra_config":
{"shared_storage_path": "/dev/shm/kvflow-kv"}}`: a prefill engine (kv_producer) saves each
prompt's KV blocks under their block hashes in that directory, a decode engine (kv_consumer)
loads them instead of computing them; kv_both does both. Engines that share a directory must run
the same model with the same block size and KV dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvflow.json_config import config_dict

CONNECTORS = ("SharedStorageConnector",)
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
DEFAULT_SHARED_STORAGE_PATH = "/dev/shm/kvflow-kv"  # memory on Linux: a transfer never touches a disk


@dataclass(frozen=True)
class KVTransferConfig:
    kv_connector: str = "SharedStorageConnector"
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict = field(default_factory=dict)

    @property
    def shared_storage_path(self) -> str:
        return self.kv_connector_extra_config.get("shared_storage_path", DEFAULT_SHARED_STORAGE_PATH)

    @classmethod
    def parse(cls, value: dict | str | None) -> KVTransferConfig | None:
        """From the user's dict or JSON text; a bad one raises ValueError naming the key."""
        if value is None or isinstance(value, KVTransferConfig):
            return value
        config = cls(**config_dict(value, "kv_transfer_config", cls))
        if config.kv_connector not in CONNECTORS:
            raise ValueError(f"kv_transfer_config.kv_connector must be one of {', '.join(CONNECTORS)}; "
                             f"got {config.kv_connector!r}")
        if config.kv_role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config.kv_role must be one of {', '.join(KV_ROLES)}; got {config.kv_role!r}")
        extra = config.kv_connector_extra_config
        if not isinstance(extra, dict) or not isinstance(extra.get("shared_storage_path", ""), str):
            raise ValueError("kv_transfer_config.kv_connector_extra_config must be a dict whose shared_storage_path "
                             "is a directory path")
        return config
