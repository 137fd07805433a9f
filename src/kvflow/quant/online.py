"""The shared life of a method that quantizes a float checkpoint at load, or loads what
`kvflow quantize` saved from it.

From a float checkpoint the layer gets a float `weight` (loaded like an unquantized one) that
`process_weights_after_loading` quantizes into the method's stored tensors. From a saved
checkpoint the layer gets the stored tensors themselves, rows = output channels, so shards and
tensor-parallel slices load like any weight. Either way the stored tensors stay on the layer
(`stored_tensors` reads them back for saving) and a runtime module built from them multiplies.
"""

from __future__ import annotations

from abc import abstractmethod

import torch
from torch import nn

from kvflow.quant.base import QuantizationConfig, QuantMethod, set_weight_attrs
from kvflow.quant.kernel_plan import KernelPlan
from kvflow.quant.layouts import Layouts, merged
from kvflow.quant.unquantized import UnquantizedMethod


def register_stored(layer: nn.Module, tensors: dict[str, tuple[torch.dtype, tuple[int, ...], dict]]) -> None:
    """name → (dtype, shape, weight attributes): an empty parameter each on `layer`, for the loader to fill."""
    for name, (dtype, shape, attrs) in tensors.items():
        param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
        layer.register_parameter(name, set_weight_attrs(param, **attrs))


