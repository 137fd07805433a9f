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


@pytest.mark.parametrize("cuda", [True, False])
def test_auto_device_backend_and_graphs_follow_the_gpu(monkeypatch, cuda):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(config, "has_native_bf16", lambda device: True)
    monkeypatch.setattr(config, "triton_installed", lambda: True)
    cfg = EngineArgs().create_config(model_max_len=512)
    assert cfg.device == ("cuda" if cuda else "cpu")
    assert cfg.attention_backend == ("triton" if cuda else "torch_sdpa")
    assert cfg.use_cuda_graphs is cuda
    assert cfg.model.dtype == torch.bfloat16


def test_graphs_only_with_triton_on_cuda_and_not_when_eager(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(config, "has_native_bf16", lambda device: True)
    monkeypatch.setattr(config, "triton_installed", lambda: True)
    assert not EngineArgs(enforce_eager=True).create_config(512).use_cuda_graphs
    assert not EngineArgs(attention_backend="torch_sdpa").create_config(512).use_cuda_graphs
    monkeypatch.setattr(config, "triton_installed", lambda: False)
    assert EngineArgs().create_config(512).attention_backend == "torch_sdpa"  # torch runs on CUDA too


def test_asking_for_cuda_without_a_gpu_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="no CUDA GPU"):
        EngineArgs(device="cuda").create_config(512)
    with pytest.raises(ValueError, match="device"):
        EngineArgs(device="tpu").create_config(512)


def test_a_max_model_len_past_the_models_context_is_refused_by_name():
    assert EngineArgs(max_model_len=512).create_config(512).model.max_model_len == 512
    assert EngineArgs().create_config(512).model.max_model_len == 512  # unset: the model's context
    with pytest.raises(ValueError, match=r"max_model_len must be <= the model's context of 512 positions \(got 1024\)"):
        EngineArgs(max_model_len=1024).create_config(512)


def _from_cli(argv: list[str]) -> EngineArgs:
    import argparse

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    return EngineArgs.from_cli_args(parser.parse_args(argv))


def test_vllms_flags_mean_what_they_mean_there():
    args = _from_cli(["--swap-space", "2", "--no-enable-chunked-prefill", "--trust-remote-code",
                      "--gpu-memory-utilization", "0.5", "--max-num-batched-tokens", "256", "--device", "cpu"])
    cfg = args.create_config(4096)
    assert args.swap_space_gb == 2 and args.trust_remote_code
    assert cfg.cache.gpu_memory_utilization == 0.5
    assert cfg.scheduler.max_num_batched_tokens == cfg.model.max_model_len  # a prompt is never split
    chunked = _from_cli(["--max-num-batched-tokens", "256", "--device", "cpu"]).create_config(4096)
    assert chunked.scheduler.max_num_batched_tokens == 256
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        EngineArgs(gpu_memory_utilization=1.5, device="cpu").create_config(4096)


def test_gpu_memory_utilization_budgets_a_fraction_of_memory_less_what_the_process_holds():
    from kvflow.worker.kv_cache import _meminfo_bytes, utilization_budget_gb

    cpu = torch.device("cpu")
    step = utilization_budget_gb(0.6, cpu) - utilization_budget_gb(0.5, cpu)
    assert step == pytest.approx(0.1 * _meminfo_bytes("MemTotal") / 1024**3, rel=0.02)
    with pytest.raises(ValueError, match="no room is left for the KV cache"):
        utilization_budget_gb(1e-6, cpu)
