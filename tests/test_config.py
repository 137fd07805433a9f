from __future__ import annotations

import pytest
import torch

from kvflow import config
from kvflow.config import EngineArgs


@pytest.mark.parametrize("native,expected", [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_dtype_follows_native_bf16_support(monkeypatch, native, expected):
    monkeypatch.setattr(config, "has_native_bf16", lambda device: native)
    assert EngineArgs(dtype="auto").resolve_dtype() == expected


def test_explicit_dtypes():
    assert EngineArgs(dtype="float32").resolve_dtype() == torch.float32
    assert EngineArgs(dtype="bfloat16").resolve_dtype() == torch.bfloat16


@pytest.mark.parametrize("field,value", [
    ("max_num_seqs", 0), ("max_num_batched_tokens", 0), ("kv_cache_memory_gb", 0), ("num_kv_blocks", 0),
    ("scheduling_policy", "lifo"), ("preemption_mode", "drop"), ("swap_space_gb", -1), ("load_format", "pt"),
    ("attention_backend", "flash"), ("max_model_len", -5),
])
def test_invalid_engine_args_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        EngineArgs(**{field: value}).create_config(model_max_len=512)
