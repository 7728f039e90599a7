"""One engine request, as every layer passes it: the gateway builds it, the wire carries it, the
engine admits it and its sequences hold it (vLLM's EngineCoreRequest).

``validate`` is the one check of a request against what the model and its engine allow: the gateway
runs it on every prompt of a request before submitting any (all or nothing), the engine again at
admission (a request may come from a gateway of another configuration, or from the offline LLM).
Its errors are InvalidParameter, naming the field; the engine alone adds what only it can know (an
id in use, KV blocks).

Adding a field: declare it here, carry it in EngineRequest of protos/pagedserve_internal.proto (and
to_proto/from_proto below), check it in validate if it can be wrong, and read it where it is used.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from shared.invalid_parameter import InvalidParameter, require
from shared.lora import LoRARequest
from shared.multimodal import ImageInput, check_images
from shared.pooling import PoolerConfig, PoolingParams
from shared.proto import pagedserve_internal_pb2 as wire
from shared.resumption import Resumption
from shared.sampling_params import SamplingParams

PRIORITY_RANGE = (-(2 ** 31), 2 ** 31 - 1)  # what the wire's int32 holds


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One prompt's request to the engine; not to be changed once made (replace() makes another)."""

    request_id: str  # unique among the engine's requests in flight
    prompt_token_ids: list[int]  # the prompt, tokenized (and truncated) as the engine takes it
    params: SamplingParams = field(default_factory=SamplingParams)  # unused by an embedding request
    cache_salt: str | None = None  # only requests with the same salt share prefix-cache blocks
    # Submitted again after its scheduler or worker was lost: the sequences to carry on, with their tokens so far.
    resumption: Resumption | None = None
    lora: LoRARequest | None = None  # the adapter it runs with; None: the base model
    pooling: PoolingParams | None = None  # set: an embedding (or class scores) request of a pooling model
    priority: int = 0  # vLLM's: under --scheduling-policy priority, lower runs first (else only 0 is taken)
    arrival_time: float = field(default_factory=time.time)  # when it was made (time.time()); kept when resumed
    # The W3C trace context it runs under (shared/tracing.py: traceparent, tracestate); None: untraced.
    trace_context: dict[str, str] | None = None
    images: tuple[ImageInput, ...] = ()  # its prompt's images, in order (shared/multimodal.py)

    def to_proto(self) -> wire.EngineRequest:
        return wire.EngineRequest(
            request_id=self.request_id, prompt_token_ids=self.prompt_token_ids, params=self.params.to_proto(),
            cache_salt=self.cache_salt, resumed=self.resumption.to_proto() if self.resumption is not None else (),
            lora=self.lora.to_proto() if self.lora is not None else None,
            pooling=self.pooling.to_proto() if self.pooling is not None else None,
            priority=self.priority, arrival_time=self.arrival_time, trace_context=self.trace_context,
            images=[image.to_proto() for image in self.images])

    @classmethod
    def from_proto(cls, m: wire.EngineRequest) -> EngineRequest:
        """ValueError for a message whose fields do not make a request (the gateway checked the grammar)."""
        return cls(
            request_id=m.request_id, prompt_token_ids=list(m.prompt_token_ids),
            params=SamplingParams.from_proto(m.params, grammar_checked=True),
            cache_salt=m.cache_salt if m.HasField("cache_salt") else None,
            resumption=Resumption.from_proto(m.resumed),
            lora=LoRARequest.from_proto(m.lora) if m.HasField("lora") else None,
            pooling=PoolingParams.from_proto(m.pooling) if m.HasField("pooling") else None,
            priority=m.priority, arrival_time=m.arrival_time, trace_context=dict(m.trace_context) or None,
            images=tuple(ImageInput.from_proto(image) for image in m.images))


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What the served model and its engine allow a request (the scheduler reports each to gateways)."""

    max_model_len: int
    vocab_size: int
    max_logprobs: int
    max_num_seqs: int = 0  # the most sequences one request may have (n, or its beams); 0: not known here
    eos_token_ids: tuple[int, ...] = ()
    max_loras: int = 0  # 0: LoRA is not enabled
    priority_scheduling: bool = False  # --scheduling-policy priority: requests may carry a priority
    pooler: PoolerConfig | None = None  # set: a pooling model (embeddings or class scores, no generation)
    model_name: str | None = None  # how errors name the model
    image_token_id: int | None = None  # the placeholder of image features; None: the model takes no images
    # The most placeholders an image may have: one step computes each image whole (Gemma 3's images attend both
    # ways), within the step's token budget; None: any (chunks may end inside an image).
    max_image_tokens: int | None = None

    @property
    def model(self) -> str:
        return "this model" if self.model_name is None else f"the model `{self.model_name}`"


def validate(request: EngineRequest, limits: RequestLimits) -> None:
    """InvalidParameter, naming the field, unless the model could serve the request."""
    check_runner(request.pooling, limits)
    if request.lora is not None and not limits.max_loras:
        raise InvalidParameter(f"LoRA adapter {request.lora.name!r} was asked for, but LoRA is not enabled: start "
                               "the worker with --enable-lora (LLM(enable_lora=True))", "lora")
    require(request.cache_salt is None or request.cache_salt, "cache_salt",
            "must not be empty: leave it out for no salt")
    require(request.priority == 0 or limits.priority_scheduling, "priority",
            f"is {request.priority!r}, but priority scheduling is not enabled (--scheduling-policy priority): "
            "requests are served first come, first served")
    require(type(request.priority) is int and PRIORITY_RANGE[0] <= request.priority <= PRIORITY_RANGE[1], "priority",
            f"must be an integer in [{PRIORITY_RANGE[0]}, {PRIORITY_RANGE[1]}], got {request.priority!r}")
    check_images(request.images, request.prompt_token_ids, limits.image_token_id, limits.max_image_tokens)
    if request.pooling is not None:
        _check_pooling(request, limits)
    else:
        _check_generation(request, limits)


def check_runner(pooling: PoolingParams | None, limits: RequestLimits) -> None:
    """Embeddings and class scores only from a pooling model, each from its own kind; generation only from the
    others (the gateway asks before it tokenizes anything)."""
    pooler = limits.pooler
    if pooling is None and pooler is not None:
        raise InvalidParameter(f"{limits.model} is a pooling model ({_kind(pooler)}): it serves {_served(pooler)}, "
                               "not generation", "model")
    if pooling is not None and pooler is None:
        kind = "class scores" if pooling.task == "classify" else "embeddings"
        raise InvalidParameter(f"{limits.model} generates text and serves no {kind}: start its worker with "
                               "--runner pooling (LLM(runner='pooling')) for a pooling model", "model")
    if pooling is not None and pooling.task not in (None, pooler.task):
        raise InvalidParameter(f"{limits.model} is {_kind(pooler)}: it serves the {pooler.task} task, not "
                               f"{pooling.task}: {_served(pooler)}", "model")


def check_token_ids(token_ids: list[int], vocab_size: int) -> None:
    """A prompt given as token ids stays inside the vocabulary (checked before anything decodes it)."""
    bad = next((t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidParameter(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab_size})", "prompt")


def _kind(pooler: PoolerConfig) -> str:
    return "a classifier" if pooler.classifies else "an embedding model"


def _served(pooler: PoolerConfig) -> str:
    return "class scores only (/classify, /score, /rerank, LLM.classify)" if pooler.classifies else \
        "embeddings only (/v1/embeddings, /score, /rerank, LLM.embed)"


def _check_prompt(prompt: list[int], vocab_size: int) -> None:
    if not prompt:
        raise InvalidParameter("the prompt is empty: give at least one token", "prompt")
    check_token_ids(prompt, vocab_size)


def _check_pooling(request: EngineRequest, limits: RequestLimits) -> None:
    """An embedding request's prompt may fill the whole context: it needs no room for an output token."""
    prompt = request.prompt_token_ids
    _check_prompt(prompt, limits.vocab_size)
    if len(prompt) > limits.max_model_len:
        raise InvalidParameter(f"the prompt has {len(prompt)} tokens, but the context length is "
                               f"{limits.max_model_len}: shorten it, or set truncate_prompt_tokens", "prompt")
    try:
        request.pooling.check_fits(limits.pooler)
    except ValueError as exc:  # (the task matched: what is left is dimensions)
        raise InvalidParameter(str(exc), "dimensions") from None
    require(request.resumption is None, "resumption",
            "is not for an embedding request: it has one output, so it starts over")


