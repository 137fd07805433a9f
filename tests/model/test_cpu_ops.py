"""The fused CPU kernels (model/layers/cpu_ops: residual add + RMSNorm, RoPE, SiLU·mul) against
their torch code, the layers' choice between the two, and a tiny model run both ways.

RoPE and the residual sum agree bit for bit (the same float32 operations, rounded at the same
points). RMSNorm's sum of squares is taken in another order (the kernel accumulates in double,
torch in float, pairwise: a last-place difference for about a third of rows), and SiLU's exp is
glibc's, not torch's vectorised one; so in float32 those agree to a unit or two in the last
place (measured: 2e-7 relative), and in bfloat16 bit for bit except where such a difference
straddles a rounding boundary (measured: 2 elements in a million, one unit in the last place).
"""

from __future__ import annotations

import pytest
import torch

from kvflow.config import KernelConfig
from kvflow.cpu_extension import kernel_scope
from kvflow.model.layers import cpu_ops, triton_ops
from kvflow.model.layers.activation import torch_silu_and_mul
from kvflow.model.layers.norm import RMSNorm
from kvflow.model.layers.reference import Rope, torch_rms_norm, torch_rotary
from kvflow.model.layers.rotary import RotaryEmbedding

DTYPES = [torch.float32, torch.bfloat16]
EPS = 1e-6


@pytest.fixture(autouse=True)
def kernels_built():
    assert cpu_ops.load() is not None, "the fused CPU kernels did not build (see the warning above)"


def randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-7)
        return
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-8, atol=1e-7)  # one bf16 ulp
    assert (out != ref).float().mean().item() < 2e-3


