"""Rotary-embedding settings from a config.json, in either transformers format.

v4 wrote ``rope_theta`` beside a ``rope_scaling`` dict (its kind under "type" or "rope_type"); v5 writes
one ``rope_parameters`` dict holding the theta too, or, for models whose layer kinds rotate differently
(Gemma 3), one such dict per layer type. Either becomes ``(theta, scaling)``, ``scaling`` None for plain
RoPE; a kind we cannot compute exactly is refused.

LongRoPE (Phi-3's "longrope", which its older configs call "su" or "yarn") keeps two sets of frequency
factors, for contexts within ``original_max_position_embeddings`` and beyond; YaRN (Qwen's long-context
setting) blends interpolated and original frequencies by wavelength. Their scaling dicts get the
pretraining length, the cos/sin ``attention_factor`` and YaRN's defaults filled in here, as transformers
derives them.
"""

from __future__ import annotations

import math
from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")
# Keys each rope type needs besides rope_theta; checked up front so a bad config fails at load.
_ROPE_KEYS = {"default": (), "linear": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
              "longrope": ("short_factor", "long_factor"), "yarn": ()}
PHI3_ROPE_ALIASES = {"su": "longrope", "yarn": "longrope"}  # Phi-3's older names for LongRoPE, and only Phi-3's


def parse_rope(raw: dict[str, Any], default_theta: float, max_positions: int, aliases: dict[str, str] | None = None,
               pretraining_length: int | None = None) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling) of a model whose every layer rotates alike; ``max_positions``: the model's
    max_position_embeddings; ``pretraining_length``: see complete_scaling."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    if any(isinstance(value, dict) for value in params.values()):
        raise ValueError(f"rope parameters per layer type ({', '.join(params)}) are not supported for this model")
    theta, scaling = rope_from_params(params, raw.get("rope_theta", default_theta), aliases)
    return theta, complete_scaling(scaling, max_positions, pretraining_length)


def complete_scaling(scaling: dict[str, Any] | None, max_positions: int, pretraining_length: int | None = None
                     ) -> dict[str, Any] | None:
    """LongRoPE's and YaRN's derived settings filled in. Their pretraining length is the rope dict's
    original_max_position_embeddings, else ``max_positions``; a model-level one (``pretraining_length``:
    Phi-3's, whose config class always has it) wins over both, as in transformers."""
    if scaling is None or scaling["rope_type"] not in ("longrope", "yarn"):
        return scaling
    original = pretraining_length or scaling.get("original_max_position_embeddings") or max_positions
    if scaling["rope_type"] == "longrope":
        return _longrope(scaling, max_positions, original)
    return _yarn(scaling, max_positions, original)


def partial_rotary_factor(raw: dict[str, Any]) -> float:
    """The share of each head's dimensions that rotates (1.0: all); transformers reads the rope dict's first."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    value = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= 1:
        raise ValueError(f"partial_rotary_factor must be in (0, 1], got {value!r}")
    return float(value)


def rope_from_params(params: dict[str, Any], default_theta: float, aliases: dict[str, str] | None = None
                     ) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling) from one parameter dict (its theta, else ``default_theta``)."""
    params = dict(params)
    theta = float(params.pop("rope_theta", default_theta))
    params.pop("partial_rotary_factor", None)  # partial_rotary_factor(): the model decides whether it may
    # v4 spelled the kind "type"; v5 "rope_type".
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    rope_type = (aliases or {}).get(rope_type, rope_type)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    missing = [key for key in _ROPE_KEYS[rope_type] if key not in params]
    if missing:
        raise ValueError(f"rope type {rope_type!r} needs {', '.join(missing)}")
    if theta <= 0:
        raise ValueError(f"rope_theta must be positive, got {theta}")
    if rope_type == "default":
        return theta, None
    return theta, {"rope_type": rope_type, **params}


def _longrope(scaling: dict[str, Any], maximum: int, original: int) -> dict[str, Any]:
    """LongRoPE's cos/sin factor resolved, as transformers does: without a factor the ratio of the two
    lengths stands in; the attention factor is sqrt(1 + ln(factor) / ln(original))."""
    factor = scaling.get("factor") or maximum / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    for name in ("short_factor", "long_factor"):
        values = scaling[name]
        if not isinstance(values, list) or not all(isinstance(v, (int, float)) and v > 0 for v in values):
            raise ValueError(f"longrope {name} must be a list of positive numbers")
    return {**scaling, "original_max_position_embeddings": int(original), "attention_factor": float(attention_factor)}


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(scaling: dict[str, Any], maximum: int, original: int) -> dict[str, Any]:
    """YaRN's scaling with transformers' defaults resolved: the factor (else the ratio of the two lengths),
    beta_fast 32 and beta_slow 1, truncation on, and the cos/sin attention factor (DeepSeek's mscale over
    mscale_all_dim where both are given)."""
    factor = scaling.get("factor") or maximum / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, all_dims = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, all_dims) if mscale and all_dims
                            else _yarn_mscale(factor))
    if not factor > 0:
        raise ValueError(f"yarn factor must be positive, got {factor!r}")
    return {**scaling, "factor": float(factor), "original_max_position_embeddings": int(original),
            "attention_factor": float(attention_factor), "beta_fast": scaling.get("beta_fast") or 32,
            "beta_slow": scaling.get("beta_slow") or 1, "truncate": scaling.get("truncate", True)}
