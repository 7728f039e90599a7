"""The W4A16 / W8A16 Triton GEMM (services/worker/quantization/wna16_gemm.py) under the interpreter, against the
format's published dequantization (quantization/dequantize.py) followed by a plain matmul: fresh random codes,
scales and zero points, edge sizes, an output poisoned before the kernel writes it."""

from __future__ import annotations

import pytest
import torch

from services.worker.quantization import wna16_gemm
from services.worker.quantization.dequantize import group_index, grouped_dequantize
from services.worker.quantization.wna16_gemm import wna16_matmul
from services.worker.quantization.packing import unpack_int32

CASES = [  # M (rows: decode batches and a prefill), N, K, group, dtype, bits
    (1, 64, 64, 64, torch.float32, 4), (5, 80, 128, 64, torch.float32, 4), (17, 136, 256, 128, torch.float32, 4),
    (3, 64, 192, 64, torch.float16, 4), (16, 96, 128, 128, torch.bfloat16, 4), (33, 72, 256, 64, torch.bfloat16, 4),
    (1, 64, 128, 64, torch.float32, 8), (17, 72, 192, 64, torch.float32, 8), (9, 80, 256, 128, torch.bfloat16, 8),
]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def random_layer(n: int, k: int, group: int, dtype: torch.dtype, generator: torch.Generator, bits: int = 4):
    """Words of random bits (every code value, the sign bit too), scales, and zero points over the whole range."""
    words = k * bits // 32
    codes = torch.randint(-2 ** 31, 2 ** 31 - 1, (n, words), generator=generator, dtype=torch.int64).to(torch.int32)
    scales = (torch.rand(n, k // group, generator=generator) * 0.05 / bits + 1e-3).to(dtype)
    zeros = torch.randint(0, 1 << bits, (n, k // group), generator=generator).to(dtype)
    return codes, scales, zeros


@pytest.mark.parametrize("m, n, k, group, dtype, bits", CASES)
def test_equals_the_published_dequantization_then_a_matmul(m, n, k, group, dtype, bits, monkeypatch):
    seed = torch.seed() % (1 << 31)
    generator = torch.Generator().manual_seed(seed)
    codes, scales, zeros = random_layer(n, k, group, dtype, generator, bits)
    x = torch.randn(m, k, generator=generator).to(dtype)
    weight = grouped_dequantize(unpack_int32(codes, bits, 1), scales.float(), zeros.float(), group_index(k, group))
    expected = (x.float() @ weight.to(dtype).float().t())  # the weight as the kernel holds it: in x's dtype
    empty = torch.empty
    monkeypatch.setattr(wna16_gemm.torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(float("nan")))
    y = wna16_matmul(x, codes, scales, zeros, group, bits)
    monkeypatch.undo()
    assert y.dtype == dtype and y.shape == (m, n) and torch.isfinite(y).all()
    scale = expected.abs().max().item()
    torch.testing.assert_close(y.float(), expected, atol=TOLERANCE[dtype] * scale, rtol=TOLERANCE[dtype],
                               msg=lambda m: f"seed {seed}: {m}")


def test_strided_activations_and_an_empty_batch():
    generator = torch.Generator().manual_seed(1)
    codes, scales, zeros = random_layer(64, 128, 64, torch.float32, generator)
    wide = torch.randn(4, 256, generator=generator)
    x = wide[:, ::2]  # a column stride of 2
    weight = grouped_dequantize(unpack_int32(codes, 4, 1), scales, zeros, group_index(128, 64))
    torch.testing.assert_close(wna16_matmul(x, codes, scales, zeros, 64), x @ weight.t(), atol=1e-5, rtol=1e-5)
    assert wna16_matmul(torch.empty(0, 128), codes, scales, zeros, 64).shape == (0, 64)


@pytest.mark.parametrize("change, error", [
    (dict(k=100), "K \\(100\\) must be a multiple of 8"),
    (dict(k=102, bits=8), "K \\(102\\) must be a multiple of 4"),
    (dict(group=32), "group size \\(32\\) must be a multiple of 64"),
    (dict(codes_dtype=torch.int64), "codes must be int32"),
    (dict(words=16, bits=8), "codes must be int32 \\[N, 32\\]"),  # 4-bit words for 8-bit codes
    (dict(scales_dtype=torch.float16), "scales must be torch.float32"),
    (dict(bits=3), "codes of 3 bits are not taken"),
])
def test_what_the_kernel_cannot_take_is_refused(change, error):
    k, group, bits = change.get("k", 128), change.get("group", 64), change.get("bits", 4)
    codes = torch.zeros(64, change.get("words", k // 8), dtype=change.get("codes_dtype", torch.int32))
    scales = torch.ones(64, max(1, k // group), dtype=change.get("scales_dtype", torch.float32))
    with pytest.raises(ValueError, match=error):
        wna16_matmul(torch.zeros(2, k), codes, scales, torch.zeros(64, max(1, k // group)), group, bits)
