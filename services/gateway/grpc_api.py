"""The public gRPC API (pagedserve.api.v1.Generation) on grpc.aio, over the same generation core,
with grpc.health.v1 and server reflection."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.gateway.api_keys import ApiKey
from services.gateway.auth import Authenticator, single_authorization
from services.gateway.call_ids import CallIds
from services.gateway.classify_api import best_label
from services.gateway.deltas import SeqDelta, TokenLogprob
from services.gateway.engine_requests import engine_requests, new_request_id
from services.gateway.generator import Generator
from services.gateway.grpc_tracing import call_span
from services.gateway.media import decoded_image, load_image
from services.gateway.prompt_bound import refuse_texts_too_long
from shared.grpc_errors import ResourceExhausted, Unauthenticated, status_for
from shared.invalid_parameter import InvalidParameter
from shared.logging import bind_request_id, clear_request_id, setup_logging
from shared.pooling import PoolingParams
from shared.proto import pagedserve_api_pb2 as api
from shared.proto import pagedserve_api_pb2_grpc as api_grpc
from shared.request import check_runner
from shared.sampling_params import SamplingParams

log = setup_logging("gateway")


async def _abort_with(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    """Domain error -> status, through shared/grpc_errors (grpc.aio's abort must be awaited)."""
    code = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("request failed")
    if isinstance(exc, ResourceExhausted):  # when to try again, as HTTP's Retry-After says it
        context.set_trailing_metadata((("retry-after", str(exc.retry_after_s)),))
    await context.abort(code, str(exc) or type(exc).__name__)


def _token_logprob(entry: TokenLogprob) -> api.TokenLogprob:
    return api.TokenLogprob(token_id=entry.token_id, logprob=entry.logprob, rank=entry.rank, token=entry.token,
                            top=[api.TopLogprob(token_id=t.token_id, logprob=t.logprob, token=t.token)
                                 for t in entry.top])


def _engine_id(api_key: ApiKey | None, request_id: str) -> str:
    """The engine knows a call by its client's id, within the caller's key when there are keys: one
    tenant can neither abort another's request nor learn (ALREADY_EXISTS) which ids are in use."""
    return request_id if api_key is None else f"{api_key.key_id[:16]}/{request_id}"


class GenerationServicer(api_grpc.GenerationServicer):
    def __init__(self, gen: Generator, call_ids: CallIds | None = None, auth: Authenticator | None = None):
        self.gen = gen
        self.call_ids = call_ids or CallIds()
        self.auth = auth or Authenticator()

    async def _caller(self, context: grpc.aio.ServicerContext) -> ApiKey | None:
        """The call's API key, from its `authorization: Bearer <key>` metadata (None: the gateway is open)."""
        if not self.auth.enabled:  # nothing to read
            return None
        authorization = single_authorization([value for key, value in context.invocation_metadata() or ()
                                              if key == "authorization"], "authorization metadata entries")
        try:
            return await self.auth.authenticate(authorization)
        except Unauthenticated:
            self.gen.metrics.unauthenticated.inc()
            raise

    async def Generate(self, request, context):
        with call_span(self.gen.tracing, context, "Generate"):
            await self._generate(request, context)

    async def _generate(self, request, context):
        request_id = request.request_id or new_request_id()
        bind_request_id(request_id)
        try:
            api_key = await self._caller(context)
            engine_id = _engine_id(api_key, request_id)
            async with self.call_ids.claim(engine_id) as call, self.gen.admitted(api_key) as admission:
                model = await self.gen.model()
                lora = model.resolve(request.model)
                try:  # off the event loop: checking a structured output's grammar can take long
                    params = await asyncio.to_thread(SamplingParams.from_proto, request.params,
                                                     defaults=model.generation_defaults)
                except ValueError as exc:  # its messages name the field, as over HTTP
                    raise InvalidParameter.from_params_error(exc) from None
                # Off the event loop, as over HTTP: a huge prompt must not stall the other streams.
                images = ()
                if request.images:
                    prompt, images = await self.gen.tokenized(_encoded_with_images, model, request, params)
                elif request.WhichOneof("prompt") == "text":
                    prompt = await self.gen.tokenized(_encoded_text, model, request.text, params)
                else:
                    prompt = list(request.token_ids.ids)
                # The engine request keeps the client's id, so Abort(request_id) reaches it.
                salt = request.cache_salt if request.HasField("cache_salt") else None
                requests = engine_requests(engine_id, [prompt], unique=False, params=params, cache_salt=salt, lora=lora,
                                           priority=request.priority, images=[images])
                (run,) = await self.gen.start(model, requests, on_submit=call.attach, admission=admission)
                try:
                    await self._stream(context, request_id, run)
                finally:
                    run.cancel()  # a cancelled stream: abort now, before a new call reusing the id is submitted
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort_with(context, exc)
        finally:
            clear_request_id()

    async def _stream(self, context: grpc.aio.ServicerContext, request_id: str, run) -> None:
        # context.write rather than yield: a client's cancellation then lands in this coroutine and
        # the finally above runs at once. A generator cancelled while its response was being sent
        # is closed only later, by the event loop, and its abort would trail the next call.
        first = True
        async for delta in run:
            await context.write(self._response(request_id, delta, run, first))
            first = False

    @staticmethod
    def _response(request_id: str, delta: SeqDelta, run, first: bool) -> api.GenerateResponse:
        out = api.GenerateResponse(request_id=request_id, index=delta.index, token_ids=delta.token_ids,
                                   text=delta.text, finish_reason=delta.finish_reason or "",
                                   logprobs=[_token_logprob(e) for e in delta.logprobs or []])
        if first and run.prompt_logprobs:
            out.prompt_logprobs.extend(_token_logprob(e) for e in run.prompt_logprobs if e is not None)
        if isinstance(delta.stop_reason, str):
            out.stop_string = delta.stop_reason
        elif isinstance(delta.stop_reason, int):
            out.stop_token_id = delta.stop_reason
        if delta.finish_reason:
            out.usage.prompt_tokens = len(run.prompt)
            out.usage.completion_tokens = run.completion_tokens
            out.usage.cached_prompt_tokens = run.cached_tokens
        return out

    async def Abort(self, request, context):
        try:
            engine_id = _engine_id(await self._caller(context), request.request_id)
            if not request.request_id:
                raise ValueError("request_id must name the request to abort")
        except Exception as exc:
            await _abort_with(context, exc)
        if self.call_ids.abort(engine_id):  # a call open here: its own session stream carries it
            return api.AbortResponse(found=True)
        try:  # a call at another gateway, or one that has not opened here yet
            found = await self.gen.client.abort(engine_id) or await self.call_ids.abort_arriving(engine_id)
            return api.AbortResponse(found=found)
        except Exception as exc:
            await _abort_with(context, exc)

    async def Embed(self, request, context):
        """Every input's embedding (a pooling engine); cancelling the call aborts them."""
        def answer(request_id, model, lora, runs, usage):
            return api.EmbedResponse(
                request_id=request_id, model=model.answer_name(lora), usage=usage,
                embeddings=[api.Embedding(index=run.position, values=run.embedding, prompt_tokens=len(run.prompt))
                            for run in runs])
        return await self._pool(request, context, "embd", "embed", answer)

    async def Classify(self, request, context):
        """Every input's class scores (a sequence classifier); cancelling the call aborts them."""
        def answer(request_id, model, lora, runs, usage):
            labels = model.pooler.labels
            return api.ClassifyResponse(
                request_id=request_id, model=model.answer_name(lora), usage=usage,
                classifications=[api.Classification(index=run.position, label=best_label(labels, run.embedding),
                                                    probs=run.embedding, prompt_tokens=len(run.prompt))
                                 for run in runs])
        return await self._pool(request, context, "classify", "classify", answer)

    async def _pool(self, request, context, id_prefix: str, task: str, answer):
        """An Embed or Classify call: its inputs pooled side by side, then ``answer``'s response."""
        with call_span(self.gen.tracing, context, task.capitalize()):
            return await self._pooled(request, context, id_prefix, task, answer)

    async def _pooled(self, request, context, id_prefix: str, task: str, answer):
        request_id = request.request_id or new_request_id(id_prefix)
        bind_request_id(request_id)
        try:
            api_key = await self._caller(context)
            async with self.gen.admitted(api_key) as admission:
                model = await self.gen.model()
                lora = model.resolve(request.model)
                pooling = _pooling_params(request, task)
                check_runner(pooling, model.limits)
                prompts = await self.gen.tokenized(_pooling_inputs, model, request)
                salt = request.cache_salt if request.HasField("cache_salt") else None
                requests = engine_requests(_engine_id(api_key, request_id), prompts, cache_salt=salt, lora=lora,
                                           pooling=pooling)
                runs = await self.gen.start(model, requests, admission=admission)
            usage = api.Usage(prompt_tokens=sum(len(run.prompt) for run in runs),
                              cached_prompt_tokens=sum(run.cached_tokens for run in runs))
            return answer(request_id, model, lora, runs, usage)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort_with(context, exc)
        finally:
            clear_request_id()

    async def ListModels(self, request, context):
        try:
            await self._caller(context)
            model = await self.gen.model()
        except Exception as exc:
            await _abort_with(context, exc)
        return api.ListModelsResponse(models=[api.ModelCard(id=name, max_model_len=model.max_model_len,
                                                            vocab_size=model.vocab_size)
                                              for name in [*model.names, *model.adapters]])


def _pooling_params(request: api.EmbedRequest | api.ClassifyRequest, task: str) -> PoolingParams:
    truncate = request.truncate_prompt_tokens if request.HasField("truncate_prompt_tokens") else None
    try:
        if task == "classify":
            return PoolingParams(truncate_prompt_tokens=truncate, task=task,
                                 use_activation=request.use_activation if request.HasField("use_activation") else None)
        params = api.PoolingParameters()
        params.CopyFrom(request.params)
        params.task = task  # the call's, whatever the client put there
        return dataclasses.replace(PoolingParams.from_proto(params), truncate_prompt_tokens=truncate)
    except ValueError as exc:
        raise InvalidParameter.from_params_error(exc) from None


def _encoded_text(model, text: str, params: SamplingParams) -> list[int]:
    """The prompt's tokens; one that certainly cannot fit the context is refused before it is all tokenized."""
    if params.truncate_prompt_tokens is None:
        refuse_texts_too_long(model, [("text", text)])
    return model.encode(text)


def _encoded_with_images(model, request: api.GenerateRequest, params: SamplingParams) -> tuple[list[int], tuple]:
    """The prompt's tokens and images, through the model's processor (blocking: fetches and decodes images)."""
    if model.image_prompts is None:
        raise InvalidParameter("were given, but the model takes no images: it is a text model", "images")
    if request.WhichOneof("prompt") != "text":
        raise InvalidParameter("a prompt with images must be text, with the model's placeholder where each goes",
                               "text")
    if len(request.images) > model.media.max_images_per_prompt:
        raise InvalidParameter(f"holds {len(request.images)} images; a prompt may hold at most "
                               f"{model.media.max_images_per_prompt} (--limit-mm-per-prompt)", "images")
    if params.truncate_prompt_tokens is not None:
        raise InvalidParameter("cannot cut a prompt with images (it could cut one in two)", "truncate_prompt_tokens")
    images = [load_image(image.url, model.media, f"images[{i}]") if image.WhichOneof("source") == "url"
              else decoded_image(image.data, model.media, f"images[{i}]") for i, image in enumerate(request.images)]
    return model.image_prompts.process(request.text, images)


def _pooling_inputs(model, request: api.EmbedRequest | api.ClassifyRequest) -> list[list[int]]:
    if not request.inputs:
        raise InvalidParameter("inputs is empty: give at least one text or token ids", "inputs")
    if not request.HasField("truncate_prompt_tokens"):
        refuse_texts_too_long(model, [("inputs", item.text) for item in request.inputs
                                      if item.WhichOneof("input") == "text"])
    prompts = []
    for item in request.inputs:
        if item.WhichOneof("input") == "text":
            prompts.append(model.encode_input(item.text))
        else:
            prompts.append(list(item.token_ids.ids))
    return prompts


def create_grpc_server(gen: Generator, address: str, auth: Authenticator | None = None
                       ) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    server = grpc.aio.server()
    api_grpc.add_GenerationServicer_to_server(GenerationServicer(gen, auth=auth), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([api.DESCRIPTOR.services_by_name["Generation"].full_name,
                                         reflection.SERVICE_NAME, health.SERVICE_NAME], server)
    if not server.add_insecure_port(address):
        raise OSError(f"cannot listen on {address} for gRPC")
    return server, health_servicer


# The whole server ("") and the Generation service, for probes that name it.
HEALTH_SERVICES = ("", api.DESCRIPTOR.services_by_name["Generation"].full_name)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
