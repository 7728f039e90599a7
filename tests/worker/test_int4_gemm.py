"""The W4A16 Triton GEMM (services/worker/quantization/int4_gemm.py) under the interpreter, against the
format's published dequantization (quantization/dequantize.py) followed by a plain matmul: fresh random codes,
scales and zero points, edge sizes, an output poisoned before the kernel writes it."""

from __future__ import annotations

import pytest
import torch

from services.worker.quantization import int4_gemm
from services.worker.quantization.dequantize import group_index, grouped_dequantize
from services.worker.quantization.int4_gemm import w4a16_matmul
from services.worker.quantization.packing import unpack_int32

CASES = [  # M (rows: decode batches and a prefill), N, K, group, dtype
    (1, 64, 64, 64, torch.float32), (5, 80, 128, 64, torch.float32), (17, 136, 256, 128, torch.float32),
    (3, 64, 192, 64, torch.float16), (16, 96, 128, 128, torch.bfloat16), (33, 72, 256, 64, torch.bfloat16),
]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def random_layer(n: int, k: int, group: int, dtype: torch.dtype, generator: torch.Generator):
    codes = torch.randint(-2 ** 31, 2 ** 31 - 1, (n, k // 8), generator=generator, dtype=torch.int64).to(torch.int32)
    scales = (torch.rand(n, k // group, generator=generator) * 0.05 + 1e-3).to(dtype)
    zeros = torch.randint(0, 16, (n, k // group), generator=generator).to(dtype)
    return codes, scales, zeros


@pytest.mark.parametrize("m, n, k, group, dtype", CASES)
def test_equals_the_published_dequantization_then_a_matmul(m, n, k, group, dtype, monkeypatch):
    seed = torch.seed() % (1 << 31)
    generator = torch.Generator().manual_seed(seed)
    codes, scales, zeros = random_layer(n, k, group, dtype, generator)
    x = torch.randn(m, k, generator=generator).to(dtype)
    weight = grouped_dequantize(unpack_int32(codes, 4, 1), scales.float(), zeros.float(), group_index(k, group))
    expected = (x.float() @ weight.to(dtype).float().t())  # the weight as the kernel holds it: in x's dtype
    empty = torch.empty
    monkeypatch.setattr(int4_gemm.torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(float("nan")))
    y = w4a16_matmul(x, codes, scales, zeros, group)
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
    torch.testing.assert_close(w4a16_matmul(x, codes, scales, zeros, 64), x @ weight.t(), atol=1e-5, rtol=1e-5)
    assert w4a16_matmul(torch.empty(0, 128), codes, scales, zeros, 64).shape == (0, 64)


@pytest.mark.parametrize("change, error", [
    (dict(k=100), "K \\(100\\) must be a multiple of 8"),
    (dict(group=32), "group size \\(32\\) must be a multiple of 64"),
    (dict(codes_dtype=torch.int64), "codes must be int32"),
    (dict(scales_dtype=torch.float16), "scales must be torch.float32"),
])
def test_what_the_kernel_cannot_take_is_refused(change, error):
    k, group = change.get("k", 128), change.get("group", 64)
    codes = torch.zeros(64, k // 8, dtype=change.get("codes_dtype", torch.int32))
    scales = torch.ones(64, max(1, k // group), dtype=change.get("scales_dtype", torch.float32))
    with pytest.raises(ValueError, match=error):
        w4a16_matmul(torch.zeros(2, k), codes, scales, torch.zeros(64, max(1, k // group)), group)
