"""A directory store creates its directory only when it first writes: a refused disaggregation
config leaves nothing on disk, and a path that could never be written is refused at opening,
naming the field, without creating anything."""

from __future__ import annotations

import hashlib

import pytest
from tiny_models import make_tiny_model

from kvflow import LLMEngine
from kvflow.config import EngineArgs
from kvflow.kv_store import DirectoryKVStore

KEY = hashlib.sha256(b"block").digest()


def test_an_engine_refused_after_opening_its_store_leaves_no_directory(tmp_path):
    make_tiny_model("mistral-window", tmp_path / "model")  # refused: KV transfer needs full attention
    store = tmp_path / "kv" / "store"
    args = EngineArgs(str(tmp_path / "model"), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=16,
                      kv_transfer_config={"kv_role": "kv_producer",
                                          "kv_connector_extra_config": {"shared_storage_path": str(store)}})
    with pytest.raises(ValueError, match="sliding-window"):
        LLMEngine(args)
    assert not (tmp_path / "kv").exists()


def test_opening_creates_nothing_and_the_first_write_makes_the_directory(tmp_path):
    path = tmp_path / "a" / "b"
    store = DirectoryKVStore(path, max_bytes=1000)
    assert store.lookup([KEY]) == 0 and store.get([KEY]) == [None]
    store.delete([KEY])
    assert store.evict_to(0) == 0
    assert not (tmp_path / "a").exists()
    assert store.put([(KEY, b"kv")]) == 1
    assert store.lookup([KEY]) == 1 and store.get([KEY]) == [b"kv"]
    assert store.location == str(path.resolve())


def test_a_path_that_cannot_be_a_directory_is_refused_naming_the_field(tmp_path):
    file = tmp_path / "file"
    file.write_text("not a directory")
    for bad in (file, file / "below"):
        with pytest.raises(ValueError, match=r"kv_connector_extra_config\.shared_storage_path .* is not a directory"):
            DirectoryKVStore(bad)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]

