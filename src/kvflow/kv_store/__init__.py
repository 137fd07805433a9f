"""Block stores for KV transfer between engines (`KVBlockStore` and its implementations)."""

from __future__ import annotations

from kvflow.kv_store.base import KVBlockStore, KVStoreError
from kvflow.kv_store.directory import DirectoryKVStore
from kvflow.kv_store.tcp_client import TCPKVStore
from kvflow.kv_transfer_config import KVTransferConfig

__all__ = ["DirectoryKVStore", "KVBlockStore", "KVStoreError", "TCPKVStore", "open_kv_block_store"]


def open_kv_block_store(config: KVTransferConfig) -> KVBlockStore:
    """The store `config.kv_connector` names, as its extra config describes it."""
    if config.kv_connector == "TCPStoreConnector":
        host, port = config.kv_store_address
        return TCPKVStore(host, port, timeout_s=config.kv_store_timeout_s)
    return DirectoryKVStore(config.shared_storage_path, config.max_store_bytes)
