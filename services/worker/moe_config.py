"""Mixture-of-experts settings, read from the config.json of Mixtral, Qwen2-MoE and Qwen3-MoE.

Each sparse layer replaces the MLP with ``num_experts`` SwiGLU experts and a router: every token goes
to the ``top_k`` experts with the highest softmax probability, and their outputs are summed, weighted
by those probabilities (rescaled to sum to one where the model says so). Qwen2-MoE adds a shared
expert that every token goes through, scaled by a sigmoid gate. The three families differ only in the
details kept here, which decide whether our outputs equal transformers'.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int  # experts per token
    intermediate_size: int  # each expert's (routed and shared experts alike have SwiGLU MLPs)
    renormalize: bool  # the top-k probabilities are rescaled to sum to 1 (Mixtral always; Qwen: norm_topk_prob)
    float32_weights: bool  # the routing weights stay float32 (Mixtral); else cast to the activations' dtype
    sparse_layers: tuple[int, ...]  # the layers with experts; the others have a dense MLP of intermediate_size
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's always-on expert; 0: none

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.top_k}) exceeds the number of experts "
                             f"({self.num_experts})")
        if self.shared_expert_intermediate_size < 0:
            raise ValueError("shared_expert_intermediate_size must not be negative")

    def is_sparse(self, layer: int) -> bool:
        return layer in self.sparse_layers


def parse_moe(raw: dict[str, Any], model_type: str) -> MoEConfig | None:
    """The MoE settings of a config.json; None for a dense model."""
    if model_type not in MOE_MODEL_TYPES:
        return None
    # Hub configs say num_experts (Qwen) or num_local_experts (Mixtral); transformers v5 writes the latter.
    num_experts = raw.get("num_local_experts") or raw.get("num_experts")
    if "num_experts_per_tok" not in raw or num_experts is None:
        raise ValueError(f"a {model_type} config needs num_experts_per_tok and num_experts (or num_local_experts)")
    layers = range(raw["num_hidden_layers"])
    if model_type == "mixtral":
        return MoEConfig(num_experts=num_experts, top_k=raw["num_experts_per_tok"],
                         intermediate_size=raw["intermediate_size"], renormalize=True, float32_weights=True,
                         sparse_layers=tuple(layers))
    if "moe_intermediate_size" not in raw:
        raise ValueError(f"a {model_type} config needs moe_intermediate_size")
    # Qwen: a layer is sparse unless listed in mlp_only_layers, and only every decoder_sparse_step-th one.
    dense, step = set(raw.get("mlp_only_layers") or ()), raw.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or step <= 0:
        raise ValueError(f"decoder_sparse_step must be a positive integer, got {step!r}")
    # (transformers' Qwen2-MoE default, which Hub configs always override)
    shared = raw.get("shared_expert_intermediate_size", 5632) if model_type == "qwen2_moe" else 0
    return MoEConfig(num_experts=num_experts, top_k=raw["num_experts_per_tok"],
                     intermediate_size=raw["moe_intermediate_size"],
                     renormalize=bool(raw.get("norm_topk_prob", False)), float32_weights=False,
                     sparse_layers=tuple(i for i in layers if i not in dense and (i + 1) % step == 0),
                     shared_expert_intermediate_size=shared or 0)
