"""The W8A8 FP8 GEMMs (services/worker/quantization/fp8_gemm.py) and Fp8Linear (fp8_linear.py): the block-wise
Triton kernel under the interpreter and ``torch._scaled_mm`` (where it runs on this CPU), against the format's
published arithmetic (codes x scales, per block, quantization/dequantize.py) in float64: fresh random codes
over e4m3's whole range, edge sizes, an output poisoned before the kernel writes it, and the refusals.

Tolerance: a product of two e4m3 values is exact in float32, so the kernel's only roundings are float32 ones
(each tile's sum, its scaling by two scales, the accumulation over tiles, the bias) and the output's. For K
terms, ``|error| <= (K + 8) * 2^-24 * sum_k |x_k w_k|`` (+ the bias's rounding) plus the output dtype's unit
roundoff times ``|y|``, element by element: checked as such, not with a rule-of-thumb rtol."""

from __future__ import annotations

import pytest
import torch

from services.worker.model_loader import _materialize
from services.worker.quantization import fp8_gemm
from services.worker.quantization.dequantize import fp8_dequantize, fp8_round_per_row, fp8_weight_and_scales
from services.worker.quantization.fp8_gemm import (
    quantize_fp8_per_token, quantize_fp8_per_token_group, scaled_mm_fp8, w8a8_block_fp8_matmul)
from services.worker.quantization.fp8_linear import Fp8Layout, Fp8Linear, gpu_runs_fp8

E4M3 = torch.float8_e4m3fn
UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def fresh_seed() -> tuple[int, torch.Generator]:
    seed = torch.seed() % (1 << 31)
    return seed, torch.Generator().manual_seed(seed)


def random_codes(rows: int, cols: int, generator: torch.Generator) -> torch.Tensor:
    """Every e4m3 bit pattern but NaN's (0x7F, 0xFF): zeros, subnormals, +-448."""
    bits = torch.randint(0, 256, (rows, cols), generator=generator, dtype=torch.int64).to(torch.uint8)
    bits[(bits & 0x7F) == 0x7F] = 0
    return bits.view(E4M3)


