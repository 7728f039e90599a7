"""Llama 3's rope scaling as llama.cpp stores it: not as settings but as a tensor, ``rope_freqs.weight``, one
divisor per rotary frequency (the frequency a query and key rotate by is ``theta^(-2i/d) / factors[i]``).

Hugging Face's ``llama3`` rope type computes the same divisors from four settings: 1 for wavelengths under
``original / high_freq_factor``, ``factor`` over ``original / low_freq_factor``, and between them
``1 / ((1 - s) / factor + s)`` with ``s = (original / wavelength - low_freq_factor) / (high_freq_factor -
low_freq_factor)``. The settings are recovered here from the divisors (s is linear in 1 / wavelength, so two
divisors between the ends fix it; Llama 3's own 1 and 4 are tried too), and kept only where they give every
stored divisor back: then the config is a plain Hugging Face one and the model's own rope code serves it.
"""

from __future__ import annotations

import math

import numpy as np

MATCH = 1e-4  # relative: the stored divisors are float32
_LLAMA3 = (1.0, 4.0)  # Llama 3.1 / 3.2's low_freq_factor, high_freq_factor


def llama3_rope_scaling(factors: np.ndarray, theta: float, head_dim: int, original: int) -> dict | None:
    """The ``rope_scaling`` dict whose divisors are ``factors`` (None: all 1, no scaling); ``original``: the
    pretraining context the file records (or Llama 3's 8192). ValueError where no llama3 setting fits."""
    factors = np.asarray(factors, dtype=np.float64).reshape(-1)
    if factors.size != head_dim // 2:
        raise ValueError(f"rope_freqs holds {factors.size} values; the rotary dimension {head_dim} has "
                         f"{head_dim // 2} frequencies")
    if np.allclose(factors, 1.0, rtol=MATCH, atol=0):
        return None
    wavelengths = 2 * math.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)
    factor = float(factors.max())
    for low, high in [*_fitted(factors, wavelengths, factor, original), _LLAMA3]:
        scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                   "original_max_position_embeddings": original}
        if np.allclose(llama3_divisors(scaling, wavelengths), factors, rtol=MATCH, atol=0):
            return scaling
    raise ValueError("rope_freqs holds divisors that no llama3 rope scaling gives (Llama 3's is the one read)")


def llama3_divisors(scaling: dict, wavelengths: np.ndarray) -> np.ndarray:
    """What Hugging Face's llama3 rope type divides each frequency by."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    smooth = (original / wavelengths - low) / (high - low)
    between = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelengths < original / high, 1.0, np.where(wavelengths > original / low, factor, between))


def _fitted(factors: np.ndarray, wavelengths: np.ndarray, factor: float, original: int) -> list[tuple[float, float]]:
    """(low_freq_factor, high_freq_factor) from the divisors strictly between 1 and ``factor``, where there are
    two or more: s = original * a / wavelength + b is a straight line in 1 / wavelength."""
    between = (factors > 1 + MATCH) & (factors < factor * (1 - MATCH))
    if between.sum() < 2:
        return []
    smooth = (1 / factors[between] - 1 / factor) / (1 - 1 / factor)
    slope, intercept = np.polyfit(original / wavelengths[between], smooth, 1)
    if slope <= 0:
        return []
    low = -intercept / slope
    return [(float(low), float(low + 1 / slope))]
