"""Int4 planes' two paths: the int4 kernel for a few rows, the dense bf16 copy (packed for oneDNN)
for more (quant/int4pack.py). Both must give the planes' own product: against the float32
product of the dequantized weights, for every group size the kernel runs, one and two planes,
fused shards, and the low-memory mode that keeps no copy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvflow.model.layers.linear import MergedColumnParallelLinear
from kvflow.quant.int4pack import GROUP_SIZES, KERNEL_MAX_ROWS, KERNEL_MAX_ROWS_NO_COPY, Int4Planes, planes_from_affine
from kvflow.quant.packed_linear import DenseWeight
from kvflow.quant.registry import get_quantization_config


def _planes(n: int, k: int, group: int, bits: int, dtype: torch.dtype, seed: int = 0,
            dense_copy: bool = True) -> Int4Planes:
    gen = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 2**bits, (n, k), generator=gen).to(torch.uint8)
    scale = torch.rand(n, k // group, generator=gen) * 0.02 + 0.001
    minimum = -scale * 2 ** (bits - 1) + torch.randn(n, k // group, generator=gen) * 0.01
    return Int4Planes(planes_from_affine(u, scale, minimum, bits), group, dtype, f"g{group}b{bits}", dense_copy)


def _assert_near(y: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype) -> None:
    tol = 2e-5 if dtype == torch.float32 else 2e-2  # bf16: weights, activations and outputs rounded
    assert (y.float() - reference).abs().max().item() <= tol * reference.abs().max().item()


def _both_paths(layer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer on all rows at once (the dense copy), and a few rows at a time (the kernel)."""
    assert len(x) > KERNEL_MAX_ROWS
    return layer(x), torch.cat([layer(chunk) for chunk in x.split(KERNEL_MAX_ROWS)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bits", [4, 8], ids=["one_plane", "two_planes"])
@pytest.mark.parametrize("group", GROUP_SIZES)
def test_dense_copy_and_kernel_give_the_planes_product(group, bits, dtype):
    planes = _planes(130, 512, group, bits, dtype)  # 130 rows: the kernel's padding to 64 is cut off
    assert planes.dense is not None
    x = torch.randn(3 * KERNEL_MAX_ROWS + 1, 512).to(dtype)
    reference = x.float() @ planes.dequantize(torch.float32).t()
    large, small = _both_paths(planes, x)
    _assert_near(large, reference, dtype)
    _assert_near(small, reference, dtype)


def test_fused_shards_run_both_paths():
    """gate and up quantized as one layer (two shards, one set of planes) in bf16."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        layer = MergedColumnParallelLinear(256, [96, 160], quant_config=get_quantization_config("int4", 64, None),
                                           prefix="mlp.gate_up_proj")
    finally:
        torch.set_default_dtype(prev)
    torch.manual_seed(0)
    w = torch.randn(256, 256) * 0.05
    layer.weight_loader(layer.weight, w[:96].bfloat16(), 0)
    layer.weight_loader(layer.weight, w[96:].bfloat16(), 1)
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(2 * KERNEL_MAX_ROWS + 3, 256).bfloat16()
    reference = x.float() @ layer.quant_runtime.dequantize(torch.float32).t()
    for y in _both_paths(layer, x):
        _assert_near(y, reference, torch.bfloat16)


def test_without_dense_copy_large_calls_dequantize():
    planes = _planes(64, 256, 32, 4, torch.bfloat16, dense_copy=False)  # --cpu-weight-layouts compact
    assert planes.dense is None
    x = torch.randn(KERNEL_MAX_ROWS_NO_COPY + 1, 256).bfloat16()
    reference = x.float() @ planes.dequantize(torch.float32).t()
    for y in _both_paths(planes, x):
        _assert_near(y, reference, torch.bfloat16)


def test_dense_weight_packs_bf16_only():
    weight = torch.randn(96, 64)
    x = torch.randn(7, 64)
    bf16 = DenseWeight(weight.bfloat16())
    assert bf16.packed_weight is not None and "packed_weight" not in bf16.state_dict()
    assert torch.equal(bf16(x.bfloat16()), F.linear(x.bfloat16(), weight.bfloat16()))
    f32 = DenseWeight(weight)
    assert f32.packed_weight is None and torch.equal(f32(x), F.linear(x, weight))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_dtypes_the_kernel_does_not_vectorise_take_the_dense_copy_at_any_row_count(dtype):
    """The int4 kernel is 40-100x slower outside bf16 (see KERNEL_MAX_ROWS): one row in float32
    or float16 must be the dense copy's product, bit for bit."""
    from kvflow.quant.packed_linear import linear

    planes = _planes(64, 256, 32, 4, dtype)
    x = torch.randn(1, 256).to(dtype)
    assert torch.equal(planes(x), linear(x, planes.dense))


def _mapping_rss(address: int) -> int:
    """Resident bytes of this process's mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                start, end = (int(a, 16) for a in head.split("-"))
                inside = start <= address < end
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_dense_copy_from_the_cache_gives_its_mapped_source_back(tmp_path):
    """The packed-weights cache's dequantized weights (memory-mapped) are read once, to pack the
    dense copy: then their pages leave the resident set (300 MiB of the default model's)."""
    planes = _planes(512, 4096, 32, 4, torch.bfloat16)
    torch.save({"dense": planes.dequantize()}, tmp_path / "cache.pt")  # 4 MiB
    mapped = torch.load(tmp_path / "cache.pt", mmap=True, weights_only=True)["dense"]
    assert mapped.float().abs().sum() > 0  # read: its pages are in this process
    before = _mapping_rss(mapped.data_ptr())
    cached = Int4Planes.from_packed(planes.packed, planes.scale_zero, planes.group, planes.out_features, mapped)
    assert _mapping_rss(mapped.data_ptr()) <= before - 3 * 2**20
    x = torch.randn(KERNEL_MAX_ROWS + 9, 4096).bfloat16()
    assert torch.equal(cached(x), planes(x))  # the same dense copy
