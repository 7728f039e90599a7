"""What sets Gemma, Gemma 2 and Gemma 3 (text) apart from Llama, read from their config.json.

All three: RMSNorms that scale by ``1 + weight`` in float32 before the cast back, a GeGLU MLP (GELU, tanh
approximation), embeddings multiplied by sqrt(hidden_size), tied embeddings unless the config unties
them. Gemma 2 and 3 add a norm after attention's and the MLP's outputs and one before the MLP, scale
attention by ``query_pre_attn_scalar ** -0.5``, and alternate sliding-window and full layers (Gemma 2
every other layer, Gemma 3 five in six) and soft-cap attention scores and the final logits where the
config says (Gemma 2 does, by 50 and 30). Gemma 3
normalises q and k per head and rotates its sliding layers with a RoPE of their own (base 10000,
unscaled) while the full layers take rope_theta and any scaling.
"""

from __future__ import annotations

from typing import Any

from services.worker.rope_config import complete_scaling, parse_rope, rope_from_params

GEMMA_MODEL_TYPES = ("gemma", "gemma2", "gemma3_text")
_DEFAULT_WINDOW = 4096  # transformers' Gemma2Config / Gemma3TextConfig default
_DEFAULT_PATTERN = 6  # Gemma 3: layers i with (i + 1) % 6 != 0 slide
_DEFAULT_CAPS = {"gemma2": (50.0, 30.0)}  # (attention scores, logits): Gemma2Config's defaults


def gemma_activation(raw: dict[str, Any], model_type: str) -> str:
    """The MLP's activation. Gemma 1 reads hidden_act, whose "gelu" in its official configs transformers
    takes for the tanh approximation it was trained with; Gemma 2 and 3 read hidden_activation alone."""
    if model_type == "gemma":
        name = raw.get("hidden_act") or "gelu_pytorch_tanh"
        name = "gelu_pytorch_tanh" if name == "gelu" else name
    else:
        name = raw.get("hidden_activation") or "gelu_pytorch_tanh"
    if name != "gelu_pytorch_tanh":
        raise ValueError(f"unsupported activation {name!r} for {model_type}; only 'gelu_pytorch_tanh' is supported")
    return name


def gemma_layer_types(raw: dict[str, Any], model_type: str) -> tuple[int | None, tuple[str, ...]]:
    """(sliding_window, layer_types): Gemma 1 has no window; 2 and 3 follow layer_types, else their pattern."""
    if model_type == "gemma":
        return None, ()
    window = raw.get("sliding_window", _DEFAULT_WINDOW)
    if window is None:  # written as null: the sliding layers' mask is the causal one
        return None, ()
    num_layers = raw["num_hidden_layers"]
    given = raw.get("layer_types")
    if given is not None:
        if not isinstance(given, list):
            raise ValueError(f"layer_types must be a list, got {given!r}")
        return window, tuple(given)
    pattern = 2 if model_type == "gemma2" else raw.get("sliding_window_pattern", _DEFAULT_PATTERN)
    if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern < 1:
        raise ValueError(f"sliding_window_pattern must be a positive integer, got {pattern!r}")
    return window, tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers))


def gemma_rope(raw: dict[str, Any], model_type: str, max_positions: int
               ) -> tuple[float, dict[str, Any] | None, float | None]:
    """(rope_theta, rope_scaling, local_rope_theta): the last is Gemma 3's sliding layers' base (None for
    Gemma 1 and 2, whose layers all rotate alike)."""
    if model_type != "gemma3_text":
        theta, scaling = parse_rope(raw, 10000.0, max_positions)
        return theta, scaling, None
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):  # v5: one dict per layer type
        theta, scaling = rope_from_params(params["full_attention"], raw.get("rope_theta", 1_000_000.0))
        scaling = complete_scaling(scaling, max_positions)
        local, local_scaling = rope_from_params(params.get("sliding_attention") or {},
                                                raw.get("rope_local_base_freq", 10_000.0))
    else:  # v4: rope_theta and rope_scaling for the full layers, rope_local_base_freq for the sliding ones
        theta, scaling = parse_rope(raw, 1_000_000.0, max_positions)
        local, local_scaling = float(raw.get("rope_local_base_freq", 10_000.0)), None
    if local_scaling is not None:
        raise ValueError("Gemma 3's sliding layers must use plain RoPE (their rope_type 'default')")
    return theta, scaling, local


def gemma_fields(raw: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The ModelConfig fields that differ from a Llama's."""
    if raw.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention (Gemma embedding models) is not supported: "
                         "the engine's attention is causal")
    later = model_type != "gemma"
    scalar = raw.get("query_pre_attn_scalar", 256) if later else None
    caps = _DEFAULT_CAPS.get(model_type, (None, None))  # what transformers takes when config.json omits them
    return dict(
        hidden_act=gemma_activation(raw, model_type),
        norm_style="gemma",
        embedding_multiplier=float(raw["hidden_size"]) ** 0.5,
        round_embedding_multiplier=True,
        norm_placement="sandwich" if later else "pre",
        query_pre_attn_scalar=float(scalar) if scalar is not None else None,
        attn_logit_softcap=raw.get("attn_logit_softcapping", caps[0]) if later else None,
        final_logit_softcap=raw.get("final_logit_softcapping", caps[1]) if later else None,
    )
