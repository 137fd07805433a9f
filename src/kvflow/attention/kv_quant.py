"""KV-cache quantization: keys and values stored as fp8 (E4M3 or E5M2) or int8, one scale per vector.

Each position's key (and value) of each KV head — one vector of head_dim numbers — is stored as
head_dim one-byte codes and one bfloat16 scale, ~amax / qmax: symmetric, nothing but the scale
(int8: round(x / scale) in [-127, 127]; fp8: x / scale in E4M3's [-448, 448] or E5M2's
[-57344, 57344], rounded to nearest even). Attention reads code * scale. The scale is per
vector and fixed when the vector is written, so a position's stored bits depend on its own K/V
only: a prompt written in one chunk or many, a block restored from a prefix-cache hit, swapped
back in or recomputed after preemption all hold the same bits. (A scale per block would have to
grow, and re-round the block, as positions arrive.)

E4M3 or E5M2. The per-vector scale already maps each vector's largest number to the top code,
so E5M2's wider range (57344 against 448) only reaches further below that number (its smallest
code is ~2^-32 of it, E4M3's ~2^-18), while its 2 mantissa bits against E4M3's 3 double the
rounding step: up to 1/8 of a value instead of 1/16. "fp8_e5m2" is offered for parity with
vLLM's flag; tests/attention/test_kv_quant.py measures its larger attention error.

Layout. A quantized cache is one tensor of dtype int8, float8_e4m3fn or float8_e5m2,
`[2, num_blocks, num_kv_heads, block_size * (head_dim + 2)]`: for each (K or V, block, head) a
row holding the block_size x head_dim codes, position-major as in the float cache, followed by
the block_size bfloat16 scales (two bytes each; bfloat16 rather than float16 for its range: a
vector of keys near 1e-4 or 1e5 still gets a scale that uses the codes' whole range). Why:
- dimension 1 is still the block, so block copies (copy-on-write), swaps to host and prefix
  caching move the scales with the codes without knowing they exist;
- a paged kernel finds everything for (block, head) at one address from the block table: the
  codes start the row (block_size * head_dim bytes, aligned as the float layout's rows are) and
  the tile's scales follow them contiguously;
- the tensor's dtype says how to decode it, so nothing else has to be threaded through models.

At 64 dims this costs 66 bytes per vector: 1.94x the positions of bfloat16, 3.88x of float32.
"""

from __future__ import annotations

import torch

from kvflow.kv_cache_spec import KV_SCALE_BYTES

# kv_cache_dtype → codes (kv_cache_spec.QUANTIZED_KV_CACHE_DTYPES names the same settings)
_CODE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
                "int8": torch.int8}
_QMAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0, torch.int8: 127.0}  # the largest finite code
SCALE_DTYPE = torch.bfloat16
assert SCALE_DTYPE.itemsize == KV_SCALE_BYTES  # the planner and the pool count these bytes
_SCALE_MIN = torch.finfo(SCALE_DTYPE).tiny  # an all-zero vector still gets a positive scale
# Rounding to bfloat16 moves a number by at most 2^-9 of itself: raising amax / qmax by 2^-8
# first keeps the stored scale >= amax / qmax, so no code ever needs clamping.
_SCALE_ROUNDING_MARGIN = 1 + 2**-8


def storage_dtype(kv_cache_dtype: str) -> torch.dtype | None:
    """The codes' dtype for a (validated) `kv_cache_dtype`; None: "auto", the model's dtype."""
    return None if kv_cache_dtype == "auto" else _CODE_DTYPES[kv_cache_dtype]


def is_quantized(kv_cache: torch.Tensor) -> bool:
    return kv_cache.dtype in _QMAX


def packed_shape(num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int) -> tuple[int, ...]:
    return (2, num_blocks, num_kv_heads, block_size * (head_dim + SCALE_DTYPE.itemsize))


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] → (codes [..., D] of `dtype`, bfloat16 scales [...]). The scale is rounded to
    bfloat16 before dividing, so code * scale is exactly what was meant."""
    qmax = _QMAX[dtype]
    x = x.float()
    scale = (x.abs().amax(dim=-1) * (_SCALE_ROUNDING_MARGIN / qmax)).clamp(min=_SCALE_MIN).to(SCALE_DTYPE)
    scaled = (x / scale.float()[..., None]).clamp(-qmax, qmax)  # the clamp only guards rounding
    codes = scaled.round().to(dtype) if dtype == torch.int8 else scaled.to(dtype)
    return codes, scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes [..., D], scale [...] → float values [..., D] of `dtype` (multiplied in float32)."""
    return (codes.float() * scale.float()[..., None]).to(dtype)


def round_trip(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What the cache will give back for x: attention over a prompt's own new keys must see these."""
    return dequantize(*quantize(x, dtype), x.dtype)


def split(kv_cache: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a packed cache: codes [2, num_blocks, heads, block_size, head_dim] and bfloat16
    scales [2, num_blocks, heads, block_size]. Writing into them writes the cache."""
    width = kv_cache.shape[-1] // block_size - SCALE_DTYPE.itemsize
    codes = kv_cache[..., :block_size * width].unflatten(-1, (block_size, width))
    return codes, kv_cache[..., block_size * width:].view(SCALE_DTYPE)


def write(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, blocks: torch.Tensor,
          offsets: torch.Tensor, block_size: int) -> None:
    """Quantize k, v [T, heads, head_dim] into (block, offset) of a packed cache."""
    codes, scales = split(kv_cache, block_size)
    for i, x in enumerate((k, v)):
        q, s = quantize(x, kv_cache.dtype)
        codes[i].transpose(1, 2)[blocks, offsets] = q
        scales[i].transpose(1, 2)[blocks, offsets] = s


def gather(kv_cache: torch.Tensor, index: torch.Tensor, batch: int, block_size: int, dtype: torch.dtype):
    """Rows `index` (metadata.gather_index: block * heads + head, in [B, heads, n] order) of a
    packed cache, dequantized: K and V as [B, heads, n * block_size, head_dim] of `dtype`. One
    index_select per K/V brings each block's codes and scales together."""
    _, num_blocks, heads, row = kv_cache.shape
    width = row // block_size - SCALE_DTYPE.itemsize
    out = []
    for i in (0, 1):
        rows = kv_cache[i].reshape(num_blocks * heads, row).index_select(0, index).view(batch, heads, -1, row)
        codes = rows[..., :block_size * width].unflatten(-1, (block_size, width))
        scales = rows[..., block_size * width:].view(SCALE_DTYPE)
        out.append(dequantize(codes, scales, dtype).flatten(2, 3))
    return tuple(out)
