"""LLM.int8() (Dettmers et al., 2022): bitsandbytes' 8-bit checkpoints as transformers writes them
(`"quant_method": "bitsandbytes"`, `"load_in_8bit": true`), and `-q bitsandbytes`, which rounds a
float checkpoint the same way at load.

The stored tensors, per linear layer W [N, K] (bitsandbytes' `Linear8bitLt` state dict): weight int8
[N, K], row-major; SCB float32 [N], each row's largest |w|; weight_format, a uint8 scalar naming the
layout of `weight` (0: row-major, the only one bitsandbytes writes now; the GPU-tiled layouts 1–3
that some of its older versions wrote are refused). w = q·SCB/127. The config's llm_int8_threshold
t says how the layers run, and llm_int8_skip_modules which stay float (matched as transformers
matches them: a regular expression at the start of the module's name, or its end).

The product is LLM.int8()'s outlier decomposition: the few input columns ("outlier features") where
some row has |x| ≥ t (bitsandbytes' test) are multiplied in float by the dequantized weight columns;
the rest, rounded to int8 per row as w8a8 rounds its activations, by the int8 weights (w8a8's
`W8A8Channel`: oneDNN's int8 GEMM where it runs). Rounded whole to int8, a row whose outliers reach
60 would have its ordinary values, near 1, rounded in steps of 0.47; set apart, they keep theirs. t = 0
means no decomposition: every column in int8. Where bitsandbytes sets only the outlier elements
aside before taking a row's scale, here the scale is the largest |x| over the row's non-outlier
columns: exactly what is rounded is what the int8 product multiplies. Which columns are outliers is
decided over the whole batch, as bitsandbytes decides it, so a token's result depends (slightly) on
the tokens it runs beside, as w8a8's per-row rounding alone does not; under tensor parallelism a
row-parallel rank decides them, and the scales, on its own input columns.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from kvflow.quant.base import WeightsModule
from kvflow.quant.formats import check_finite
from kvflow.quant.online import OnlineQuantConfig, OnlineQuantMethod, register_stored
from kvflow.quant.w8a8 import W8A8Channel

DEFAULT_THRESHOLD = 6.0  # transformers' BitsAndBytesConfig default; what `-q bitsandbytes` runs with
ROW_MAJOR = 0  # weight_format's code for row-major int8 (bitsandbytes' "row")
WEIGHT_FORMATS = ("row", "col32", "col_turing", "col_ampere")  # weight_format's codes, bitsandbytes' names


class OutlierDecomposed(WeightsModule):
    """A layer's LLM.int8() product: q [N, K] int8 with a float32 scale per output row (SCB/127);
    the input columns holding an |x| ≥ `threshold` in float, the others in int8."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, threshold: float) -> None:
        super().__init__()
        self.int8 = W8A8Channel(q, scale)
        self.threshold = threshold

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        outliers = (rows.abs() >= self.threshold).any(dim=0).nonzero().flatten()
        if outliers.numel() == 0:
            return self.int8(x)
        ordinary = rows.clone()
        ordinary[:, outliers] = 0
        # summed in float32: in bfloat16 the outliers' large partial products would round the rest away
        y = self.int8(ordinary).float() + rows[:, outliers].float() @ self.columns(outliers).t()
        return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])

    def columns(self, index: torch.Tensor) -> torch.Tensor:
        """The dequantized weight's columns `index` [N, len(index)], float32."""
        return self.int8.q[:, index].float() * self.int8.scale[:, None]

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.int8.dequantize(dtype)


class BnbInt8Method(OnlineQuantMethod):
    # Loads only what it reads: its runtime is all the layer needs, and a checkpoint of it is
    # transformers' to write (`stored_tensors` refuses).
    keeps_stored = False
    stored_spec = {"weight": (torch.int8, lambda k: k), "SCB": (torch.float32, None)}

    def __init__(self, config: BnbInt8Config) -> None:
        super().__init__(config)
        if config.from_saved:  # a transformers checkpoint records each layer's layout beside it
            self.stored_spec = self.stored_spec | {"weight_format": (torch.uint8, None)}

    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        if not self.config.from_saved:  # a float checkpoint: `weight` in the model's dtype, rounded below
            return super().create_weights(layer, input_size, output_sizes, params_dtype)
        layer.quant_dtype, n = params_dtype, sum(output_sizes)
        row = dict(weight_loader=layer.weight_loader, output_dim=0)
        register_stored(layer, {
            "weight": (torch.int8, (n, input_size), row | dict(input_dim=1, weight_loader=_Int8Loader(layer))),
            "SCB": (torch.float32, (n,), row),
            "weight_format": (torch.uint8, (len(output_sizes),), dict(weight_loader=_FormatLoader(layer)))})

    def quantize(self, weight, name):
        """bitsandbytes' rounding: q = round(w·127 / max|w| of its row), SCB = that maximum (0 for a
        row of zeros, whose q are 0)."""
        check_finite(weight, name)
        w = weight.float()
        scb = w.abs().amax(dim=1)
        q = (w * (127 / torch.where(scb > 0, scb, torch.ones_like(scb)))[:, None]).round().clamp(-127, 127)
        return {"weight": q.to(torch.int8), "SCB": scb}

    def runtime(self, stored, dtype, name, dense_copy=True):
        scb = stored["SCB"].float()
        if not bool((torch.isfinite(scb) & (scb >= 0)).all()):
            raise ValueError(f"{name}: SCB (each row's largest |w|) holds a negative, NaN or infinite value")
        if self.config.threshold > 0:
            return OutlierDecomposed(stored["weight"], scb / 127, self.config.threshold)
        return W8A8Channel(stored["weight"], scb / 127)

    def stored_tensors(self, layer):
        raise ValueError(f"{layer.prefix}: -q bitsandbytes is not saved by kvflow: it rounds at load in one pass, "
                         "and an LLM.int8() checkpoint (transformers' save_pretrained) loads as is")


