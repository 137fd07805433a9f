"""`kv_transfer_config` for the two stores (a directory, a Redis server): good ones parse, bad
ones name the field."""

from __future__ import annotations

import pytest

from kvflow.kv_store import DirectoryKVStore, RedisKVStore, open_kv_block_store
from kvflow.kv_transfer_config import DEFAULT_MAX_STORE_BYTES, KVTransferConfig


def test_each_connector_opens_its_store(tmp_path):
    directory = KVTransferConfig.parse({"kv_role": "kv_producer", "kv_connector_extra_config": {
        "shared_storage_path": str(tmp_path), "max_store_bytes": 1000}})
    store = open_kv_block_store(directory).inner  # seen through the engine's namespace
    assert isinstance(store, DirectoryKVStore) and store.max_bytes == 1000
    assert KVTransferConfig.parse({}).max_store_bytes == DEFAULT_MAX_STORE_BYTES
    redis = KVTransferConfig.parse('{"kv_connector": "RedisStoreConnector", "kv_role": "kv_consumer", '
                                   '"kv_connector_extra_config": {"kv_store_url": "redis://:pw@10.1.2.3:6380/2", '
                                   '"kv_store_timeout_s": 0.5}}')
    store = open_kv_block_store(redis).inner  # no connection yet: the store may start after the engines
    assert isinstance(store, RedisKVStore) and store.location == "redis://10.1.2.3:6380/2"  # never the password


@pytest.mark.parametrize("extra, message", [
    ({}, "kv_store_url is required"),
    ({"kv_store_url": "http://h:6379"}, "kv_store_url must be redis://"),
    ({"kv_store_url": "redis://h"}, "kv_store_url must be redis://"),
    ({"kv_store_url": "redis://h:99999"}, "kv_store_url 'redis://h:99999' is not redis://"),
    ({"kv_store_url": 6379}, "kv_store_url must be redis://.*; got 6379"),
    ({"kv_store_url": "redis://h:1", "kv_store_timeout_s": 0}, "kv_store_timeout_s must be positive"),
    ({"kv_store_url": "redis://h:1", "kv_store_timeout_s": "5"}, "kv_store_timeout_s must be seconds"),
    ({"kv_store_url": "redis://h:1", "shared_storage_path": "/x"},
     "unknown key 'shared_storage_path' for RedisStoreConnector"),
])
def test_a_bad_redis_store_config_names_the_field(extra, message):
    with pytest.raises(ValueError, match=message):
        KVTransferConfig.parse({"kv_connector": "RedisStoreConnector", "kv_connector_extra_config": extra})


def test_the_replaced_tcp_connector_says_what_took_its_place():
    with pytest.raises(ValueError, match="'TCPStoreConnector' was replaced by RedisStoreConnector"):
        KVTransferConfig.parse({"kv_connector": "TCPStoreConnector"})


@pytest.mark.parametrize("extra, message", [
    ({"max_store_bytes": 0}, "max_store_bytes must be positive"),
    ({"max_store_bytes": "4GiB"}, "max_store_bytes must be a number of bytes"),
    ({"max_store_bytes": True}, "max_store_bytes must be a number of bytes"),
    ({"shared_storage_path": 3}, "shared_storage_path must be a directory path"),
    ({"kv_store_url": "redis://h:1"}, "unknown key 'kv_store_url' for SharedStorageConnector"),
])
def test_a_bad_directory_store_config_names_the_field(extra, message):
    with pytest.raises(ValueError, match=message):
        KVTransferConfig.parse({"kv_connector_extra_config": extra})
    with pytest.raises(ValueError, match="kv_connector_extra_config must be a dict"):
        KVTransferConfig.parse({"kv_connector_extra_config": ["x"]})


def test_a_namespace_keeps_blocks_apart_under_equal_hashes(tmp_path):
    config = KVTransferConfig.parse({"kv_connector_extra_config": {"shared_storage_path": str(tmp_path),
                                                                   "kv_store_namespace": "mine"}})
    key = bytes(range(32))
    ours, theirs = (open_kv_block_store(config.with_namespace(ns)) for ns in ("fp8 codes", "int8 codes"))
    assert ours.namespace == "mine|fp8 codes"
    ours.put([(key, b"ours")])
    assert (ours.lookup([key]), theirs.lookup([key])) == (1, 0)
    assert theirs.get([key]) == [None] and bytes(ours.get([key])[0]) == b"ours"
    assert [p.name for p in tmp_path.iterdir()] == [f"{ours.stored_key(key).hex()}.kv"]  # never the bare hash
    ours.delete([key])
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("url, ok", [
    ("redis://10.0.0.5:6379", True), ("redis://:secret@10.0.0.5:6379/3", True), ("rediss://h:6380/0", True),
    ("tcp://h:6379", False), ("redis://h", False), ("redis://h:6379/x", False),
])
def test_redis_urls_are_checked_and_name_the_field(url, ok):
    raw = {"kv_connector": "RedisStoreConnector", "kv_connector_extra_config": {"kv_store_url": url}}
    if ok:
        assert open_kv_block_store(KVTransferConfig.parse(raw)).location.startswith("redis://")
    else:
        with pytest.raises(ValueError, match="kv_store_url must be redis://"):
            KVTransferConfig.parse(raw)


@pytest.mark.parametrize("url", ["redis://:s3cret@h", "redis://user:s3cret@h:6379/x", "redis://:s3cret@h:port"])
def test_a_refused_redis_url_keeps_its_password_out_of_the_error(url):
    """The error reaches logs and (offloading's flag) the console: the password is starred out."""
    raw = {"kv_connector": "RedisStoreConnector", "kv_connector_extra_config": {"kv_store_url": url}}
    with pytest.raises(ValueError, match="kv_store_url") as refused:
        KVTransferConfig.parse(raw)
    assert "s3cret" not in str(refused.value) and ":***@h" in str(refused.value)
