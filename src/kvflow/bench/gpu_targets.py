"""The GPUs kvflow's kernels are compiled for ahead of time, and what one SM can hold at once.

Limits are NVIDIA's published per-SM figures for compute capability 8.0 (A100) and 9.0 (H100):
64 Ki 32-bit registers, at most 255 per thread, allocated per warp in units of 256; 64 resident
warps (2048 threads) and 32 resident blocks; 164 KiB (A100) or 228 KiB (H100) of shared memory
per SM, of which one block may use 163 KiB or 227 KiB (the opt-in maximum triton asks the driver
for), and the CUDA runtime reserves 1 KiB per resident block.
"""

from __future__ import annotations

from dataclasses import dataclass

KIB = 1024


@dataclass(frozen=True)
class GpuTarget:
    arch: str  # "sm_90"
    capability: int  # 90
    gpu: str  # the part the numbers below describe
    hardware: str  # its kvflow.analysis.hardware preset, for roofline estimates
    num_sms: int
    smem_per_sm: int  # bytes
    smem_per_block: int  # bytes: the opt-in maximum one block may use
    registers_per_sm: int = 64 * KIB
    max_registers_per_thread: int = 255
    register_unit: int = 256  # registers are granted per warp in multiples of this
    max_warps_per_sm: int = 64
    max_blocks_per_sm: int = 32
    reserved_smem_per_block: int = KIB


TARGETS = {
    t.arch: t
    for t in (
        GpuTarget("sm_90", 90, "H100 SXM", "H100-SXM", num_sms=132, smem_per_sm=228 * KIB, smem_per_block=227 * KIB),
        GpuTarget("sm_80", 80, "A100 SXM", "A100-80GB", num_sms=108, smem_per_sm=164 * KIB, smem_per_block=163 * KIB),
    )
}


def parse_targets(text: str) -> list[GpuTarget]:
    """"sm_90,sm_80" (also "90", "sm90") → targets, in the order given."""
    targets = []
    for part in filter(None, (p.strip().lower() for p in text.split(","))):
        arch = "sm_" + part.removeprefix("sm").removeprefix("_")
        if arch not in TARGETS:
            raise ValueError(f"--arch: unknown target {part!r}; known: {', '.join(TARGETS)}")
        targets.append(TARGETS[arch])
    if not targets:
        raise ValueError("--arch: name at least one target, e.g. sm_90,sm_80")
    return targets


@dataclass(frozen=True)
class Occupancy:
    blocks_per_sm: int
    limited_by: str  # "registers" | "shared memory" | "warps" | "blocks"

    @property
    def describe(self) -> str:
        return f"{self.blocks_per_sm} ({self.limited_by})"


def occupancy(target: GpuTarget, num_warps: int, registers: int, shared_bytes: int) -> Occupancy:
    """Blocks of one kernel that fit on one SM at once, and which resource runs out first."""
    per_warp = -(-registers * 32 // target.register_unit) * target.register_unit
    limits = {
        "registers": (target.registers_per_sm // per_warp) // num_warps if per_warp else target.max_blocks_per_sm,
        "warps": target.max_warps_per_sm // num_warps,
        "blocks": target.max_blocks_per_sm,
        "shared memory": target.smem_per_sm // (shared_bytes + target.reserved_smem_per_block),
    }
    if shared_bytes > target.smem_per_block:
        limits["shared memory"] = 0
    limited_by = min(limits, key=limits.get)
    return Occupancy(limits[limited_by], limited_by)
