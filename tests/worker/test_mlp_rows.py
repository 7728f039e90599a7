"""The MLP on the CPU takes a long step's rows in parts (decoder.CPU_MLP_BYTES): the same output, fewer bytes alive."""

from __future__ import annotations

import pytest
import torch

from services.worker.models import decoder
from services.worker.models.decoder import MLP
from services.worker.models.packed_linear import can_pack, pack_linear_layers
from services.worker.tensor_parallel import TensorParallel

pytestmark = pytest.mark.skipif(not can_pack(torch.float32, torch.device("cpu")), reason="oneDNN is not available")


def make_mlp(seed: int) -> MLP:
    torch.manual_seed(seed)
    mlp = MLP(48, 80, bias=True, tp=TensorParallel())
    for parameter in mlp.parameters():
        parameter.data.normal_(0, 0.5)
    return mlp


def parts_of_16_rows(monkeypatch) -> None:
    """make_mlp's gate/up rows are 160 float32s: 16 of them fit 10240 bytes, and 16 is a power of two."""
    monkeypatch.setattr(decoder, "CPU_MLP_BYTES", 16 * 160 * 4 + 100)
    monkeypatch.setattr(decoder, "CPU_MLP_MIN_ROWS", 1)


def rows_seen(mlp: MLP) -> list[int]:
    """Records the rows of every gate/up product the MLP runs."""
    seen, project = [], mlp.gate_up_proj.forward

    def recording(x: torch.Tensor) -> torch.Tensor:
        seen.append(x.shape[0])
        return project(x)

    mlp.gate_up_proj.forward = recording
    return seen


@pytest.mark.parametrize("rows", [16, 17, 40, 48])
def test_a_packed_mlp_takes_long_steps_in_parts_with_the_same_output(rows, monkeypatch):
    parts_of_16_rows(monkeypatch)
    plain, packed = make_mlp(rows), make_mlp(rows)
    assert pack_linear_layers(packed) == 2
    x = torch.randn(rows, 48)
    seen = rows_seen(packed)
    with torch.inference_mode():
        out, expected = packed(x), plain(x)
    assert seen == [16] * (rows // 16) + ([rows % 16] if rows % 16 else [])
    assert out.shape == (rows, 48)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-5)


def test_unpacked_projections_take_the_step_whole(monkeypatch):
    """A LoRA wrapper, or any projection but a packed one, may read the whole step's tokens at once."""
    parts_of_16_rows(monkeypatch)
    mlp = make_mlp(0)
    seen = rows_seen(mlp)
    with torch.inference_mode():
        mlp(torch.randn(40, 48))
    assert seen == [40]


@pytest.mark.parametrize("dtype, rows", [(torch.float32, 1024), (torch.bfloat16, 2048)])
def test_the_bench_model_s_parts_are_a_power_of_two_of_rows_within_the_budget(dtype, rows):
    mlp = MLP(512, 1408, bias=False, tp=TensorParallel())  # gate/up rows of 2816 values
    assert mlp._rows_per_part(torch.empty(0, 512, dtype=dtype)) == rows
    assert rows * 2816 * dtype.itemsize <= decoder.CPU_MLP_BYTES < 2 * rows * 2816 * dtype.itemsize


def test_wide_mlps_keep_the_fewest_rows_oneDNN_runs_well():
    with torch.device("meta"):  # (its weights would take 768 MB)
        mlp = MLP(64, 1 << 20, bias=False, tp=TensorParallel())  # 8 MiB a float32 row of gate/up
    assert mlp._rows_per_part(torch.empty(0, 64)) == decoder.CPU_MLP_MIN_ROWS
