"""Rotary-embedding settings from a config.json, in either transformers format.

v4 wrote ``rope_theta`` beside a ``rope_scaling`` dict (its kind under "type" or "rope_type"); v5 writes
one ``rope_parameters`` dict holding the theta too, or, for models whose layer kinds rotate differently
(Gemma 3), one such dict per layer type. Either becomes ``(theta, scaling)``, ``scaling`` None for plain
RoPE; a kind we cannot compute exactly is refused.
"""

from __future__ import annotations

from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# Keys each rope type needs besides rope_theta; checked up front so a bad config fails at load.
_ROPE_KEYS = {"default": (), "linear": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


def parse_rope(raw: dict[str, Any], default_theta: float) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling) of a model whose every layer rotates alike."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    if any(isinstance(value, dict) for value in params.values()):
        raise ValueError(f"rope parameters per layer type ({', '.join(params)}) are not supported for this model")
    return rope_from_params(params, raw.get("rope_theta", default_theta))


def rope_from_params(params: dict[str, Any], default_theta: float) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling) from one parameter dict (its theta, else ``default_theta``)."""
    params = dict(params)
    theta = float(params.pop("rope_theta", default_theta))
    # v4 spelled the kind "type"; v5 "rope_type".
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    missing = [key for key in _ROPE_KEYS[rope_type] if key not in params]
    if missing:
        raise ValueError(f"rope type {rope_type!r} needs {', '.join(missing)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1.0 is not supported")
    if theta <= 0:
        raise ValueError(f"rope_theta must be positive, got {theta}")
    if rope_type == "default":
        return theta, None
    return theta, {"rope_type": rope_type, **params}
