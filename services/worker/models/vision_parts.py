"""What the image encoders share: an image's pixels as a tensor, and their tensors from a vision-language
checkpoint, each part (tower, projector) found under one of the prefixes transformers' releases wrote it with and
loaded whole or refused."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from shared.multimodal import ImageInput

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def pixels_of(image: ImageInput) -> torch.Tensor:
    """The image's pixel values, in their shape and dtype."""
    return torch.frombuffer(bytearray(image.pixel_values), dtype=_DTYPES[image.dtype]).view(image.shape)


def strip_prefix(name: str, prefixes: tuple[str, ...]) -> str | None:
    """``name`` without the first of ``prefixes`` it starts with; None: it starts with none."""
    return next((name[len(prefix):] for prefix in prefixes if name.startswith(prefix)), None)


def read_part(files: list[Path], prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The tensors under any of ``prefixes``, by their names below it."""
    state = {}
    for file in files:
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                if (inner := strip_prefix(name, prefixes)) is not None:
                    state[inner] = f.get_tensor(name)
    return state


def load_whole(part: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Every parameter and buffer of ``part`` from ``state``; ValueError naming what the checkpoint lacks."""
    wanted = part.state_dict()
    missing = sorted(set(wanted) - set(state))
    if missing:
        raise ValueError(f"the checkpoint lacks the vision encoder's {', '.join(missing[:4])}"
                         + (f" and {len(missing) - 4} more" if len(missing) > 4 else ""))
    part.load_state_dict({name: state[name] for name in wanted})