def random_activations(m: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """Rows and columns of very different sizes, so that the scales per token and group differ."""
    return torch.randn(m, k, generator=generator) * torch.rand(m, 1, generator=generator) * 10 \
        * (torch.rand(1, k, generator=generator) + 0.05)


def expand_blocks(scales: torch.Tensor, block: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    return scales.double().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:shape[0], :shape[1]]


def reference(x_codes, x_scales, x_block, weight, w_scales, w_block, bias=None):
    """The published arithmetic in float64 (exact for these sizes): (expected [M, N], sum_k |x_k w_k| + |b|)."""
    x = x_codes.double() * expand_blocks(x_scales, x_block, x_codes.shape)
    w = weight.double() * expand_blocks(w_scales, w_block, weight.shape)
    y, size = x @ w.t(), x.abs() @ w.abs().t()
    if bias is not None:
        y, size = y + bias.double(), size + bias.double().abs()
    return y, size


def assert_within(y: torch.Tensor, expected: torch.Tensor, size: torch.Tensor, k: int, seed: int,
                  late_bias: torch.Tensor | None = None) -> None:
    """``y`` equals ``expected`` to float32 accumulation over ``k`` terms and one rounding to y's dtype (and one
    more where ``late_bias`` was added to the rounded product, in y's dtype)."""
    assert torch.isfinite(y).all(), f"seed {seed}: non-finite outputs (a tile left unwritten?)"
    bound = (k + 8) * 2.0 ** -24 * size + 2 * UNIT_ROUNDOFF[y.dtype] * expected.abs() + 1e-30
    if late_bias is not None:
        bound = bound + UNIT_ROUNDOFF[y.dtype] * late_bias.double().abs()
    error = (y.double() - expected).abs()
    worst = int((error / bound).argmax())
    assert (error <= bound).all(), (f"seed {seed}: {int((error > bound).sum())} outputs off; worst at "
                                    f"{divmod(worst, y.shape[1])}: {y.flatten()[worst].item()} vs "
                                    f"{expected.flatten()[worst].item()} (bound {bound.flatten()[worst].item():.3g})")


def poisoned(monkeypatch):
    """Every torch.empty in fp8_gemm filled with NaN: an output element the kernel misses shows."""
    empty = torch.empty
    monkeypatch.setattr(fp8_gemm.torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(float("nan")))


# --- the activations' quantization -----------------------------------------------------------------------------


@pytest.mark.parametrize("m, k, group", [(3, 256, 128), (4, 200, 64), (2, 48, 48), (0, 128, 128)])
def test_per_token_group_quantization_is_amax_over_448(m, k, group):
    seed, generator = fresh_seed()
    x = random_activations(m, k, generator)
    if m:
        x[0, :group] = 0  # a group of zeros: a positive scale, codes 0
    codes, scales = quantize_fp8_per_token_group(x, group)
    groups = -(-k // group)
    assert codes.dtype == E4M3 and codes.shape == (m, k) and scales.dtype == torch.float32
    assert scales.shape == (m, groups) and (scales > 0).all()
    padded = torch.nn.functional.pad(x, (0, groups * group - k)).view(m, groups, group)
    amax = padded.abs().amax(dim=2)
    torch.testing.assert_close(scales, amax.clamp_min(1e-10) / 448, rtol=0, atol=0, msg=lambda s: f"seed {seed}: {s}")
    dequantized = codes.double() * expand_blocks(scales, (1, group), (m, k))
    spacing = (x.double().abs() * 2.0 ** -4).maximum(expand_blocks(scales, (1, group), (m, k)) * 2.0 ** -10)
    assert ((dequantized - x.double()).abs() <= spacing * 1.0001).all(), f"seed {seed}: beyond e4m3 rounding"
    if m:  # each group's largest value lands on +-448
        top = torch.zeros(m, groups * group)
        top[:, :k] = codes.float().abs()
        assert (top.view(m, groups, group).amax(dim=2)[amax > 0] == 448).all(), f"seed {seed}"
        assert (codes[0, :group].float() == 0).all()


def test_per_token_quantization_is_one_group_per_row():
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(3), dtype=torch.float32).to(torch.bfloat16)
    codes, scales = quantize_fp8_per_token(x)
    assert scales.shape == (5, 1)
    torch.testing.assert_close(scales, x.float().abs().amax(dim=1, keepdim=True) / 448, rtol=0, atol=0)
    assert codes.equal(quantize_fp8_per_token_group(x, 96)[0])


# --- the block-wise Triton GEMM --------------------------------------------------------------------------------

BLOCK_CASES = [  # M, N, K, (bn, bk), out dtype, bias
    (1, 64, 128, (128, 128), torch.float32, False),  # one token; N inside one partial scale block
    (5, 200, 300, (128, 128), torch.float32, True),  # N ragged against bn and BLOCK_N; the last K block partial
    (17, 136, 256, (64, 64), torch.bfloat16, False),  # the prefill tile; M ragged against it
    (70, 130, 200, (128, 128), torch.float32, True),  # two prefill row tiles, N one past a tile
    (3, 96, 160, (32, 32), torch.float16, True),  # small blocks: K tiles of 32
    (4, 50, 100, (16, 48), torch.bfloat16, True),  # bk = 48: three K tiles of 16 per scale block
]


@pytest.mark.parametrize("m, n, k, block, out_dtype, with_bias", BLOCK_CASES)
def test_block_gemm_equals_the_published_arithmetic(m, n, k, block, out_dtype, with_bias, monkeypatch):
    seed, generator = fresh_seed()
    bn, bk = block
    codes, x_scales = quantize_fp8_per_token_group(random_activations(m, k, generator), bk)
    weight = random_codes(n, k, generator)
    w_scales = torch.rand(-(-n // bn), -(-k // bk), generator=generator) * 1e-2 + 1e-4
    bias = torch.randn(n, generator=generator).to(out_dtype) if with_bias else None
    expected, size = reference(codes, x_scales, (1, bk), weight, w_scales, block, bias)
    poisoned(monkeypatch)
    y = w8a8_block_fp8_matmul(codes, x_scales, weight, w_scales, block, out_dtype, bias)
    monkeypatch.undo()
    assert y.dtype == out_dtype and y.shape == (m, n)
    assert_within(y, expected, size, k, seed)


def test_block_gemm_takes_strided_operands_and_an_empty_batch():
    seed, generator = fresh_seed()
    codes, x_scales = quantize_fp8_per_token_group(random_activations(4, 256, generator), 64)
    weight = random_codes(72, 256, generator)
    w_scales = torch.rand(2, 4, generator=generator) + 0.5
    wide = torch.zeros(4, 512, dtype=E4M3)
    wide[:, ::2] = codes  # a column stride of 2
    column_major = weight.t().contiguous().t()
    y = w8a8_block_fp8_matmul(wide[:, ::2], x_scales.t().contiguous().t(), column_major,
                              w_scales.t().contiguous().t(), (64, 64), torch.float32)
    expected, size = reference(codes, x_scales, (1, 64), weight, w_scales, (64, 64))
    assert_within(y, expected, size, 256, seed)
    empty = w8a8_block_fp8_matmul(codes[:0], x_scales[:0], weight, w_scales, (64, 64), torch.bfloat16)
    assert empty.shape == (0, 72) and empty.dtype == torch.bfloat16


def block_arguments(**change):
    """Valid arguments for M 2, N 64, K 256, blocks (128, 128), with ``change`` applied."""
    args = dict(codes=torch.zeros(2, 256, dtype=E4M3), x_scales=torch.ones(2, 2),
                weight=torch.zeros(64, 256, dtype=E4M3), weight_scales=torch.ones(1, 2), block=(128, 128),
                out_dtype=torch.bfloat16, bias=None)
    args.update(change)
    return args


@pytest.mark.parametrize("change, error", [
    (dict(codes=torch.zeros(2, 256, dtype=torch.float8_e5m2)), "codes must be 2-D torch.float8_e4m3fn"),
    (dict(weight=torch.zeros(64, 256, dtype=torch.int8)), "weight must be 2-D torch.float8_e4m3fn"),
    (dict(weight=torch.zeros(64, 128, dtype=E4M3)), "K differs: codes have 256 columns, weight 128"),
    (dict(block=(128, 100)), "the block's K size \\(100\\) must be a multiple of 16"),
    (dict(block=(0, 128)), "block must be two positive sizes"),
    (dict(x_scales=torch.ones(2, 1)), "x_scales must be torch.float32 \\(2, 2\\)"),
    (dict(x_scales=torch.ones(2, 2, dtype=torch.bfloat16)), "x_scales must be torch.float32"),
    (dict(weight=torch.zeros(200, 256, dtype=E4M3), weight_scales=torch.ones(1, 2)),
     "weight_scales must be torch.float32 \\(2, 2\\)"),  # floor(200 / 128): the partial block's scale missing
    (dict(weight_scales=torch.ones(1, 2, dtype=torch.float16)), "weight_scales must be torch.float32"),
    (dict(out_dtype=torch.int32), "out_dtype must be one of"),
    (dict(bias=torch.zeros(63)), "bias must be a float \\[64\\]"),
    (dict(weight_scales=torch.ones(1, 2, device="meta")), "every tensor must be on codes' device \\(cpu\\)"),
])
def test_what_the_block_kernel_cannot_take_is_refused(change, error):
    with pytest.raises(ValueError, match=error):
        w8a8_block_fp8_matmul(**block_arguments(**change))


# --- torch._scaled_mm (per tensor, per row) ----------------------------------------------------------------------


def scaled_mm_runs_here() -> tuple[bool, str]:
    try:
        a = torch.zeros(1, 16, dtype=E4M3)
        torch._scaled_mm(a, torch.zeros(16, 16, dtype=E4M3).t(), scale_a=torch.ones(1, 1), scale_b=torch.ones(1, 16),
                         out_dtype=torch.bfloat16)
        return True, ""
    except (RuntimeError, NotImplementedError) as e:
        return False, f"torch._scaled_mm does not run on this CPU ({torch.__version__}): {str(e).splitlines()[0]}"


RUNS, WHY_NOT = scaled_mm_runs_here()
needs_scaled_mm = pytest.mark.skipif(not RUNS, reason=WHY_NOT)


@needs_scaled_mm
@pytest.mark.parametrize("m, n, k, scale_shape, out_dtype, with_bias", [
    (1, 48, 64, (1,), torch.float32, False),  # per tensor
    (7, 64, 96, (), torch.bfloat16, True),  # per tensor, as a 0-d scalar
    (9, 80, 128, (80, 1), torch.float32, True),  # per row
    (4, 32, 64, (32, 1), torch.float16, False),
    (3, 48, 160, (48,), torch.bfloat16, False),
])
def test_scaled_mm_equals_the_published_arithmetic(m, n, k, scale_shape, out_dtype, with_bias):
    seed, generator = fresh_seed()
    x = random_activations(m, k, generator).to(out_dtype)
    weight = random_codes(n, k, generator)
    weight_scale = torch.rand(scale_shape, generator=generator) * 1e-2 + 1e-4
    bias = torch.randn(n, generator=generator).to(out_dtype) if with_bias else None
    y = scaled_mm_fp8(x, weight, weight_scale, bias)
    codes, x_scale = quantize_fp8_per_token(x)
    per_row = weight_scale.reshape(-1, 1).expand(n, 1)
    expected, size = reference(codes, x_scale, (1, k), weight, per_row, (1, k), bias)
    assert y.dtype == out_dtype and y.shape == (m, n)
    assert_within(y, expected, size, k, seed, late_bias=bias)  # the bias is added to the rounded product
    assert scaled_mm_fp8(x[:0], weight, weight_scale, bias).shape == (0, n)


def scaled_mm_arguments(**change):
    args = dict(x=torch.zeros(2, 64), weight=torch.zeros(32, 64, dtype=E4M3), weight_scale=torch.ones(1), bias=None,
                out_dtype=torch.bfloat16)
    args.update(change)
    return args


@pytest.mark.parametrize("change, error", [
    (dict(x=torch.zeros(2, 64, dtype=torch.float64)), "x must be 2-D"),
    (dict(weight=torch.zeros(32, 64, dtype=torch.float8_e5m2)), "weight must be 2-D torch.float8_e4m3fn"),
    (dict(weight=torch.zeros(32, 48, dtype=E4M3)), "K differs: x has 64 columns, weight 48"),
    (dict(x=torch.zeros(2, 40), weight=torch.zeros(32, 40, dtype=E4M3)), "K \\(40\\) and N \\(32\\) must be positive "
                                                                         "multiples of 16"),
    (dict(weight=torch.zeros(64, 32, dtype=E4M3).t()), "weight must be row-major"),
    (dict(weight_scale=torch.ones(16, 1)),
     "weight_scale must be torch.float32, \\[1\\] \\(per tensor\\) or \\[32, 1\\]"),
    (dict(weight_scale=torch.ones(32, 1, dtype=torch.bfloat16)), "weight_scale must be torch.float32"),
    (dict(out_dtype=torch.float8_e4m3fn), "out_dtype must be one of"),
    (dict(bias=torch.zeros(32, dtype=torch.int32)), "bias must be a float \\[32\\]"),
    (dict(weight_scale=torch.ones(1, device="meta")), "every tensor must be on x's device \\(cpu\\)"),
])
def test_what_scaled_mm_cannot_take_is_refused(change, error):
    with pytest.raises(ValueError, match=error):
        scaled_mm_fp8(**scaled_mm_arguments(**change))


# --- Fp8Linear --------------------------------------------------------------------------------------------------


def block_quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight -> (e4m3 [N, K], float32 scales per block): each block's largest magnitude at 448."""
    n, k = weight.shape
    rows, cols = -(-n // block[0]), -(-k // block[1])
    padded = torch.nn.functional.pad(weight.abs(), (0, cols * block[1] - k, 0, rows * block[0] - n))
    scales = padded.view(rows, block[0], cols, block[1]).amax(dim=(1, 3)).clamp_min(1e-12) / 448
    return (weight / expand_blocks(scales, block, (n, k)).float()).to(E4M3), scales


@pytest.mark.parametrize("block, n, k, dtype", [
    ((64, 64), 96, 160, torch.float32),  # blocks: N and K partial against them
    ((128, 128), 64, 128, torch.bfloat16),
    pytest.param(None, 48, 64, torch.float32, marks=needs_scaled_mm),  # per row
    pytest.param(None, 32, 96, torch.bfloat16, marks=needs_scaled_mm),
])
def test_fp8_linear_is_the_dequantized_layer_on_its_quantized_activations(block, n, k, dtype):
    seed, generator = fresh_seed()
    float_weight = torch.randn(n, k, generator=generator) * 0.05
    layer = Fp8Linear(k, n, bias=True, layout=Fp8Layout(None if block is None else block[1]))
    _materialize(layer, dtype, torch.device("cpu"))  # as the loader gives a model of this dtype its storage
    assert layer.weight.dtype == E4M3 and not layer.weight.requires_grad and layer.weight_scale.dtype == torch.float32
    assert layer.bias.dtype == dtype
    assert layer.weight_scale.shape == ((n, 1) if block is None else (n, -(-k // block[1])))
    codes, scale = fp8_round_per_row(float_weight) if block is None else block_quantize(float_weight, block)
    stored, held = fp8_weight_and_scales(codes, scale, block, "layer")  # the loader's conversion
    layer.weight.data.copy_(stored)
    layer.weight_scale.data.copy_(held)
    layer.bias.data.copy_(torch.randn(n, generator=generator))
    x = random_activations(6, k, generator).to(dtype).view(2, 3, k)
    y = layer(x)
    assert y.dtype == dtype and y.shape == (2, 3, n)
    group = k if block is None else block[1]
    x_codes, x_scales = quantize_fp8_per_token_group(x.reshape(-1, k), group)
    x_deq = x_codes.double() * expand_blocks(x_scales, (1, group), (6, k))
    w_deq = fp8_dequantize(codes, scale, block).double()  # the loader's arithmetic, on the stored scales
    expected = x_deq @ w_deq.t() + layer.bias.double()
    size = x_deq.abs() @ w_deq.abs().t() + layer.bias.double().abs()
    assert_within(y.reshape(6, n), expected, size, k, seed, late_bias=layer.bias if block is None else None)
    # ... and close to the unquantized layer: e4m3 keeps 4 significant bits of each operand
    exact = x.reshape(6, k).double() @ float_weight.double().t() + layer.bias.double()
    relative = (y.reshape(6, n).double() - exact).norm() / exact.norm()
    assert relative < 0.1, f"seed {seed}: {relative:.3f} off the float layer"


def test_no_fp8_arithmetic_off_cuda():
    assert not gpu_runs_fp8("cpu") and not gpu_runs_fp8(torch.device("meta"))
