"""GPTQ's rounding (quant/gptq.py) and fp8's use of it: values on the format's grid, and a layer
output on the calibration inputs nearer the float layer's than rounding to nearest gives."""

from __future__ import annotations

import torch

from kvflow.quant.calibration import InputStats
from kvflow.quant.formats import fp8_per_channel
from kvflow.quant.fp8 import Fp8Method, shifted_scales
from kvflow.quant.gptq import gptq_round
from kvflow.quant.registry import get_quantization_config


def _correlated_inputs(rows: int = 2048, k: int = 64) -> torch.Tensor:
    """Inputs whose channels share a few directions and whose first channels are large, as a
    transformer layer's are."""
    torch.manual_seed(0)
    x = torch.randn(rows, 8) @ torch.randn(8, k) + 0.3 * torch.randn(rows, k)
    x[:, :4] *= 10
    return x


def _output_error(x, w, q) -> float:
    return (x @ (w - q).t()).square().mean().item()


def test_gptq_beats_rounding_to_nearest_on_the_calibration_outputs():
    x = _correlated_inputs()
    w = torch.randn(32, 64)
    step = 0.25

    def nearest(column):
        return (column / step).round() * step

    rounded = gptq_round(w, x.t() @ x / x.shape[0], nearest)
    assert torch.equal(nearest(rounded), rounded)  # every value on the grid
    assert _output_error(x, w, rounded) < 0.5 * _output_error(x, w, nearest(w))


def test_gptq_with_an_input_channel_never_seen():
    """A channel whose calibration input is always zero weighs nothing; H stays invertible."""
    x = _correlated_inputs()
    x[:, 7] = 0
    rounded = gptq_round(torch.randn(16, 64), x.t() @ x / x.shape[0], lambda c: c.round())
    assert torch.isfinite(rounded).all()


def test_shifted_scales_never_clip_and_never_lose_to_the_max_abs_scale():
    torch.manual_seed(1)
    w, power = torch.randn(64, 128), torch.rand(128)
    base = fp8_per_channel(w, "w")[1]
    scale = shifted_scales(w, power)
    assert ((scale >= base) & (scale < 2 * base)).all()

    def err(s):
        q = (w / s[:, None]).to(torch.float8_e4m3fn).float() * s[:, None]
        return ((w - q).square() * power).sum(1)

    assert (err(scale) <= err(base)).all()


def test_fp8_calibrated_layer_keeps_its_outputs_nearer_than_rounding_to_nearest():
    """The layer as the engine builds it: E4M3 codes and a scale per row, rounded by calibration's
    second moment."""
    from kvflow.model.layers.linear import ReplicatedLinear

    x = _correlated_inputs(k=128)
    w = torch.randn(96, 128) * 0.05
    layers = []
    for calibrated in (False, True):
        layer = ReplicatedLinear(128, 96, bias=False, quant_config=get_quantization_config("fp8", None, None),
                                 prefix="down_proj")
        layer.weight_loader(layer.weight, w)
        assert isinstance(layer.quant_method, Fp8Method)
        if calibrated:
            layer.quant_method.finish_calibration(layer, InputStats(x.abs().mean(0), x[:512], x.t() @ x / x.shape[0]))
        else:  # as where the engine cannot calibrate
            layer.calibrated = True
            layer.quant_method.process_weights_after_loading(layer)
        assert layer.weight.dtype == torch.float8_e4m3fn
        layers.append(layer)
    nearest, gptq = (layer.quant_runtime.dequantize(torch.float32) for layer in layers)
    assert _output_error(x, w, gptq) < 0.5 * _output_error(x, w, nearest)
    torch.testing.assert_close(layers[1](x), x @ gptq.t(), atol=1e-4, rtol=1e-4)
