"""GPTQ checkpoints as AutoGPTQ, GPTQModel and optimum write them (`"quant_method": "gptq"`), run on
int4's planes (`Int4Planes`, aten's int4 kernel: the runtime `-q int4` and AWQ use).

The stored tensors, per linear layer W [N, K], G input channels per group (`group_size`, -1: all K):
qweight int32 [K·bits/32, N], each int32 holding 32/bits consecutive input channels, the first in
its lowest bits; qzeros int32 [K/G, N·bits/32], packed the same way along the output channels;
scales [K/G, N]; g_idx int32 [K], the group of each input channel. w = (q − z)·s. A `gptq` (v1)
checkpoint stores z − 1 (masked to `bits`, so a zero point of 0 is stored as all ones), the
convention of the original GPTQ code; `checkpoint_format: gptq_v2` (GPTQModel) stores z.

bits 4 is one plane, bits 8 two (u = u₀ + 16·u₁: `planes_from_affine`). A group the kernel does not
run (per channel, 512, ...) is split into the largest kernel group that divides it, its scale and
zero repeated. Act-order (`desc_act`) checkpoints whose g_idx is not k // G are refused: their input
channels would have to be permuted before every product, which int4's runtime does not do.
"""

from __future__ import annotations

import torch
from torch import nn

from kvflow.quant.int4pack import check_group, kernel_planes, unpack
from kvflow.quant.online import OnlineQuantConfig, OnlineQuantMethod, register_stored

BITS = (4, 8)
FORMATS = ("gptq", "gptq_v2")


class GPTQConfig(OnlineQuantConfig):
    """Loads only: rounding a float checkpoint the GPTQ way is `-q fp8` (quant/gptq.py) or a GPTQ tool's."""

    name = "gptq"

    def __init__(self, stored: dict) -> None:
        self.bits = _field(stored, "bits", 4, BITS)
        self.checkpoint_format = _field(stored, "checkpoint_format", "gptq", FORMATS)
        _field(stored, "pack_dtype", "int32", ("int32",))
        _field(stored, "lm_head", False, (False,))  # GPTQModel can quantize the head; kvflow keeps it float
        if stored.get("is_marlin_format"):
            raise ValueError("gptq: is_marlin_format=true (AutoGPTQ's Marlin repacking) is not loadable; "
                             "load the plain GPTQ checkpoint")
        group = stored.get("group_size", 128)
        if not isinstance(group, int) or group == 0 or group < -1:
            raise ValueError(f"gptq: group_size={group!r} must be a positive number of input channels or -1")
        super().__init__(None if group == -1 else group, from_saved=True)
        self.sym, self.desc_act = bool(stored.get("sym", True)), bool(stored.get("desc_act", False))
        self.stored = dict(stored)

    def get_quant_method(self, kind: str, prefix: str):
        return GPTQMethod(self) if kind == "linear" else None  # embedding and head: float, as stored

    def to_dict(self) -> dict:
        return self.stored


def _field(stored: dict, key: str, default, allowed: tuple):
    value = stored.get(key, default)
    if value not in allowed:
        raise ValueError(f"gptq: {key}={value!r} is not loadable (kvflow loads {', '.join(map(repr, allowed))})")
    return value


class GPTQMethod(OnlineQuantMethod):
    keeps_stored = False  # loads only (`stored_tensors` refuses): its runtime is all the layer needs

    def __init__(self, config: GPTQConfig) -> None:
        super().__init__(config)
        self.stored_spec = {"qweight": (torch.int32, None), "qzeros": (torch.int32, None),
                            "scales": (torch.float32, None), "g_idx": (torch.int32, None)}
        self.pack = 32 // config.bits  # values per int32

    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        layer.quant_dtype, n = params_dtype, sum(output_sizes)
        group = self.config.group_size or input_size
        check_group(layer.prefix, "gptq", group, input_size, self.pack)
        by_output = dict(weight_loader=layer.weight_loader, input_dim=0, output_dim=1)
        shape_attrs = {"qweight": ((input_size // self.pack, n), by_output),
                       "qzeros": ((input_size // group, n // self.pack), by_output | dict(packed_dim=1, packed_factor=self.pack)),
                       "scales": ((input_size // group, n), by_output),
                       # one per shard of a fused layer: each must be the plain k // G
                       "g_idx": ((input_size,), dict(weight_loader=_GIdxLoader(layer, group), input_dim=0))}
        register_stored(layer, {name: (dtype, *shape_attrs[name]) for name, (dtype, _) in self.stored_spec.items()})

    def stored_tensors(self, layer):
        raise ValueError(f"{layer.prefix}: a GPTQ checkpoint is not saved again; its directory already loads as is")

    def quantize(self, weight, name):
        raise ValueError(f"{name}: quantization='gptq' loads GPTQ checkpoints; a float checkpoint is quantized "
                         "with -q int4, awq or fp8 (which rounds the GPTQ way)")

    def runtime(self, stored, dtype, name, dense_copy=True):
        return kernel_planes(*self.affine(stored), self.config.bits, dtype, name, dense_copy)

    def affine(self, stored: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(u [N, K], s [N, K/G], min [N, K/G]) with w = s·u + min, i.e. min = −z·s."""
        bits = self.config.bits
        u = unpack(stored["qweight"], bits, dim=0).t()
        zero = unpack(stored["qzeros"], bits, dim=1)
        if self.config.checkpoint_format == "gptq":  # v1 stores z − 1, wrapped to `bits`
            zero = (zero + 1) & (2**bits - 1)
        scale = stored["scales"].float()
        return u.to(torch.uint8).contiguous(), scale.t().contiguous(), (-zero.float() * scale).t().contiguous()


class _GIdxLoader:
    """Checks a shard's g_idx as it loads: act-order (desc_act) gives each input channel its own
    group, which int4's contiguous groups cannot hold without permuting every layer's input."""

    def __init__(self, layer: nn.Module, group: int) -> None:
        self.group = group
        self.first = layer.tp_rank * layer.input_size if layer.tp_split == "input" else 0

    def __call__(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        k = param.shape[0]
        local = loaded if self.first == 0 and loaded.shape[0] == k else loaded[self.first:self.first + k]
        want = (torch.arange(self.first, self.first + k) // self.group).to(torch.int32)
        if local.shape != want.shape or not torch.equal(local.to(torch.int32), want):
            raise ValueError("(g_idx) puts input channels in groups other than k // group_size: an act-order "
                             "(desc_act=true) checkpoint, which kvflow does not load; quantize with desc_act=false "
                             "or static_groups=true")
        param.data.copy_(want)
