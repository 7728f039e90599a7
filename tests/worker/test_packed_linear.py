"""oneDNN-packed projections (CPU, float32 and bfloat16) against F.linear, and the model packed against unpacked."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from services.worker.model_loader import load_model
from services.worker.models.packed_linear import (EXACT_ROWS, PackedLinear, can_pack, pack_linear_layers, padded_rows,
                                                  uses_panel_kernel)
from tests.worker.test_model import ARCH_FIXTURES, PagedRunner, random_prompts

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not can_pack(torch.float32, CPU), reason="oneDNN is not available")


@pytest.mark.parametrize("rows", [0, 1, 7, 33, 45, 256, 300, 1000])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(rows, bias):
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 80, generator=generator)
    b = torch.randn(96, generator=generator) if bias else None
    x = torch.randn(rows, 80, generator=generator)
    torch.testing.assert_close(PackedLinear(weight, b)(x), F.linear(x, weight, b), atol=1e-5, rtol=1e-5)


def test_packed_linear_takes_strided_inputs():
    weight, x = torch.randn(64, 32), torch.randn(10, 64)[:, ::2]  # rows with stride 64, columns 2 apart
    assert not x.is_contiguous()
    torch.testing.assert_close(PackedLinear(weight, None)(x), F.linear(x, weight), atol=1e-5, rtol=1e-5)


def test_padded_rows_are_few_and_close_above_the_exact_ones():
    sizes = {rows: padded_rows(rows) for rows in range(0, 8193)}
    assert all(sizes[rows] == rows for rows in range(EXACT_ROWS + 1))
    assert all(rows <= padded <= rows * 17 / 16 for rows, padded in sizes.items())
    assert all(padded_rows(padded) == padded for padded in sizes.values())  # a padded size needs no more
    assert len(set(sizes.values())) == EXACT_ROWS + 1 + 16 * 8  # sixteen an octave, 32 to 8192


def test_padded_rows_keep_the_input_shape_and_leave_the_input_alone():
    weight, x = torch.randn(24, 64), torch.randn(3, 17, 128)[..., ::2]  # 51 rows, padded to 52
    before = x.clone()
    out = PackedLinear(weight, None)(x)
    assert padded_rows(51) == 52 and out.shape == (3, 17, 24) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, weight), atol=1e-5, rtol=1e-5)
    assert torch.equal(x, before)


def test_pack_replaces_every_linear():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 4, bias=False)))
    x = torch.randn(5, 8)
    expected = model(x)
    assert pack_linear_layers(model) == 2
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    torch.testing.assert_close(model(x), expected, atol=1e-5, rtol=1e-5)


def test_can_pack_float32_and_native_bfloat16_on_cpu():
    assert can_pack(torch.bfloat16, CPU) == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert not can_pack(torch.float16, CPU)
    assert not can_pack(torch.float32, torch.device("meta"))


@pytest.mark.skipif(not can_pack(torch.bfloat16, CPU), reason="this CPU runs no bfloat16 oneDNN matmul natively")
@pytest.mark.skipif(uses_panel_kernel(torch.zeros(2, 2, dtype=torch.bfloat16)),
                    reason="bfloat16 runs in csrc/panel_linear.cpp here (test_panel_linear.py)")
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_packed_bfloat16_equals_f_linear_exactly(rows):
    """The same oneDNN kernel, without the re-pack on every call: the same bits."""
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 80, generator=generator).bfloat16()
    bias = torch.randn(96, generator=generator).bfloat16()
    x = torch.randn(rows, 80, generator=generator).bfloat16()
    assert torch.equal(PackedLinear(weight, bias)(x), F.linear(x, weight, bias))


@pytest.mark.skipif(not can_pack(torch.bfloat16, CPU), reason="this CPU runs no bfloat16 oneDNN matmul natively")
def test_a_bfloat16_model_is_packed_and_equals_unpacked(llama_dir):
    packed, config = load_model(llama_dir, torch.bfloat16, CPU)
    plain, _ = load_model(llama_dir, torch.bfloat16, CPU, pack=False)
    assert packed.packed_logits is not None and not any(isinstance(m, nn.Linear) for m in packed.modules())
    prompt = random_prompts(config.vocab_size, [17])[0]
    runs = [PagedRunner(model, config, torch.bfloat16).step({0: prompt})[0] for model in (packed, plain)]
    # Not bit for bit: in some processes (1 run in 20-30 of this file on a Xeon with AMX) oneDNN takes another
    # kernel for F.linear's re-packed weights, whose additions in another order round a bfloat16 here and there
    # an ulp apart; through the layers the logits then differ by a few ulps (seen: 0.055 where they reach 6).
    # A wrong layout would differ by as much as the logits themselves.
    scale = runs[1].float().abs().max().item()
    torch.testing.assert_close(runs[0].float(), runs[1].float(), atol=0.03 * scale, rtol=0)


@pytest.mark.parametrize("fixture", ARCH_FIXTURES)
def test_packed_model_matches_unpacked(fixture, request):
    model_dir = request.getfixturevalue(fixture)
    packed, config = load_model(model_dir, torch.float32, CPU)
    plain, _ = load_model(model_dir, torch.float32, CPU, pack=False)
    assert packed.packed_logits is not None and plain.packed_logits is None
    assert not any(isinstance(m, nn.Linear) for m in packed.modules())
    prompt = random_prompts(config.vocab_size, [17])[0]
    torch.testing.assert_close(PagedRunner(packed, config).step({0: prompt})[0],
                               PagedRunner(plain, config).step({0: prompt})[0], atol=1e-4, rtol=0)
