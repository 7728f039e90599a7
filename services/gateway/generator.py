"""The generation core shared by the OpenAI HTTP API and the public gRPC API: it learns the served model
from the scheduler (lazily, so the gateway starts before its backend), admits requests (within
--max-concurrent-requests and their API key's rate limits) and submits each prompt as one engine request,
a Run, once every one of them passed the model's checks."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable

from services.gateway.api_keys import ApiKey
from services.gateway.billing import Admission, Billing
from services.gateway.image_prompts import ImagePrompts, image_prompts
from services.gateway.lora_modules import LoRAModule, adapters_for
from services.gateway.media import MediaOptions
from services.gateway.metrics import GatewayMetrics
from services.gateway.model import Model
from services.gateway.model_files import ModelFiles
from services.gateway.rate_limits import RateLimiter
from services.gateway.reasoning_parsers import ReasoningParser
from services.gateway.resumption import ResumePolicy, Resumer
from services.gateway.run import Run
from services.gateway.run_span import RunSpan
from services.gateway.scheduler_pool import SchedulerPool
from services.gateway.scheduler_session import SubmitStream
from services.gateway.tool_parsers import ToolCallParser
from shared.grpc_errors import ResourceExhausted, ServiceUnavailable
from shared.hub import model_name
from shared.logging import setup_logging
from shared.pooling import PoolerConfig
from shared.request import EngineRequest
from shared.tokenizer import load_tokenizer
from shared.tracing import Tracing, traced_call
from shared.wire_version import check_peer_version

log = setup_logging("gateway")


class Overloaded(ResourceExhausted):
    """More requests in flight than --max-concurrent-requests allows."""


class Generator:
    def __init__(self, client: SchedulerPool, metrics: GatewayMetrics,
                 served_model_name: str | list[str] | None = None,
                 files: ModelFiles = ModelFiles(), max_concurrent_requests: int | None = None,
                 limiter: RateLimiter | None = None, resume_policy: ResumePolicy | None = ResumePolicy(),
                 tool_parser: ToolCallParser | None = None,
                 lora_modules: list[LoRAModule] | None = None, trust_request_chat_template: bool = False,
                 reasoning_parser: ReasoningParser | None = None, return_tokens_as_token_ids: bool = False,
                 tracing: Tracing | None = None, media: MediaOptions = MediaOptions()):
        """``lora_modules``: parse_lora_modules' adapters (--lora-modules); ``tracing``: --otlp-traces-endpoint's;
        ``media``: how requests' image URLs are read."""
        self.client = client
        self.media = media
        self.tracing = tracing  # None: nothing is traced
        self.return_tokens_as_token_ids = return_tokens_as_token_ids  # --return-tokens-as-token-ids
        self.reasoning_parser = reasoning_parser  # None: outputs are not split into reasoning and content
        self.trust_request_chat_template = trust_request_chat_template
        self.lora_modules = lora_modules or []
        # Runs whose scheduler is lost are submitted again (None: they fail with 503).
        self.resumer = None if resume_policy is None else Resumer(client, resume_policy, metrics)
        # Per-key rate limits (keys from the Redis store); None: none kept.
        self.billing = Billing(limiter, metrics) if limiter is not None else None
        self.metrics = metrics
        # --served-model-name: the name answers carry, then the aliases it also answers to (vLLM's flag).
        names = [served_model_name] if isinstance(served_model_name, str) else \
            list(dict.fromkeys(served_model_name or []))
        self.served_model_name, self.model_aliases = (names[0], tuple(names[1:])) if names else (None, ())
        self.files = files
        self.max_concurrent_requests = max_concurrent_requests
        self.tool_parser = tool_parser  # None: tool_choice "auto" is refused
        self.in_flight = 0
        self._model: Model | None = None
        self._lock = asyncio.Lock()

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
        try:
            tokenizer_dir = await asyncio.to_thread(self.files.tokenizer_dir, info.model)  # (a Hub id: resolved once)
            tokenizer = await asyncio.to_thread(load_tokenizer, tokenizer_dir)
            defaults = self.files.generation_defaults(info.model, tokenizer_dir)
        except (FileNotFoundError, ValueError) as exc:  # a deployment error, not the client's
            raise ServiceUnavailable(f"cannot load the tokenizer or generation config ({exc}); pass --tokenizer "
                                     "or --generation-config") from exc
        name = self.served_model_name or model_name(info.model)
        adapters = adapters_for((name, *self.model_aliases), self.lora_modules, info.max_loras)
        log.info("model ready", model=name, path=info.model, max_model_len=info.max_model_len,
                 lora_adapters=sorted(adapters), generation_defaults=defaults.as_dict(),
                 generation_defaults_from=defaults.source)
        return Model(name=name, max_model_len=info.max_model_len, vocab_size=info.vocab_size,
                     max_logprobs=info.max_logprobs, tokenizer=tokenizer, max_num_seqs=info.max_num_seqs,
                     tool_parser=self.tool_parser, eos_token_ids=tuple(info.eos_token_ids), adapters=adapters,
                     trust_request_chat_template=self.trust_request_chat_template,
                     pooler=PoolerConfig.from_proto(info.pooler) if info.HasField("pooler") else None,
                     reasoning_parser=self.reasoning_parser, aliases=self.model_aliases, path=info.model,
                     return_tokens_as_token_ids=self.return_tokens_as_token_ids, max_loras=info.max_loras,
                     generation_defaults=defaults, priority_scheduling=info.priority_scheduling,
                     image_prompts=await self._image_prompts(info, tokenizer_dir), media=self.media)

    async def _image_prompts(self, info, tokenizer_dir) -> ImagePrompts | None:
        """A vision-language model's processor, from its directory (where the tokenizer is)."""
        if not info.HasField("image_token_id"):
            return None
        try:
            return await asyncio.to_thread(image_prompts, tokenizer_dir, info.image_token_id)
        except (OSError, ValueError) as exc:
            raise ServiceUnavailable(f"cannot load the model's image processor from {tokenizer_dir}: {exc}") from exc

    @contextlib.asynccontextmanager
    async def admitted(self, api_key: ApiKey | None = None):
        """Holds one of --max-concurrent-requests slots for as long as a request (and its stream)
        lasts, within the caller's rate limits. Yields an Admission: the runs put in it are
        charged to the key's tokens per minute when the request ends."""
        if self.max_concurrent_requests and self.in_flight >= self.max_concurrent_requests:
            raise Overloaded(f"the gateway is at its limit of {self.max_concurrent_requests} concurrent requests; "
                             "retry later")
        billing = self.billing if api_key is not None else None
        admission = Admission(api_key if billing is not None else None)
        self.in_flight += 1  # before the limiter's wait: the slot is taken while it checks
        try:
            if billing is not None:
                await billing.count_request(admission)
            yield admission
        except ServiceUnavailable:
            if billing is not None:  # failed by us: unless it ran, the request does not count
                billing.take_back_request(admission)
            raise
        finally:
            self.in_flight -= 1
            if billing is not None:
                billing.settle(admission)

    async def settle_charges(self) -> None:
        """Wait for the rate-limit charges still on their way (at shutdown, before the store closes)."""
        if self.billing is not None:
            await self.billing.settle_charges()

    async def start(self, model: Model, requests: list[EngineRequest],
                    on_submit: Callable[[Run], None] | None = None,
                    admission: Admission | None = None) -> list[Run]:
        """Validate every request (one per prompt of the client's: engine_requests), then submit them all
        and wait for each one's first output. on_submit gets each run as soon as it is submitted, before
        its first output. An embedding request's run has its embedding when this returns."""
        requests = [model.checked(request) for request in requests]
        if admission is not None and admission.api_key is not None:
            await self.billing.reserve(admission, model, requests)
        runs: list[Run] = []
        starts: list[asyncio.Future] = []
        try:
            for position, request in enumerate(requests):
                stream, request, span = await self._submit(request, model)
                try:
                    runs.append(Run(model, stream, request, self.metrics, position=position, resumer=self.resumer,
                                    span=span))
                    if on_submit is not None:
                        on_submit(runs[-1])
                except BaseException as exc:
                    stream.cancel()  # submitted but not yet a run: nothing below would abort it
                    if span is not None:
                        span.fail(exc)
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

    async def _submit(self, request: EngineRequest, model: Model) -> tuple[SubmitStream, EngineRequest, RunSpan | None]:
        """The request submitted, as it was (carrying its trace context when traced), and its span."""
        if self.tracing is None:
            return await self.client.submit(request), request, None
        span = RunSpan(self.tracing.tracer, request, model.name)
        try:
            return await self.client.submit(span.request), span.request, span
        except BaseException as exc:
            span.fail(exc)
            raise

    async def tokenized(self, fn, *args):
        """fn(*args) off the event loop, in a "tokenize" span when tracing: a megabyte prompt takes seconds to
        tokenize (or render and tokenize), and every other stream would wait that long (the tokenizer lets go
        of the GIL)."""
        if self.tracing is None:
            return await asyncio.to_thread(fn, *args)
        return await asyncio.to_thread(traced_call, self.tracing.tracer, "tokenize", fn, *args)


def _log_started(requests: list[EngineRequest]) -> None:
    """One line per client request (its engine requests differ only in their prompts)."""
    first, prompt_tokens = requests[0], sum(len(request.prompt_token_ids) for request in requests)
    lora = first.lora.name if first.lora is not None else None
    if first.pooling is not None:
        log.info("embeddings done", inputs=len(requests), lora=lora, prompt_tokens=prompt_tokens)
    else:
        log.info("request started", prompts=len(requests), n=first.params.n, max_tokens=first.params.max_tokens,
                 lora=lora, prompt_tokens=prompt_tokens)
