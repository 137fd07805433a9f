"""Orthogonal Hadamard transforms x ↦ x·H over the last dimension, for the rotations that spread
outlier channels before 4-bit rounding (quant/rotation.py, QuaRot's method).

H_n has entries ±1/√n and Hᵀ·H = I: every output channel is an equal-weight mix of every input
channel, so one large channel becomes n moderate ones and per-token rounding loses little.

Sizes. Sylvester's construction gives H for n = 2^k only; the default model's widths are not
powers of two (hidden 576 = 2^4·36, intermediate 1536 = 2^7·12). Every Hadamard order is 1, 2 or
a multiple of 4, and Paley's constructions give one of order q+1 for a prime q ≡ 3 (mod 4) and of
order 2(q+1) for a prime q ≡ 1 (mod 4): 12 = 11+1, 36 = 2·(17+1). So n = 2^k·m with such an m
takes H_{2^k} ⊗ H_m, a true Hadamard (no entry larger than another). Where no m of that kind
divides n, the odd part of n takes a seeded random orthogonal matrix Q instead (H_{2^k} ⊗ Q): still
orthogonal, spreading within blocks of that odd size only as well as a random rotation does.

The transform is fast as a product of Kronecker factors, each at most `MAX_FACTOR` wide: x viewed
as [..., f1, f2, ..., fr] is multiplied by each factor along its own axis, O(n·Σfᵢ) work in r
GEMMs (the 1536-wide transform: 2 of them, 128 and 12 wide) rather than the n² of a dense H, or the log₂n passes of
several small torch ops each that radix-2 butterflies would take.
"""

from __future__ import annotations

import math

import torch

MAX_FACTOR = 128  # widest dense factor: a 128×128 float32 matrix is 64 KiB, resident in L2


def _is_prime(q: int) -> bool:
    return q >= 2 and all(q % d for d in range(2, math.isqrt(q) + 1))


def _jacobsthal(q: int) -> torch.Tensor:
    """Q[i, j] = χ(j − i) for the quadratic character χ of the prime field of order q (χ(0) = 0)."""
    squares = torch.zeros(q)
    squares[[(x * x) % q for x in range(1, q)]] = 1
    chi = torch.where(squares > 0, 1.0, -1.0)
    chi[0] = 0
    idx = torch.arange(q)
    return chi[(idx[None, :] - idx[:, None]) % q]


def paley_hadamard(m: int) -> torch.Tensor | None:
    """A ±1 Hadamard matrix of order m from Paley's constructions over a prime field, or None where
    neither applies (m = 1 and 2 are given directly)."""
    if m in (1, 2):
        return torch.tensor([[1.0]]) if m == 1 else torch.tensor([[1.0, 1.0], [1.0, -1.0]])
    q = m - 1
    if _is_prime(q) and q % 4 == 3:  # Paley I: I + S, S = [[0, 1ᵀ], [−1, Q]] skew
        s = torch.zeros(m, m)
        s[0, 1:], s[1:, 0], s[1:, 1:] = 1, -1, _jacobsthal(q)
        return torch.eye(m) + s
    q = m // 2 - 1
    if m % 2 == 0 and _is_prime(q) and q % 4 == 1:  # Paley II: C = [[0, 1ᵀ], [1, Q]] symmetric, blown up 2×2
        c = torch.zeros(m // 2, m // 2)
        c[0, 1:], c[1:, 0], c[1:, 1:] = 1, 1, _jacobsthal(q)
        zero, one = torch.tensor([[1.0, -1.0], [-1.0, -1.0]]), torch.tensor([[1.0, 1.0], [1.0, -1.0]])
        return torch.kron(c, one) + torch.kron((c == 0).float(), zero)
    return None


def _odd_factor(n: int, seed: int) -> tuple[int, torch.Tensor]:
    """(m, an orthogonal m×m matrix) with n / m a power of two: the smallest Paley order that fits,
    else n's odd part with a seeded random orthogonal matrix."""
    odd = n // (n & -n)
    m = odd
    while n % m == 0:
        h = paley_hadamard(m)
        if h is not None:
            return m, h / math.sqrt(m)
        m *= 2
    q, r = torch.linalg.qr(torch.randn(odd, odd, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    return odd, (q * torch.sign(torch.diagonal(r))).float()


def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


class HadamardTransform:
    """x ↦ x·H_n over the last dimension (`transpose`: x·H_nᵀ, its inverse), computed in float32 (float64
    for float64 x) and returned in x's dtype. `seed` chooses the random orthogonal factor where n needs one."""

    def __init__(self, n: int, seed: int = 0) -> None:
        if n < 1:
            raise ValueError(f"a Hadamard transform needs a positive size, got {n}")
        m, base = _odd_factor(n, seed)
        self.size = n
        self.factors = [base] if m > 1 else []
        rest = n // m
        while rest > 1:
            f = min(rest, MAX_FACTOR)
            self.factors.insert(0, _sylvester(f))
            rest //= f

    def __call__(self, x: torch.Tensor, transpose: bool = False) -> torch.Tensor:
        if x.shape[-1] != self.size:
            raise ValueError(f"the Hadamard transform is of size {self.size}, its input's last dimension is {x.shape[-1]}")
        y = x.to(torch.promote_types(x.dtype, torch.float32)).reshape(-1, self.size)
        rows = y.shape[0]
        for factor in self.factors:
            f, factor = factor.shape[0], factor.to(y.dtype)
            # [rows, f, rest] → [rows, rest, f], times F over that last axis: one GEMM (a small matrix
            # broadcast over a batch would be thousands of tiny ones for the embedding's rows). Each
            # stage moves its axis to the end, so after every factor's stage the order is restored.
            y = y.reshape(rows, f, self.size // f).transpose(1, 2).reshape(-1, f) @ (factor.t() if transpose else factor)
        return y.reshape(x.shape).to(x.dtype)

    def matrix(self) -> torch.Tensor:
        """H_n itself (float32), for tests and small folds."""
        return self(torch.eye(self.size))
