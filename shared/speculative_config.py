"""Speculative decoding settings, validated once (vLLM's ``speculative_config``).

A worker with these proposes up to ``num_speculative_tokens`` draft tokens per sequence after each
step; the next step computes them beside the sequence's real next token and keeps the longest
prefix the model itself would have sampled. Two proposers are built: ``"ngram"`` (prompt lookup: the
tokens that followed the latest earlier occurrence of the sequence's last n tokens; no second model)
and ``"draft_model"`` (a smaller model with the same vocabulary, ``model``, decoding greedily ahead).
The block tables and the step protocol are the same for both.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

METHODS = ("ngram", "draft_model")
DEFAULT_PROMPT_LOOKUP = 5
# vLLM's other methods, refused with a clear error rather than silently ignored.
NOT_BUILT = ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "suffix")


@dataclass(frozen=True)
class SpeculativeConfig:
    num_speculative_tokens: int  # the most draft tokens verified per sequence and step
    method: str | None = None  # None: "draft_model" with a model, else "ngram" (as vLLM)
    # ngram: the longest suffix n-gram looked up (tried first), and the shortest tried when longer ones
    # have no earlier occurrence. As vLLM: 5 and 5 when neither is given, else the one given for both.
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None  # draft_model: the draft's Hugging Face directory
    # No drafts for steps of more sequences than this (where verifying costs more than it saves); None: any.
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method is None:
            object.__setattr__(self, "method", "draft_model" if self.model is not None else "ngram")
        if self.method in NOT_BUILT:
            raise ValueError(f"speculative_config method {self.method!r} is not supported here; "
                             f"supported: {', '.join(METHODS)}")
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {METHODS}, got {self.method!r}")
        _require_int(self.num_speculative_tokens, "num_speculative_tokens", 1, 64)
        if self.disable_by_batch_size is not None:
            _require_int(self.disable_by_batch_size, "disable_by_batch_size", 1, 1 << 20)
        if self.method == "draft_model":
            self._check_draft_model()
            return
        if self.model is not None:
            raise ValueError("speculative_config model names a draft model: use it with method 'draft_model'")
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            low = high = DEFAULT_PROMPT_LOOKUP
        object.__setattr__(self, "prompt_lookup_min", high if low is None else low)
        object.__setattr__(self, "prompt_lookup_max", low if high is None else high)
        _require_int(self.prompt_lookup_min, "prompt_lookup_min", 1, 64)
        _require_int(self.prompt_lookup_max, "prompt_lookup_max", 1, 64)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")

    def _check_draft_model(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("speculative_config method 'draft_model' needs model: the draft's model directory")
        if self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
            raise ValueError("speculative_config prompt_lookup_min/max apply to method 'ngram' only")

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict | str | None") -> "SpeculativeConfig | None":
        """From a dict (``LLM(speculative_config={...})``), its JSON (``--speculative-config``) or None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object / dict, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config key(s): {', '.join(unknown)}; known: "
                             f"{', '.join(sorted(known))}")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config needs num_speculative_tokens")
        return cls(**value)

    def to_json(self) -> str:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return json.dumps({k: v for k, v in values.items() if v is not None}, separators=(",", ":"))


def _require_int(value, name: str, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"speculative_config {name} must be an integer in [{low}, {high}], got {value!r}")