class BnbInt8Config(OnlineQuantConfig):
    """`threshold`: llm_int8_threshold (0: no outlier decomposition); `skip_modules`: the layers left
    float (llm_int8_skip_modules). The embedding and the head are float either way."""

    name = "bitsandbytes"
    method_class = BnbInt8Method

    def __init__(self, group_size: int | None = None, from_saved: bool = False,
                 threshold: float = DEFAULT_THRESHOLD, skip_modules: tuple[str, ...] = ()) -> None:
        super().__init__(group_size, from_saved)
        self.threshold, self.skip_modules = threshold, skip_modules

    @classmethod
    def from_checkpoint(cls, stored: dict) -> BnbInt8Config:
        """The config of a transformers bitsandbytes checkpoint; what kvflow cannot load is refused by field."""
        if stored.get("load_in_4bit"):
            raise ValueError("bitsandbytes: load_in_4bit=true (NF4/FP4 weights) is not loadable; kvflow loads "
                             "8-bit (LLM.int8()) checkpoints, load_in_8bit=true")
        if stored.get("load_in_8bit") is not True:
            raise ValueError(f"bitsandbytes: load_in_8bit={stored.get('load_in_8bit')!r}; kvflow loads 8-bit "
                             "(LLM.int8()) checkpoints, load_in_8bit=true")
        if stored.get("llm_int8_has_fp16_weight"):
            raise ValueError("bitsandbytes: llm_int8_has_fp16_weight=true (float weights kept for training) is "
                             "not loadable; save the model with llm_int8_has_fp16_weight=false")
        threshold = stored.get("llm_int8_threshold") or 0.0
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 <= threshold < float("inf"):
            raise ValueError(f"bitsandbytes: llm_int8_threshold={threshold!r} must be a number ≥ 0 (0: no outlier "
                             "decomposition)")
        return cls(from_saved=True, threshold=float(threshold), skip_modules=_skip_patterns(stored))

    def get_quant_method(self, kind: str, prefix: str):
        if kind != "linear" or any(re.match(key, prefix) or prefix.endswith(key) for key in self.skip_modules):
            return None  # float, as transformers left it
        return BnbInt8Method(self)

    def to_dict(self) -> dict:
        return {"quant_method": self.name, "load_in_8bit": True, "load_in_4bit": False,
                "llm_int8_threshold": self.threshold, "llm_int8_skip_modules": list(self.skip_modules) or None,
                "llm_int8_has_fp16_weight": False}


def _skip_patterns(stored: dict) -> tuple[str, ...]:
    keys = stored.get("llm_int8_skip_modules") or []
    if not isinstance(keys, list) or not all(isinstance(k, str) and k for k in keys):
        raise ValueError(f"bitsandbytes: llm_int8_skip_modules={keys!r} must be a list of module names")
    for key in keys:
        try:
            re.compile(key)
        except re.error as e:
            raise ValueError(f"bitsandbytes: llm_int8_skip_modules entry {key!r} is not a regular expression "
                             f"({e}); transformers matches each as one") from None
    return tuple(keys)


class _Int8Loader:
    """A layer's int8 `weight`: a float tensor there is a layer the checkpoint left float, which kvflow
    quantizes (it fuses it with quantized ones, or llm_int8_skip_modules does not name it), refused
    rather than cast."""

    def __init__(self, layer: nn.Module) -> None:
        self.layer = layer

    def __call__(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.dtype != torch.int8:
            raise ValueError(f"is {loaded.dtype}, not int8: a layer the checkpoint keeps float where kvflow's "
                             f"{self.layer.prefix} is 8-bit (llm_int8_skip_modules names part of a fused layer, "
                             "or not this one)")
        self.layer.weight_loader(param, loaded, shard_id)


class _FormatLoader:
    """weight_format, one per checkpoint layer (shard): only row-major int8 loads."""

    def __init__(self, layer: nn.Module) -> None:
        self.layer = layer

    def __call__(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.numel() != 1 or int(loaded.reshape(())) != ROW_MAJOR:
            value = loaded.tolist()
            layout = WEIGHT_FORMATS[value] if value in range(len(WEIGHT_FORMATS)) else "not a layout code"
            raise ValueError(f"(weight_format) is {value!r} ({layout}); kvflow loads row-major int8 weights "
                             f"({ROW_MAJOR}), what bitsandbytes writes now")
        param.data[self.layer.shard_index(shard_id)] = ROW_MAJOR
