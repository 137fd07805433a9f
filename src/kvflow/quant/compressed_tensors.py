"""compressed-tensors checkpoints as llm-compressor writes them (`"quant_method": "compressed-tensors"`),
`pack-quantized` integer weights only (W4A16, W8A16), run on int4's planes (`Int4Planes`).

Per linear layer W [N, K], G input channels per group ("group" strategy; "channel": G = K):
weight_packed int32 [N, K·bits/32], 32/bits consecutive input channels per int32, the first in the
lowest bits; weight_scale [N, K/G]; weight_zero_point (asymmetric only) int32 [N·bits/32, K/G],
packed the same way along the output channels; weight_shape [2] = (N, K). Values and zero points
are signed, stored plus 2^(bits−1); w = (q − zp)·scale. The same planes and group splitting as
GPTQ's (quant/gptq_checkpoint.py; the int4 machinery: quant/int4pack.py), of which this is a row-major transposition.
NVFP4 weights (`"format": "nvfp4-pack-quantized"`) are quant/nvfp4.py's, with the same checks of the config.
"""

from __future__ import annotations

import torch
from torch import nn

from kvflow.quant.int4pack import check_group, kernel_planes, unpack
from kvflow.quant.online import OnlineQuantConfig, OnlineQuantMethod, register_stored

FORMAT = "pack-quantized"
NVFP4_FORMAT = "nvfp4-pack-quantized"


class CompressedTensorsConfig(OnlineQuantConfig):
    """One config group of integer weights on every Linear; anything else is refused by field."""

    name = "compressed-tensors"

    def __init__(self, stored: dict) -> None:
        check_top(stored, FORMAT)
        scheme = only_group(stored)
        refuse_activations(scheme, ("input_activations", "output_activations"))
        weights = scheme.get("weights") or {}
        self.bits = weight_field(weights, "num_bits", (4, 8))
        weight_field(weights, "type", ("int",))
        weight_field(weights, "dynamic", (False,))
        weight_field(weights, "actorder", (None, "weight", "static"))  # "group" permutes g_idx per column
        strategy = weight_field(weights, "strategy", ("group", "channel"))
        group = weights.get("group_size") if strategy == "group" else None
        if strategy == "group" and (not isinstance(group, int) or group <= 0):
            raise ValueError(f"compressed-tensors: weights.group_size={group!r} must be a positive number")
        super().__init__(group, from_saved=True)
        self.symmetric = bool(weights.get("symmetric", True))
        self.stored = dict(stored)

    def get_quant_method(self, kind: str, prefix: str):
        return CompressedTensorsMethod(self) if kind == "linear" else None  # embedding, head: float

    def to_dict(self) -> dict:
        return self.stored


def check_top(stored: dict, fmt: str) -> None:
    """The checkpoint's top-level fields: one format throughout (`fmt`), nothing but weights compressed."""
    in_groups = {g.get("format") for g in (stored.get("config_groups") or {}).values()} - {None}
    if stored.get("format") != fmt or in_groups - {fmt}:
        raise ValueError(f"compressed-tensors: format={stored.get('format')!r} (config_groups: {sorted(in_groups)}) "
                         f"is not loadable (kvflow loads {FORMAT!r}: integer weights packed in int32, and "
                         f"{NVFP4_FORMAT!r}, each alone)")
    checks = {"quantization_status": stored.get("quantization_status", "compressed") == "compressed",
              "sparsity_config": not stored.get("sparsity_config"), "kv_cache_scheme": not stored.get("kv_cache_scheme"),
              "transform_config": not stored.get("transform_config"),
              "ignore": set(stored.get("ignore") or []) <= {"lm_head", "re:.*lm_head"}}  # the head is float anyway
    for key, ok in checks.items():
        if not ok:
            raise ValueError(f"compressed-tensors: {key}={stored.get(key)!r} is not loadable")


