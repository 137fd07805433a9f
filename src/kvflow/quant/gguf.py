"""GGUF checkpoints run on their own quantized blocks (`quantization=None` with a .gguf file).

Each checkpoint tensor arrives as raw blocks (`GGUFBlocks`), one row of blocks per output channel,
and the layer keeps it per shard until all shards are in. Then every block type that is affine
per group of ≥ 32 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K) becomes int4 planes for aten's
kernel (`int4pack.py`); shards of one fused layer share one set of planes when their groups and
widths agree. What has no such form — Q6_K (groups of 16), block types without a decoder here,
float tensors — is decoded to the model dtype, that tensor only. On a GPU every tensor is decoded
(the int4 kernel here is the CPU one).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

from kvflow.quant.base import QuantizationConfig, QuantMethod
from kvflow.quant.gguf_blocks import BLOCK_SIZES, Affine, GGUFBlocks, decode
from kvflow.quant.int4pack import Int4Planes, planes_from_affine
from kvflow.quant.kernel_plan import KernelPlan
from kvflow.quant.layouts import Layouts, merged
from kvflow.quant.packed_cache import PackedWeightsCache
from kvflow.quant.packed_linear import DenseWeight


class GGUFConfig(QuantizationConfig):
    name = "gguf"

    def __init__(self, cache_dir: str | None = None) -> None:
        # Where the checkpoint's parse is cached (`gguf_cache`): the packed planes go beside it.
        self.cache_dir = cache_dir
        self.packed: dict[tuple[torch.dtype, str], PackedWeightsCache] = {}

    def get_quant_method(self, kind: str, prefix: str) -> QuantMethod:
        return GGUFMethod(self)

    def packed_cache(self, dtype: torch.dtype, weight_layouts: str) -> PackedWeightsCache | None:
        """The stored parts for `dtype` in `weight_layouts` (a compact load stores no dense copy)."""
        if self.cache_dir is None:
            return None
        key = (dtype, weight_layouts)
        if key not in self.packed:
            self.packed[key] = PackedWeightsCache(Path(self.cache_dir), dtype, (sys.modules[__name__],), weight_layouts)
        return self.packed[key]


class GGUFMethod(QuantMethod):
    def __init__(self, config: GGUFConfig) -> None:
        self.config = config

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        # A placeholder the loader can name; the shards' blocks wait in `gguf_shards`.
        weight = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        weight.weight_loader = lambda param, loaded, shard_id=None: self._load(layer, loaded, shard_id)
        layer.register_parameter("weight", weight)
        layer.gguf_shards, layer.gguf_dtype = {}, params_dtype

    def _load(self, layer: nn.Module, loaded, shard_id) -> None:
        index = layer.shard_index(shard_id)
        rows = layer.output_sizes[index]
        full_rows, start = layer.tp_shard_rows(index) if layer.tp_split == "output" else (rows, 0)
        expected = (full_rows, layer.input_size * (layer.tp_size if layer.tp_split == "input" else 1))
        if tuple(loaded.shape) != expected:
            raise ValueError(f"has shape {tuple(loaded.shape)}, expected {expected}")
        if layer.tp_split == "input" and layer.tp_size > 1:
            raise ValueError("cannot split GGUF blocks over input channels (row-parallel ranks); to run a GGUF "
                             "tensor-parallel, re-quantize each rank's slice: --quantization int8 (or int4, fp8, ...)")
        layer.gguf_shards[index] = (loaded.narrow_rows(start, rows) if isinstance(loaded, GGUFBlocks)
                                    else loaded.narrow(0, start, rows))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        on_cpu = layer.weight.device.type == "cpu"
        layouts = layer.kernels.weight_layouts
        cache = self.config.packed_cache(layer.gguf_dtype, layouts) if on_cpu else None  # GPUs decode to dense
        states = None if cache is None else cache.get(layer.prefix)
        if states is not None:
            layer.gguf_parts = nn.ModuleList(_part_from_state(state, layouts == "fast") for state in states)
        else:
            layer.gguf_parts = self._parts(layer, on_cpu)
            if cache is not None:
                cache.put(layer.prefix, [_part_state(part) for part in layer.gguf_parts])
        del layer.weight, layer.gguf_shards

    def finish_loading(self) -> None:
        for cache in self.config.packed.values():
            cache.save()

    def _parts(self, layer: nn.Module, on_cpu: bool) -> nn.ModuleList:
        shards = [layer.gguf_shards[i] for i in range(len(layer.output_sizes))]
        forms = [_affine(s) if on_cpu else None for s in shards]
        parts, i = [], 0
        while i < len(shards):  # consecutive shards with the same group run as one set of planes
            j = i + 1
            while j < len(shards) and forms[i] is not None and forms[j] is not None and forms[j].group == forms[i].group:
                j += 1
            parts.append(self._part(shards[i:j], forms[i:j], layer))
            i = j
        return nn.ModuleList(parts)

    @staticmethod
    def _part(shards, forms, layer) -> nn.Module:
        dtype, device = layer.gguf_dtype, layer.weight.device
        if forms[0] is None:
            dense = [decode(s).dequantize() if isinstance(s, GGUFBlocks) and s.qtype in BLOCK_SIZES else s.float()
                     for s in shards]
            return DenseWeight(torch.cat(dense).to(device=device, dtype=dtype))
        bits = max(f.bits for f in forms)
        u, scale, minimum = (torch.cat([getattr(f, name) for f in forms]) for name in ("u", "scale", "min"))
        return Int4Planes(planes_from_affine(u, scale, minimum, bits), forms[0].group, dtype, layer.prefix,
                          dense_copy=layer.kernels.weight_layouts == "fast")

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        parts = layer.gguf_parts
        y = parts[0](x) if len(parts) == 1 else torch.cat([part(x) for part in parts], dim=-1)
        return y if bias is None else y + bias

    def silu_and_mul(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        parts = layer.gguf_parts
        return parts[0].silu_and_mul(x) if len(parts) == 1 else None

    def kernel_plan(self, layer: nn.Module, rows: int, dtype: torch.dtype) -> KernelPlan:
        parts = layer.gguf_parts  # several parts: their outputs concatenated, by `apply`
        return parts[0].kernel_plan(rows, dtype) if len(parts) == 1 else super().kernel_plan(layer, rows, dtype)

    def silu_and_mul_plan(self, layer: nn.Module, rows: int, dtype: torch.dtype) -> KernelPlan | None:
        parts = layer.gguf_parts
        return parts[0].silu_and_mul_plan(rows, dtype) if len(parts) == 1 else None

    def layouts(self, layer: nn.Module) -> Layouts:
        return merged(*(part.layouts() for part in layer.gguf_parts))

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return layer.gguf_parts[0].rows(ids)


def _part_state(part: nn.Module) -> dict:
    if isinstance(part, Int4Planes):
        return {"kind": "int4", "packed": part.packed, "scale_zero": part.scale_zero, "group": part.group,
                "out_features": part.out_features, "dense": part.dequantize() if part.dense is not None else None,
                "gemv": part.gemv.state() if part.gemv is not None else None}
    return {"kind": "dense", "weight": part.weight}


def _part_from_state(state: dict, dense_copy: bool) -> nn.Module:
    if state["kind"] == "int4":
        return Int4Planes.from_packed(state["packed"], state["scale_zero"], state["group"], state["out_features"],
                                      state.get("dense"), state.get("gemv"), dense_copy)
    return DenseWeight(state["weight"])


def _affine(shard) -> Affine | None:
    """The int4-plane form of a shard, or None where it has none (float, Q6_K, unknown types)."""
    if not isinstance(shard, GGUFBlocks) or shard.qtype not in BLOCK_SIZES:
        return None
    form = decode(shard)
    return form if form.group >= 32 and form.bits <= 8 else None
