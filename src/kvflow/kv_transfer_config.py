"""KV transfer between engines (disaggregated prefill/decode): vLLM's `kv_transfer_config`.

A prefill engine (kv_role "kv_producer") saves each prompt's KV blocks to a store under their
block hashes; a decode engine ("kv_consumer") loads them instead of computing them; "kv_both" does
both. Blocks are kept under their hashes rehashed with what their bytes depend on (model, weights, KV
dtype, block size, parallel layout: `kvflow.kv_store.namespaced`), so engines that differ in any of
it share a store without reading each other's blocks; `kv_store_namespace` in the extra config adds
a name of the user's (two fine-tunes of one model). Two stores (`kv_connector`):

- `{"kv_connector": "SharedStorageConnector", "kv_role": "kv_producer", "kv_connector_extra_config":
  {"shared_storage_path": "/dev/shm/kvflow-kv", "max_store_bytes": 4294967296}}`: one file per
  block in a directory the engines of one host share;
- `{"kv_connector": "RedisStoreConnector", "kv_role": "kv_consumer", "kv_connector_extra_config":
  {"kv_store_url": "redis://10.0.0.5:6379/0", "kv_store_timeout_s": 5.0}}`: a Redis server, for
  engines on different hosts (its bound is Redis' `maxmemory`, with `maxmemory-policy allkeys-lru`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from urllib.parse import urlsplit

from kvflow.json_config import config_dict

CONNECTORS = ("SharedStorageConnector", "RedisStoreConnector")
# Connectors kvflow had, and what took their place.
REPLACED = {"TCPStoreConnector": "RedisStoreConnector (a Redis server, kv_store_url redis://host:port): "
                                 "kvflow's own `kvflow kv-store` server and its protocol are gone"}
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
DEFAULT_SHARED_STORAGE_PATH = "/dev/shm/kvflow-kv"  # memory on Linux: a transfer never touches a disk
DEFAULT_MAX_STORE_BYTES = 4 << 30  # a few GiB: what a producer whose consumer never came can leave behind
DEFAULT_KV_STORE_TIMEOUT_S = 5.0
# kv_connector_extra_config's keys, per connector: (the types each may have, what it is)
# Every connector's: a name of the user's own in front of the engine's derived namespace, for
# engines whose KV bytes differ although nothing in their configs does (two fine-tunes of one model).
_NAMESPACE_KEY = {"kv_store_namespace": (str, "a string")}
EXTRA_KEYS = {
    "SharedStorageConnector": {"shared_storage_path": (str, "a directory path"),
                               "max_store_bytes": (int, "a number of bytes"), **_NAMESPACE_KEY},
    "RedisStoreConnector": {"kv_store_url": (str, "redis://[:password@]host:port[/db]"),
                            "kv_store_timeout_s": ((int, float), "seconds"), **_NAMESPACE_KEY},
}


@dataclass(frozen=True)
class KVTransferConfig:
    kv_connector: str = "SharedStorageConnector"
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict = field(default_factory=dict)
    # Set by the engine, not the user: what its blocks' bytes depend on (kvflow.kv_store.namespaced).
    namespace: str = ""

    @property
    def shared_storage_path(self) -> str:
        return self.kv_connector_extra_config.get("shared_storage_path", DEFAULT_SHARED_STORAGE_PATH)

    @property
    def max_store_bytes(self) -> int:
        return self.kv_connector_extra_config.get("max_store_bytes", DEFAULT_MAX_STORE_BYTES)

    def with_namespace(self, engine_namespace: str) -> KVTransferConfig:
        user = self.kv_connector_extra_config.get("kv_store_namespace", "")
        return replace(self, namespace=f"{user}|{engine_namespace}")

    @property
    def kv_store_timeout_s(self) -> float:
        return float(self.kv_connector_extra_config.get("kv_store_timeout_s", DEFAULT_KV_STORE_TIMEOUT_S))

    @classmethod
    def parse(cls, value: dict | str | None) -> KVTransferConfig | None:
        """From the user's dict or JSON text; a bad one raises ValueError naming the key."""
        if value is None or isinstance(value, KVTransferConfig):
            return value
        config = cls(**config_dict(value, "kv_transfer_config", cls))
        if config.kv_connector in REPLACED:
            raise ValueError(f"kv_transfer_config.kv_connector {config.kv_connector!r} was replaced by "
                             f"{REPLACED[config.kv_connector]}")
        if config.kv_connector not in CONNECTORS:
            raise ValueError(f"kv_transfer_config.kv_connector must be one of {', '.join(CONNECTORS)}; "
                             f"got {config.kv_connector!r}")
        if config.kv_role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config.kv_role must be one of {', '.join(KV_ROLES)}; got {config.kv_role!r}")
        _check_extra(config.kv_connector, config.kv_connector_extra_config)
        return config


