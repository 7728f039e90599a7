"""The bfloat16 projection kernel (csrc/bf16_linear.cpp) against the exact product, and PackedLinear's use of it."""

from __future__ import annotations

import pytest
import torch

from services.worker.cpu_tuning import has_amx
from services.worker.models import cpu_layers
from services.worker.models.packed_linear import PackedLinear, uses_bf16_kernel

pytestmark = pytest.mark.skipif(not cpu_layers.has_bf16_linear(),
                                reason="the C++ kernels here have no bf16_linear (no AVX512-BF16)")
NAN_BITS = 0x7FC1  # a NaN no rounding makes: poisons what the kernel must write, and what it must not


def exact_bound(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The product in float64 (the exact one: every term is a product of two bfloat16), and how far a float32
    accumulation over the input dimension may stray from it (K steps of half an ulp of the running magnitude)."""
    exact = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    magnitude = x.double().abs() @ weight.double().abs().T + (0 if bias is None else bias.double().abs())
    return exact, magnitude * x.shape[1] * 2.0 ** -24


def assert_rounded_product(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """Every output the bfloat16 rounding (half an ulp of it) of a float32 sum of the exact terms."""
    exact, slack = exact_bound(x, weight, bias)
    got = out.double()
    ulp = (out.float().abs().view(torch.int32) + 65536).view(torch.float32).double() - out.float().abs().double()
    assert not torch.isnan(got).any()
    assert ((got - exact).abs() <= ulp / 2 + slack).all()


@pytest.mark.parametrize("rows", [0, 1, 5, 6, 7, 13, 193, 400])
@pytest.mark.parametrize("out_features, in_features", [(64, 32), (96, 80), (50, 34), (130, 512)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_linear_is_the_rounded_product(rows, out_features, in_features, with_bias):
    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features, generator=generator).bfloat16()
    bias = torch.randn(out_features, generator=generator).bfloat16() if with_bias else None
    x = torch.randn(rows, in_features, generator=generator).bfloat16()
    # out sits in a buffer with a poisoned guard after it: columns past out_features, in the last panel, are
    # computed on zero weights and must never be stored.
    buffer = torch.full((rows * out_features + 64,), NAN_BITS, dtype=torch.int16).view(torch.bfloat16)
    out = buffer[:rows * out_features].view(rows, out_features)
    packed = cpu_layers.pack_bf16_linear_weight(weight)
    torch.ops.pagedserve_cpu.bf16_linear(out, x, packed, None if bias is None else bias.float())
    assert_rounded_product(out, x, weight, bias)
    assert (buffer[rows * out_features:].view(torch.int16) == NAN_BITS).all()


def test_bf16_linear_takes_rows_at_any_stride():
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(70, 40, generator=generator).bfloat16()
    x = torch.randn(9, 100, generator=generator).bfloat16()[:, 30:70]  # rows 100 apart
    out = cpu_layers.bf16_linear(x, cpu_layers.pack_bf16_linear_weight(weight), 70)
    assert_rounded_product(out, x, weight, None)


def test_bf16_linear_keeps_extreme_values():
    """Overflow to infinity, infinities and NaN as in float32 (subnormal values count as zero: vdpbf16ps's rule)."""
    weight = torch.tensor([[1.0, 0.0], [0.0, 1.0], [3e38, 3e38], [1e-30, 0.0]]).bfloat16()
    x = torch.tensor([[1.0, -2.0], [float("inf"), 1.0]]).bfloat16()
    out = cpu_layers.bf16_linear(x, cpu_layers.pack_bf16_linear_weight(weight), 4)
    expected = torch.nn.functional.linear(x.float(), weight.float()).bfloat16()
    torch.testing.assert_close(out, expected, equal_nan=True, atol=0, rtol=0)


def test_bf16_linear_errors():
    packed = cpu_layers.pack_bf16_linear_weight(torch.randn(8, 4).bfloat16())
    with pytest.raises(ValueError, match="even"):
        cpu_layers.pack_bf16_linear_weight(torch.randn(8, 5).bfloat16())
    with pytest.raises(ValueError, match="bfloat16"):
        cpu_layers.pack_bf16_linear_weight(torch.randn(8, 4))
    with pytest.raises(ValueError, match="x must be"):
        cpu_layers.bf16_linear(torch.randn(2, 4), packed, 8)
    with pytest.raises(ValueError, match="no packed weight"):
        cpu_layers.bf16_linear(torch.randn(2, 6).bfloat16(), packed, 8)
    with pytest.raises(ValueError, match="no packed weight"):
        cpu_layers.bf16_linear(torch.randn(2, 4).bfloat16(), packed, 65)
    with pytest.raises(ValueError, match="bias"):
        cpu_layers.bf16_linear(torch.randn(2, 4).bfloat16(), packed, 8, torch.zeros(8).bfloat16())


@pytest.mark.skipif(has_amx(), reason="with AMX, bfloat16 projections stay with oneDNN")
def test_packed_linear_takes_the_kernel_for_bfloat16_only():
    generator = torch.Generator().manual_seed(2)
    weight, bias = torch.randn(96, 80, generator=generator), torch.randn(96, generator=generator)
    x = torch.randn(3, 7, 160, generator=generator)[..., ::2].bfloat16()  # batched, strided along in_features
    packed = PackedLinear(weight.bfloat16(), bias.bfloat16())
    assert packed.bf16_kernel and uses_bf16_kernel(weight.bfloat16())
    out = packed(x)
    assert out.shape == (3, 7, 96)
    assert_rounded_product(out.reshape(21, 96), x.reshape(21, 80), weight.bfloat16(), bias.bfloat16())
    assert not PackedLinear(weight, bias).bf16_kernel  # float32 stays with oneDNN
    assert not uses_bf16_kernel(torch.randn(8, 5).bfloat16())  # an odd input dimension too
