"""The planner's view of a hybrid (Bamba: Mamba-2 mixers and attention layers, an MLP in each):
parameters against transformers' model, memory per request as states plus the attention layers'
KV, and the context where that beats the model with attention in every layer."""

from __future__ import annotations

from tiny_hybrid_models import _BAMBA

from kvflow.analysis.model_spec import ModelSpec
from kvflow.kv_cache_spec import STATE_BYTES

_CONFIG = {**_BAMBA, "architectures": ["BambaForCausalLM"], "model_type": "bamba"}


def test_parameters_are_transformers_count():
    import transformers

    hf = transformers.BambaForCausalLM(transformers.BambaConfig(**_BAMBA))
    assert ModelSpec.from_hf_config(_CONFIG).param_count() == sum(p.numel() for p in hf.parameters())


def test_a_request_holds_its_states_and_the_attention_layers_kv():
    spec = ModelSpec.from_hf_config(_CONFIG)
    state = spec.ssm.state_elements * STATE_BYTES
    per_token = 2 * 2 * 2 * 16 * 2  # two attention layers, K and V of two KV heads of 16, bfloat16
    assert spec.state_bytes_per_request() == 2 * state  # two mixer layers
    assert spec.kv_bytes_per_token() == per_token
    assert spec.kv_bytes_for_context(1000) == 2 * state + 1000 * per_token
    assert spec.attention_kind == "gqa" and spec.attention_twin().kv_bytes_per_token() == 2 * per_token


def test_the_crossover_is_where_the_hybrid_first_holds_less():
    spec = ModelSpec.from_hf_config(_CONFIG)
    twin, crossover = spec.attention_twin(), spec.state_crossover_tokens()
    assert spec.kv_bytes_for_context(crossover) < twin.kv_bytes_for_context(crossover)
    assert spec.kv_bytes_for_context(crossover - 1) >= twin.kv_bytes_for_context(crossover - 1)
