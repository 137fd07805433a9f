"""The model layers' Triton kernels (residual add + RMSNorm, RoPE, SiLU·mul) against their torch
code, and the layers' choice between the two.

Without a GPU the kernels run under TRITON_INTERPRET=1 (see tests/conftest.py); with one, on it.
In bfloat16 the kernels round exactly where the torch code does, so they agree with it bit for
bit except where a last-place difference in float32 (summation order, exp) straddles a bfloat16
rounding boundary: rare, and one unit in the last place.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton")

from kvflow.model.layers import cpu_ops, triton_ops  # noqa: E402
from kvflow.model.layers.activation import torch_silu_and_mul  # noqa: E402
from kvflow.model.layers.reference import Rope, torch_rms_norm, torch_rotary  # noqa: E402
from kvflow.model.layers.rotary import RotaryEmbedding  # noqa: E402
from kvflow.model.layers.triton_ops.activation import silu_and_mul  # noqa: E402
from kvflow.model.layers.triton_ops.norm import rms_norm  # noqa: E402
from kvflow.model.layers.triton_ops.rotary import rotary  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.bfloat16]
EPS = 1e-5


def randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


def assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        return
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=1e-6)  # one bf16 ulp
    assert (out != ref).float().mean().item() < 1e-3


# -- residual add + RMSNorm ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, width", [(1, 576), (37, 576), (37, 64)])
def test_add_rms_norm_matches_torch(tokens, width, dtype):
    # x is a column slice of a wider tensor, so its rows are strided as a fused output's would be.
    x = randn(tokens, width + 8, dtype=dtype, seed=0)[:, :width]
    residual = randn(tokens, width, dtype=dtype, seed=1, scale=4.0)
    weight = 1 + randn(width, dtype=dtype, seed=2, scale=0.1)
    normed, new_residual = rms_norm(x, weight, EPS, residual)
    ref_normed, ref_residual = torch_rms_norm(x, weight, EPS, residual)
    assert torch.equal(new_residual, ref_residual)  # one rounding of the sum: bit for bit
    assert_matches(normed, ref_normed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 37])
def test_rms_norm_over_heads_matches_torch(tokens, dtype):
    # Qwen3's q norm: each head of a strided [T, heads, head_dim] view of the qkv output.
    heads, head_dim = 4, 128
    q = randn(tokens, (heads + 2) * head_dim, dtype=dtype, seed=3)[:, : heads * head_dim].unflatten(-1, (heads, -1))
    weight = 1 + randn(head_dim, dtype=dtype, seed=4, scale=0.1)
    assert_matches(rms_norm(q, weight, EPS), torch_rms_norm(q, weight, EPS))


# -- RoPE -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 37])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (4, 1, 128)])
def test_rotary_matches_torch_bit_for_bit(tokens, heads, kv_heads, head_dim, dtype):
    table = RotaryEmbedding(head_dim, 4096, 10000.0, None).to(DEVICE)
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=5)
    q, k, _ = (t.unflatten(-1, (-1, head_dim)) for t in qkv.split([heads * head_dim] + 2 * [kv_heads * head_dim], -1))
    positions = torch.randint(0, 4096, (tokens,), generator=torch.Generator().manual_seed(6)).to(DEVICE)
    q_out, k_out = rotary(q, k, positions, table.cos, table.sin)
    rope = Rope(positions, table.cos, table.sin)
    # The same float32 products and sums as torch, each rounded once: no tolerance needed.
    assert torch.equal(q_out, torch_rotary(q, rope))
    assert torch.equal(k_out, torch_rotary(k, rope))


# -- SiLU(gate) * up --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, intermediate", [(1, 1536), (37, 96)])
def test_silu_and_mul_matches_torch(tokens, intermediate, dtype):
    gate_up = randn(tokens, 2 * intermediate, dtype=dtype, seed=7, scale=3.0)
    assert_matches(silu_and_mul(gate_up), torch_silu_and_mul(gate_up))


# -- the layers' dispatch -----------------------------------------------------------------------------------
def test_cpu_tensors_never_take_the_triton_kernels():
    kernels = triton_ops.kernels_for(torch.zeros(1))  # the C++ kernels (tests/model/test_cpu_ops.py), or None
    assert kernels is None or kernels.rms_norm is cpu_ops.rms_norm


def test_missing_triton_falls_back_to_torch(monkeypatch):
    triton_ops._load.cache_clear()
    monkeypatch.setitem(sys.modules, "triton", None)
    try:
        assert triton_ops._load() is None
    finally:
        triton_ops._load.cache_clear()


def test_model_imports_and_runs_without_triton():
    script = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "import kvflow.model.models.llama\nfrom kvflow.model.layers.norm import RMSNorm\n"
        "from kvflow.model.layers.activation import silu_and_mul\n"
        "normed, residual = RMSNorm(8, 1e-6)(torch.ones(2, 8), torch.ones(2, 8))\n"
        "assert torch.equal(residual, torch.full((2, 8), 2.0)) and silu_and_mul(torch.ones(2, 8)).shape == (2, 4)\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the layers take the kernels only for CUDA tensors")
def test_llm_with_kernels_matches_the_torch_layers(tmp_path, monkeypatch):
    from tiny_models import make_tiny_model

    from kvflow import LLM, SamplingParams
    from kvflow.model.layers import activation, norm
    from kvflow.model.layers import rotary as rotary_layer

    assert triton_ops.kernels_for(torch.zeros(1, device=DEVICE)) is not None
    make_tiny_model("qwen3-qknorm", tmp_path)  # GQA and the per-head q/k norms
    prompts = [[5, 17, 3, 88, 40, 2, 9, 61, 33, 12, 7, 70, 1, 4], [44, 45], [90, 3, 3, 3, 8, 11]]
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=0, ignore_eos=True)

    def generate():
        llm = LLM(str(tmp_path), dtype="float32", skip_tokenizer_init=True, device="cuda",
                  attention_backend="torch_sdpa")
        return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]

    fused = generate()
    for module in (activation, norm, rotary_layer):
        monkeypatch.setattr(module, "kernels_for", lambda x: None)
    plain = generate()
    for a, b in zip(fused, plain):
        assert a.token_ids == b.token_ids
        chosen = [(lp[t].logprob, lp_b[t].logprob) for t, lp, lp_b in zip(a.token_ids, a.logprobs, b.logprobs)]
        assert all(abs(x - y) < 1e-4 for x, y in chosen)
