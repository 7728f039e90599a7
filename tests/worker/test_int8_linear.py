"""W8A8 int8 linear layers (services/worker/models/int8_linear.py): the per-token quantization is the
scheme's published arithmetic, and oneDNN's int8 product equals the plain PyTorch reference."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from services.worker.models import int8_linear
from services.worker.models.int8_linear import (Int8Linear, can_run_onednn_int8, quantize_per_channel,
                                                quantize_per_token, w8a8_reference)


def test_per_token_codes_are_absmax_over_127_rounded_half_to_even():
    x = torch.tensor([[1.0, -2.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0], [3.0, 1.5, -0.75, 0.3]])
    codes, scale = quantize_per_token(x)
    ref = x.double().numpy()
    absmax = np.abs(ref).max(axis=1, keepdims=True)
    expected = np.clip(np.round(np.divide(ref, absmax / 127, out=np.zeros_like(ref), where=absmax > 0)), -127, 127)
    assert codes.dtype == torch.int8 and np.array_equal(codes.numpy(), expected)
    assert codes[0].tolist() == [64, -127, 32, 0]  # 63.5 rounds to the even 64; 31.75 to 32
    assert scale[0].item() == pytest.approx(2 / 127) and codes[1].abs().sum() == 0  # a zero row: all codes 0


def _layer(generator, k: int, n: int, bias: bool) -> tuple[Int8Linear, torch.Tensor]:
    weight = torch.randn(n, k, generator=generator) * 0.05
    layer = Int8Linear(k, n, bias)
    codes, scale = quantize_per_channel(weight)
    layer.weight.data.copy_(codes)
    layer.weight_scale.data.copy_(scale)
    if bias:
        layer.bias.data.copy_(torch.randn(n, generator=generator))
    layer.prepare()
    return layer, weight


@pytest.mark.parametrize("rows, k, n, bias", [(1, 64, 32, False), (7, 96, 160, True), (33, 200, 72, True),
                                              (256, 512, 1408, False)])
def test_the_int8_product_equals_the_reference(rows, k, n, bias):
    generator = torch.Generator().manual_seed(rows * 1000 + k)
    layer, weight = _layer(generator, k, n, bias)
    assert (layer._packed is not None) == can_run_onednn_int8(torch.device("cpu"))
    x = torch.randn(rows, k, generator=generator) * 3
    x[0, :] = 0 if rows > 1 else x[0, :]  # a row of zeros: only its bias
    got = layer(x)
    want = w8a8_reference(x, layer.weight, layer.weight_scale, layer.bias, dtype=torch.float64)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    # and it is the float layer, within the quantization's error
    dense = x @ weight.t() + (layer.bias if layer.bias is not None else 0)
    assert (got - dense).abs().max() <= 0.02 * dense.abs().max()


def test_transformers_shaped_and_bfloat16_inputs():
    generator = torch.Generator().manual_seed(5)
    layer, _ = _layer(generator, 128, 64, True)
    x = torch.randn(1, 9, 128, generator=generator)
    flat = layer(x.view(9, 128))
    assert torch.equal(layer(x), flat.view(1, 9, 64))
    out = layer(x.bfloat16())
    assert out.dtype == torch.bfloat16 and out.shape == (1, 9, 64)


def test_a_saturating_onednn_is_not_used(monkeypatch):
    """Where oneDNN's product saturates (AVX2 without VNNI) the exactness check fails and layers run the
    reference; with VNNI it passes. Either way the layer's answer is the reference's (test above)."""
    exact = int8_linear.onednn_int8_is_exact()
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text() if cpuinfo.exists() else ""
    if "avx512_vnni" in flags or "avx_vnni" in flags:
        assert exact
    saturating = lambda codes, weight: (codes.double() @ weight.double().t()).clamp(-32767, 32767)  # noqa: E731
    monkeypatch.setattr(int8_linear, "_onednn_product", saturating)
    int8_linear.onednn_int8_is_exact.cache_clear()
    try:
        assert not int8_linear.onednn_int8_is_exact()
    finally:
        int8_linear.onednn_int8_is_exact.cache_clear()
