"""Block stores (`KVBlockStore` and its implementations): for KV transfer between engines
(`open_kv_block_store`), and for KV offloading's tiers (`open_offload_store`)."""

from __future__ import annotations

from pathlib import Path

from kvflow.kv_store.base import KVBlockStore, KVStoreError
from kvflow.kv_store.directory import DirectoryKVStore
from kvflow.kv_store.host_memory import HostMemoryKVStore
from kvflow.kv_store.namespaced import NamespacedStore
from kvflow.kv_store.redis_store import RedisKVStore
from kvflow.kv_store.tiered import TieredKVStore
from kvflow.kv_transfer_config import DEFAULT_MAX_STORE_BYTES, KVOffloadConfig, KVTransferConfig

__all__ = ["DirectoryKVStore", "HostMemoryKVStore", "KVBlockStore", "KVStoreError", "NamespacedStore", "RedisKVStore",
           "TieredKVStore", "open_kv_block_store", "open_offload_store"]


def open_kv_block_store(config: KVTransferConfig) -> NamespacedStore:
    """The store `config.kv_connector` names, as its extra config describes it, seen through the
    engine's namespace (`config.namespace`: `kvflow.kv_store.namespaced`)."""
    if config.kv_connector == "RedisStoreConnector":
        inner: KVBlockStore = RedisKVStore(config.kv_connector_extra_config["kv_store_url"],
                                           timeout_s=config.kv_store_timeout_s)
    else:
        inner = DirectoryKVStore(config.shared_storage_path, config.max_store_bytes)
    return NamespacedStore(inner, config.namespace)


def open_offload_store(config: KVOffloadConfig, rank: int = 0, world_size: int = 1,
                       pin_memory: bool = False) -> NamespacedStore:
    """One rank's KV offloading tiers: its own host memory, its own disk directory (a rank's
    subdirectory under tensor parallel, so no rank's bound evicts another's blocks), then the
    shared store every rank and engine reaches; through the engine's namespace."""
    tiers: list[KVBlockStore] = [HostMemoryKVStore(config.host_bytes, pin_memory)]
    if config.disk_path is not None:
        path = Path(config.disk_path) / (f"rank{rank}" if world_size > 1 else "")
        tiers.append(DirectoryKVStore(path, config.disk_bytes, setting="kv_offloading_disk_path"))
    if config.remote_is_redis:
        tiers.append(RedisKVStore(config.remote_url, timeout_s=config.remote_timeout_s))
    elif config.remote_url is not None:
        tiers.append(DirectoryKVStore(config.remote_url, DEFAULT_MAX_STORE_BYTES, setting="kv_offloading_remote_url"))
    return NamespacedStore(TieredKVStore(tiers), config.namespace)
