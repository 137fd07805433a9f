"""Accelerator ceilings for the roofline: memory capacity, memory bandwidth, peak FLOP/s.

Preset figures are the vendor datasheets quoted in the seeds, in decimal units (80 GB =
80e9 bytes, 3.35 TB/s = 3.35e12 B/s). Datasheet tensor-core rows are "with sparsity"; the
planner uses the dense figures (half of those), as the seeds do (989 TFLOP/s bf16 on H100).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from kvflow.analysis.model_spec import canonical_dtype


@dataclass(frozen=True)
class Hardware:
    name: str
    memory_bytes: float
    memory_bandwidth: float  # bytes/s
    peak_flops: Mapping[str, float]  # dtype -> dense FLOP/s
    # Device-to-device link, bytes/s each way (tensor parallelism's all-reduces); None: no link.
    interconnect_bandwidth: float | None = None

    def peak(self, dtype: str) -> float:
        key = canonical_dtype(dtype)
        if key not in self.peak_flops:
            known = ", ".join(self.peak_flops)
            raise ValueError(f"{self.name} has no peak FLOP/s for {key} (has: {known})")
        return self.peak_flops[key]

    def ridge_point(self, dtype: str = "bfloat16") -> float:
        """FLOPs per byte where compute time equals memory time (the roofline's knee)."""
        return self.peak(dtype) / self.memory_bandwidth

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "memory_bytes": self.memory_bytes,
            "memory_bandwidth": self.memory_bandwidth,
            "peak_flops": dict(self.peak_flops),
            "interconnect_bandwidth": self.interconnect_bandwidth,
        }


def peaks(**flops: float) -> Mapping[str, float]:
    """dtype → dense FLOP/s, keyed by canonical dtype names."""
    return MappingProxyType({canonical_dtype(k): v for k, v in flops.items()})


PRESETS: Mapping[str, Hardware] = MappingProxyType(
    {
        # A100 80GB SXM datasheet (seed 000): 312 TFLOP/s bf16 dense, 2,039 GB/s; NVLink
        # 600 GB/s in both directions together (seed 000:67), 300 GB/s each way.
        "A100-80GB": Hardware(
            "A100-80GB",
            80e9,
            2.039e12,
            peaks(bfloat16=312e12, float16=312e12, float32=19.5e12, int8=624e12),
            300e9,
        ),
        # H100 SXM datasheet (seeds 000, 002, 004): 989 TFLOP/s bf16 dense, 3.35 TB/s, 80 GB;
        # NVLink 900 GB/s both ways (seed 000:91), 450 GB/s each way.
        "H100-SXM": Hardware(
            "H100-SXM",
            80e9,
            3.35e12,
            peaks(bfloat16=989e12, float16=989e12, float32=67e12, float8=1979e12, int8=1979e12),
            450e9,
        ),
        # H200: the H100's compute and NVLink with 141 GB of HBM3e at 4.8 TB/s.
        "H200": Hardware(
            "H200",
            141e9,
            4.8e12,
            peaks(bfloat16=989e12, float16=989e12, float32=67e12, float8=1979e12, int8=1979e12),
            450e9,
        ),
    }
)


def get_hardware(name: str) -> Hardware:
    """A preset by (case-insensitive) name (this machine's measured ceilings come from
    `kvflow.bench.ceilings.measured_hardware`)."""
    for key, hw in PRESETS.items():
        if key.lower() == name.lower():
            return hw
    raise ValueError(f"unknown hardware {name!r}; presets: {', '.join(PRESETS)}, or 'measured'")
