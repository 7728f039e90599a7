"""The panel projection kernel (csrc/panel_linear.cpp) against the exact product, and PackedLinear's use of it."""

from __future__ import annotations

import pytest
import torch

from services.worker.models import cpu_layers
from services.worker.models.packed_linear import PackedLinear, uses_panel_kernel

DTYPES = [pytest.param(dtype, marks=pytest.mark.skipif(not cpu_layers.has_panel_linear(dtype),
                                                       reason=f"no panel_linear for {dtype} in this build"))
          for dtype in (torch.float32, torch.bfloat16)]
POISON = float("nan")  # what the kernel must overwrite, and what it must leave past the last column


def exact_bound(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The product in float64 (exact for bfloat16 terms, within 1e-16 for float32 ones), and how far a float32
    accumulation over the input dimension may stray from it (K steps of half an ulp of the running magnitude)."""
    exact = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    magnitude = x.double().abs() @ weight.double().abs().T + (0 if bias is None else bias.double().abs())
    return exact, magnitude * x.shape[1] * 2.0 ** -24


def half_ulp(out: torch.Tensor) -> torch.Tensor:
    """Half the spacing of ``out``'s dtype at each value (its rounding's largest error)."""
    mantissa_bits = 7 if out.dtype == torch.bfloat16 else 23
    exponent = torch.frexp(out.double().abs().clamp_min(1e-30))[1]
    return torch.ldexp(torch.ones_like(out, dtype=torch.float64), exponent - mantissa_bits - 2)


def assert_rounded_product(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """Every output the rounding to out's dtype of a float32 sum of the exact terms."""
    exact, slack = exact_bound(x, weight, bias)
    assert not torch.isnan(out).any()
    assert ((out.double() - exact).abs() <= half_ulp(out) + slack).all()


def randn(*shape, generator, dtype):
    return torch.randn(*shape, generator=generator).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [0, 1, 5, 6, 7, 13, 193, 400])
@pytest.mark.parametrize("out_features, in_features", [(64, 32), (96, 80), (50, 34), (130, 512)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_panel_linear_is_the_rounded_product(dtype, rows, out_features, in_features, with_bias):
    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = randn(out_features, in_features, generator=generator, dtype=dtype)
    bias = randn(out_features, generator=generator, dtype=dtype) if with_bias else None
    x = randn(rows, in_features, generator=generator, dtype=dtype)
    # out sits in a buffer with a poisoned guard after it: columns past out_features, in the last panel, are
    # computed on zero weights and must never be stored.
    buffer = torch.full((rows * out_features + 64,), POISON, dtype=dtype)
    out = buffer[:rows * out_features].view(rows, out_features)
    packed = cpu_layers.pack_panel_weight(weight)
    torch.ops.pagedserve_cpu.panel_linear(out, x, packed, None if bias is None else bias.float())
    assert_rounded_product(out, x, weight, bias)
    assert buffer[rows * out_features:].isnan().all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_panel_linear_takes_rows_at_any_stride(dtype):
    generator = torch.Generator().manual_seed(1)
    weight = randn(70, 40, generator=generator, dtype=dtype)
    x = randn(9, 100, generator=generator, dtype=dtype)[:, 30:70]  # rows 100 apart
    out = cpu_layers.panel_linear(x, cpu_layers.pack_panel_weight(weight), 70)
    assert_rounded_product(out, x, weight, None)


@pytest.mark.parametrize("dtype", DTYPES)
def test_panel_linear_keeps_extreme_values(dtype):
    """Overflow to infinity, infinities and NaN as in float32 (bfloat16's subnormal values count as zero:
    vdpbf16ps's rule)."""
    weight = torch.tensor([[1.0, 0.0], [0.0, 1.0], [3e38, 3e38], [1e-30, 0.0]]).to(dtype)
    x = torch.tensor([[1.0, 2.0], [float("inf"), -1.0]]).to(dtype)
    out = cpu_layers.panel_linear(x, cpu_layers.pack_panel_weight(weight), 4)
    expected = torch.nn.functional.linear(x.float(), weight.float()).to(dtype)
    torch.testing.assert_close(out, expected, equal_nan=True, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_panel_linear_errors(dtype):
    packed = cpu_layers.pack_panel_weight(torch.randn(8, 4).to(dtype))
    with pytest.raises(ValueError, match="even"):
        cpu_layers.pack_panel_weight(torch.randn(8, 5).bfloat16())
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu_layers.pack_panel_weight(torch.randn(8, 4).half())
    with pytest.raises(ValueError, match="x must be"):
        cpu_layers.panel_linear(torch.randn(2, 4).half(), packed, 8)
    with pytest.raises(ValueError, match="no packed weight"):  # another dtype
        cpu_layers.panel_linear(torch.randn(2, 4).to(torch.float32 if dtype == torch.bfloat16 else torch.bfloat16),
                                packed, 8)
    with pytest.raises(ValueError, match="no packed weight"):
        cpu_layers.panel_linear(torch.randn(2, 6).to(dtype), packed, 8)
    with pytest.raises(ValueError, match="no packed weight"):
        cpu_layers.panel_linear(torch.randn(2, 4).to(dtype), packed, 65)
    with pytest.raises(ValueError, match="bias"):
        cpu_layers.panel_linear(torch.randn(2, 4).to(dtype), packed, 8, torch.zeros(8).bfloat16())


@pytest.mark.parametrize("dtype", [pytest.param(dtype, marks=pytest.mark.skipif(
    not uses_panel_kernel(torch.zeros(2, 2, dtype=dtype)), reason=f"{dtype} projections stay with oneDNN on this CPU"))
    for dtype in (torch.float32, torch.bfloat16)])
def test_packed_linear_takes_the_kernel(dtype):
    generator = torch.Generator().manual_seed(2)
    weight, bias = randn(96, 80, generator=generator, dtype=dtype), randn(96, generator=generator, dtype=dtype)
    x = randn(3, 7, 160, generator=generator, dtype=dtype)[..., ::2]  # batched, strided along in_features
    packed = PackedLinear(weight, bias)
    assert packed.panel_kernel and uses_panel_kernel(weight)
    out = packed(x)
    assert out.shape == (3, 7, 96) and out.dtype == dtype
    assert_rounded_product(out.reshape(21, 96), x.reshape(21, 80), weight, bias)
    assert not uses_panel_kernel(torch.randn(8, 5).bfloat16())  # an odd input dimension: oneDNN
    assert not uses_panel_kernel(torch.randn(8, 4).half())