def _check_generation(request: EngineRequest, limits: RequestLimits) -> None:
    params, prompt = request.params, request.prompt_token_ids
    if limits.max_num_seqs:  # first: a front builds per-sequence state after this check
        params.check_sequences_fit(limits.max_num_seqs)
    _check_prompt(prompt, limits.vocab_size)
    if (outside := params.token_id_outside(limits.vocab_size)) is not None:
        name, bad = outside
        raise InvalidParameter(f"token id {bad} in {name} is outside the vocabulary [0, {limits.vocab_size})", name)
    params.check_truncation_fits(limits.max_model_len)
    params.check_a_token_allowed(limits.eos_token_ids)
    _check_context(len(prompt), params, limits.max_model_len)
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > limits.max_logprobs:
            raise InvalidParameter(f"{name}={value} exceeds the maximum of {limits.max_logprobs}", name)
    if request.resumption is not None:
        _check_resumption(request.resumption, len(prompt), params, limits)


def _check_context(prompt_len: int, params: SamplingParams, max_model_len: int) -> None:
    """The prompt and the output it asks for fit the context."""
    if prompt_len >= max_model_len:
        raise InvalidParameter(f"the prompt has {prompt_len} tokens, but the context length is {max_model_len}: it "
                               "must be shorter, to leave room for at least one output token", "prompt")
    for name in ("max_tokens", "min_tokens"):
        count = getattr(params, name)
        if count is not None and prompt_len + count > max_model_len:
            raise InvalidParameter(f"the prompt ({prompt_len} tokens) + {name} ({count}) = {prompt_len + count} tokens "
                                   f"exceeds the context length of {max_model_len} tokens: shorten the prompt or "
                                   f"lower {name}", name)


def max_output_tokens(prompt_len: int, params: SamplingParams, max_model_len: int) -> int:
    """The most tokens a sequence of the request may generate: max_tokens, capped by the context."""
    room = max_model_len - prompt_len
    return room if params.max_tokens is None else min(room, params.max_tokens)


def _check_resumption(resumption: Resumption, prompt_len: int, params: SamplingParams,
                      limits: RequestLimits) -> None:
    if params.use_beam_search:
        raise InvalidParameter("a beam search cannot be resumed (its beams are chosen at its end): submit it again",
                               "resumption")
    max_output = max_output_tokens(prompt_len, params, limits.max_model_len)
    for index, output in resumption.outputs.items():
        if index >= params.n:
            raise InvalidParameter(f"resumed sequence {index} is not one of the request's n={params.n}", "resumption")
        bad = next((t for t in output if not 0 <= t < limits.vocab_size), None)
        if bad is not None:
            raise InvalidParameter(f"resumed sequence {index}'s token id {bad} is outside the vocabulary "
                                   f"[0, {limits.vocab_size})", "resumption")
        if len(output) >= max_output:
            raise InvalidParameter(f"resumed sequence {index} has {len(output)} output tokens already, as many as it "
                                   f"may have ({max_output}): it had finished", "resumption")
