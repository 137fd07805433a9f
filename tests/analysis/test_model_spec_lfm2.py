"""The planner's view of LFM2 (gated short convolutions and attention layers, an MLP in each):
parameters against transformers' model, memory per request as the convolutions' states plus the
attention layers' KV."""

from __future__ import annotations

import pytest
from tiny_hybrid_models import _LFM2, LFM2_CONFIGS

from kvflow.analysis.model_spec import ModelSpec
from kvflow.kv_cache_spec import STATE_BYTES


def _config(name: str) -> dict:
    return {**_LFM2, **LFM2_CONFIGS[name], "architectures": ["Lfm2ForCausalLM"], "model_type": "lfm2"}


@pytest.mark.parametrize("name", list(LFM2_CONFIGS))
def test_parameters_are_transformers_count(name):
    """Convolutions with and without biases, q/k norms, a tied and an untied head."""
    import transformers

    hf = transformers.Lfm2ForCausalLM(transformers.Lfm2Config(**{**_LFM2, **LFM2_CONFIGS[name]}))
    assert ModelSpec.from_hf_config(_config(name)).param_count() == sum(p.numel() for p in hf.parameters())


def test_a_request_holds_its_states_and_the_attention_layers_kv():
    spec = ModelSpec.from_hf_config(_config("lfm2-conv-first"))
    state = 64 * 2 * STATE_BYTES  # 64 channels x the kernel's 2 past inputs, float32
    per_token = 2 * 2 * 2 * 16 * 2  # two attention layers, K and V of two KV heads of 16, bfloat16
    assert spec.state_bytes_per_request() == 2 * state  # two convolution layers
    assert spec.kv_bytes_per_token() == per_token
    assert spec.kv_bytes_for_context(1000) == 2 * state + 1000 * per_token
    assert spec.attention_kind == "gqa" and spec.attention_twin().kv_bytes_per_token() == 2 * per_token
    twin, crossover = spec.attention_twin(), spec.state_crossover_tokens()
    assert spec.kv_bytes_for_context(crossover) < twin.kv_bytes_for_context(crossover)
    assert spec.kv_bytes_for_context(crossover - 1) >= twin.kv_bytes_for_context(crossover - 1)
