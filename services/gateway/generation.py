"""The generation core shared by the OpenAI HTTP API and the public gRPC API.

It learns the model from the scheduler (lazily, so the gateway starts before its
backend), tokenizes and validates prompts, submits each prompt as one engine
request, and turns the engine's token ids into text deltas per sequence: an
IncrementalDetokenizer per sequence applies stop strings: a sequence that hits one is ended at
the scheduler, freeing its KV blocks while its siblings run on, and once every sequence of a
request has stopped the request is cancelled on the Session stream, which aborts the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from services.gateway.api_keys import ApiKey
from services.gateway.lora_modules import LoRAModule, adapters_for
from services.gateway.metrics import GatewayMetrics
from services.gateway.rate_limits import RateLimiter, Reservation
from services.gateway.resumption import Resubmission, ResumePolicy, Resumer
from services.gateway.scheduler_client import SessionLost, SubmitStream
from services.gateway.scheduler_pool import SchedulerPool
from services.gateway.reasoning_parsers import ReasoningParser
from services.gateway.tool_parsers import ToolCallParser
from shared.detokenizer import IncrementalDetokenizer
from shared.grpc_errors import NotFound, ResourceExhausted, ServiceUnavailable
from shared.logging import setup_logging
from shared.lora import LoRARequest
from shared.pooling import PoolerConfig, PoolingParams
from shared.resumption import Resumption
from shared.sampling_params import SamplingParams
from shared.tokenizer import load_tokenizer, render_chat
from shared.wire_version import check_peer_version

log = setup_logging("gateway")


class InvalidParameter(ValueError):
    """A request error that names the offending parameter (the OpenAI error's `param`)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param

    @classmethod
    def from_params_error(cls, exc: ValueError, param: str | None = None) -> "InvalidParameter":
        """SamplingParams' and PoolingParams' "<class>.<name> must ..." errors name the parameter (unless
        ``param`` says which)."""
        text = str(exc)
        for prefix in ("SamplingParams.", "PoolingParams."):
            if text.startswith(prefix):
                message = text.removeprefix(prefix)
                return cls(message, param or message.split(" ", 1)[0])
        return cls(text, param)


class Overloaded(ResourceExhausted):
    """More requests in flight than --max-concurrent-requests allows."""


def new_request_id(prefix: str = "req") -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# --- what a run yields --------------------------------------------------------------------------


@dataclass(slots=True)
class TopToken:
    token_id: int
    token: str
    logprob: float


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    rank: int
    top: list[TopToken]
    text_offset: int = 0  # where this token's text starts in the sequence's output text


@dataclass(slots=True)
class SeqDelta:
    """New output of one sequence since its last delta."""
    index: int  # the sequence's index within its prompt's n
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop", "length" or "abort" in the sequence's last delta
    stop_reason: int | str | None = None
    position: int = 0  # which of the request's prompts (its Run's position)


# --- the model, as the scheduler reports it ---------------------------------------------------------


@dataclass(slots=True)
class Model:
    name: str
    max_model_len: int
    vocab_size: int
    max_logprobs: int
    tokenizer: object
    max_num_seqs: int = 0  # per request (n, beams); 0: the scheduler did not say
    tool_parser: ToolCallParser | None = None  # how its tool calls are told from text (--tool-call-parser)
    eos_token_ids: tuple[int, ...] = ()
    adapters: dict[str, LoRAModule] = field(default_factory=dict)  # --lora-modules, by the name clients use
    trust_request_chat_template: bool = False  # a request may bring its own chat template
    pooler: PoolerConfig | None = None  # set: the engine runs a pooling model (embeddings, no generation)
    reasoning_parser: ReasoningParser | None = None  # how its reasoning is told from its answer (--reasoning-parser)
    aliases: tuple[str, ...] = ()  # other names it answers to (--served-model-name's after the first)
    path: str | None = None  # where the scheduler's model comes from (its card's root, as vLLM's)
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:<id>" unless a request says
    _token_strings: dict[int, str] = field(default_factory=dict)

    def resolve(self, requested: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names (None: the model itself, also when it names none)."""
        if not requested or requested in self.names:
            return None
        module = self.adapters.get(requested)
        if module is None:
            served = ", ".join(f"`{name}`" for name in [*self.names, *self.adapters])
            raise NotFound(f"The model `{requested}` does not exist; this server serves {served}.")
        return module.lora

    @property
    def names(self) -> tuple[str, ...]:
        """The names it is served under: the first is the one answers carry."""
        return (self.name, *self.aliases)

    def check_name(self, requested: str | None) -> None:
        self.resolve(requested)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    def encode_chat(self, messages: list[dict], chat_template: str | None = None,
                    **template_options) -> tuple[str, list[int]]:
        if chat_template is not None and not self.trust_request_chat_template:
            # As vLLM's: a template is code the gateway runs (sandboxed Jinja), so the operator opts in.
            raise InvalidParameter("a chat_template per request is refused unless the gateway runs with "
                                   "--trust-request-chat-template", "chat_template")
        # As the offline LLM.chat does: the template already holds any special tokens.
        text = render_chat(self.tokenizer, messages, chat_template=chat_template, **template_options)
        return text, self.encode(text, add_special_tokens=False)

    def encode_input(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """An embedding input's tokens: lowercased first where the pooling model says (do_lower_case)."""
        return self.encode(self.pooler.text(text) if self.pooler is not None else text, add_special_tokens)

    def encode_pair(self, text_1: str, text_2: str, limit: int | None = None) -> list[int]:
        """A cross-encoder's input: the two texts tokenized together, as the tokenizer joins a pair; at most
        ``limit`` tokens, the longer text trimmed to fit."""
        return list(self.tokenizer(self.pooler.text(text_1), self.pooler.text(text_2), truncation=limit is not None,
                                   max_length=limit).input_ids)

    def answer_name(self, lora: LoRARequest | None) -> str:
        """The model an answer names: the adapter's, when the request ran with one."""
        return lora.name if lora is not None else self.name

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    def vocabulary_strings(self, token_ids: list[int]) -> list[str]:
        """The tokens as the vocabulary spells them ("Ġthe" for " the" in byte-level BPE), as vLLM's /tokenize."""
        return list(self.tokenizer.convert_ids_to_tokens(token_ids))

    def token_string(self, token_id: int) -> str:
        text = self._token_strings.get(token_id)
        if text is None:
            text = self._token_strings[token_id] = self.tokenizer.decode([token_id])
        return text

    def check_token_ids(self, token_ids: list[int]) -> None:
        """A prompt given as token ids must stay inside the vocabulary (before anything decodes it)."""
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidParameter(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})", "prompt")

    def check_prompt(self, prompt: list[int], params: SamplingParams) -> None:
        """What the scheduler would refuse, checked here so a multi-prompt request is all or nothing
        (and before a run builds a detokenizer per sequence)."""
        try:
            if self.max_num_seqs:
                params.check_sequences_fit(self.max_num_seqs)
            params.check_truncation_fits(self.max_model_len)
            params.check_a_token_allowed(self.eos_token_ids)
        except ValueError as exc:
            raise InvalidParameter.from_params_error(exc) from None
        if not prompt:
            raise InvalidParameter("the prompt is empty: give at least one token", "prompt")
        self.check_token_ids(prompt)
        if len(prompt) >= self.max_model_len:
            raise InvalidParameter(f"This model's maximum context length is {self.max_model_len} tokens, "
                                   f"but the prompt has {len(prompt)} tokens; it must leave room for at least "
                                   "one output token.", "prompt")
        if params.max_tokens is not None and len(prompt) + params.max_tokens > self.max_model_len:
            raise InvalidParameter(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{len(prompt) + params.max_tokens} tokens ({len(prompt)} in the prompt, {params.max_tokens} "
                "for the completion). Please reduce the prompt or max_tokens.", "max_tokens")
        if len(prompt) + params.min_tokens > self.max_model_len:
            raise InvalidParameter(f"This model's maximum context length is {self.max_model_len} tokens, but the "
                                   f"prompt ({len(prompt)} tokens) + min_tokens ({params.min_tokens}) exceed it.",
                                   "min_tokens")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.max_logprobs:
                raise InvalidParameter(f"{name}={value} exceeds the maximum of {self.max_logprobs}", name)
        if (outside := params.token_id_outside(self.vocab_size)) is not None:
            name, bad = outside
            raise InvalidParameter(f"token id {bad} in {name} is outside the vocabulary [0, {self.vocab_size})", name)

    def check_runner(self, pooling: PoolingParams | None) -> None:
        """Embeddings only from a pooling model, generation only from the others; ``dimensions`` as it allows."""
        if pooling is None and self.pooler is not None:
            raise InvalidParameter(f"The model `{self.name}` is {'a classifier' if self.pooler.classifies else 'an embedding'} "
                                   f"(pooling) model: it serves {'/classify' if self.pooler.classifies else '/v1/embeddings'}"
                                   ", /score and /rerank, not generation.", "model")
        if pooling is not None and self.pooler is None:
            kind = "class scores" if pooling.task == "classify" else "embeddings"
            raise InvalidParameter(f"The model `{self.name}` generates text and serves no {kind}: run its worker "
                                   "with --runner pooling for a pooling model.", "model")
        if pooling is not None and pooling.task != self.pooler.task:
            raise InvalidParameter(
                f"The model `{self.name}` is a classifier: it serves /classify, /score and /rerank, not embeddings."
                if self.pooler.classifies else
                f"The model `{self.name}` is an embedding model: it serves /v1/embeddings, /score and /rerank, "
                "not classification.", "model")
        if pooling is not None:
            try:
                pooling.check_fits(self.pooler)
            except ValueError as exc:
                raise InvalidParameter.from_params_error(exc, "dimensions") from None

    def check_embedding_prompt(self, prompt: list[int]) -> None:
        """What the scheduler would refuse of an embedding input (it needs no room for output tokens)."""
        if not prompt:
            raise InvalidParameter("an input is empty: give at least one token", "input")
        self.check_token_ids(prompt)
        if len(prompt) > self.max_model_len:
            raise InvalidParameter(f"This model's maximum context length is {self.max_model_len} tokens, but an "
                                   f"input has {len(prompt)} tokens; shorten it, or set truncate_prompt_tokens.",
                                   "input")

    def logprob(self, position, text_offset: int = 0) -> TokenLogprob:
        top = [TopToken(t, self.token_string(t), _finite(lp))
               for t, lp in zip(position.top_token_ids, position.top_logprobs)]
        return TokenLogprob(position.token_id, self.token_string(position.token_id), _finite(position.logprob),
                            position.rank, top, text_offset)


def _finite(logprob: float) -> float:
    """As vLLM's: -inf (a token the model rules out) as -9999, which JSON can carry."""
    return max(logprob, -9999.0)


# --- one engine request ---------------------------------------------------------------------------


class Run:
    """One prompt's engine request: iterate it for SeqDeltas; leaving early aborts it. With a
    resumer, a run whose scheduler is lost goes on at another (or the same one, back)."""

    def __init__(self, model: Model, stream: SubmitStream, request_id: str, prompt: list[int],
                 params: SamplingParams, metrics: GatewayMetrics, position: int = 0,
                 resumer: Resumer | None = None, cache_salt: str | None = None, lora: LoRARequest | None = None,
                 pooling: PoolingParams | None = None):
        self.model, self.request_id, self.prompt, self.params = model, request_id, prompt, params
        self.lora = lora  # the adapter it runs with; None: the model itself
        # An embedding request's: its one output (start() waits for it) carries the embedding.
        self.pooling = pooling
        self.embedding: list[float] | None = None
        self.position = position  # which of the request's prompts this is
        self._stream, self._metrics = stream, metrics
        self._resumer, self._cache_salt = resumer, cache_salt
        self.resumes = 0  # times this run was submitted again after losing its scheduler
        self.finish_reasons: list[str] = []  # its sequences' as they end ("stop", "length", "abort")
        self._recorded = False  # its end is in the metrics (by __aiter__'s end, once it was read)
        self._read = False
        self._aborted = False  # the client's Abort: a resumption stops
        self._outputs: list[list[int]] = [[] for _ in range(params.n)]  # each sequence's tokens so far
        self._skip_prompt_logprobs = 0  # a run started over sends the prompt logprobs already passed on again
        self._first = None
        self._detoks = [IncrementalDetokenizer(model.tokenizer, prompt, stop=params.stop,
                                               skip_special_tokens=params.skip_special_tokens,
                                               include_stop_str_in_output=params.include_stop_str_in_output,
                                               min_tokens=params.min_tokens)
                        for _ in range(params.n)]
        self._done = [False] * params.n
        self._last_tokens_at: list[float | None] = [None] * params.n  # each sequence's latest tokens' arrival
        self.completion_tokens = 0
        self.cached_tokens = 0  # prompt tokens the prefix cache held (known from the first output on)
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self._started = time.perf_counter()
        self._first_output_s: float | None = None  # submit to first output (start())

    @property
    def finished(self) -> bool:
        return all(self._done)

    def cancel(self) -> None:
        self._stream.cancel()

    def abort(self) -> None:
        """Abort at the scheduler; iterating goes on to the sequences' ends, as "abort" (the Abort RPC)."""
        self._aborted = True
        self._stream.abort()

    async def start(self) -> None:
        """Wait for the first output, so admission errors surface before any response is sent."""
        try:
            self._first = await self._next()
        except BaseException:
            self.cancel()
            raise
        self._first_output_s = time.perf_counter() - self._started
        if self.pooling is not None:  # its whole latency: no first token to time
            await self._take_embedding(self._first)
            return
        self._metrics.ttft.observe(self._first_output_s)

    async def _take_embedding(self, message) -> None:
        """An embedding request is done with its first output."""
        self._done, self._recorded = [True], True
        self._metrics.finish(len(self.prompt), 0, time.perf_counter() - self._started, None, 1,
                             ["stop" if message is not None and message.embedding else "abort"])
        if message is not None and message.num_cached_tokens:
            self.cached_tokens = min(message.num_cached_tokens, len(self.prompt))
        if message is None or not message.embedding:  # aborted at the scheduler (it is stopping)
            raise ServiceUnavailable(f"embedding request {self.request_id} ended without its embedding")
        self.embedding = list(message.embedding)
        # Its end came in the same session message: take it, so the stream ends without an abort.
        if await anext(self._stream, None) is not None:
            raise RuntimeError(f"embedding request {self.request_id} had an output after its embedding")

    async def __aiter__(self) -> AsyncIterator[SeqDelta]:
        self._read = True
        try:
            message = self._first
            while message is not None:
                delta = self._apply(message)
                if delta is not None and delta.token_ids:
                    self._observe_inter_token_latency(delta.index)
                # A prefill chunk's output brings only prompt logprobs (kept in the run): no delta.
                if delta is not None and (delta.token_ids or delta.text or delta.finish_reason):
                    yield delta
                if self.finished:
                    return
                message = await self._next()
            # The stream ended with sequences still running: the request was aborted (Abort RPC).
            for index, done in enumerate(self._done):
                if not done:
                    self._done[index] = True
                    self.finish_reasons.append("abort")
                    yield SeqDelta(index, [], self._detoks[index].flush().text, None, "abort", None, self.position)
        finally:
            self.cancel()  # no-op after a normal end; otherwise aborts the rest at the scheduler
            # Beam search reports its beams once, at the end: there is no time per token to see.
            first = None if self.params.use_beam_search else self._first_output_s
            # A sequence that did not end (the client went away) was aborted.
            reasons = self.finish_reasons + ["abort"] * (len(self._done) - len(self.finish_reasons))
            self._recorded = True
            self._metrics.finish(len(self.prompt), self.completion_tokens, time.perf_counter() - self._started,
                                 first, self.params.n, reasons)

    def _observe_inter_token_latency(self, index: int) -> None:
        """The time since the sequence's previous tokens came (vLLM's inter-token latency; beam search reports
        its beams once, at the end: nothing to time)."""
        now, last = time.perf_counter(), self._last_tokens_at[index]
        self._last_tokens_at[index] = now
        if last is not None and not self.params.use_beam_search:
            self._metrics.inter_token.observe(now - last)

    def record_abandoned(self) -> None:
        """A run given up before it was read (its request failed, or its client left, first): its
        sequences ended as aborted."""
        if not (self._recorded or self._read):
            self._recorded = True
            self._metrics.request_success.labels(finished_reason="abort").inc(len(self._done))

    async def _next(self):
        """The request's next output (None once it ended), from the scheduler it runs on now."""
        try:
            return await anext(self._stream, None)
        except SessionLost as exc:
            if self._resumer is None or not self._resumer.may_resume(exc, self.resumes):
                raise
            lost = exc
        self._skip_prompt_logprobs = len(self.prompt_logprobs) - 1 if self.prompt_logprobs else 0
        resumes_left = self._resumer.policy.max_resumes - self.resumes
        try:
            first, used = await self._resumer.resubmit(self._resubmission(), lost, resumes_left, self._take_stream,
                                                       lambda: self._aborted)
        except SessionLost:
            self.resumes = self._resumer.policy.max_resumes
            raise
        self.resumes += used
        return first

    def _take_stream(self, stream: SubmitStream) -> None:
        self._stream = stream

    def _resubmission(self) -> Resubmission:
        """Once any token came, the unfinished sequences carry on after theirs (the prompt's logprobs
        came before them); until then the request starts over."""
        resumption, params = None, self.params
        if any(self._outputs):
            resumption = Resumption({i: list(out) for i, out in enumerate(self._outputs) if not self._done[i]})
            params = replace(params, prompt_logprobs=None)
        return Resubmission(self.request_id, self.prompt, params, self._cache_salt, resumption, self.lora, self.pooling)

    def _apply(self, message) -> SeqDelta | None:
        # Every streamed token comes through here: each protobuf field is read once.
        index = message.seq_index
        params = self.params
        if params.prompt_logprobs is not None and message.prompt_logprobs:
            positions = message.prompt_logprobs
            if self._skip_prompt_logprobs:
                skip = min(self._skip_prompt_logprobs, len(positions))
                self._skip_prompt_logprobs -= skip
                positions = positions[skip:]
            self.prompt_logprobs = (self.prompt_logprobs or [None]) + [self.model.logprob(p) for p in positions]
        if message.num_cached_tokens:  # (a resumed request's count covers its earlier outputs too)
            self.cached_tokens = max(self.cached_tokens, min(message.num_cached_tokens, len(self.prompt)))
        if self._done[index]:  # stopped by a stop string; the engine may still be running it for a moment
            return None
        ids = list(message.new_token_ids)
        self._outputs[index] += ids  # all of them: a sequence that keeps fewer has stopped
        detok = self._detoks[index]
        delta = SeqDelta(index, ids, "", position=self.position)
        finish_reason = message.finish_reason
        on_stop_token = finish_reason == "stop"  # the engine's stops are EOS and stop token ids
        if params.logprobs is not None:
            if len(message.new_logprobs) != len(ids):  # zip would drop the text of the tokens without
                raise RuntimeError(f"the engine sent {len(ids)} tokens with {len(message.new_logprobs)} logprobs")
            delta.logprobs = []
            for i, (token_id, position) in enumerate(zip(ids, message.new_logprobs)):
                delta.logprobs.append(self.model.logprob(position, text_offset=len(detok.text)))
                delta.text += detok.append([token_id], on_stop_token and i == len(ids) - 1).text
                if detok.stopped is not None:  # several tokens at once (speculative decoding): the rest go
                    del ids[i + 1:]
                    break
        else:
            text = detok.append(ids, on_stop_token)
            delta.text = text.text
            del ids[text.num_tokens_kept:]
        self.completion_tokens += len(ids)
        if detok.stopped is not None:
            delta.finish_reason, delta.stop_reason = "stop", detok.stopped
            self._done[index] = True
            if not finish_reason and not self.finished:  # its siblings run on: free this one's blocks now
                self._stream.stop_sequence(index, detok.stopped)
        elif finish_reason:
            delta.text += detok.flush().text
            delta.finish_reason = finish_reason

            which = message.WhichOneof("stop_reason")
            delta.stop_reason = getattr(message, which) if which else None
        self._done[index] = delta.finish_reason is not None
        if delta.finish_reason is not None:
            self.finish_reasons.append(delta.finish_reason)
        return delta


def merge(runs: list[Run]) -> AsyncIterator[SeqDelta]:
    """The deltas of several runs as they come (each carries its run's position); a single run is
    iterated directly, without a task or a queue in between."""
    if len(runs) == 1:
        return runs[0].__aiter__()
    return _merged(runs)


async def _merged(runs: list[Run]) -> AsyncIterator[SeqDelta]:
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(run: Run) -> None:
        try:
            async for delta in run:
                await queue.put(delta)
        except Exception as exc:  # handed to the consumer, which re-raises it
            await queue.put(exc)
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(run)) for run in runs]
    try:
        pending = len(tasks)
        while pending:
            item = await queue.get()
            if item is None:
                pending -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:  # a client that went away: each run's finally aborts it at the scheduler
            task.cancel()


