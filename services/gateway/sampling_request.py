"""What an OpenAI completions or chat request shares (plus vLLM's extension fields): its sampling fields, checked
and turned into SamplingParams, its stream options, and its structured outputs, whichever field asks for them.

Fields OpenAI defines but the engine cannot honour either have a clear 400 (UNSUPPORTED) or are accepted
and ignored (user, metadata, ...: extra="allow"), but never where ignoring them would hand back an answer of
another kind than the one asked for. An explicit null means the field's default, as the openai client
sends null for a None argument.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from services.gateway.strict_input import Flag, check_text
from shared.generation_defaults import GenerationDefaults
from shared.invalid_parameter import InvalidParameter
from shared.request import PRIORITY_RANGE
from shared.sampling_params import SamplingParams, keep_last_tokens
from shared.structured_outputs import StructuredOutputs

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


def _null_is_default(cls, value: Any, info) -> Any:
    """A field validator: null stands for the field's default."""
    return cls.model_fields[info.field_name].default if value is None else value


class StreamOptions(BaseModel):
    include_usage: Flag = False
    continuous_usage_stats: Flag = False  # vLLM's: with include_usage, every chunk carries the usage so far

    _null = field_validator("include_usage", "continuous_usage_stats", mode="before")(classmethod(_null_is_default))


# vLLM's and OpenAI's fields that change what comes back, which this engine does not do: refused
# when given (not null), rather than answered with plain text.
UNSUPPORTED = {
    "logits_processors": "logits processors", "chat_template": "chat template for a completion (a chat's only)",
    "functions": "function calling", "function_call": "function calling",
}


