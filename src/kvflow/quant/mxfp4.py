"""mxfp4 (OCP microscaling): blocks of 32 E2M1 values sharing an E8M0 power-of-two scale.

No aten kernel decodes E2M1, but its values are integers in halves: 2·v ∈ {−12 … 12}, so
2·v + 16 is a 5-bit unsigned integer and the block runs as two int4 planes with scale 2^e / 2
(`int4pack.planes_from_affine`), exactly. That reads 8.5 bits per weight at run time although
4.25 are stored: the bytes a real E2M1 kernel would save are not saved here."""

from __future__ import annotations

import torch

from kvflow.quant.formats import MX_BLOCK, e2m1_decode, e8m0_decode, mxfp4_per_block, pack_nibbles, unpack_nibbles
from kvflow.quant.int4pack import Int4Planes, planes_from_affine
from kvflow.quant.online import OnlineQuantConfig, OnlineQuantMethod


class Mxfp4Method(OnlineQuantMethod):
    stored_spec = {"weight_packed": (torch.uint8, lambda k: k // 2), "weight_scale": (torch.uint8, lambda k: k // MX_BLOCK)}

    def quantize(self, weight, name):
        codes, scales = mxfp4_per_block(weight, name)
        return {"weight_packed": pack_nibbles(codes), "weight_scale": scales}

    def runtime(self, stored, dtype, name, dense_copy=True):
        doubled = (2 * e2m1_decode(unpack_nibbles(stored["weight_packed"]))).to(torch.int16)  # −12 … 12
        half_scale = e8m0_decode(stored["weight_scale"]) / 2
        u = (doubled + 16).to(torch.uint8)
        return Int4Planes(planes_from_affine(u, half_scale, -16 * half_scale, 5), MX_BLOCK, dtype, name, dense_copy)


class Mxfp4Config(OnlineQuantConfig):
    name = "mxfp4"
    method_class = Mxfp4Method