# --- the core ---------------------------------------------------------------------------------------


@dataclass
class Admission:
    """One admitted request, and what it counts towards its key's tokens per minute: a reservation
    made when its runs are submitted, settled to what they used when it ends."""
    api_key: ApiKey | None = None
    runs: list = field(default_factory=list)
    reservation: Reservation | None = None
    counted_in: int | None = None  # the minute its request was counted in, if its key has a request limit

    def num_tokens(self) -> int:
        return sum(len(run.prompt) + run.completion_tokens for run in self.runs)


class Generator:
    def __init__(self, client: SchedulerPool, metrics: GatewayMetrics,
                 served_model_name: str | list[str] | None = None,
                 tokenizer: str | None = None, max_concurrent_requests: int | None = None,
                 limiter: RateLimiter | None = None, resume_policy: ResumePolicy | None = ResumePolicy(),
                 tool_parser: ToolCallParser | None = None,
                 lora_modules: list[LoRAModule] | None = None, trust_request_chat_template: bool = False,
                 reasoning_parser: ReasoningParser | None = None, return_tokens_as_token_ids: bool = False):
        """``lora_modules``: parse_lora_modules' adapters (--lora-modules)."""
        self.client = client
        self.return_tokens_as_token_ids = return_tokens_as_token_ids  # --return-tokens-as-token-ids
        self.reasoning_parser = reasoning_parser  # None: outputs are not split into reasoning and content
        self.trust_request_chat_template = trust_request_chat_template
        self.lora_modules = lora_modules or []
        # Runs whose scheduler is lost are submitted again (None: they fail with 503).
        self.resumer = None if resume_policy is None else Resumer(client, resume_policy, metrics)
        self.limiter = limiter  # per-key rate limits (keys from the Redis store); None: none kept
        self.metrics = metrics
        # --served-model-name: the name answers carry, then the aliases it also answers to (vLLM's flag).
        names = [served_model_name] if isinstance(served_model_name, str) else \
            list(dict.fromkeys(served_model_name or []))
        self.served_model_name, self.model_aliases = (names[0], tuple(names[1:])) if names else (None, ())
        self.tokenizer_path = tokenizer
        self.max_concurrent_requests = max_concurrent_requests
        self.tool_parser = tool_parser  # None: tool_choice "auto" is refused
        self.in_flight = 0
        self._model: Model | None = None
        self._lock = asyncio.Lock()
        self._charges: set[asyncio.Task] = set()  # token charges on their way to the rate limit store

    async def model(self) -> Model:
        """The served model; learned from the scheduler on first use and kept (the gateway holds no other state)."""
        if self._model is None:
            async with self._lock:
                if self._model is None:
                    self._model = await self._load_model()
        return self._model

    def known_model_name(self) -> str | None:
        """The served model's name, once the scheduler said which model it is (or --served-model-name)."""
        return self._model.name if self._model is not None else self.served_model_name

    async def _load_model(self) -> Model:
        info = await self.client.info()
        check_peer_version("scheduler", self.client.address, info.protocol_version)
        path = self.tokenizer_path or info.model
        try:
            tokenizer = await asyncio.to_thread(load_tokenizer, path)
        except (FileNotFoundError, ValueError) as exc:  # a deployment error, not the client's
            raise ServiceUnavailable(f"cannot load the tokenizer ({exc}); pass --tokenizer") from exc
        name = self.served_model_name or Path(info.model).name or info.model
        adapters = adapters_for((name, *self.model_aliases), self.lora_modules, info.max_loras)
        log.info("model ready", model=name, path=info.model, max_model_len=info.max_model_len,
                 lora_adapters=sorted(adapters))
        return Model(name, info.max_model_len, info.vocab_size, info.max_logprobs, tokenizer, info.max_num_seqs,
                     self.tool_parser, tuple(info.eos_token_ids), adapters, self.trust_request_chat_template,
                     PoolerConfig.from_proto(info.pooler) if info.HasField("pooler") else None, self.reasoning_parser,
                     self.model_aliases, path=info.model, return_tokens_as_token_ids=self.return_tokens_as_token_ids)

    @contextlib.asynccontextmanager
    async def admitted(self, api_key: ApiKey | None = None):
        """Holds one of --max-concurrent-requests slots for as long as a request (and its stream)
        lasts, within the caller's rate limits. Yields an Admission: the runs put in it are
        charged to the key's tokens per minute when the request ends."""
        if self.max_concurrent_requests and self.in_flight >= self.max_concurrent_requests:
            raise Overloaded(f"the gateway is at its limit of {self.max_concurrent_requests} concurrent requests; "
                             "retry later")
        limited = api_key is not None and self.limiter is not None
        admission = Admission(api_key if limited else None)
        self.in_flight += 1  # before the limiter's wait: the slot is taken while it checks
        try:
            if limited:
                admission.counted_in = await self._within_limits(self.limiter.admit(api_key), api_key)
            yield admission
        except ServiceUnavailable:
            if admission.counted_in is not None and not admission.runs:  # failed by us, before it ran
                self._later(self.limiter.take_back_request(api_key, admission.counted_in), api_key, "request")
            raise
        finally:
            self.in_flight -= 1
            if admission.reservation is not None:
                self._later(self.limiter.settle(api_key, admission.reservation, admission.num_tokens()),
                            api_key, "tokens")

    async def _within_limits(self, check, api_key: ApiKey):
        try:
            return await check
        except ResourceExhausted:
            self.metrics.count_rate_limited(api_key)
            raise
        except Exception as exc:  # redis' errors: the limits cannot be checked, so nothing is let through
            log.warning("rate limit store unreachable", error=str(exc))
            raise ServiceUnavailable("the rate limit store is unreachable; retry later") from exc

    async def _reserve(self, admission: Admission, model: Model, prompts: list[list[int]],
                       params: SamplingParams | None) -> None:
        """The most the runs can use, against the key's tokens per minute (before they are submitted);
        ``params`` None: embeddings, which use their prompts only."""
        most = sum(map(len, prompts))
        if params is not None:
            most += sum(params.n * (model.max_model_len - len(p) if params.max_tokens is None else params.max_tokens)
                        for p in prompts)
        admission.reservation = await self._within_limits(
            self.limiter.reserve_tokens(admission.api_key, most), admission.api_key)

    def _later(self, charge, api_key: ApiKey, what: str) -> None:
        """A change to the key's counters, off the request's path (it may be ending by cancellation):
        a task the gateway keeps."""
        async def run():
            try:
                await charge
            except Exception as exc:
                log.warning("could not update the API key's rate counters", api_key=api_key.name, what=what,
                            error=str(exc))

        task = asyncio.get_running_loop().create_task(run())
        self._charges.add(task)
        task.add_done_callback(self._charges.discard)

    async def settle_charges(self) -> None:
        """Wait for the token charges still on their way (at shutdown, before the store closes)."""
        if self._charges:
            await asyncio.wait(list(self._charges), timeout=5)

    async def start(self, model: Model, request_id: str, prompts: list[list[int]], params: SamplingParams,
                    suffix_ids: bool = True, cache_salt: str | None = None,
                    on_submit: Callable[[Run], None] | None = None, admission: Admission | None = None,
                    lora: LoRARequest | None = None, pooling: PoolingParams | None = None) -> list[Run]:
        """Validate every prompt, then submit them all and wait for each one's first output.

        One engine request per prompt; their ids are request_id-<8 random hex digits>-<i> (or
        request_id itself when suffix_ids is false, as the gRPC API needs to abort by the client's id).
        on_submit gets each run as soon as it is submitted, before its first output.
        ``pooling``: embedding requests (``params`` unused); each run's embedding is there when this returns.
        """
        model.check_runner(pooling)
        if pooling is None:
            prompts = [params.truncated(prompt, model.max_model_len) for prompt in prompts]
            params = params.with_bad_words_tokenized(lambda word: model.encode(word, add_special_tokens=False))
            for prompt in prompts:
                model.check_prompt(prompt, params)
        else:
            prompts = [pooling.truncated(prompt, model.max_model_len) for prompt in prompts]
            for prompt in prompts:
                model.check_embedding_prompt(prompt)
        if admission is not None and admission.api_key is not None:
            await self._reserve(admission, model, prompts, params if pooling is None else None)
        runs: list[Run] = []
        starts: list[asyncio.Future] = []
        # A client's X-Request-Id may repeat (a tracing header); engine ids must not.
        unique = f"{request_id}-{uuid.uuid4().hex[:8]}" if suffix_ids else request_id
        try:
            for i, prompt in enumerate(prompts):
                engine_id = f"{unique}-{i}" if suffix_ids else unique
                stream = await self.client.submit(engine_id, prompt, params, cache_salt, lora=lora, pooling=pooling)
                try:
                    runs.append(Run(model, stream, engine_id, prompt, params, self.metrics, position=i,
                                    resumer=self.resumer, cache_salt=cache_salt, lora=lora, pooling=pooling))
                    if on_submit is not None:
                        on_submit(runs[-1])
                except BaseException:
                    stream.cancel()  # submitted but not yet a run: nothing below would abort it
                    raise
            starts = [asyncio.ensure_future(run.start()) for run in runs]
            await asyncio.gather(*starts)
        except BaseException:
            for run, started in itertools.zip_longest(runs, starts):  # all or nothing: abort every one
                run.cancel()
                run.record_abandoned()
                if started is not None:
                    started.cancel()
            raise
        if pooling is not None:
            log.info("embeddings done", inputs=len(prompts), lora=lora.name if lora is not None else None,
                     prompt_tokens=sum(map(len, prompts)))
        else:
            log.info("request started", prompts=len(prompts), n=params.n, max_tokens=params.max_tokens,
                     lora=lora.name if lora is not None else None, prompt_tokens=sum(map(len, prompts)))
        if admission is not None:
            admission.runs = runs
        return runs
