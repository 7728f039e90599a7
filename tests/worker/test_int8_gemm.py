"""The W8A8 int8 Triton GEMM (services/worker/quantization/int8_gemm.py) under the interpreter, against the
scheme's arithmetic computed exactly in float64 (the integer product is exact there): fresh random full-range
codes (-128 included, as compressed-tensors writes) and scales each run, their seed in every failure message;
edge sizes; the output written into a NaN-poisoned buffer wider than itself, so an element left unwritten or
one written out of bounds shows."""

from __future__ import annotations

import pytest
import torch

from services.worker.attention.triton_attention import interpreter_enabled
from services.worker.models.int8_linear import w8a8_reference
from services.worker.quantization import int8_gemm
from services.worker.quantization.int8_gemm import (BLOCK_K, BLOCK_M, BLOCK_N, int8_matmul_with_quantization,
                                                    w8a8_int8_matmul)

# The relative error of the last cast, float32 to the output dtype: half a step where it rounds to nearest (a GPU,
# and the interpreter's float16), a whole step for the interpreter's bfloat16, which Triton 3.9 truncates toward
# zero (fp_downcast_rounding="rtne" too: 16.8728 comes out 16.75, not 16.875).
ROUNDOFF = {torch.float32: 0.0, torch.float16: 2.0 ** -11,
            torch.bfloat16: 2.0 ** -7 if interpreter_enabled() else 2.0 ** -8}
F32 = 2.0 ** -24

CASES = [  # M, N, K, out dtype, bias, strided operands
    (1, 64, 128, torch.float32, False, False),  # a decode token, one tile each way
    (5, 80, 200, torch.float32, True, False),  # N and K not multiples of their tiles
    (17, 136, 300, torch.bfloat16, True, False),  # M past one tile
    (3, 72, 130, torch.float16, False, True),  # codes with a column stride, weight transposed in memory
    (33, 64, 2 * BLOCK_K + 7, torch.float16, True, False),
    (2, 70, 2304, torch.float32, True, False),  # a long K: 18 tiles, a partial one
]


