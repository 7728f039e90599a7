"""The MLP on the CPU takes a long step's rows in parts (decoder.CPU_MLP_ROWS): the same output, fewer bytes alive."""

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
    monkeypatch.setattr(decoder, "CPU_MLP_ROWS", 16)
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
    monkeypatch.setattr(decoder, "CPU_MLP_ROWS", 16)
    mlp = make_mlp(0)
    seen = rows_seen(mlp)
    with torch.inference_mode():
        mlp(torch.randn(40, 48))
    assert seen == [40]