def _check_extra(connector: str, extra: object) -> None:
    name = "kv_transfer_config.kv_connector_extra_config"
    if not isinstance(extra, dict):
        raise ValueError(f"{name} must be a dict; got {type(extra).__name__}")
    known = EXTRA_KEYS[connector]
    for key, value in extra.items():
        if key not in known:
            raise ValueError(f"{name} has unknown key {key!r} for {connector}; known keys: {', '.join(known)}")
        types, what = known[key]
        if not isinstance(value, types) or isinstance(value, bool):
            raise ValueError(f"{name}.{key} must be {what}; got {value!r}")
    if extra.get("max_store_bytes", 1) <= 0:
        raise ValueError(f"{name}.max_store_bytes must be positive; got {extra['max_store_bytes']}")
    if extra.get("kv_store_timeout_s", 1) <= 0:
        raise ValueError(f"{name}.kv_store_timeout_s must be positive; got {extra['kv_store_timeout_s']}")
    if connector == "RedisStoreConnector":
        if "kv_store_url" not in extra:
            raise ValueError(f"{name}.kv_store_url is required for RedisStoreConnector (e.g. redis://10.0.0.5:6379/0)")
        check_redis_url(extra["kv_store_url"])


def check_redis_url(url: str, name: str = "kv_store_url") -> None:
    """`redis://[:password@]host:port[/db]` (rediss:// for TLS); ValueError naming `name` otherwise."""
    form = "redis://[:password@]host:port[/db] (a Redis server)"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise ValueError(f"{name} {_without_password(url)!r} is not {form}: {e}") from None
    db = parts.path.strip("/")
    if parts.scheme not in ("redis", "rediss") or not parts.hostname or port is None or not (db == "" or db.isdigit()):
        raise ValueError(f"{name} must be {form}; got {_without_password(url)!r}")


def _without_password(url: str) -> str:
    """The URL as an error may show it: a password in it (logs, a client's 400) replaced by ***."""
    scheme, sep, rest = url.partition("://")
    credentials, at, host = rest.rpartition("@")
    if not at or ":" not in credentials:
        return url
    return f"{scheme}{sep}{credentials.split(':', 1)[0]}:***@{host}"


@dataclass(frozen=True)
class KVOffloadConfig:
    """KV offloading (`--kv-offloading-size` and its tiers): every full block a request computes is
    also kept in host memory, then on a local disk, then in a shared store, and a later prompt with
    that prefix loads it back instead of computing it (`kvflow.kv_store.tiered`)."""

    host_bytes: int  # the host-memory tier's bound (vLLM's --kv-offloading-size, in GiB there)
    disk_path: str | None = None  # the local disk tier's directory (LMCache's local_disk)
    disk_bytes: int = 0  # its bound (LMCache's max_local_disk_size)
    remote_url: str | None = None  # the shared tier: redis://host:port[/db], or a shared directory's path
    remote_timeout_s: float = DEFAULT_KV_STORE_TIMEOUT_S
    # The backstop for a load: every tier bounds its own calls (Redis by remote_timeout_s), but a
    # load also waits behind the saves queued before it; past this it fails and its request
    # computes its prompt.
    load_timeout_s: float = 30.0
    # Set by the engine, not the user: what its blocks' bytes depend on (kvflow.kv_store.namespaced).
    namespace: str = ""

    def with_namespace(self, engine_namespace: str) -> KVOffloadConfig:
        return replace(self, namespace=engine_namespace)

    @property
    def remote_is_redis(self) -> bool:
        return self.remote_url is not None and self.remote_url.startswith(("redis://", "rediss://"))

    @classmethod
    def from_args(cls, size_gib: float | None, disk_path: str | None, disk_size_gib: float,
                  remote_url: str | None) -> KVOffloadConfig | None:
        """From the engine arguments; ValueError naming the argument otherwise. None: no offloading."""
        if size_gib is None:
            for name, value in (("kv_offloading_disk_path", disk_path), ("kv_offloading_remote_url", remote_url)):
                if value is not None:
                    raise ValueError(f"{name} is a tier below host memory: it needs kv_offloading_size "
                                     "(--kv-offloading-size GiB), the tier every offloaded block goes to first")
            return None
        if not size_gib > 0:
            raise ValueError(f"kv_offloading_size must be > 0 GiB; got {size_gib}")
        if disk_path is not None and not disk_size_gib > 0:
            raise ValueError(f"kv_offloading_disk_size must be > 0 GiB; got {disk_size_gib}")
        if remote_url is not None and remote_url.startswith(("redis://", "rediss://")):
            check_redis_url(remote_url, "kv_offloading_remote_url")
        elif remote_url is not None and not remote_url.startswith("/"):
            raise ValueError("kv_offloading_remote_url must be redis://[:password@]host:port[/db] or the absolute "
                             f"path of a directory the engines share; got {remote_url!r}")
        return cls(int(size_gib * (1 << 30)), disk_path, int(disk_size_gib * (1 << 30)) if disk_path else 0, remote_url)
