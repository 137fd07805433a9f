"""NVFP4 weights as llm-compressor writes them: compressed-tensors' `"format": "nvfp4-pack-quantized"`
(its NVFP4A16 and NVFP4 schemes), routed here by quant/registry.py.

The stored tensors, per linear layer W [N, K] (compressed-tensors' NVFP4PackedCompressor):
weight_packed uint8 [N, K/2], two E2M1 codes per byte, the even input channel in the low nibble
(bit 3 of a code is its sign; quant/formats.py's E2M1 table and nibble order, mxfp4's too);
weight_scale float8_e4m3fn [N, K/16], one per 16 input channels; weight_global_scale float32 [1],
one per checkpoint layer (q, k and v each their own). w = e2m1 · weight_scale / weight_global_scale:
compressed-tensors' dequantization divides the local scale by the global one (in float32), whose
value 448·6 / max|W| lets the E4M3 local scales use their whole range.

The NVFP4 scheme also rounds activations to FP4 at run time (per 16, with a per-layer
input_global_scale). This CPU has no FP4 product, so such a checkpoint runs weight-only, its
activations in the model's dtype, as vLLM runs it on GPUs without FP4 tensor cores;
input_global_scale is read and not used. Other activation schemes are refused by field.

No kernel here multiplies E2M1 codes with a scale per 16 input channels (int4's, which runs mxfp4,
takes groups of 32 or more), so each layer keeps its weight dequantized in the model's dtype
(`packed_linear.DenseWeight`): 2 bytes per weight in bfloat16, plus oneDNN's packed copy, as an
unquantized layer holds, against the 0.5625 bytes stored. The checkpoint is a quarter of the
bfloat16 one on disk; at run time it costs what the bfloat16 model does.
"""

from __future__ import annotations

import torch
from torch import nn

from kvflow.quant.compressed_tensors import NVFP4_FORMAT, check_top, only_group, refuse_activations, weight_field
from kvflow.quant.formats import e2m1_decode, unpack_nibbles
from kvflow.quant.online import OnlineQuantConfig, OnlineQuantMethod, register_stored
from kvflow.quant.packed_linear import DenseWeight

GROUP = 16  # input channels per E4M3 scale
# NVFP4's activations as llm-compressor's scheme records them (rounded per token group at run time)
ACTIVATIONS = (("num_bits", 4), ("type", "float"), ("strategy", "tensor_group"), ("group_size", GROUP),
               ("dynamic", "local"))


class Nvfp4Config(OnlineQuantConfig):
    """One config group of NVFP4 weights on every Linear; anything else is refused by field."""

    name = "compressed-tensors"

    def __init__(self, stored: dict) -> None:
        check_top(stored, NVFP4_FORMAT)
        scheme = only_group(stored)
        refuse_activations(scheme, ("output_activations",))
        self.fp4_activations = _activation_scheme(scheme.get("input_activations"))
        weights = scheme.get("weights") or {}
        weight_field(weights, "num_bits", (4,))
        weight_field(weights, "type", ("float",))
        weight_field(weights, "strategy", ("tensor_group",))
        weight_field(weights, "group_size", (GROUP,))
        weight_field(weights, "symmetric", (True,))
        weight_field(weights, "dynamic", (False,))
        super().__init__(GROUP, from_saved=True)
        self.stored = dict(stored)

    def get_quant_method(self, kind: str, prefix: str):
        return Nvfp4Method(self) if kind == "linear" else None  # embedding, head: float

    def to_dict(self) -> dict:
        return self.stored


def _activation_scheme(activations: dict | None) -> bool:
    """Whether the checkpoint is NVFP4 (W4A4; kvflow loads its activation scheme and runs the
    activations unquantized) rather than NVFP4A16."""
    if not activations:
        return False
    for key, want in ACTIVATIONS:
        weight_field(activations, key, (want,), "input_activations")
    return True


