"""The fused C++ CPU layers (csrc/cpu_layers.cpp) against the PyTorch code they replace (layers.py).

float32 must agree to 1e-6 (rotary, the residual sum and SiLU's products exactly; RMSNorm's sum of
squares is added in another order); bfloat16/float16 reproduce torch's roundings, so they agree to
a unit or two in the last place of the format (rotary exactly).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.worker.models import cpu_layers
from services.worker.models.layers import RMSNorm, RotaryEmbedding, rotate_half

pytestmark = pytest.mark.skipif(not cpu_layers.available(), reason="the C++ CPU kernels are not built here")

NAN = float("nan")
# (rtol, atol) per dtype: float32 to 1e-6; the half formats to two units in their last place (a last-bit
# difference in RMSNorm's float result can round either way, twice: to the dtype, then times the weight).
TOLERANCE = {torch.float32: (1e-6, 1e-6), torch.bfloat16: (2 ** -6, 1e-3), torch.float16: (2 ** -9, 1e-4)}
DTYPES = list(TOLERANCE)


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    rtol, atol = TOLERANCE[expected.dtype]
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def torch_rotary(positions, x, cos, sin):
    cos, sin = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    return x * cos + rotate_half(x) * sin


def rotary_tables(head_dim: int, max_positions: int, dtype: torch.dtype):
    rotary = RotaryEmbedding(head_dim, max_positions, theta=10000.0, scaling=None)
    rotary._build(torch.device("cpu"), dtype)
    return rotary._cos, rotary._sin


def randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# ---- RMSNorm ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, hidden", [(1, 512), (7, 40), (33, 72), (300, 512), (130, 1408)])
def test_rms_norm(dtype, tokens, hidden):
    x = randn(tokens, hidden, dtype=dtype) * 3
    weight = randn(hidden, dtype=dtype, seed=1)
    out = torch.full_like(x, NAN)
    assert cpu_layers.rms_norm(x, weight, 1e-6, out=out) is out
    assert_close(out, torch_rms_norm(x, weight, 1e-6))


def test_rms_norm_float32_is_within_a_few_ulp():
    x, weight = randn(2048, 512) * 5, randn(512, seed=1)
    expected = torch_rms_norm(x, weight, 1e-5)
    ulp = torch.finfo(torch.float32).eps * expected.abs().clamp_min(torch.finfo(torch.float32).tiny)
    assert ((cpu_layers.rms_norm(x, weight, 1e-5) - expected).abs() / ulp).max() <= 4


def test_rms_norm_strided_heads():
    # Qwen3's per-head q norm: q [T, H, D] is a view into the fused qkv output.
    qkv = randn(9, 3 * 4 * 16)
    q = qkv[:, :64].view(9, 4, 16)
    weight = randn(16, seed=1)
    assert_close(cpu_layers.rms_norm(q, weight, 1e-6), torch_rms_norm(q, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, hidden", [(1, 512), (5, 40), (17, 72), (256, 512)])
def test_fused_add_rms_norm(dtype, tokens, hidden):
    x, residual = randn(tokens, hidden, dtype=dtype), randn(tokens, hidden, dtype=dtype, seed=1) * 4
    weight = randn(hidden, dtype=dtype, seed=2)
    expected_sum = residual + x
    out = torch.full_like(x, NAN)
    cpu_layers.fused_add_rms_norm(x, residual, weight, 1e-5, out=out)
    assert torch.equal(residual, expected_sum)  # the residual stream is bit for bit torch's add
    assert_close(out, torch_rms_norm(expected_sum, weight, 1e-5))


def test_rms_norm_module_uses_the_kernel_on_cpu():
    norm = RMSNorm(72, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(randn(72, seed=3))
    x, residual = randn(11, 72), randn(11, 72, seed=1)
    expected_sum = x + residual
    with torch.no_grad():
        assert_close(norm(x), torch_rms_norm(x, norm.weight, 1e-6))
        out, new_residual = norm.forward_with_residual(x, residual)
    assert new_residual is residual and torch.equal(residual, expected_sum)
    assert_close(out, torch_rms_norm(expected_sum, norm.weight, 1e-6))


def test_modules_keep_pytorch_where_gradients_are_wanted():
    norm, x = RMSNorm(8, 1e-6), randn(3, 8).requires_grad_()
    norm(x).sum().backward()  # the kernels have no backward; the PyTorch path does
    assert x.grad is not None and norm.weight.grad is not None


# ---- rotary embedding -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, heads, kv_heads, head_dim", [(1, 8, 4, 64), (5, 4, 1, 16), (37, 8, 4, 64),
                                                                (130, 2, 2, 128)])
def test_rotary_embedding(dtype, tokens, heads, kv_heads, head_dim):
    cos, sin = rotary_tables(head_dim, 4096, dtype)
    positions = torch.randint(0, 4096, (tokens,), generator=torch.Generator().manual_seed(0))
    # q and k as the model has them: strided views into one fused qkv output.
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype) * 2
    q = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v_before = qkv[:, (heads + kv_heads) * head_dim:].clone()
    expected_q, expected_k = torch_rotary(positions, q, cos, sin), torch_rotary(positions, k, cos, sin)
    cpu_layers.rotary_embedding(positions, q, k, cos, sin)
    # The same operations, rounded at the same points, in every dtype: exact.
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], v_before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rotary_rounds_every_value_like_torch(dtype):
    # Every finite value of the format, times cos/sin from 1e-6 to 1e4: the kernel's software
    # conversions round as torch's do, subnormals and overflow to inf included.
    values = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    values = values[torch.isfinite(values)]
    x = values[: values.numel() // 64 * 64].view(-1, 1, 64)
    scales = torch.logspace(-6, 4, 16)[:, None]
    cos, sin = (randn(16, 64) * scales).to(dtype), (randn(16, 64, seed=1) * scales).to(dtype)
    positions = torch.randint(0, 16, (x.shape[0],), generator=torch.Generator().manual_seed(0))
    q, k = x.clone(), x.flip(0).clone()
    expected_q, expected_k = torch_rotary(positions, q, cos, sin), torch_rotary(positions, k, cos, sin)
    cpu_layers.rotary_embedding(positions, q, k, cos, sin)
    torch.testing.assert_close(q, expected_q, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(k, expected_k, rtol=0, atol=0, equal_nan=True)


def test_rotary_module_uses_the_kernel_on_cpu():
    rotary = RotaryEmbedding(32, 256, theta=500000.0, scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})
    positions = torch.tensor([0, 1, 2, 200, 255, 7])
    q, k = randn(6, 4, 32), randn(6, 2, 32, seed=1)
    rotary._build(torch.device("cpu"), torch.float32)
    expected_q = torch_rotary(positions, q, rotary._cos, rotary._sin)
    expected_k = torch_rotary(positions, k, rotary._cos, rotary._sin)
    with torch.no_grad():
        out_q, out_k = rotary(positions, q, k)
    assert out_q is q and out_k is k  # the fused kernel rotates in place
    assert torch.equal(out_q, expected_q) and torch.equal(out_k, expected_k)


def test_rotary_position_outside_the_table():
    cos, sin = rotary_tables(16, 8, torch.float32)
    q, k = randn(2, 2, 16), randn(2, 1, 16)
    with pytest.raises(IndexError, match="outside the rotary table"):
        cpu_layers.rotary_embedding(torch.tensor([0, 8]), q, k, cos, sin)


# ---- SiLU and mul -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, intermediate", [(1, 1408), (3, 40), (19, 72), (200, 1408)])
def test_silu_and_mul(dtype, tokens, intermediate):
    gate_up = randn(tokens, 2 * intermediate, dtype=dtype) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    out = torch.full((tokens, intermediate), NAN, dtype=dtype)
    assert cpu_layers.silu_and_mul(gate_up, out=out) is out
    assert_close(out, F.silu(gate) * up)


def test_silu_and_mul_extreme_gates():
    gate = torch.tensor([-1000.0, -100.0, -88.0, -20.0, -1e-30, 0.0, 1e-30, 20.0, 88.0, 100.0, 1000.0])
    gate_up = torch.cat([gate, torch.ones_like(gate)])[None]
    torch.testing.assert_close(cpu_layers.silu_and_mul(gate_up)[0], F.silu(gate), rtol=1e-6, atol=1e-30)


def test_silu_and_mul_strided_rows():
    gate_up = randn(6, 100)[:, 10:90]  # rows 100 apart, 80 wide
    gate, up = gate_up.chunk(2, dim=-1)
    assert_close(cpu_layers.silu_and_mul(gate_up), F.silu(gate) * up)


# ---- per-token int8 quantization (W8A8) -----------------------------------------------------------


def torch_shifted_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from services.worker.models.int8_linear import quantize_per_token

    codes, scales = quantize_per_token(x)
    return (codes.to(torch.int16) + 128).to(torch.uint8), scales


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, hidden", [(1, 512), (3, 40), (19, 1408), (256, 512)])
def test_quantize_rows_uint8_equals_pytorch_code_for_code(dtype, tokens, hidden):
    seed = torch.seed() % (1 << 31)
    x = randn(tokens, hidden, dtype=dtype, seed=seed) * 3
    codes, scales = cpu_layers.quantize_rows_uint8(x)
    expected_codes, expected_scales = torch_shifted_codes(x)
    assert torch.equal(scales, expected_scales), f"seed {seed}"
    assert torch.equal(codes, expected_codes), f"seed {seed}: {(codes != expected_codes).sum()} codes differ"


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_rows_uint8_by_a_static_scale_equals_pytorch(dtype):
    """A checkpoint's calibrated scale for every row: values past 127 of it clamp."""
    from services.worker.models.int8_linear import quantize_per_token

    x = randn(9, 300, dtype=dtype, seed=torch.seed() % (1 << 31)) * 3
    static = torch.tensor([0.021])
    codes, scales = cpu_layers.quantize_rows_uint8(x, static_scale=static.item())
    expected, expected_scales = quantize_per_token(x, static)
    assert torch.equal(codes, (expected.to(torch.int16) + 128).to(torch.uint8))
    assert torch.equal(scales, expected_scales) and codes.max() == 255 and codes.min() == 1
    with pytest.raises(ValueError, match="static_scale must be positive"):
        cpu_layers.quantize_rows_uint8(x, static_scale=0.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scaled, biased", [(True, True), (True, False), (False, True)])
def test_int8_epilogue_scales_adds_and_rounds_once(dtype, scaled, biased):
    from services.worker.models.int8_linear import _scaled_output

    acc = randn(37, 300, seed=torch.seed() % (1 << 31)) * 1000
    scales = torch.rand(37, 1) * 0.01 if scaled else None
    bias = randn(300, dtype=dtype, seed=5) if biased else None
    expected = _scaled_output(acc.clone(), scales, bias, dtype)
    got = cpu_layers.int8_epilogue(acc.clone(), scales, bias, dtype)
    assert got.dtype == dtype and got.shape == acc.shape
    assert_close(got, expected)  # the multiply and add may fuse: one rounding fewer


def test_quantize_rows_uint8_edges():
    """Halves round to even (row 0: 127 * k / 2 for odd k); a row of zeros; the row's largest value at +-127;
    rows with a stride."""
    halves = torch.tensor([[254.0, 1.0, 3.0, 5.0, -1.0, -3.0, 0.5 * 254]])  # scale 2: 0.5, 1.5, 2.5, ...
    zeros = torch.zeros(1, 7)
    extremes = torch.tensor([[-1e30, 1e30, 1.0, -1.0, 1e-30, 0.0, 5e29]])
    x = torch.cat([halves, zeros, extremes])
    codes, scales = cpu_layers.quantize_rows_uint8(x)
    expected_codes, expected_scales = torch_shifted_codes(x)
    assert torch.equal(codes, expected_codes) and torch.equal(scales, expected_scales)
    assert codes[0].tolist() == [255, 128, 130, 130, 128, 126, 192] and codes[1].eq(128).all()
    wide = randn(5, 100)
    assert torch.equal(cpu_layers.quantize_rows_uint8(wide[:, 10:90])[0], torch_shifted_codes(wide[:, 10:90])[0])
    with pytest.raises(ValueError, match="unit stride"):
        cpu_layers.quantize_rows_uint8(randn(8, 4).t())


# ---- argument errors --------------------------------------------------------------------------------


def test_rms_norm_errors():
    x, weight = randn(4, 8), randn(8)
    with pytest.raises(ValueError, match="share one dtype"):
        cpu_layers.rms_norm(x, weight.double(), 1e-6)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        cpu_layers.rms_norm(x.double(), weight.double(), 1e-6)
    with pytest.raises(ValueError, match="weight must be"):
        cpu_layers.rms_norm(x, randn(7), 1e-6)
    with pytest.raises(ValueError, match="unit stride"):
        cpu_layers.rms_norm(randn(8, 4).t(), randn(8), 1e-6)
    with pytest.raises(ValueError, match="out must be contiguous"):
        cpu_layers.rms_norm(x, weight, 1e-6, out=torch.empty(4, 9))
    with pytest.raises(ValueError, match="residual must be"):
        cpu_layers.fused_add_rms_norm(x, randn(4, 9), weight, 1e-6)
    with pytest.raises(ValueError, match="contiguous"):
        cpu_layers.fused_add_rms_norm(x, randn(8, 4).t(), randn(4), 1e-6)


def test_rotary_errors():
    cos, sin = rotary_tables(16, 8, torch.float32)
    q, k, positions = randn(2, 2, 16), randn(2, 1, 16), torch.tensor([0, 1])
    with pytest.raises(ValueError, match="share one dtype"):
        cpu_layers.rotary_embedding(positions, q, k.half(), cos, sin)
    with pytest.raises(ValueError, match="int64"):
        cpu_layers.rotary_embedding(positions.int(), q, k, cos, sin)
    with pytest.raises(ValueError, match=r"\[T, H, D\]"):
        cpu_layers.rotary_embedding(positions, q, randn(2, 1, 8), cos, sin)
    with pytest.raises(ValueError, match="even"):
        odd_cos = torch.zeros(8, 15)
        cpu_layers.rotary_embedding(positions, randn(2, 2, 15), randn(2, 1, 15), odd_cos, odd_cos)
    with pytest.raises(ValueError, match="cos and sin"):
        cpu_layers.rotary_embedding(positions, q, k, cos[:, :8], sin[:, :8])


def test_silu_and_mul_errors():
    with pytest.raises(ValueError, match=r"\[T, 2 \* I\]"):
        cpu_layers.silu_and_mul(randn(3, 7))
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        cpu_layers.silu_and_mul(randn(3, 8).double())
    with pytest.raises(ValueError, match="out must be"):
        cpu_layers.silu_and_mul(randn(3, 8), out=torch.empty(3, 8))


# ---- greedy argmax --------------------------------------------------------------------------------


def argmax_into_poison(scores: torch.Tensor) -> torch.Tensor:
    """The op itself, into an output poisoned beforehand (the wrapper allocates a fresh one)."""
    out = torch.full((scores.shape[0],), -7, dtype=torch.int64)
    getattr(torch.ops, cpu_layers.LIBRARY).argmax_rows(out, scores)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, width", [(1, 1), (3, 255), (5, 257), (64, 32000), (300, 700)])
def test_argmax_rows_equals_torch_argmax(dtype, rows, width):
    # bfloat16's 8-bit mantissa makes equal largest values common at 32000 wide: the first must win.
    scores = randn(rows, width, dtype=dtype, seed=rows * 1000 + width) * 4
    assert torch.equal(argmax_into_poison(scores), scores.argmax(-1))
    assert torch.equal(cpu_layers.argmax_rows(scores), scores.argmax(-1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_rows_breaks_ties_and_orders_nan_as_torch_does(dtype):
    inf = float("inf")
    scores = torch.zeros(8, 600, dtype=dtype)
    scores[0, [5, 300]] = 3.0  # equal largest values in different chunks: the first
    scores[1, [7, 400, 599]] = NAN  # NaN above everything, the first of them
    scores[1, 2] = inf
    scores[2] = -inf  # nothing above -inf: index 0
    scores[3, 0] = -0.0  # -0 equals +0: the first zero
    scores[4, 599] = 1.0  # the last position
    scores[5, 256] = 1.0  # the first of a chunk
    scores[6, 255] = inf
    scores[7, 0], scores[7, 599] = NAN, inf
    expected = scores.argmax(-1)
    assert expected.tolist() == [5, 7, 0, 0, 599, 256, 255, 0]
    assert torch.equal(argmax_into_poison(scores), expected)


def test_argmax_rows_takes_rows_apart_in_memory():
    wide = randn(9, 1200, seed=3)
    scores = wide[:, 100:1100]  # rows 1200 apart, 1000 wide: a slice of a bigger batch
    assert torch.equal(argmax_into_poison(scores), scores.argmax(-1))


def test_argmax_rows_errors():
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        cpu_layers.argmax_rows(randn(3, 8).double())
    with pytest.raises(ValueError, match="n > 0"):
        cpu_layers.argmax_rows(randn(3, 0))
    with pytest.raises(ValueError, match="unit stride"):
        cpu_layers.argmax_rows(randn(8, 3).t())
    with pytest.raises(ValueError, match=r"\[rows, n\]"):
        cpu_layers.argmax_rows(randn(8))
