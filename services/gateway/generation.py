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
from services.gateway.resumption import ResumePolicy, Resumer
from services.gateway.scheduler_client import SessionLost, SubmitStream
from services.gateway.scheduler_pool import SchedulerPool
from services.gateway.reasoning_parsers import ReasoningParser
from services.gateway.tool_parsers import ToolCallParser
from shared.detokenizer import IncrementalDetokenizer
from shared.grpc_errors import NotFound, ResourceExhausted, ServiceUnavailable
from shared.invalid_parameter import InvalidParameter
from shared.logging import setup_logging
from shared.lora import LoRARequest
from shared.pooling import PoolerConfig
from shared.request import EngineRequest, RequestLimits, check_token_ids, validate
from shared.resumption import Resumption
from shared.sampling_params import SamplingParams
from shared.tokenizer import load_tokenizer, render_chat
from shared.wire_version import check_peer_version

log = setup_logging("gateway")


class Overloaded(ResourceExhausted):
    """More requests in flight than --max-concurrent-requests allows."""


def new_request_id(prefix: str = "req") -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def engine_requests(request_id: str, prompts: list[list[int]], unique: bool = True, **fields) -> list[EngineRequest]:
    """One engine request per prompt, each with ``fields`` (EngineRequest's). Their ids are
    request_id-<8 random hex digits>-<i>: a client's X-Request-Id may repeat (a tracing header), engine
    ids must not; with ``unique`` false, request_id itself (one prompt: the gRPC API aborts by the
    client's id)."""
    if not unique:
        return [EngineRequest(request_id, prompt, **fields) for prompt in prompts]
    ids = f"{request_id}-{uuid.uuid4().hex[:8]}"
    return [EngineRequest(f"{ids}-{i}", prompt, **fields) for i, prompt in enumerate(prompts)]


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
    max_loras: int = 0  # distinct LoRA adapters the engine runs in one step; 0: LoRA is not enabled
    _token_strings: dict[int, str] = field(default_factory=dict)

    @property
    def limits(self) -> RequestLimits:
        """What the engine allows a request, as the scheduler reported it: what validate checks here."""
        return RequestLimits(max_model_len=self.max_model_len, vocab_size=self.vocab_size,
                             max_logprobs=self.max_logprobs, max_num_seqs=self.max_num_seqs,
                             eos_token_ids=self.eos_token_ids, max_loras=self.max_loras, pooler=self.pooler,
                             model_name=self.name)

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
        check_token_ids(token_ids, self.vocab_size)

    def prepared(self, request: EngineRequest) -> EngineRequest:
        """The request as the engine takes it: its prompt truncated as it asks, its bad words as token ids."""
        if request.pooling is not None:
            return replace(request, prompt_token_ids=request.pooling.truncated(request.prompt_token_ids,
                                                                               self.max_model_len))
        params = request.params
        return replace(request, prompt_token_ids=params.truncated(request.prompt_token_ids, self.max_model_len),
                       params=params.with_bad_words_tokenized(lambda word: self.encode(word, add_special_tokens=False)))

    def checked(self, request: EngineRequest) -> EngineRequest:
        """The request prepared, if the engine would take it (what it would refuse is refused here, so a
        request of several prompts is all or nothing, before a run builds a detokenizer per sequence).
        Its errors name the fields as the APIs do (an embedding input is the prompt's ``input``)."""
        request = self.prepared(request)
        try:
            validate(request, self.limits)
        except ValueError as exc:
            error = InvalidParameter.from_params_error(exc)
            if request.pooling is not None and error.param == "prompt":
                error = error.renamed("input")
            raise error from None
        return request

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

    def __init__(self, model: Model, stream: SubmitStream, request: EngineRequest, metrics: GatewayMetrics,
                 position: int = 0, resumer: Resumer | None = None):
        self.model, self.request = model, request
        params = request.params
        # An embedding request's (``pooling``): its one output (start() waits for it) carries the embedding.
        self.embedding: list[float] | None = None
        self.position = position  # which of the request's prompts this is
        self._stream, self._metrics = stream, metrics
        self._resumer = resumer
        self.resumes = 0  # times this run was submitted again after losing its scheduler
        self.finish_reasons: list[str] = []  # its sequences' as they end ("stop", "length", "abort")
        self._recorded = False  # its end is in the metrics (by __aiter__'s end, once it was read)
        self._read = False
        self._aborted = False  # the client's Abort: a resumption stops
        self._outputs: list[list[int]] = [[] for _ in range(params.n)]  # each sequence's tokens so far
        self._skip_prompt_logprobs = 0  # a run started over sends the prompt logprobs already passed on again
        self._first = None
        self._detoks = [IncrementalDetokenizer(model.tokenizer, request.prompt_token_ids, stop=params.stop,
                                               skip_special_tokens=params.skip_special_tokens,
                                               include_stop_str_in_output=params.include_stop_str_in_output,
                                               min_tokens=params.min_tokens)
                        for _ in range(params.n)]
        self._done = [False] * params.n
        self._last_tokens_at: list[float | None] = [None] * params.n  # each sequence's latest tokens' arrival
        self.completion_tokens = 0
        self.cached_tokens = 0  # prompt tokens the prefix cache held (known from the first output on)
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self._first_output_s: float | None = None  # arrival to first output (start())

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    def _since_arrival(self) -> float:
        """Seconds since the request arrived (vLLM's latencies count from there; a resumption keeps it)."""
        return time.time() - self.request.arrival_time

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
        self._first_output_s = self._since_arrival()
        if self.request.pooling is not None:  # its whole latency: no first token to time
            await self._take_embedding(self._first)
            return
        self._metrics.ttft.observe(self._first_output_s)

    async def _take_embedding(self, message) -> None:
        """An embedding request is done with its first output."""
        self._done, self._recorded = [True], True
        self._metrics.finish(len(self.prompt), 0, self._since_arrival(), None, 1,
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
            self._metrics.finish(len(self.prompt), self.completion_tokens, self._since_arrival(), first,
                                 self.params.n, reasons)

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

    def _resubmission(self) -> EngineRequest:
        """The request again: once any token came, its unfinished sequences carry on after theirs (the
        prompt's logprobs came before them); until then it starts over."""
        if not any(self._outputs):
            return self.request
        resumption = Resumption({i: list(out) for i, out in enumerate(self._outputs) if not self._done[i]})
        return replace(self.request, resumption=resumption, params=replace(self.params, prompt_logprobs=None))

    def _apply(self, message) -> SeqDelta | None:
        # Every streamed token comes through here: each protobuf field is read once.
        index = message.seq_index
        params = self.request.params
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
        return Model(name=name, max_model_len=info.max_model_len, vocab_size=info.vocab_size,
                     max_logprobs=info.max_logprobs, tokenizer=tokenizer, max_num_seqs=info.max_num_seqs,
                     tool_parser=self.tool_parser, eos_token_ids=tuple(info.eos_token_ids), adapters=adapters,
                     trust_request_chat_template=self.trust_request_chat_template,
                     pooler=PoolerConfig.from_proto(info.pooler) if info.HasField("pooler") else None,
                     reasoning_parser=self.reasoning_parser, aliases=self.model_aliases, path=info.model,
                     return_tokens_as_token_ids=self.return_tokens_as_token_ids, max_loras=info.max_loras)

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

    async def _reserve(self, admission: Admission, model: Model, requests: list[EngineRequest]) -> None:
        """The most the runs can use, against the key's tokens per minute (before they are submitted):
        an embedding uses its prompt only."""
        most = 0
        for request in requests:
            prompt_len, params = len(request.prompt_token_ids), request.params
            most += prompt_len
            if request.pooling is None:
                per_sequence = model.max_model_len - prompt_len if params.max_tokens is None else params.max_tokens
                most += params.n * per_sequence
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

    async def start(self, model: Model, requests: list[EngineRequest],
                    on_submit: Callable[[Run], None] | None = None,
                    admission: Admission | None = None) -> list[Run]:
        """Validate every request (one per prompt of the client's: engine_requests), then submit them all
        and wait for each one's first output. on_submit gets each run as soon as it is submitted, before
        its first output. An embedding request's run has its embedding when this returns."""
        requests = [model.checked(request) for request in requests]
        if admission is not None and admission.api_key is not None:
            await self._reserve(admission, model, requests)
        runs: list[Run] = []
        starts: list[asyncio.Future] = []
        try:
            for position, request in enumerate(requests):
                stream = await self.client.submit(request)
                try:
                    runs.append(Run(model, stream, request, self.metrics, position=position, resumer=self.resumer))
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
        if requests:
            _log_started(requests)
        if admission is not None:
            admission.runs = runs
        return runs


def _log_started(requests: list[EngineRequest]) -> None:
    """One line per client request (its engine requests differ only in their prompts)."""
    first, prompt_tokens = requests[0], sum(len(request.prompt_token_ids) for request in requests)
    lora = first.lora.name if first.lora is not None else None
    if first.pooling is not None:
        log.info("embeddings done", inputs=len(requests), lora=lora, prompt_tokens=prompt_tokens)
    else:
        log.info("request started", prompts=len(requests), n=first.params.n, max_tokens=first.params.max_tokens,
                 lora=lora, prompt_tokens=prompt_tokens)