# -- residual add + RMSNorm ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, width", [(1, 576), (37, 576), (37, 67)])  # 67: no vector multiple
def test_add_rms_norm_matches_torch_and_updates_the_residual_in_place(tokens, width, dtype):
    # x is a column slice of a wider tensor, so its rows are strided as a fused output's would be.
    x = randn(tokens, width + 8, dtype=dtype, seed=0)[:, :width]
    residual = randn(tokens, width, dtype=dtype, seed=1, scale=4.0)
    weight = 1 + randn(width, dtype=dtype, seed=2, scale=0.1)
    ref_normed, ref_residual = torch_rms_norm(x, weight, EPS, residual)
    normed, new_residual = cpu_ops.rms_norm(x, weight, EPS, residual)
    assert new_residual is residual  # the sum overwrote the old stream
    assert torch.equal(new_residual, ref_residual)  # one rounding of the sum: bit for bit
    assert_matches(normed, ref_normed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, width", [(1, 576), (37, 67)])
def test_rms_norm_matches_torch(tokens, width, dtype):
    x = randn(tokens, width, dtype=dtype, seed=3, scale=3.0)
    weight = 1 + randn(width, dtype=dtype, seed=4, scale=0.1)
    assert_matches(cpu_ops.rms_norm(x, weight, EPS), torch_rms_norm(x, weight, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_over_heads_of_a_strided_view(dtype):
    # Qwen3's q norm: each head of a strided [T, heads, head_dim] view of the qkv output.
    heads, head_dim = 4, 64
    q = randn(5, (heads + 2) * head_dim, dtype=dtype, seed=5)[:, : heads * head_dim].unflatten(-1, (heads, -1))
    weight = 1 + randn(head_dim, dtype=dtype, seed=6, scale=0.1)
    assert_matches(cpu_ops.rms_norm(q, weight, EPS), torch_rms_norm(q, weight, EPS))


def test_mixed_dtypes_take_the_torch_code():
    x, residual = randn(3, 16, dtype=torch.bfloat16, seed=7), randn(3, 16, dtype=torch.float32, seed=8)
    weight = torch.ones(16)
    normed, new_residual = cpu_ops.rms_norm(x, weight, EPS, residual.clone())
    ref_normed, ref_residual = torch_rms_norm(x, weight, EPS, residual)
    assert torch.equal(normed, ref_normed) and torch.equal(new_residual, ref_residual)


# -- RoPE -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 37])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (4, 1, 128), (3, 1, 18)])
def test_rotary_in_place_matches_torch_bit_for_bit(tokens, heads, kv_heads, head_dim, dtype):
    table = RotaryEmbedding(head_dim, 4096, 10000.0, None)
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=9)
    v_before = qkv[:, (heads + kv_heads) * head_dim:].clone()
    q, k, _ = (t.unflatten(-1, (-1, head_dim)) for t in qkv.split([heads * head_dim] + 2 * [kv_heads * head_dim], -1))
    positions = torch.randint(0, 4096, (tokens,), generator=torch.Generator().manual_seed(10))
    rope = Rope(positions, table.cos, table.sin)
    ref_q, ref_k = torch_rotary(q, rope), torch_rotary(k, rope)
    q_out, k_out = cpu_ops.rotary(q, k, positions, table.cos, table.sin)
    assert q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr()  # rotated where they lie
    # The same float32 products and sums as torch, each rounded once: no tolerance needed.
    assert torch.equal(q_out, ref_q) and torch.equal(k_out, ref_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], v_before)


def test_rotary_refuses_a_position_outside_the_table():
    table = RotaryEmbedding(8, 16, 10000.0, None)
    q, k = torch.zeros(2, 1, 8), torch.zeros(2, 1, 8)
    with pytest.raises(RuntimeError, match="position 16 is outside the table of 16"):
        cpu_ops.rotary(q, k, torch.tensor([3, 16]), table.cos, table.sin)


# -- SiLU(gate) * up --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, intermediate", [(1, 1536), (37, 37)])
def test_silu_and_mul_matches_torch(tokens, intermediate, dtype):
    gate_up = randn(tokens, 2 * intermediate + 6, dtype=dtype, seed=11, scale=3.0)[:, : 2 * intermediate]
    assert_matches(cpu_ops.silu_and_mul(gate_up), torch_silu_and_mul(gate_up))


def test_silu_and_mul_of_a_non_contiguous_last_dim():
    gate_up = randn(8, 3, dtype=torch.float32, seed=12).t()  # [3, 8] with column stride 3
    assert_matches(cpu_ops.silu_and_mul(gate_up), torch_silu_and_mul(gate_up))


def test_the_op_refuses_a_wrong_output_shape():
    with pytest.raises(RuntimeError, match="silu_and_mul: out"):
        torch.ops.kvflow_cpu_ops.silu_and_mul(torch.empty(2, 3), torch.zeros(2, 8))


# -- the layers' dispatch and a whole model ---------------------------------------------------------------
def test_cpu_tensors_take_the_kernels_unless_built_with_custom_ops_none():
    assert triton_ops.kernels_for(torch.zeros(1)).rms_norm is cpu_ops.rms_norm
    assert triton_ops.kernels_for(torch.zeros(1, dtype=torch.bfloat16)) is not None
    assert triton_ops.kernels_for(torch.zeros(1, dtype=torch.float64)) is None
    stream = torch.ones(2, 8)
    normed, residual = RMSNorm(8, EPS)(torch.ones(2, 8), stream)  # the kernel: the sum written in place
    assert residual is stream and torch.equal(stream, torch.full((2, 8), 2.0))
    with kernel_scope(KernelConfig(custom_ops=False)):
        norm = RMSNorm(8, EPS)
    stream = torch.ones(2, 8)
    normed, residual = norm(torch.ones(2, 8), stream)  # the torch code: a new sum
    assert residual is not stream and torch.equal(stream, torch.ones(2, 8))


@pytest.mark.parametrize("name", ["llama-gqa-llama3-rope", "qwen3-qknorm"])
def test_tiny_model_with_kernels_matches_the_torch_code(name, tmp_path):
    """The engine as users run it against the same engine with `custom_ops="none"` (the torch
    code, the reference the HF-oracle tests may ask for)."""
    from tiny_models import make_tiny_model

    from kvflow import LLM, SamplingParams

    make_tiny_model(name, tmp_path)
    prompts = [[5, 17, 3, 88, 40, 2, 9, 61, 33, 12, 7, 70, 1, 4], [44, 45], [90, 3, 3, 3, 8, 11]]
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True)

    def generate(custom_ops: str):
        llm = LLM(str(tmp_path), dtype="float32", skip_tokenizer_init=True, kv_cache_memory_gb=0.01,
                  custom_ops=custom_ops)
        return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]

    fused, plain = generate("all"), generate("none")
    for a, b in zip(fused, plain):
        assert a.token_ids == b.token_ids
        for lp_a, lp_b in zip(a.logprobs, b.logprobs):
            assert lp_a.keys() == lp_b.keys()
            assert all(abs(lp_a[t].logprob - lp_b[t].logprob) < 1e-5 for t in lp_a)
