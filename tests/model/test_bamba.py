"""Bamba, a hybrid of Mamba-2 mixers and attention, served by the engine: attention layers in KV
blocks, the mixers' states in state slots apart from the block pool (kv_cache_spec), against
transformers' BambaForCausalLM in float32; and the layout, slots and pool budget underneath."""

from __future__ import annotations

import pytest
import torch
from tiny_hybrid_models import (
    _BAMBA,
    check_a_preempted_request_recomputes_its_states,
    check_chunked_and_batched_match_transformers,
    check_n_completions_hold_their_own_states,
    check_swap_is_refused,
    make_tiny_bamba,
)

from kvflow import SamplingParams
from kvflow.config import CacheConfig
from kvflow.core.block_pool import StateSlots
from kvflow.core.kv_cache_manager import KVCacheManager
from kvflow.core.request import Request
from kvflow.kv_cache_spec import STATE_BYTES, FullAttentionSpec, MambaStateSpec
from kvflow.model.arch_config import ArchConfig
from kvflow.worker.kv_cache import allocate_kv_caches, pool_blocks


@pytest.fixture(scope="module", params=["bamba-g1", "bamba-g2-bias"])
def tiny_bamba(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    return str(directory), make_tiny_bamba(request.param, directory)


def _tiny_arch() -> ArchConfig:
    return ArchConfig.from_hf({**_BAMBA, "architectures": ["BambaForCausalLM"], "model_type": "bamba"})


# -- served against transformers ---------------------------------------------------------------

@pytest.mark.parametrize("step_tokens", [16, 512])
def test_prompts_chunked_and_batched_match_transformers(tiny_bamba, step_tokens):
    check_chunked_and_batched_match_transformers(*tiny_bamba, step_tokens)


def test_n_completions_each_hold_their_own_state(tiny_bamba):
    check_n_completions_hold_their_own_states(*tiny_bamba)


def test_a_preempted_request_recomputes_its_state(tiny_bamba):
    check_a_preempted_request_recomputes_its_states(*tiny_bamba)


def test_swap_is_refused_naming_the_setting(tiny_bamba):
    check_swap_is_refused(tiny_bamba[0])


# -- layout, slots, pool budget ----------------------------------------------------------------

def test_layout_keeps_the_states_apart_from_the_block_pool():
    """The two attention layers share one group of blocks; the two mixers form one state group whose
    slot tensors are not the pool's: a block costs the attention layers' KV only."""
    layout = _tiny_arch().kv_layout
    assert [(type(g.spec), g.layers) for g in layout.groups] == [(FullAttentionSpec, (1, 3)), (MambaStateSpec, (0, 2))]
    assert layout.hybrid and layout.state_groups == (False, True) and layout.state_layers == (0, 2)
    assert layout.block_bytes(16, 4) == 2 * 16 * (2 * 2 * 16) * 4  # 2 layers x 16 tokens x K,V of 2 heads of 16
    state = layout.groups[1].spec.state_elements * STATE_BYTES
    assert layout.state_bytes() == 2 * state and layout.state_bytes(range(1, 4)) == state
    caches = allocate_kv_caches(layout, 5, 16, torch.float32, "cpu", populate=False, num_state_slots=3)
    assert caches[1].shape[1] == caches[3].shape[1] == 5 and caches[1].data_ptr() != caches[3].data_ptr()
    assert caches[0].shape == caches[2].shape == (1, 3, layout.groups[1].spec.state_elements)
    with pytest.raises(ValueError, match="num_state_slots"):
        allocate_kv_caches(layout, 5, 16, torch.float32, "cpu", populate=False)


def test_the_budget_sets_max_num_seqs_states_aside_before_the_blocks():
    layout = _tiny_arch().kv_layout
    block, states = layout.block_bytes(16, 2), 8 * layout.state_bytes()
    cache = CacheConfig(block_size=16, kv_cache_memory_gb=(states + 10.5 * block) / 1024**3, num_kv_blocks=None)
    assert pool_blocks(cache, layout, 2, max_model_len=10**6, max_num_seqs=8) == (10, 0)
    starved = CacheConfig(block_size=16, kv_cache_memory_gb=(states + 0.5 * block) / 1024**3, num_kv_blocks=None)
    with pytest.raises(ValueError, match="kv_cache_memory_gb=.*beside max_num_seqs requests' states"):
        pool_blocks(starved, layout, 2, max_model_len=10**6, max_num_seqs=8)


def test_state_slots_are_handed_out_lowest_first():
    slots = StateSlots()
    assert [slots.allocate() for _ in range(3)] == [0, 1, 2]
    slots.release(1)
    slots.release(0)
    assert [slots.allocate(), slots.allocate(), slots.allocate()] == [0, 1, 3]
    slots.release(3)
    with pytest.raises(RuntimeError, match="released twice"):
        slots.release(3)


def test_the_manager_gives_each_request_a_slot_and_blocks():
    """Blocks per attention group and one slot per state group; the block pool counts only the
    blocks (a slot never makes an allocation fail); free gives both back."""
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_caching=False, sliding_windows=(None, None),
                        state_groups=(False, True))
    a, b = (Request(rid, list(range(9)), SamplingParams(), 8, frozenset()) for rid in "ab")
    assert kv.allocate_slots(a, 0, 9) and kv.block_ids("a") == ([0, 1, 2], [0])
    assert kv.max_blocks_held(9, 9) == 3
    assert not kv.allocate_slots(b, 0, 9)  # three blocks wanted, one free
    assert kv.allocate_slots(b, 0, 4) and kv.block_ids("b") == ([3], [1])
    kv.free(a)
    kv.free(b)
    assert kv.pool.num_free_blocks == 4 and kv.state_slots[1].num_held == 0


