"""LLaVA-1.5's image encoder: a CLIP vision tower and LLaVA's two-layer projector, as transformers builds them
(the modules are transformers' own; the language model is ours, llama.py). An image's features are the tower's
hidden states at ``vision_feature_layer``, without the CLS row under the "default" strategy, projected to the
language model's width: one row per placeholder token the processor put in the prompt.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

# Where the checkpoint keeps each part (transformers v4 wrote the first, v5 the second), and where in a tower
# saved by v4 the CLIPVisionModel's own parameters begin.
_TOWER_PREFIXES = ("vision_tower.", "model.vision_tower.")
_PROJECTOR_PREFIXES = ("multi_modal_projector.", "model.multi_modal_projector.")
_TOWER_INNER = "vision_model."


class LlavaVision(nn.Module):
    def __init__(self, raw_config: dict[str, Any]):
        from transformers import AutoModel, LlavaConfig
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

        config = LlavaConfig.from_dict(raw_config)
        if not isinstance(config.vision_feature_layer, int):
            raise ValueError("a LLaVA checkpoint whose vision_feature_layer is a list is not supported yet")
        if config.vision_feature_select_strategy not in ("default", "full"):
            raise ValueError(f"unknown vision_feature_select_strategy {config.vision_feature_select_strategy!r}")
        super().__init__()
        self.feature_layer = config.vision_feature_layer
        self.drop_cls = config.vision_feature_select_strategy == "default"
        self.vision_tower = AutoModel.from_config(config.vision_config)
        self.multi_modal_projector = LlavaMultiModalProjector(config)

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[images, 3, H, W]`` -> ``[images, rows, hidden]``: each image's features."""
        dtype = self.multi_modal_projector.linear_1.weight.dtype
        out = self.vision_tower(pixel_values.to(dtype), output_hidden_states=True, return_dict=True)
        features = out.hidden_states[self.feature_layer]
        if self.drop_cls:
            features = features[:, 1:]
        return self.multi_modal_projector(features)

    def load_checkpoint(self, files: list[Path]) -> None:
        """The tower's and projector's tensors from the checkpoint's safetensors files; ValueError if some are
        missing."""
        tower, projector = {}, {}
        for file in files:
            with safe_open(str(file), "pt") as f:
                for name in f.keys():
                    if (inner := _strip(name, _TOWER_PREFIXES)) is not None:
                        tower[inner.removeprefix(_TOWER_INNER)] = f.get_tensor(name)
                    elif (inner := _strip(name, _PROJECTOR_PREFIXES)) is not None:
                        projector[inner] = f.get_tensor(name)
        for part, state in ((self.vision_tower, tower), (self.multi_modal_projector, projector)):
            wanted = part.state_dict()
            missing = sorted(set(wanted) - set(state))
            if missing:
                raise ValueError(f"the checkpoint lacks the vision encoder's {', '.join(missing[:4])}"
                                 + (f" and {len(missing) - 4} more" if len(missing) > 4 else ""))
            part.load_state_dict({name: state[name] for name in wanted})


def _strip(name: str, prefixes: tuple[str, ...]) -> str | None:
    return next((name[len(prefix):] for prefix in prefixes if name.startswith(prefix)), None)


def load_llava_vision(model_dir: Path, raw_config: dict[str, Any], files: list[Path], dtype: torch.dtype,
                      device: torch.device) -> LlavaVision:
    vision = LlavaVision(raw_config)
    vision.load_checkpoint(files)
    return vision.to(device=device, dtype=dtype).eval().requires_grad_(False)
