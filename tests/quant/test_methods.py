"""Each method's layer against its own dequantized weights in float32, for every matmul shape the
default model has, at decode (kernel) and prefill (dequantized) sizes, and its embedding rows."""

from __future__ import annotations

import pytest
import torch

from kvflow.model.layers.embedding import VocabParallelEmbedding
from kvflow.model.layers.linear import MergedColumnParallelLinear
from kvflow.quant.registry import get_quantization_config

# (N, K) of SmolLM2-135M: qkv, o, gate_up, down; the 49152-row head is covered by the GGUF tests
# (int4 planes) and by a smaller vocabulary here.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
METHODS = ["int8", "int4", "fp8", "mxfp4", "w8a8"]


def _layer(method: str, n: int, k: int, group: int | None = None):
    config = get_quantization_config(method, group, None)
    layer = MergedColumnParallelLinear(k, [n // 2, n // 2], quant_config=config, prefix=f"{method}.{n}x{k}")
    w = torch.randn(n, k) * 0.05
    layer.weight_loader(layer.weight, w[: n // 2], 0)
    layer.weight_loader(layer.weight, w[n // 2:], 1)
    layer.calibrated = True  # w8a8 waits for calibration's scales; here it rounds the weights as they are
    layer.quant_method.process_weights_after_loading(layer)
    return layer, w


def _dequantized(layer) -> torch.Tensor:
    return layer.quant_runtime.dequantize(torch.float32) if hasattr(layer.quant_runtime, "dequantize") else None


@pytest.mark.parametrize("method", METHODS)
def test_matmul_matches_its_dequantized_weights(method):
    torch.manual_seed(0)
    for n, k in SHAPES:
        layer, w = _layer(method, n, k)
        for rows in (1, 3, 100):
            x = torch.randn(rows, k)
            y = layer(x)
            if method == "w8a8":  # activations are rounded too: compare with both sides rounded
                scale = x.abs().amax(1, keepdim=True) / 127
                x = (x * (1 / scale)).round() * scale
            torch.testing.assert_close(y, x @ _dequantized(layer).t(), atol=2e-4, rtol=1e-4)
        # and the quantized weights stay near the float ones (the format's own bound)
        deq = _dequantized(layer)
        assert (deq - w).abs().max() <= {"int8": 0.002, "int4": 0.03, "fp8": 0.016, "mxfp4": 0.1, "w8a8": 0.002}[method]


@pytest.mark.parametrize("group", [32, 64])
def test_int4_group_sizes(group):
    layer, w = _layer("int4", 576, 1536, group)
    x = torch.randn(2, 1536)
    torch.testing.assert_close(layer(x), x @ _dequantized(layer).t(), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("method", [m for m in METHODS if m not in ("fp8", "w8a8")])  # theirs: below
def test_embedding_rows_and_tied_head(method):
    config = get_quantization_config(method, None, None)
    embed = VocabParallelEmbedding(1000, 576, quant_config=config, prefix="model.embed_tokens")
    w = torch.randn(1000, 576)
    embed.weight_loader(embed.weight, w)
    embed.quant_method.process_weights_after_loading(embed)
    ids = torch.tensor([0, 1, 63, 64, 999])
    rows = embed(ids)
    assert rows.is_contiguous()  # the CPU decode loop's C++ kernels take the embedding's rows as they are
    torch.testing.assert_close(rows, _dequantized(embed)[ids])
    assert embed.compute_logits(torch.randn(2, 576)).shape == (2, 1000)


@pytest.mark.parametrize("method", ["fp8", "w8a8"])
def test_fp8_and_w8a8_leave_the_embedding_and_head_float(method):
    """As vLLM's fp8 and w8a8 do: only the linear layers are quantized."""
    embed = VocabParallelEmbedding(1000, 576, quant_config=get_quantization_config(method, None, None),
                                   prefix="model.embed_tokens")
    w = torch.randn(1000, 576)
    embed.weight_loader(embed.weight, w)
    ids = torch.tensor([0, 63, 999])
    assert embed.weight.dtype == torch.float32 and not hasattr(embed, "quant_runtime")
    torch.testing.assert_close(embed(ids), w[ids], rtol=0, atol=0)


def test_int8_takes_the_few_row_gemv_in_bfloat16():
    """int8 rows in a bfloat16 model: calls of ≤ 4 rows run kvflow's GEMV (codes + 128, (s, 0) per
    group: the same weights exactly), more rows int8pack; both the dequantized product within the
    bf16 output's rounding (and the one-row int8 levels' bound, far below it)."""
    from kvflow.quant import int4_gemv

    if not int4_gemv.fast():
        pytest.skip("no AVX-512 BF16 here: the GEMV does not run")
    torch.manual_seed(0)
    config = get_quantization_config("int8", None, None)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # the model's dtype, as the loader sets it
    try:
        layer = MergedColumnParallelLinear(576, [480, 480], quant_config=config, prefix="int8.bf16")
    finally:
        torch.set_default_dtype(before)
    w = torch.randn(960, 576) * 0.05
    layer.weight_loader(layer.weight, w[:480].bfloat16(), 0)
    layer.weight_loader(layer.weight, w[480:].bfloat16(), 1)
    layer.quant_method.process_weights_after_loading(layer)
    runtime = layer.quant_runtime
    exact = runtime.q.float() * runtime.scale.float()[:, None]  # q·s, as int8pack applies it
    assert runtime.gemv is not None and torch.equal(runtime.gemv.dequantize(), exact)
    for rows in (1, 4, 5):
        x = torch.randn(rows, 576).bfloat16()
        reference = x.float() @ exact.t()
        assert (layer(x).float() - reference).abs().max() <= 2**-8 * reference.abs().max()
