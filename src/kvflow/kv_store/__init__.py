"""Block stores for KV transfer between engines (`KVBlockStore` and its implementations)."""

from __future__ import annotations

from kvflow.kv_store.base import KVBlockStore, KVStoreError
from kvflow.kv_store.directory import DirectoryKVStore
from kvflow.kv_store.namespaced import NamespacedStore
from kvflow.kv_store.redis_store import RedisKVStore
from kvflow.kv_transfer_config import KVTransferConfig

__all__ = ["DirectoryKVStore", "KVBlockStore", "KVStoreError", "NamespacedStore", "RedisKVStore", "open_kv_block_store"]


def open_kv_block_store(config: KVTransferConfig) -> NamespacedStore:
    """The store `config.kv_connector` names, as its extra config describes it, seen through the
    engine's namespace (`config.namespace`: `kvflow.kv_store.namespaced`)."""
    if config.kv_connector == "RedisStoreConnector":
        inner: KVBlockStore = RedisKVStore(config.kv_connector_extra_config["kv_store_url"],
                                           timeout_s=config.kv_store_timeout_s)
    else:
        inner = DirectoryKVStore(config.shared_storage_path, config.max_store_bytes)
    return NamespacedStore(inner, config.namespace)
