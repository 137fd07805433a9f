"""awq: activation-aware int4 (Lin et al.). Placeholder until calibration lands."""

from __future__ import annotations

from kvflow.quant.int4 import Int4Config


class AWQConfig(Int4Config):
    name = "awq"