def random_int8(*shape: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(-128, 128, shape, generator=generator, dtype=torch.int8)


def exact(codes, row_scales, weight, weight_scale, bias) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, the bound on |y|'s terms) in float64: the product is exact, every scale a float32 exactly held."""
    product = (codes.double() @ weight.double().t()) * row_scales.double() * weight_scale.double().view(1, -1)
    if bias is None:
        return product, product.abs()
    return product + bias.double(), product.abs() + bias.double().abs()


def check(y: torch.Tensor, expected: torch.Tensor, terms: torch.Tensor, dtype: torch.dtype, seed: int) -> None:
    """Element by element: float32 rounds the int32 sum, two products and a bias sum (four roundings of at most
    |terms| each), then the output dtype rounds once (plus its smallest subnormal step, for float16)."""
    bound = 4 * F32 * terms * (1 + ROUNDOFF[dtype]) + ROUNDOFF[dtype] * expected.abs() * 1.001
    if dtype == torch.float16:
        bound += 2.0 ** -25
    error = (y.double() - expected).abs()
    worst = (error - bound).argmax()
    assert (error <= bound).all(), (f"seed {seed}: element {divmod(worst.item(), y.shape[1])} is "
                                    f"{y.flatten()[worst].item()!r}, exactly {expected.flatten()[worst].item()!r}")


@pytest.mark.parametrize("m, n, k, dtype, with_bias, strided", CASES)
def test_equals_the_exact_product_to_the_output_rounding(m, n, k, dtype, with_bias, strided):
    seed = torch.seed() % (1 << 31)
    generator = torch.Generator().manual_seed(seed)
    codes, weight = random_int8(m, k, generator=generator), random_int8(n, k, generator=generator)
    if strided:
        codes = torch.stack([codes, random_int8(m, k, generator=generator)], dim=2).view(m, 2 * k)[:, ::2]
        weight = weight.t().contiguous().t()  # strides (1, N)
        assert codes.stride() == (2 * k, 2) and weight.stride() == (1, n)
    row_scales = torch.rand(m, 1, generator=generator) * 2e-3 + 1e-5
    weight_scale = torch.rand(n, 1, generator=generator) * 2e-3 + 1e-5
    bias = torch.randn(n, generator=generator).to(dtype) if with_bias else None
    # The output is a window into a NaN buffer a row and three columns wider: every element of the window must
    # be written (no NaN left), none outside it.
    poisoned = torch.full((m + 1, n + 3), float("nan"), dtype=dtype)
    out = poisoned[:m, 1:n + 1]
    y = w8a8_int8_matmul(codes, row_scales, weight, weight_scale, bias, dtype, out=out)
    assert y is out and y.dtype == dtype and y.shape == (m, n)
    assert torch.isfinite(y).all(), f"seed {seed}: {(~torch.isfinite(y)).sum().item()} elements left unwritten"
    outside = poisoned.clone()
    outside[:m, 1:n + 1] = float("nan")
    assert outside.isnan().all(), f"seed {seed}: written outside the output"
    check(y, *exact(codes, row_scales, weight, weight_scale, bias), dtype, seed)


def structured_codes(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, weight) of the extremes: rows of -128s and of 127s, and a weight row of 127s with a 2 at every
    128th place, whose every 128 products sum to an odd number (127 x 16129 + 254). Over K = 4096 the sums
    reach 2^26, beyond float32's exact integers (2^24) from the ninth tile of 128 on, where a float32
    accumulator drops the odd tile sums' last bits; they end as float32 holds exactly."""
    codes = torch.tensor([[-128], [127]], dtype=torch.int8).repeat(1, k)
    spiked = torch.full((1, k), 127, dtype=torch.int8)
    spiked[0, ::128] = 2
    return codes, torch.cat([codes, spiked])


@pytest.mark.parametrize("pattern", ["structured", "random"])
def test_full_range_codes_are_summed_exactly_in_int32(pattern):
    # Unit scales: the float32 output is the integer sum itself, where float32 holds it exactly (asserted).
    # These sums overflow int16 and float16 at once; the structured ones also a float32 accumulator.
    seed = torch.seed() % (1 << 31)
    if pattern == "structured":
        codes, weight = structured_codes(4096)
    else:
        generator = torch.Generator().manual_seed(seed)  # |sum| <= 1000 x 16384 < 2^24
        codes, weight = random_int8(3, 1000, generator=generator), random_int8(67, 1000, generator=generator)
    expected = codes.double() @ weight.double().t()
    assert expected.abs().max() > 2 ** 15 and torch.equal(expected.float().double(), expected)
    y = w8a8_int8_matmul(codes, torch.ones(codes.shape[0], 1), weight, torch.ones(weight.shape[0], 1), None,
                         torch.float32)
    assert torch.equal(y.double(), expected), f"seed {seed}: {(y.double() - expected).abs().max().item()} off"
    if pattern == "structured":
        assert expected[0, 0] == 2 ** 26 and expected[1, 2] == 32 * (127 * 16129 + 254)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_quantizing_entry_matches_the_layers_reference(dtype):
    seed = torch.seed() % (1 << 31)
    generator = torch.Generator().manual_seed(seed)
    k, n = 96, 40
    x = (torch.randn(2, 3, k, generator=generator) * 3).to(dtype)
    weight = random_int8(n, k, generator=generator)
    weight_scale = torch.rand(n, 1, generator=generator) * 1e-2 + 1e-4
    bias = torch.randn(n, generator=generator).to(dtype)
    y = int8_matmul_with_quantization(x, weight, weight_scale, bias)
    assert y.dtype == dtype and y.shape == (2, 3, n)
    expected = w8a8_reference(x.reshape(-1, k), weight, weight_scale, bias, dtype=torch.float64)
    codes, row_scales = int8_gemm.quantize_per_token(x.reshape(-1, k))
    _, terms = exact(codes, row_scales, weight, weight_scale, bias)
    check(y.view(-1, n), expected, terms, dtype, seed)


class _NoLaunch:
    def __getitem__(self, grid):
        raise AssertionError(f"launched with grid {grid}")


def test_an_empty_batch_launches_nothing(monkeypatch):
    monkeypatch.setattr(int8_gemm, "_w8a8_kernel", _NoLaunch())
    weight, weight_scale = torch.zeros(48, 64, dtype=torch.int8), torch.ones(48, 1)
    y = w8a8_int8_matmul(torch.zeros(0, 64, dtype=torch.int8), torch.ones(0, 1), weight, weight_scale,
                         torch.zeros(48), torch.bfloat16)
    assert y.shape == (0, 48) and y.dtype == torch.bfloat16
    assert int8_matmul_with_quantization(torch.zeros(0, 64), weight, weight_scale, None).shape == (0, 48)


def test_the_tiles_are_what_the_mma_takes():
    # int8 MMA steps K by 32 and Triton's dot wants every side at least 16.
    assert BLOCK_K % 32 == 0 and BLOCK_M >= 16 and BLOCK_N >= 16


@pytest.mark.parametrize("change, error", [
    (dict(codes=torch.zeros(4, 64, dtype=torch.int16)), "codes must be 2-D torch.int8"),
    (dict(codes=torch.zeros(64, dtype=torch.int8)), "codes must be 2-D torch.int8"),
    (dict(weight=torch.zeros(48, 64, dtype=torch.float16)), "weight must be 2-D torch.int8"),
    (dict(weight=torch.zeros(48, 32, dtype=torch.int8)), "K differs: codes have 64 columns, weight 32"),
    (dict(row_scales=torch.ones(4)), "row_scales must be torch.float32 \\(4, 1\\)"),
    (dict(row_scales=torch.ones(4, 1, dtype=torch.float16)), "row_scales must be torch.float32"),
    (dict(weight_scale=torch.ones(48)), "weight_scale must be torch.float32 \\(48, 1\\)"),
    (dict(weight_scale=torch.ones(48, 1, dtype=torch.bfloat16)), "weight_scale must be torch.float32"),
    (dict(bias=torch.zeros(47)), "bias must be a float \\[48\\]"),
    (dict(bias=torch.zeros(48, dtype=torch.int32)), "bias must be a float \\[48\\]"),
    (dict(out_dtype=torch.int32), "out_dtype must be one of"),
    (dict(out=torch.zeros(4, 47)), "out must be torch.float32 \\(4, 48\\)"),
    (dict(out=torch.zeros(4, 48, dtype=torch.float16)), "out must be torch.float32"),
    (dict(weight=torch.zeros(48, 64, dtype=torch.int8, device="meta")), "every tensor must be on codes' device"),
])
def test_what_the_kernel_cannot_take_is_refused(change, error, monkeypatch):
    monkeypatch.setattr(int8_gemm, "_w8a8_kernel", _NoLaunch())
    args = dict(codes=torch.zeros(4, 64, dtype=torch.int8), row_scales=torch.ones(4, 1),
                weight=torch.zeros(48, 64, dtype=torch.int8), weight_scale=torch.ones(48, 1), bias=None,
                out_dtype=torch.float32, out=None)
    with pytest.raises(ValueError, match=error):
        w8a8_int8_matmul(**{**args, **change})


def test_the_quantizing_entry_takes_float_activations_only():
    with pytest.raises(ValueError, match="x must be one of"):
        int8_matmul_with_quantization(torch.zeros(2, 64, dtype=torch.int8), torch.zeros(48, 64, dtype=torch.int8),
                                      torch.ones(48, 1), None)
