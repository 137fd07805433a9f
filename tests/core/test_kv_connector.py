"""The scheduler half of the KV connector (over the directory store): keys, matching, and what it deletes."""

from __future__ import annotations

from kvflow.core.block_hash import extend_block_hashes
from kvflow.core.kv_connector import KVStoreConnector, transfer_keys
from kvflow.core.request import Request
from kvflow.kv_store import DirectoryKVStore, KVBlockStore, KVStoreError
from kvflow.sampling_params import SamplingParams

B = 4


def _request(tokens, salt=None) -> Request:
    return Request("r", list(tokens), SamplingParams(), 4, frozenset(), cache_salt=salt)


def _directory_connector(path, role: str) -> KVStoreConnector:
    return KVStoreConnector(DirectoryKVStore(path), role, B)


def test_keys_cover_the_prompt_but_its_last_token_and_chain_like_the_prefix_cache():
    tokens = list(range(11))  # 10 tokens transferred: 2 full blocks and a partial one of 2
    keys = transfer_keys(tokens, B)
    assert [covered for _, covered in keys] == [4, 8, 10]
    full = []
    extend_block_hashes(full, tokens, B)
    assert [k for k, _ in keys[:2]] == full[:2]  # the prefix cache's own hashes
    assert transfer_keys(tokens[:9], B) == keys[:2]  # a prompt of 2 whole blocks + 1 token: no partial key
    assert transfer_keys([5], B) == []
    assert transfer_keys(tokens, B, ("salt",))[0][0] != keys[0][0]  # a salt changes every key


def test_matches_consecutive_stored_blocks_after_the_local_hit(tmp_path):
    connector = _directory_connector(tmp_path, "kv_consumer")
    request = _request(range(11))
    keys = transfer_keys(request.prompt_token_ids, B)
    assert connector.get_num_matched_tokens(request, 0) == 0
    for key, _ in (keys[0], keys[2]):
        connector.store.block_path(key).write_bytes(b"")
    assert connector.get_num_matched_tokens(request, 0) == 4  # the second block is missing: stop there
    connector.store.block_path(keys[1][0]).write_bytes(b"")
    assert connector.get_num_matched_tokens(request, 0) == 10
    assert connector.get_num_matched_tokens(request, 8) == 2  # two blocks found locally
    connector.update_state_after_alloc(request, [7, 8, 9], 4, 6)
    meta = connector.build_connector_meta([], {})
    assert [(t.key, t.block_id) for t in meta.loads] == [(keys[1][0], 8), (keys[2][0], 9)]
    assert connector.build_connector_meta([], {}).empty  # handed over once
    connector.request_finished(request)
    assert list(tmp_path.iterdir()) == []  # a consumer deletes its request's blocks when it ends


def test_a_producer_loads_nothing_and_keeps_what_it_saved(tmp_path):
    connector = _directory_connector(tmp_path, "kv_producer")
    request = _request(range(6), salt="s")
    key = transfer_keys(request.prompt_token_ids, B, request.cache_extra_keys)[0][0]
    connector.store.block_path(key).write_bytes(b"")
    assert connector.get_num_matched_tokens(request, 0) == 0
    connector.request_finished(request)
    assert connector.store.block_path(key).exists()


class _DownStore(KVBlockStore):
    """A store that cannot be reached: every call fails."""

    location = "nowhere"

    def lookup(self, keys):
        raise KVStoreError("unreachable")

    put = get = delete = lookup


def test_a_failed_load_is_not_retried_and_a_failing_store_matches_nothing(tmp_path):
    connector = _directory_connector(tmp_path, "kv_consumer")
    request = _request(range(11))
    for key, _ in transfer_keys(request.prompt_token_ids, B):
        connector.store.block_path(key).write_bytes(b"")
    assert connector.get_num_matched_tokens(request, 0) == 10
    connector.request_load_failed(request)  # the request computes its prompt from now on
    assert connector.get_num_matched_tokens(request, 0) == 0
    connector.request_finished(request)
    assert list(tmp_path.iterdir()) == []
    down = KVStoreConnector(_DownStore(), "kv_both", B)
    assert down.get_num_matched_tokens(request, 0) == 0
    down.request_finished(request)  # nothing to delete it from: no error
    down.discard(request.prompt_token_ids)