class SamplingRequest(BaseModel):
    """What completions and chat share."""
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stream: Flag = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, description="None: up to the context length")
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: Flag | None = None
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None  # words never generated (tokenized when the request starts)
    # keep the prompt's last k tokens (-1: the context length), or its first k with truncation_side "right"
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None
    # each prompt token's logprob and the top k (-1: the whole vocabulary; whole responses only)
    prompt_logprobs: int | None = Field(None, ge=-1)
    skip_special_tokens: Flag | None = None
    include_stop_str_in_output: Flag | None = None
    # Beam search in the engine (an extension): the n best of beam_width beams, best first.
    use_beam_search: Flag | None = None
    beam_width: int | None = None
    length_penalty: float | None = None
    early_stopping: Flag | Literal["never"] | None = None
    spaces_between_special_tokens: Flag | None = None
    # vLLM's: logprobs name tokens "token_id:<id>" (None: as the gateway's --return-tokens-as-token-ids says)
    return_tokens_as_token_ids: Flag | None = None
    return_token_ids: Flag | None = None  # vLLM's: the prompt's and each choice's token ids in the answer
    cache_salt: str | None = Field(None, min_length=1, description="only requests with the same salt share "
                                                                    "prefix-cache blocks")
    priority: int = Field(0, ge=PRIORITY_RANGE[0], le=PRIORITY_RANGE[1],
                          description="vLLM's: with --scheduling-policy priority, lower values run first")
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs, or vLLM's older guided_* fields.
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    _PASSED = ("n", "temperature", "top_p", "presence_penalty", "frequency_penalty", "seed", "top_k", "min_p",
               "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "allowed_token_ids", "bad_words",
               "skip_special_tokens", "include_stop_str_in_output", "truncate_prompt_tokens", "use_beam_search",
               "beam_width", "length_penalty", "early_stopping", "spaces_between_special_tokens")

    # Completions' echo and chat's logprobs and template flags too (check_fields: declared below).
    _nulls = field_validator("n", "stream", "echo", "logprobs", "add_generation_prompt", "continue_final_message",
                             "include_reasoning", mode="before", check_fields=False)(classmethod(_null_is_default))

    # The fields that count logprobs per position, where -1 asks for the whole vocabulary (declared below).
    _LOGPROB_COUNTS = ("prompt_logprobs",)

    def check_text(self) -> None:
        """Every string is text (before anything parses or tokenizes one)."""
        check_text(self)

    def check_supported(self, unsupported: dict[str, str] = UNSUPPORTED) -> None:
        for name, value in (self.model_extra or {}).items():
            if name in unsupported and value is not None and not (name == "function_call" and value == "none"):
                raise InvalidParameter(f"{name} is not supported: this server does no {unsupported[name]}", name)
        if self.stream_options is not None and not self.stream:
            raise InvalidParameter("stream_options is only allowed with stream=true", "stream_options")
        if self.prompt_logprobs is not None and self.stream:
            raise InvalidParameter("prompt_logprobs come only in a whole response (stream=false)", "prompt_logprobs")

    def public_error(self, exc: InvalidParameter) -> InvalidParameter:
        """An error about an engine parameter, under the name this request's client gave the field."""
        return exc

    def count_whole_vocabulary(self, vocab_size: int, max_logprobs: int) -> None:
        """vLLM's -1 for a count of logprobs: the whole vocabulary, where the server's --max-logprobs allows
        that many (the field then holds the vocabulary's size)."""
        for name in self._LOGPROB_COUNTS:
            if getattr(self, name) != -1:
                continue
            if vocab_size > max_logprobs:
                raise InvalidParameter(f"{name}=-1 asks for the whole vocabulary ({vocab_size} tokens), more than this "
                                       f"server returns (at most {max_logprobs} per position: --max-logprobs)", name)
            setattr(self, name, vocab_size)

    def truncated(self, token_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt as the engine takes it: truncate_prompt_tokens of its tokens (-1: as many as the context
        holds), its last ones, or with vLLM's truncation_side "right" its first ones."""
        keep = max_model_len if self.truncate_prompt_tokens == -1 else self.truncate_prompt_tokens
        if self.truncation_side != "right" or keep is None or len(token_ids) <= keep:
            return keep_last_tokens(token_ids, self.truncate_prompt_tokens, max_model_len)
        return token_ids[:keep]

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None,
                        structured: StructuredOutputs | None = None,
                        defaults: GenerationDefaults = GenerationDefaults()) -> SamplingParams:
        """structured: a constraint of the request's own making (a forced tool call), else what it asked for.
        Fields the request leaves unset take the served model's defaults (shared/generation_defaults.py)."""
        self.check_supported()
        kwargs = defaults.applied({name: getattr(self, name) for name in self._PASSED if getattr(self, name) is not None})
        max_tokens = defaults.capped(max_tokens)
        try:
            bias = {int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None
        except ValueError:
            raise InvalidParameter("logit_bias keys must be token ids", "logit_bias") from None
        structured = structured or self.structured_outputs_asked()
        try:
            return SamplingParams(**kwargs, max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                                  stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
                                  logit_bias=bias, structured_outputs=structured)
        except ValueError as exc:
            raise InvalidParameter.from_params_error(exc) from None

    def structured_outputs_asked(self) -> StructuredOutputs | None:
        """The output's constraint, from whichever of the fields that ask for one was given (one at most)."""
        asked = {name: getattr(self, name) for name in _STRUCTURED_FIELDS if getattr(self, name) is not None}
        if (asked.get("response_format") or {}).get("type", "text") == "text":
            asked.pop("response_format", None)
        if len(asked) > 1:
            raise InvalidParameter(f"give one of {', '.join(asked)}: each asks for a structured output",
                                   next(iter(asked)))
        if not asked:
            return None
        (name, value), = asked.items()
        try:
            if name == "response_format":
                return _from_response_format(value)
            if name == "structured_outputs":
                if not isinstance(value, dict):
                    raise ValueError("structured_outputs must be an object")
                known = {k: v for k, v in value.items() if v is not None}
                return StructuredOutputs(**known)
            return StructuredOutputs(**{name.removeprefix("guided_"): value})
        except TypeError as exc:  # an unknown field of structured_outputs
            raise InvalidParameter(f"structured_outputs has an unknown field ({exc})", name) from None
        except ValueError as exc:
            raise InvalidParameter(str(exc).removeprefix("SamplingParams."), name) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats


_STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                      "guided_grammar")


def _from_response_format(response_format: dict) -> StructuredOutputs:
    """OpenAI's JSON mode ({"type": "json_object"}) or structured outputs ({"type": "json_schema",
    "json_schema": {"name": ..., "schema": {...}}})."""
    kind = response_format.get("type")
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or spec.get("schema") is None:
            raise ValueError("response_format json_schema needs json_schema.schema, the JSON schema to follow")
        return StructuredOutputs(json=spec["schema"])
    raise ValueError(f"response_format type {kind!r} is not supported; use 'text', 'json_object' or 'json_schema'")
