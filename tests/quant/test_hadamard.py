"""The Hadamard transforms the rotations rest on (quant/hadamard.py): orthogonal at every size the
default model has (576 = 16·36, 1536 = 128·12, head 64) and at the tiny models' (96 = 8·12), true
Hadamards (every entry ±1/√n) wherever Paley's constructions reach, a random orthogonal factor
where they do not; the fast transform equals the dense product."""

from __future__ import annotations

import math

import pytest
import torch

from kvflow.quant.hadamard import HadamardTransform, paley_hadamard


@pytest.mark.parametrize("m", [1, 2, 4, 8, 12, 20, 24, 28, 36, 44, 60, 68, 72])
def test_paley_orders_are_hadamard_matrices(m):
    h = paley_hadamard(m)
    assert set(h.unique().tolist()) <= {-1.0, 1.0}
    assert torch.equal(h @ h.t(), m * torch.eye(m))


def test_orders_paley_does_not_reach_are_none():
    assert paley_hadamard(3) is None and paley_hadamard(6) is None and paley_hadamard(52) is None  # 51, 25: not prime


@pytest.mark.parametrize("n", [1, 2, 64, 96, 576, 1536, 448, 4096])
def test_transform_is_an_orthogonal_hadamard(n):
    h = HadamardTransform(n).matrix().double()
    torch.testing.assert_close(h @ h.t(), torch.eye(n, dtype=torch.float64), atol=1e-5, rtol=0)
    torch.testing.assert_close(h.abs(), torch.full((n, n), 1 / math.sqrt(n), dtype=torch.float64), atol=1e-6, rtol=0)


def test_sizes_without_a_hadamard_take_a_random_orthogonal_factor():
    """15 and 210 = 2·105: no Paley order m with n / m a power of two (and none of odd order exists);
    the seeded factor is orthogonal, and another seed draws another."""
    for n in (15, 2 * 15 * 7):
        h = HadamardTransform(n, seed=1).matrix().double()
        torch.testing.assert_close(h @ h.t(), torch.eye(n, dtype=torch.float64), atol=1e-5, rtol=0)
    assert not torch.equal(HadamardTransform(15, seed=1).matrix(), HadamardTransform(15, seed=2).matrix())


def test_power_of_two_is_sylvesters():
    h2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]])
    expected = torch.ones(1, 1)
    for _ in range(8):  # 256: two dense factors (128 and 2) compose into Sylvester's order
        expected = torch.kron(expected, h2)
    torch.testing.assert_close(HadamardTransform(256).matrix(), expected / math.sqrt(256), atol=1e-6, rtol=0)


@pytest.mark.parametrize("n", [96, 576, 1536])
def test_fast_transform_equals_the_dense_product_and_inverts(n):
    t = HadamardTransform(n)
    x = torch.randn(2, 3, n, dtype=torch.float64)
    h = t.matrix().double()
    torch.testing.assert_close(t(x), x @ h)
    torch.testing.assert_close(t(x, transpose=True), x @ h.t())
    torch.testing.assert_close(t(t(x), transpose=True), x)


def test_dtype_kept_and_size_checked():
    t = HadamardTransform(64)
    assert t(torch.randn(4, 64, dtype=torch.bfloat16)).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="size 64.*last dimension is 32"):
        t(torch.randn(4, 32))
    with pytest.raises(ValueError, match="positive size"):
        HadamardTransform(0)