def test_a_sliding_group_beside_a_state_group_gives_blocks_back_and_keeps_the_slot():
    """A window of 4 over blocks of 4: once position 8 is computed, the first block has left the
    window of every query to come and returns to the pool; the request keeps its one slot."""
    kv = KVCacheManager(num_blocks=6, block_size=4, enable_caching=False, sliding_windows=(None, 4, None),
                        state_groups=(False, False, True))
    request = Request("a", list(range(9)), SamplingParams(), 8, frozenset())
    assert kv.allocate_slots(request, 0, 8) and kv.block_ids("a") == ([0, 1], [2, 3], [0])
    assert kv.allocate_slots(request, 8, 1)
    assert kv.block_ids("a") == ([0, 1, 4], [-1, 3, 5], [0]) and kv.pool.num_free_blocks == 1
    kv.free(request)
    assert kv.pool.num_free_blocks == 6 and kv.state_slots[2].num_held == 0


def test_tensor_and_pipeline_parallel_are_refused_naming_the_flag():
    """The mixers do not shard (mamba2_mixer's docstring): the model refuses before it is built."""
    from kvflow.attention.backend import get_attention_backend
    from kvflow.distributed.parallel_state import TensorParallel, tensor_parallel_scope
    from kvflow.distributed.pipeline import PipelineStage, pipeline_scope
    from kvflow.model.models.bamba import BambaForCausalLM

    arch, backend = _tiny_arch(), get_attention_backend("torch_sdpa")
    with tensor_parallel_scope(TensorParallel(0, 2)), pytest.raises(ValueError, match="BambaForCausalLM.*tensor_parallel_size=2"):
        BambaForCausalLM(arch, backend)
    with pipeline_scope(PipelineStage(0, 2, range(2))), pytest.raises(ValueError, match="pipeline_parallel_size=2"):
        BambaForCausalLM(arch, backend)


@pytest.mark.parametrize("field", ["attention_bias", "mlp_bias"])
def test_biases_kvflow_does_not_carry_are_refused_naming_the_field(field):
    from kvflow.attention.backend import get_attention_backend
    from kvflow.model.models.bamba import BambaForCausalLM

    arch = ArchConfig.from_hf({**_BAMBA, "architectures": ["BambaForCausalLM"], "model_type": "bamba", field: True})
    with pytest.raises(ValueError, match=f"{field}=true is not supported"):
        BambaForCausalLM(arch, get_attention_backend("torch_sdpa"))