class OnlineQuantMethod(QuantMethod):
    # name → (dtype, columns as a function of input_size or None for a 1-D per-row tensor)
    stored_spec: dict[str, tuple[torch.dtype, object]] = {}
    # Whether the stored tensors stay on the layer beside its runtime (for `stored_tensors` to save);
    # a method that only loads another tool's format drops them: a second int4-sized copy per layer.
    keeps_stored = True

    def __init__(self, config: OnlineQuantConfig) -> None:
        self.config = config

    @abstractmethod
    def quantize(self, weight: torch.Tensor, name: str) -> dict[str, torch.Tensor]:
        """A float weight [N, K] → the stored tensors (rows = output channels)."""

    @abstractmethod
    def runtime(self, stored: dict[str, torch.Tensor], dtype: torch.dtype, name: str,
                dense_copy: bool = True) -> nn.Module:
        """The module that multiplies (and gathers rows) from the stored tensors (a `WeightsModule`);
        `dense_copy`: it may keep bf16 layouts beside them (`KernelConfig.weight_layouts`)."""

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        layer.quant_dtype = params_dtype
        rows = sum(output_sizes)
        specs = self.stored_specs(input_size) if self.config.from_saved else {"weight": (params_dtype, input_size)}
        tensors = {}
        for name, (dtype, cols) in specs.items():
            attrs = dict(output_dim=0, weight_loader=layer.weight_loader)
            if cols is not None and cols == input_size:
                attrs["input_dim"] = 1
            tensors[name] = (dtype, (rows,) if cols is None else (rows, cols), attrs)
        register_stored(layer, tensors)

    def stored_specs(self, input_size: int) -> dict[str, tuple[torch.dtype, int | None]]:
        return {name: (dtype, cols(input_size) if callable(cols) else cols)
                for name, (dtype, cols) in self.stored_spec.items()}

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.config.from_saved:
            stored = {name: getattr(layer, name).data for name in self.stored_spec}
        else:
            stored = self.quantize(layer.weight.data, layer.prefix)
        self.install(layer, stored)

    def install(self, layer: nn.Module, stored: dict[str, torch.Tensor]) -> None:
        """The stored tensors replace the layer's parameters (unless `keeps_stored` is off), and its runtime is
        built from them."""
        for name in list(self.stored_spec) + ["weight"]:
            if name in layer._parameters:
                del layer._parameters[name]
        if self.keeps_stored:
            for name, tensor in stored.items():
                layer.register_buffer(name, tensor)
        layer.quant_runtime = self.runtime(stored, layer.quant_dtype, layer.prefix,
                                           dense_copy=layer.kernels.weight_layouts == "fast")

    def stored_tensors(self, layer: nn.Module) -> dict[str, tuple[torch.Tensor, int, int]]:
        """name → (tensor, its output-channel dim, values packed per element along it)."""
        return {name: (getattr(layer, name), 0, 1) for name in self.stored_spec}

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = layer.quant_runtime(x)
        return y if bias is None else y + bias

    def silu_and_mul(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        runtime = getattr(layer, "quant_runtime", None)  # AWQ and w8a8 have none until they are calibrated
        return None if runtime is None else runtime.silu_and_mul(x)

    def kernel_plan(self, layer: nn.Module, rows: int, dtype: torch.dtype) -> KernelPlan:
        runtime = getattr(layer, "quant_runtime", None)
        return super().kernel_plan(layer, rows, dtype) if runtime is None else runtime.kernel_plan(rows, dtype)

    def silu_and_mul_plan(self, layer: nn.Module, rows: int, dtype: torch.dtype) -> KernelPlan | None:
        runtime = getattr(layer, "quant_runtime", None)
        return None if runtime is None else runtime.silu_and_mul_plan(rows, dtype)

    def layouts(self, layer: nn.Module) -> Layouts:
        runtime = getattr(layer, "quant_runtime", None)
        return super().layouts(layer) if runtime is None else merged(super().layouts(layer), runtime.layouts())

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return layer.quant_runtime.rows(ids)


class OnlineQuantConfig(QuantizationConfig):
    method_class: type[OnlineQuantMethod]
    calibrates = False  # AWQ, w8a8, fp8: layers rounded only after calibration (CalibratedMethod below)
    calibration_tokens = 2048  # read from the end of the shipped text (perplexity reads its start)
    rounds_uncalibrated = False  # fp8: where it cannot calibrate (no tokenizer, several ranks), round to nearest

    def __init__(self, group_size: int | None = None, from_saved: bool = False) -> None:
        self.group_size = group_size
        self.from_saved = from_saved  # loading tensors `kvflow quantize` wrote, not a float checkpoint

    @property
    def needs_calibration(self) -> bool:
        """The engine calibrates at load: a float checkpoint of a calibrating method (a saved one
        was calibrated before it was written)."""
        return self.calibrates and not self.from_saved

    def get_quant_method(self, kind: str, prefix: str) -> QuantMethod:
        return self.method_class(self)

    def to_dict(self) -> dict:
        """What a saved checkpoint's config.json records as "quantization_config"."""
        return {"quant_method": self.name} | ({"group_size": self.group_size} if self.group_size else {})


class CalibratedMethod(OnlineQuantMethod):
    """A method whose layers are rounded only after calibration (quant/calibration.py) has seen
    their inputs: AWQ and w8a8's SmoothQuant fold a searched per-input-channel scale into them
    first, fp8 rounds by them (GPTQ). Until then (or when the engine runs the calibration text
    through the model) a layer is float; a checkpoint `kvflow quantize` wrote was calibrated
    before it was saved."""

    folds_scale = True  # AWQ, w8a8: `search_scale` gives the scale to fold in
    wants_gram = False  # fp8: calibration records the inputs' second moment (InputStats.gram)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not self.config.needs_calibration or getattr(layer, "calibrated", False):
            super().process_weights_after_loading(layer)
        # else: wait for calibrate_and_quantize, the float weight serves until then

    def finish_calibration(self, layer: nn.Module, inputs) -> None:
        """Round the layer, its scale (if any) folded in; `inputs` (calibration.InputStats) is what
        calibration saw at its input."""
        layer.calibrated = True
        self.process_weights_after_loading(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not hasattr(layer, "quant_runtime"):  # calibrating: still float
            return UnquantizedMethod().apply(layer, x, bias)
        return super().apply(layer, x, bias)

    def search_scale(self, weight: torch.Tensor, inputs, name: str) -> tuple[torch.Tensor, float]:
        """The scale s [K] to fold into the layer (W·diag(s), its input divided by s) given what
        calibration saw at its input (calibration.InputStats), and the choice made (for reports)."""
        raise NotImplementedError(f"{type(self).__name__} folds no scale")
