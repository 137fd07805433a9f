"""KV offloading's settings: vLLM's --kv-offloading-size and LMCache-named tiers below it, each bad
value or combination refused naming the argument and why."""

from __future__ import annotations

import argparse

import pytest

from kvflow import EngineArgs


def config(**kw):
    return EngineArgs(**kw).create_config(model_max_len=512)


def test_the_flags_make_the_tiers():
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args([
        "--kv-offloading-size", "2", "--kv-offloading-disk-path", "/tmp/kv", "--kv-offloading-disk-size", "0.5",
        "--kv-offloading-remote-url", "redis://10.0.0.5:6379/1"]))
    offload = args.create_config(512).kv_offload
    assert (offload.host_bytes, offload.disk_path, offload.disk_bytes, offload.remote_url) == (
        2 << 30, "/tmp/kv", 1 << 29, "redis://10.0.0.5:6379/1")
    assert offload.remote_is_redis
    assert config().kv_offload is None


@pytest.mark.parametrize("kw, named", [
    ({"kv_offloading_size": 0}, "kv_offloading_size must be > 0"),
    ({"kv_offloading_disk_path": "/tmp/kv"}, "kv_offloading_disk_path .* needs kv_offloading_size"),
    ({"kv_offloading_remote_url": "redis://h:1"}, "kv_offloading_remote_url .* needs kv_offloading_size"),
    ({"kv_offloading_size": 1, "kv_offloading_disk_path": "/tmp/kv", "kv_offloading_disk_size": 0},
     "kv_offloading_disk_size must be > 0"),
    ({"kv_offloading_size": 1, "kv_offloading_remote_url": "redis://nohost"}, "kv_offloading_remote_url must be"),
    ({"kv_offloading_size": 1, "kv_offloading_remote_url": "relative/dir"}, "kv_offloading_remote_url must be"),
    ({"kv_offloading_size": 1, "kv_transfer_config": {"kv_role": "kv_consumer"}},
     "kv_offloading_size with kv_transfer_config: an engine has one KV connector"),
    ({"kv_offloading_size": 1, "enable_prefix_caching": False}, "kv_offloading_size with enable_prefix_caching"),
    ({"kv_offloading_size": 1, "sparse_decode_blocks": 4}, "kv_offloading_size with sparse_decode_blocks"),
    ({"kv_offloading_size": 1, "pipeline_parallel_size": 2, "distributed_init_method": "tcp://127.0.0.1:1"},
     "pipeline_parallel_size=2 with kv_offloading_size"),
])
def test_a_bad_setting_or_combination_is_refused_by_name(kw, named):
    with pytest.raises(ValueError, match=named):
        config(**kw)
