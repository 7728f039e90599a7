"""Sampling parameters of one request, validated on construction.

Field names and meanings follow vLLM's ``SamplingParams`` so its users feel at
home. Checks that need the model (vocabulary size, context length) happen at
admission, in the engine; everything checkable alone is checked here.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from dataclasses import dataclass, field

from shared.generation_defaults import GenerationDefaults
from shared.invalid_parameter import require
from shared.structured_outputs import StructuredOutputs

# OpenAI caps top logprobs at 20; so do we (per position, sampled token excluded).
MAX_LOGPROBS = 20
# The wire's float fields are float32: smaller magnitudes would arrive as 0, larger as infinity.
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32
FLOAT32_MAX = 3.4028234663852886e38


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1  # output sequences per request
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int | None = None  # keep the k most likely tokens; None, 0 or -1 keep all
    min_p: float = 0.0  # drop tokens below min_p * p(most likely)
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # CTRL-style, over prompt and generated tokens
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    allowed_token_ids: list[int] | None = None  # only these may be sampled (None: any)
    bad_words: list[str] | None = None  # vLLM's: words never generated (see with_bad_words_tokenized)
    bad_words_token_ids: list[list[int]] | None = None  # their token sequences: set by the front end
    seed: int | None = None  # same seed, same output, whatever shares the batch
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many
    stop: list[str] = field(default_factory=list)  # stop strings (checked on text)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top logprobs per generated token (0: the sampled one only)
    prompt_logprobs: int | None = None  # the same for every prompt token
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens (-1: the context length)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    use_beam_search: bool = False  # beam search in the engine; returns the n best beams, best first
    beam_width: int | None = None  # beams kept per step (default: n)
    length_penalty: float = 1.0  # beam score = sum of logprobs / generated_length ** length_penalty
    early_stopping: bool | str = False  # True, False or "never", as in transformers
    # The output held to a JSON schema, a regex, a choice or a grammar (a dict of the same fields works too).
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        for name in self._INTS + self._FLOATS:  # numpy and torch scalars as Python numbers (the wire wants them)
            object.__setattr__(self, name, _plain_number(getattr(self, name), int if name in self._INTS else float))
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", [self.stop])
        _check(isinstance(self.stop or [], (list, tuple)), "stop", f"must be a string or a list of them, got {self.stop!r}")
        object.__setattr__(self, "stop", list(self.stop or []))
        ids = self.stop_token_ids if self.stop_token_ids is not None else []
        _check(not isinstance(ids, (str, bytes, dict)) and getattr(ids, "ndim", 1) == 1 and hasattr(ids, "__iter__"),
               "stop_token_ids", f"must be a list of token ids, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", [_plain_number(t, int) for t in ids])
        if self.top_k in (0, -1):
            object.__setattr__(self, "top_k", None)
        if isinstance(self.structured_outputs, dict):
            try:
                object.__setattr__(self, "structured_outputs", StructuredOutputs(**self.structured_outputs))
            except TypeError as exc:
                raise ValueError(f"SamplingParams.structured_outputs has an unknown field: {exc}") from None
        _check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputs),
               "structured_outputs", f"must be a StructuredOutputs (or a dict of its fields), "
                                     f"got {type(self.structured_outputs).__name__}")
        if self.allowed_token_ids is not None:
            allowed = self.allowed_token_ids
            _check(not isinstance(allowed, (str, bytes, dict)) and getattr(allowed, "ndim", 1) == 1
                   and hasattr(allowed, "__iter__"), "allowed_token_ids",
                   f"must be a list of token ids, got {allowed!r}")
            object.__setattr__(self, "allowed_token_ids", [_plain_number(t, int) for t in allowed])
        if self.logit_bias is not None:
            try:
                bias = {int(k): float(v) for k, v in dict(self.logit_bias).items()}
            except (TypeError, ValueError):
                bias = None
            _check(bias is not None, "logit_bias", f"must map token ids to numbers, got {self.logit_bias!r}")
            object.__setattr__(self, "logit_bias", bias)
        self._validate()

    def _validate(self) -> None:
        _check(_is_int(self.n) and self.n >= 1, "n", f"must be an integer >= 1, got {self.n!r}")
        _check(_is_number(self.temperature) and self.temperature >= 0, "temperature",
               f"must be a number >= 0, got {self.temperature!r}")
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p",
               f"must be in (0, 1], got {self.top_p!r}")
        _check(self.top_k is None or (_is_int(self.top_k) and self.top_k >= 1), "top_k",
               f"must be a positive integer (or 0 / -1 / None to disable), got {self.top_k!r}")
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p",
               f"must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -2 <= value <= 2, name, f"must be in [-2, 2], got {value!r}")
        _check(_is_number(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
               f"must be > 0, got {self.repetition_penalty!r}")
        _check(self.seed is None or _is_int(self.seed), "seed", f"must be an integer, got {self.seed!r}")
        _check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1), "max_tokens",
               f"must be an integer >= 1, got {self.max_tokens!r}")
        _check(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens",
               f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens",
                   f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        _check(self.truncate_prompt_tokens is None or (_is_int(self.truncate_prompt_tokens) and
                                                        (self.truncate_prompt_tokens >= 1 or
                                                         self.truncate_prompt_tokens == -1)),
               "truncate_prompt_tokens", f"must be an integer >= 1, or -1 (the context length), "
                                         f"got {self.truncate_prompt_tokens!r}")
        for name in ("logprobs", "prompt_logprobs"):  # the engine caps them (max_logprobs, 20 by default)
            value = getattr(self, name)
            _check(value is None or (_is_int(value) and value >= 0), name,
                   f"must be an integer >= 0, got {value!r}")
        # The beam fields are checked even without use_beam_search: a bad value is a bad request either way.
        _check(self.beam_width is None or (_is_int(self.beam_width) and self.beam_width >= 1), "beam_width",
               f"must be an integer >= 1, got {self.beam_width!r}")
        _check(self.early_stopping in (True, False, "never"), "early_stopping",
               f"must be True, False or 'never', got {self.early_stopping!r}")
        _check(_is_number(self.length_penalty), "length_penalty", f"must be a number, got {self.length_penalty!r}")
        if self.use_beam_search:
            width = self.beam_width if self.beam_width is not None else self.n
            _check(self.n <= width, "n", f"({self.n}) must not exceed beam_width ({width})")
            # Beams are ranked by the model's own log-probabilities: nothing that reshapes them applies (nor
            # prompt logprobs, which a beam request does not return).
            reshaped = [name for name, default in self._NOT_FOR_BEAMS if getattr(self, name) != default]
            _check(not reshaped, "use_beam_search", f"cannot be combined with {', '.join(reshaped)}")
        if self.structured_outputs is not None:  # a grammar may allow only EOS while min_tokens bans it
            _check(self.min_tokens == 0, "structured_outputs", "cannot be combined with min_tokens")
        for name, (low, high) in self._WIRE_RANGES.items():  # beyond them, the wire could not carry the value
            value = getattr(self, name)
            _check(value is None or not _is_int(value) or low <= value <= high, name,
                   f"must be in [{low}, {high}], got {value!r}")
        for name in self._FLOATS:  # what the float32 wire field would turn into 0 or infinity
            value = getattr(self, name)
            _check(value == 0 or FLOAT32_TINY <= abs(value) <= FLOAT32_MAX, name,
                   f"must be 0 or of magnitude in [{FLOAT32_TINY:.3g}, {FLOAT32_MAX:.3g}] (a float32), got {value!r}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        _check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               "must be non-negative integers")
        if self.allowed_token_ids is not None:
            _check(len(self.allowed_token_ids) > 0 and all(_is_int(t) and t >= 0 for t in self.allowed_token_ids),
                   "allowed_token_ids", "must be a non-empty list of non-negative token ids")
            _check(self.structured_outputs is None, "allowed_token_ids",
                   "cannot be combined with structured_outputs (together they may allow no token at all)")
        self._check_bad_words()
        if self.logit_bias is not None:
            for token, bias in self.logit_bias.items():
                _check(token >= 0, "logit_bias", f"token id {token} is negative")
                _check(-100 <= bias <= 100, "logit_bias", f"bias {bias} for token {token} is outside [-100, 100]")

    def _check_bad_words(self) -> None:
        if self.bad_words is not None:
            _check(isinstance(self.bad_words, (list, tuple)) and all(isinstance(w, str) and w.strip()
                                                                     for w in self.bad_words),
                   "bad_words", "must be a list of non-blank strings")
            object.__setattr__(self, "bad_words", list(self.bad_words) or None)
        if self.bad_words_token_ids is not None:
            ids = self.bad_words_token_ids
            _check(isinstance(ids, (list, tuple)) and all(isinstance(w, (list, tuple)) and w and all(
                _is_int(t) and t >= 0 for t in w) for w in ids), "bad_words_token_ids",
                "must be a list of non-empty lists of token ids")
            object.__setattr__(self, "bad_words_token_ids", [list(w) for w in ids] or None)

    def with_bad_words_tokenized(self, encode) -> "SamplingParams":
        """These params with bad_words as token sequences (``encode``: text -> ids, no special tokens), as
        vLLM makes them: each word as it reads at the text's start, and with a space before it, where that
        is another token sequence of the same length (the word inside the text)."""
        if not self.bad_words or self.bad_words_token_ids is not None:
            return self
        sequences: list[list[int]] = []
        for word in self.bad_words:
            alone = list(encode(word.lstrip()))
            spaced = list(encode(" " + word.lstrip()))
            sequences.append(alone)
            if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
                sequences.append(spaced)
        return dataclasses.replace(self, bad_words_token_ids=sequences)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def num_beams(self) -> int:
        return (self.beam_width or self.n) if self.use_beam_search else 0

    def truncated(self, prompt_token_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt as the engine takes it: its last truncate_prompt_tokens tokens (applied where
        prompts are tokenized, so that usage and echo count the tokens the model sees)."""
        return keep_last_tokens(prompt_token_ids, self.truncate_prompt_tokens, max_model_len)

    def check_truncation_fits(self, max_model_len: int) -> None:
        _check(self.truncate_prompt_tokens is None or self.truncate_prompt_tokens <= max_model_len,
               "truncate_prompt_tokens", f"({self.truncate_prompt_tokens}) exceeds the context length "
                                         f"({max_model_len}); use -1 for as many tokens as the context holds")

    def check_a_token_allowed(self, eos_token_ids) -> None:
        """allowed_token_ids must leave a token that min_tokens does not ban (the EOS ids are the model's)."""
        if self.allowed_token_ids is None or self.min_tokens == 0:
            return
        stops = set(self.stop_token_ids) | (set() if self.ignore_eos else set(eos_token_ids))
        _check(not set(self.allowed_token_ids) <= stops, "allowed_token_ids",
               "allows only stop tokens (EOS or stop_token_ids), which min_tokens bans: no token could be sampled")

    def check_sequences_fit(self, max_num_seqs: int) -> None:
        """A request's sequences (n samples, or its beams) decode side by side: more than an engine's
        max_num_seqs never could, and building that many would only take its memory."""
        named_width = self.use_beam_search and self.beam_width is not None
        name, count = ("beam_width", self.num_beams) if named_width else ("n", self.num_beams or self.n)
        _check(count <= max_num_seqs, name, f"({count}) exceeds the engine's max_num_seqs ({max_num_seqs}): a "
                                            "request's sequences must be able to run together")

    # The numeric fields (the floats are float32 on the wire).
    _INTS = ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "beam_width",
             "truncate_prompt_tokens")
    _WIRE_RANGES = {name: (-(1 << 31), (1 << 31) - 1) for name in ("top_k", "truncate_prompt_tokens")} | \
        {"seed": (-(1 << 63), (1 << 63) - 1)} | \
        {name: (0, (1 << 32) - 1) for name in ("n", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs",
                                               "beam_width")}
    _FLOATS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
               "length_penalty")
    _NOT_FOR_BEAMS = (("seed", None), ("min_tokens", 0), ("logit_bias", None), ("allowed_token_ids", None),
                      ("bad_words", None),
                      ("top_p", 1.0), ("top_k", None),
                      ("min_p", 0.0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                      ("repetition_penalty", 1.0), ("prompt_logprobs", None), ("structured_outputs", None))

    # --- wire form (pagedserve.api.v1.SamplingParameters) ---------------------------------------

    _SCALARS = ("n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                "repetition_penalty", "seed", "max_tokens", "min_tokens", "include_stop_str_in_output",
                "ignore_eos", "logprobs", "prompt_logprobs", "skip_special_tokens", "use_beam_search", "beam_width",
                "length_penalty", "truncate_prompt_tokens")

    def to_proto(self):
        from shared.proto import pagedserve_api_pb2 as api

        message = api.SamplingParameters(stop=self.stop, stop_token_ids=self.stop_token_ids,
                                         logit_bias=self.logit_bias or {},
                                         allowed_token_ids=self.allowed_token_ids or [],
                                         bad_words=self.bad_words or [],
                                         bad_words_token_ids=[api.TokenIds(ids=w) for w in self.bad_words_token_ids or []])
        for name in self._SCALARS:
            value = getattr(self, name)
            if value is not None:
                setattr(message, name, value)
        if self.use_beam_search:
            message.early_stopping = str(self.early_stopping).lower()
        if self.structured_outputs is not None:
            message.structured_outputs.CopyFrom(self.structured_outputs.to_proto())
        return message

    @classmethod
    def from_proto(cls, message, grammar_checked: bool = False,
                   defaults: GenerationDefaults = GenerationDefaults()) -> "SamplingParams":
        """Unset fields take the defaults (the served model's, where the gateway reads a client's message;
        max_tokens: up to the context); values are validated as on construction (a structured output's
        grammar, unless the sender checked it: gateway -> scheduler -> worker)."""
        kwargs = defaults.applied({name: getattr(message, name) for name in cls._SCALARS if message.HasField(name)})
        kwargs["max_tokens"] = defaults.capped(kwargs.get("max_tokens"))  # unset on the wire: up to the context
        if message.HasField("early_stopping"):
            kwargs["early_stopping"] = {"true": True, "false": False}.get(message.early_stopping,
                                                                          message.early_stopping)
        for name in cls._FLOATS:
            if name in kwargs:  # float32 on the wire: 0.1 must come back as 0.1
                kwargs[name] = float(f"{kwargs[name]:.7g}")
        if message.HasField("structured_outputs"):
            kwargs["structured_outputs"] = StructuredOutputs.from_proto(message.structured_outputs,
                                                                        check_grammar=not grammar_checked)
        return cls(**kwargs, stop=list(message.stop), stop_token_ids=list(message.stop_token_ids),
                   logit_bias={int(k): float(f"{v:.7g}") for k, v in message.logit_bias.items()} or None,
                   allowed_token_ids=list(message.allowed_token_ids) or None,
                   bad_words=list(message.bad_words) or None,
                   bad_words_token_ids=[list(w.ids) for w in message.bad_words_token_ids] or None)

    def token_id_outside(self, vocab_size: int) -> tuple[str, int] | None:
        """The first token id this request names beyond the vocabulary, with the field naming it."""
        for name, token_ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", self.logit_bias or ()),
                                ("allowed_token_ids", self.allowed_token_ids or ()),
                                ("bad_words", [t for w in self.bad_words_token_ids or () for t in w])):
            bad = next((t for t in token_ids if t >= vocab_size), None)
            if bad is not None:
                return name, bad
        return None


def keep_last_tokens(token_ids: list[int], truncate_prompt_tokens: int | None, max_model_len: int) -> list[int]:
    """The last truncate_prompt_tokens of the ids (-1: max_model_len of them; None: all)."""
    keep = max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
    if keep is None or len(token_ids) <= keep:
        return token_ids
    return token_ids[len(token_ids) - keep:]


def _plain_number(value: object, kind: type) -> object:
    """A numpy or torch scalar (or a Python number) as a Python int or float; anything else as it is."""
    if isinstance(value, bool) or type(value).__name__ in ("bool", "bool_"):
        return value
    if kind is int and isinstance(value, numbers.Integral):
        return int(value)
    if kind is float and isinstance(value, numbers.Real):
        return float(value)
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # a 0-d array or tensor
        return _plain_number(value.item(), kind)
    return value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


# Its errors say which object refused: "SamplingParams.<name> ..." (InvalidParameter names the field too).
_check = functools.partial(require, owner="SamplingParams")