class Nvfp4Method(OnlineQuantMethod):
    keeps_stored = False  # loads only (`stored_tensors` refuses): its runtime is all the layer needs

    def __init__(self, config: Nvfp4Config) -> None:
        super().__init__(config)
        self.stored_spec = {"weight_packed": (torch.uint8, None), "weight_scale": (torch.float8_e4m3fn, None),
                            "weight_global_scale": (torch.float32, None)}
        if config.fp4_activations:  # read so the checkpoint loads whole; the activations run unquantized
            self.stored_spec["input_global_scale"] = (torch.float32, None)

    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        layer.quant_dtype, n = params_dtype, sum(output_sizes)
        if input_size % GROUP:
            raise ValueError(f"{layer.prefix}: NVFP4's scales cover {GROUP} input channels each, which do not "
                             f"divide its {input_size}")
        by_row = dict(output_dim=0, input_dim=1)
        shape_attrs = {"weight_packed": ((n, input_size // 2), by_row),
                       "weight_scale": ((n, input_size // GROUP), by_row),
                       "weight_global_scale": ((len(output_sizes),), {}),
                       "input_global_scale": ((len(output_sizes),), {})}
        tensors = {}
        for name, (dtype, _) in self.stored_spec.items():
            shape, attrs = shape_attrs[name]
            tensors[name] = (dtype, shape, attrs | dict(weight_loader=_loader(layer, name, dtype)))
        register_stored(layer, tensors)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        stored = {name: getattr(layer, name).data for name in self.stored_spec}
        # each checkpoint layer's global scale, on its rows of the fused weight
        rows = torch.tensor(layer.output_sizes)
        stored["weight_global_scale"] = stored["weight_global_scale"].repeat_interleave(rows)
        self.install(layer, stored)

    def stored_tensors(self, layer):
        raise ValueError(f"{layer.prefix}: an NVFP4 checkpoint is not saved again; its directory loads as is")

    def quantize(self, weight, name):
        raise ValueError(f"{name}: NVFP4 loads llm-compressor checkpoints (compressed-tensors); a float checkpoint "
                         "is quantized to 4-bit floats with -q mxfp4")

    def runtime(self, stored, dtype, name, dense_copy=True):
        return DenseWeight(dequantize(stored, name).to(dtype))


def dequantize(stored: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """W [N, K] float32 from weight_packed, weight_scale and each row's global scale
    (`weight_global_scale` [N]); a NaN or infinite scale is refused, naming the layer."""
    codes = unpack_nibbles(stored["weight_packed"])
    n, k = codes.shape
    scale = stored["weight_scale"].float() / stored["weight_global_scale"].float()[:, None]
    if not bool(torch.isfinite(scale).all()):
        raise ValueError(f"{name}: weight_scale / weight_global_scale holds NaN or infinity")
    return (e2m1_decode(codes).view(n, k // GROUP, GROUP) * scale[..., None]).view(n, k)


def _loader(layer: nn.Module, name: str, dtype: torch.dtype):
    return _PerShardScalar(layer) if name.endswith("global_scale") else _TypedLoader(layer, dtype)


class _TypedLoader:
    """The layer's loader, for a tensor of the format's one dtype: another (an int8 weight_packed, a
    bfloat16 weight_scale) is another format, refused rather than cast."""

    def __init__(self, layer: nn.Module, dtype: torch.dtype) -> None:
        self.layer, self.dtype = layer, dtype

    def __call__(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.dtype != self.dtype:
            raise ValueError(f"is {loaded.dtype}, not {self.dtype} (compressed-tensors' NVFP4 format)")
        self.layer.weight_loader(param, loaded, shard_id)


class _PerShardScalar:
    """A global scale, one per checkpoint layer (shard): a positive finite number each."""

    def __init__(self, layer: nn.Module) -> None:
        self.layer = layer

    def __call__(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        value = loaded.float().flatten()
        if value.numel() != 1 or not bool(torch.isfinite(value).all()) or not value.item() > 0:
            raise ValueError(f"is {loaded.tolist()}; a global scale is one positive finite number")
        param.data[self.layer.shard_index(shard_id)] = value.item()