def only_group(stored: dict) -> dict:
    groups = list((stored.get("config_groups") or {}).values())
    if len(groups) != 1 or groups[0].get("targets") != ["Linear"]:
        raise ValueError("compressed-tensors: config_groups must be one group with targets ['Linear'] "
                         f"(kvflow quantizes every linear alike); got {stored.get('config_groups')!r}")
    return groups[0]


def refuse_activations(group: dict, keys: tuple[str, ...]) -> None:
    for key in keys:
        if group.get(key):
            raise ValueError(f"compressed-tensors: {key}={group[key]!r} is not loadable (weight-only W4A16/W8A16 "
                             "and NVFP4A16 are; NVFP4's input_activations run unquantized)")


def weight_field(weights: dict, key: str, allowed: tuple, section: str = "weights"):
    """`weights[key]`, or a ValueError naming `section.key` unless it is one of `allowed`."""
    value = weights.get(key)
    if value not in allowed:
        raise ValueError(f"compressed-tensors: {section}.{key}={value!r} is not loadable "
                         f"(kvflow loads {', '.join(map(repr, allowed))})")
    return value


class CompressedTensorsMethod(OnlineQuantMethod):
    keeps_stored = False  # loads only (`stored_tensors` refuses): its runtime is all the layer needs

    def __init__(self, config: CompressedTensorsConfig) -> None:
        super().__init__(config)
        self.pack = 32 // config.bits
        self.stored_spec = {"weight_packed": (torch.int32, None), "weight_scale": (torch.float32, None),
                            "weight_shape": (torch.int64, None)}
        if not config.symmetric:
            self.stored_spec["weight_zero_point"] = (torch.int32, None)

    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        layer.quant_dtype, n = params_dtype, sum(output_sizes)
        group = self.config.group_size or input_size
        check_group(layer.prefix, "compressed-tensors", group, input_size, self.pack)
        by_row = dict(weight_loader=layer.weight_loader, output_dim=0, input_dim=1)
        shape_attrs = {"weight_packed": ((n, input_size // self.pack), by_row),
                       "weight_scale": ((n, input_size // group), by_row),
                       "weight_zero_point": ((n // self.pack, input_size // group),
                                             by_row | dict(packed_dim=0, packed_factor=self.pack)),
                       # one per shard: (its rows, K), checked as it loads
                       "weight_shape": ((2,), dict(weight_loader=_ShapeLoader(layer)))}
        register_stored(layer, {name: (dtype, *shape_attrs[name]) for name, (dtype, _) in self.stored_spec.items()})

    def stored_tensors(self, layer):
        raise ValueError(f"{layer.prefix}: a compressed-tensors checkpoint is not saved again; its directory loads as is")

    def quantize(self, weight, name):
        raise ValueError(f"{name}: quantization='compressed-tensors' loads llm-compressor checkpoints; a float "
                         "checkpoint is quantized with -q int4, awq or fp8")

    def runtime(self, stored, dtype, name, dense_copy=True):
        bits, offset = self.config.bits, 2 ** (self.config.bits - 1)
        u = unpack(stored["weight_packed"], bits, dim=1).to(torch.uint8)  # q + offset
        scale = stored["weight_scale"].float()
        zero = unpack(stored["weight_zero_point"], bits, dim=0) - offset if "weight_zero_point" in stored else 0
        # w = (u − offset − zp)·scale = scale·u + min
        return kernel_planes(u, scale, -(offset + zero) * scale, bits, dtype, name, dense_copy)


class _ShapeLoader:
    """weight_shape says each shard's (N, K): a checkpoint of another shape is refused by name."""

    def __init__(self, layer: nn.Module) -> None:
        self.layer = layer

    def __call__(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        layer = self.layer
        rows = layer.output_sizes[layer.shard_index(shard_id)]
        if layer.tp_split == "output":
            rows = layer.tp_shard_rows(layer.shard_index(shard_id))[0]
        cols = layer.input_size * (layer.tp_size if layer.tp_split == "input" else 1)
        if loaded.tolist() != [rows, cols]:
            raise ValueError(f"(weight_shape) is {loaded.tolist()}, expected {[rows, cols]}")
        param.data.copy_(loaded.to(param.dtype))
