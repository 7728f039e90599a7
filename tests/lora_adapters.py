"""Test LoRA adapters in PEFT's format, and the oracle's model: the base weights with an adapter merged in."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL_MODULES = ATTENTION + ("gate_proj", "up_proj", "down_proj")


def make_adapter(model_dir: Path, out: Path, *, rank: int = 8, alpha: float = 16.0, modules=ALL_MODULES,
                 layers=None, seed: int = 0, std: float = 0.08, config_extra: dict | None = None) -> Path:
    """A random adapter on ``modules`` of ``layers`` (default: every layer), saved as PEFT saves one.
    B is random too (PEFT starts it at zero; a trained one is not), large enough to change greedy tokens."""
    weights = load_file(model_dir / "model.safetensors")
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, weight in sorted(weights.items()):
        module = name.removesuffix(".weight")
        if not name.endswith(".weight") or module.rsplit(".", 1)[-1] not in modules:
            continue
        if layers is not None and int(module.split(".")[2]) not in layers:
            continue
        out_features, in_features = weight.shape
        tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * std
        tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * std
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors", metadata={"format": "pt"})
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": sorted(modules),
              "bias": "none", "use_rslora": False, "use_dora": False, "modules_to_save": None,
              "fan_in_fan_out": False, "base_model_name_or_path": str(model_dir), **(config_extra or {})}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def merged_model(model_dir: Path, adapter_dir: Path, out: Path) -> Path:
    """A copy of the model with ``W + scaling * B @ A`` (in float32) for every module the adapter has."""
    shutil.copytree(model_dir, out)
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    rank = config["r"]
    scaling = config["lora_alpha"] / (rank ** 0.5 if config.get("use_rslora") else rank)
    adapter = load_file(adapter_dir / "adapter_model.safetensors")
    weights = load_file(out / "model.safetensors")
    for name, a in adapter.items():
        if ".lora_A." not in name:
            continue
        module = name.removeprefix("base_model.model.").split(".lora_A.")[0]
        b = adapter[name.replace(".lora_A.", ".lora_B.")]
        weight = weights[f"{module}.weight"]
        weights[f"{module}.weight"] = (weight.float() + scaling * (b.float() @ a.float())).to(weight.dtype)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out
