"""The model's own sampling defaults, as vLLM's --generation-config takes them: the fields of its
generation_config.json that a request may set (temperature, top_p, top_k, min_p, repetition_penalty)
become the defaults of every request that does not set them, and its max_new_tokens caps every request's
max_tokens. "auto" reads the model's folder, "vllm" reads nothing (the engine's own defaults), any other
value is a folder holding a generation_config.json; --override-generation-config's JSON object then
replaces fields (its own names: max_new_tokens, temperature, ...).

Applied where requests become SamplingParams: the gateway (HTTP and gRPC) and the offline LLM."""

from __future__ import annotations

import json
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared.json_file import read_json

GENERATION_CONFIG_FILE = "generation_config.json"
# generation_config.json's names of the sampling fields a request can set: the same in SamplingParams.
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
CAP_FIELD = "max_new_tokens"  # caps max_tokens


@dataclass(frozen=True)
class GenerationDefaults:
    sampling: Mapping[str, float | int] = field(default_factory=lambda: types.MappingProxyType({}))
    max_tokens: int | None = None  # every request's max_tokens at most this (None: no cap)
    source: str = "none"  # where they were read, for the start-up log

    def applied(self, given: dict[str, Any]) -> dict[str, Any]:
        """A request's sampling fields: those it set (``given``), the defaults for the others."""
        return {**{k: v for k, v in self.sampling.items() if k not in given}, **given}

    def capped(self, max_tokens: int | None) -> int | None:
        """A request's max_tokens (None: up to the context) within the model's max_new_tokens."""
        if self.max_tokens is None:
            return max_tokens
        return self.max_tokens if max_tokens is None else min(max_tokens, self.max_tokens)

    def as_dict(self) -> dict[str, Any]:
        return {**self.sampling, **({"max_tokens": self.max_tokens} if self.max_tokens is not None else {})}


def parse_override(text: str | dict | None) -> dict[str, Any]:
    """--override-generation-config: a JSON object of generation_config.json's fields ('' or None: none)."""
    if text is None or (isinstance(text, str) and not text.strip()):
        return {}
    try:
        value = json.loads(text) if isinstance(text, str) else text
    except json.JSONDecodeError as exc:
        raise ValueError(f"override_generation_config is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"override_generation_config must be a JSON object, got {text!r}")
    unknown = sorted(set(value) - set(SAMPLING_FIELDS) - {CAP_FIELD})
    if unknown:
        raise ValueError(f"override_generation_config has fields no request takes: {', '.join(unknown)} "
                         f"(known: {', '.join((*SAMPLING_FIELDS, CAP_FIELD))})")
    return value


def read_generation_defaults(mode: str, model_dir: str | Path | None, override: str | dict | None = None
                             ) -> GenerationDefaults:
    """The defaults --generation-config ``mode`` and --override-generation-config give for the model in
    ``model_dir`` (None: a model without files, such as the built-in one before it is made)."""
    if mode == "vllm":
        fields, source = {}, "vllm"
    elif mode == "auto":
        fields, source = _fields_of(Path(model_dir) / GENERATION_CONFIG_FILE) if model_dir else ({}, "none")
    elif Path(mode).is_dir():
        fields, source = _fields_of(Path(mode) / GENERATION_CONFIG_FILE)
    else:
        raise ValueError(f"generation_config {mode!r} is neither 'auto', 'vllm' nor a directory")
    overrides = parse_override(override)
    if overrides:
        source = f"{source} + override"
    fields = {**fields, **overrides}
    sampling = {name: fields[name] for name in SAMPLING_FIELDS if fields.get(name) is not None}
    cap = fields.get(CAP_FIELD)
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
        raise ValueError(f"{source}: {CAP_FIELD} must be an integer >= 1, got {cap!r}")
    _check_values(sampling, source)
    return GenerationDefaults(types.MappingProxyType(sampling), cap, source)


def _fields_of(file: Path) -> tuple[dict[str, Any], str]:
    return (read_json(file), str(file)) if file.is_file() else ({}, "none")


def _check_values(sampling: dict[str, Any], source: str) -> None:
    """The values as SamplingParams checks them, named after where they came from."""
    from shared.sampling_params import SamplingParams

    try:
        SamplingParams(**sampling)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{source}: its sampling defaults are not valid: {exc}") from None
