"""The offline Python API: ``LLM(model=...).generate(prompts, sampling_params)``, shaped like vLLM's.

Runs the engine core and one worker in this process through the in-process
executor; tokenization and output processing happen here, as the gateway does
them for the services. Part of the public front, not of a service: it brings the
scheduler and the worker (and torch) together in one process.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
import weakref
from collections.abc import Iterable
from collections.abc import Sequence as SequenceABC
from pathlib import Path

import torch
from tqdm import tqdm

from services.gateway.image_prompts import ImagePrompts, image_prompts
from services.gateway.media import MediaOptions, load_image
from services.scheduler.engine_core import EngineCore
from services.scheduler.executor import InProcessExecutor
from services.scheduler.local_workers import LocalWorkerGroup
from services.scheduler.request_tracker import RequestTracker
from services.scheduler.scheduler import SchedulerLimits
from services.scheduler.sequence import SequenceUpdate
from services.scheduler.tensor_parallel_executor import TensorParallelExecutor
from services.worker.tensor_parallel import TensorParallel
from services.worker.worker import Worker
from services.worker.model_config import ModelConfig
from services.worker.model_factory import default_model_dir
from services.worker.model_impl import chosen_impl, refuse_on_transformers_path
from shared.config import EngineConfig
from shared.gc_heap import heap_frozen_while_running
from shared.generation_defaults import read_generation_defaults
from shared.grpc_errors import ServiceUnavailable
from shared.hub import local_model_and_tokenizer
from shared.logging import setup_logging
from shared.lora import LoRARequest
from shared.multimodal import ImageInput
from shared.outputs import (ClassificationOutput, ClassificationRequestOutput, EmbeddingOutput, EmbeddingRequestOutput,
                            PoolingOutput, PoolingRequestOutput, RequestOutput, ScoringOutput, ScoringRequestOutput)
from shared.pooling import PoolingParams, check_cross_encoder, score_pairs, token_limit
from shared.request import EngineRequest, validate
from shared.sampling_params import SamplingParams
from shared.tokenizer import load_tokenizer, render_chat

PromptType = str | dict

log = setup_logging("llm")


def resolved_files(config: EngineConfig) -> EngineConfig:
    """The config with its model and tokenizer as local folders (a Hub id's snapshot, downloaded where
    missing), so that nothing resolves them again."""
    model, tokenizer = local_model_and_tokenizer(config.model, config.tokenizer, revision=config.revision,
                                                 tokenizer_revision=config.tokenizer_revision,
                                                 download_dir=config.download_dir)
    return dataclasses.replace(config, model=model, tokenizer=tokenizer)


class LLM:
    def __init__(self, model: str | None = None, *, tokenizer: str | None = None, **engine_options):
        """model: a folder or a Hub id (org/name, at revision=...); resolved here once, so every worker of a
        tensor-parallel group loads the same snapshot."""
        self.config = resolved_files(EngineConfig.from_kwargs(model=model, tokenizer=tokenizer, **engine_options))
        executor, self._workers = self._start_workers(self.config)
        info = executor.worker_info()
        self.tokenizer = load_tokenizer(self.config.tokenizer or info.model)
        self.generation_defaults = read_generation_defaults(self.config.generation_config, info.model,
                                                            self.config.override_generation_config)
        if self.generation_defaults.as_dict():
            log.info("the model's sampling defaults apply to requests that leave them unset",
                     defaults=self.generation_defaults.as_dict(), source=self.generation_defaults.source)
        limits = SchedulerLimits(max_num_seqs=self.config.max_num_seqs,
                                 max_num_batched_tokens=self.config.token_budget(info.max_model_len),
                                 enable_chunked_prefill=self.config.enable_chunked_prefill,
                                 preemption_mode=self.config.preemption_mode,
                                 scheduling_policy=self.config.scheduling_policy)
        self.engine = EngineCore(executor, limits, self.config.watermark, self.config.max_logprobs,
                                 self.config.enable_prefix_caching)
        self._request_ids = itertools.count()
        self._image_prompts: ImagePrompts | None = None  # the model's processor, made at the first prompt with images

    @staticmethod
    def _start_workers(config: EngineConfig):
        """(executor, the worker processes to stop at the end or None): a worker in this process, or with
        tensor parallelism one process per rank, driven over gRPC."""
        if config.tensor_parallel_size == 1:
            return InProcessExecutor(Worker(config)), None
        if config.model is None:
            config = dataclasses.replace(config, model=str(default_model_dir()))  # made here once, not by each rank
        # A model the ranks cannot share is refused here, before any process starts.
        if chosen_impl(config.model_impl, Path(config.model)) == "transformers":
            refuse_on_transformers_path(config.tensor_parallel_size, pooling=False, quantization=config.quantization)
        TensorParallel(0, config.tensor_parallel_size).shard(ModelConfig.from_model_dir(config.model))
        group = LocalWorkerGroup(config)
        try:
            executor = TensorParallelExecutor(group.addresses)
        except BaseException:
            group.stop()
            raise
        weakref.finalize(executor, group.stop)  # also at exit; close() does it at once
        return executor, group

    def close(self) -> None:
        """Release the engine (and stop the tensor-parallel worker processes, if any)."""
        try:
            self.engine.shutdown()
        except ServiceUnavailable:  # a worker that went away has nothing left to drop
            pass
        finally:
            if self._workers is not None:
                self._workers.stop()

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The parameters generate() and chat() use when given none: the model's generation_config.json
        defaults (--generation-config), as vLLM's."""
        defaults = self.generation_defaults
        return SamplingParams(**defaults.sampling, **({"max_tokens": defaults.max_tokens} if defaults.max_tokens
                                                      else {}))

    def stats(self) -> dict:
        return self.engine.get_stats()

    # --- generation ---------------------------------------------------------------------------------

    def generate(self, prompts: PromptType | SequenceABC[PromptType],
                 sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | SequenceABC[LoRARequest | None] | None = None,
                 priority: SequenceABC[int] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order. ``lora_request``: the adapter every
        prompt runs with, or one (or None) per prompt; the engine needs ``enable_lora=True``. ``priority``:
        one per prompt (lower runs first), with ``scheduling_policy="priority"``, as vLLM's."""
        return self._generate(prompts, sampling_params, use_tqdm, lora_request, priority)

    def _generate(self, prompts, sampling_params, use_tqdm: bool, lora_request, priority=None,
                  add_special_tokens: bool = True) -> list[RequestOutput]:
        """generate(); ``add_special_tokens``: False for a chat template's text, which holds its own."""
        prompts = self._prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = self._params_per_prompt(sampling_params, len(prompts))
        loras = self._loras_per_prompt(lora_request, len(prompts))
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority has {len(priority)} values for {len(prompts)} prompts; give one per prompt")
        priorities = [0] * len(prompts) if priority is None else list(priority)
        requests = [self._request(prompt, p, lora, rank, add_special_tokens)
                    for prompt, p, lora, rank in zip(prompts, params, loras, priorities)]
        trackers = [RequestTracker(request.request_id, text, request.prompt_token_ids, request.params, self.tokenizer)
                    for text, request in requests]
        self._add_all([request for _, request in requests])
        try:
            self._run(trackers, use_tqdm)
        except BaseException:
            for tracker in trackers:
                self.engine.abort_request(tracker.request_id)
            raise
        return [tracker.output() for tracker in trackers]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, chat_template: str | None = None,
             continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
             tools: list[dict] | None = None,
             lora_request: LoRARequest | SequenceABC[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """One conversation (a list of messages) or several; each through the chat template (which
        shows the tools, OpenAI's function definitions, where it knows how)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise ValueError("tools must be a list of dicts (OpenAI's {'type': 'function', 'function': {...}})")
        prompts = []
        for conversation in conversations:
            messages, images = self._chat_images(conversation)
            text = render_chat(self.tokenizer, messages, add_generation_prompt, chat_template, continue_final_message,
                               chat_template_kwargs, tools or None)
            prompts.append({"prompt": text, "multi_modal_data": {"image": images}} if images else text)
        return self._generate(prompts, sampling_params, use_tqdm, lora_request, add_special_tokens=False)

    def _chat_images(self, conversation: list[dict]) -> tuple[list[dict], list]:
        """The conversation with each image part (OpenAI's image_url, or vLLM's image_pil holding a PIL image) as
        the model's placeholder text, and the images in order."""
        if not isinstance(conversation, list):
            return conversation, []  # (render_chat says what is wrong with it)
        messages, images = [], []
        for i, message in enumerate(conversation):
            content = message.get("content") if isinstance(message, dict) else None
            if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") in IMAGE_PARTS
                                                        for p in content):
                messages.append(message)
                continue
            placeholder = self._images().chat_placeholder
            parts = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "image_pil":
                    images.append(part.get("image_pil"))
                elif kind == "image_url":
                    url = part.get("image_url")
                    url = url.get("url") if isinstance(url, dict) else url
                    images.append(load_image(url, OFFLINE_MEDIA, f"messages[{i}].content[{j}]"))
                parts.append({"type": "text", "text": placeholder} if kind in IMAGE_PARTS else part)
            messages.append({**message, "content": parts})
        return messages, images

    def _images(self) -> ImagePrompts:
        """The model's processor (ValueError for a text model)."""
        if self._image_prompts is None:
            if self.engine.info.image_token_id is None:
                raise ValueError(f"{self.engine.info.model} takes no images: it is a text model")
            self._image_prompts = image_prompts(self.engine.info.model, self.engine.info.image_token_id)
        return self._image_prompts

    # --- embeddings ---------------------------------------------------------------------------------

    def embed(self, prompts: PromptType | SequenceABC[PromptType],
              pooling_params: PoolingParams | SequenceABC[PoolingParams] | None = None,
              use_tqdm: bool = True, lora_request: LoRARequest | SequenceABC[LoRARequest | None] | None = None,
              truncate_prompt_tokens: int | None = None) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in input order (a pooling model: ``LLM(runner="pooling")``, or "auto" for a
        sentence-transformers directory); one PoolingParams for all, or one per prompt. ``truncate_prompt_tokens``
        is vLLM's keyword for the PoolingParams field."""
        pooled = self._pool(prompts, pooling_params, "embed", use_tqdm, lora_request, truncate_prompt_tokens)
        return [EmbeddingRequestOutput(request_id, text, token_ids, EmbeddingOutput(vector), num_cached_tokens=cached)
                for request_id, text, token_ids, vector, cached in pooled]

    def classify(self, prompts: PromptType | SequenceABC[PromptType],
                 pooling_params: PoolingParams | SequenceABC[PoolingParams] | None = None,
                 use_tqdm: bool = True, lora_request: LoRARequest | SequenceABC[LoRARequest | None] | None = None,
                 truncate_prompt_tokens: int | None = None) -> list[ClassificationRequestOutput]:
        """Each prompt's class scores, in input order (a sequence classifier: ``*ForSequenceClassification``);
        ``PoolingParams(use_activation=False)`` gives the raw logits."""
        pooled = self._pool(prompts, pooling_params, "classify", use_tqdm, lora_request, truncate_prompt_tokens)
        return [ClassificationRequestOutput(request_id, text, token_ids, ClassificationOutput(vector),
                                            num_cached_tokens=cached)
                for request_id, text, token_ids, vector, cached in pooled]

    def encode(self, prompts: PromptType | SequenceABC[PromptType],
               pooling_params: PoolingParams | SequenceABC[PoolingParams] | None = None, *,
               truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
               lora_request: LoRARequest | SequenceABC[LoRARequest | None] | None = None,
               pooling_task: str | None = None) -> list[PoolingRequestOutput]:
        """vLLM's generic pooling call: each prompt's pooled vector as a tensor (``outputs.data``), for
        ``pooling_task`` "embed" or "classify" (None: the model's own: class scores from a classifier,
        else an embedding). The same vectors as embed() and classify()."""
        pooler = self.engine.info.pooler
        task = pooling_task if pooling_task is not None else pooler.task if pooler is not None else "embed"
        if task not in ("embed", "classify"):
            raise ValueError(f"pooling_task must be 'embed' or 'classify' (or None for the model's own), got {task!r}")
        pooled = self._pool(prompts, pooling_params, task, use_tqdm, lora_request, truncate_prompt_tokens)
        return [PoolingRequestOutput(request_id, text, token_ids, PoolingOutput(torch.tensor(vector, dtype=torch.float32)),
                                     num_cached_tokens=cached)
                for request_id, text, token_ids, vector, cached in pooled]

    def score(self, text_1: str | SequenceABC[str], text_2: str | SequenceABC[str], use_tqdm: bool = True,
              lora_request: LoRARequest | None = None, truncate_prompt_tokens: int | None = None,
              pooling_params: PoolingParams | None = None) -> list[ScoringRequestOutput]:
        """vLLM's LLM.score: each pair's score (one text_1 against every text_2, or pair by pair). With an
        embedding model, the cosine similarity of the two texts' embeddings (each distinct text embedded
        once); with a one-label classifier (a cross-encoder), its score of the pair tokenized together
        (``truncate_prompt_tokens`` then trims the longer text of a pair, as the tokenizer truncates pairs)."""
        first, second = score_pairs(text_1, text_2)
        pooler = self.engine.info.pooler
        if pooler is not None and pooler.classifies:
            check_cross_encoder(pooler)
            params = (pooling_params or PoolingParams()).with_task("classify")
            k = params.truncate_prompt_tokens if truncate_prompt_tokens is None else truncate_prompt_tokens
            limit = token_limit(k, self.engine.info.max_model_len)
            pairs = [{"prompt_token_ids": self.tokenizer(a, b, truncation=limit is not None, max_length=limit).input_ids}
                     for a, b in zip(first, second)]
            outputs = self.classify(pairs, dataclasses.replace(params, truncate_prompt_tokens=None), use_tqdm,
                                    lora_request)
            return [ScoringRequestOutput(out.request_id, ScoringOutput(out.outputs.probs[0])) for out in outputs]
        distinct = list(dict.fromkeys(first + second))
        outputs = self.embed(distinct, pooling_params, use_tqdm, lora_request, truncate_prompt_tokens)
        vectors = {text: torch.tensor(out.outputs.embedding, dtype=torch.float64) for text, out in zip(distinct, outputs)}
        # A pair's id is its own: its score comes from two embedding requests (or one, shared with others).
        return [ScoringRequestOutput(str(next(self._request_ids)), ScoringOutput(
                    torch.nn.functional.cosine_similarity(vectors[a], vectors[b], dim=0).item()))
                for a, b in zip(first, second)]

    def _pool(self, prompts, pooling_params, task: str, use_tqdm: bool, lora_request,
              truncate_prompt_tokens: int | None) -> list[tuple[str, str | None, list[int], list[float], int]]:
        """(request id, text, token ids, pooled vector, cached prompt tokens) per prompt, in input order."""
        prompts = self._prompt_list(prompts)
        params = self._pooling_per_prompt(pooling_params, len(prompts), task)
        if truncate_prompt_tokens is not None:
            params = [dataclasses.replace(p, truncate_prompt_tokens=truncate_prompt_tokens) for p in params]
        loras = self._loras_per_prompt(lora_request, len(prompts))
        pooler = self.engine.info.pooler
        requests = []
        for prompt, p, lora in zip(prompts, params, loras):
            if pooler is not None:  # sentence-transformers' do_lower_case
                if isinstance(prompt, str):
                    prompt = pooler.text(prompt)
                elif isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
                    prompt = {**prompt, "prompt": pooler.text(prompt["prompt"])}
            if isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None:
                raise ValueError("embeddings of prompts with images are not supported")
            text, token_ids, _ = self._tokenize(prompt)
            token_ids = p.truncated(token_ids, self.engine.info.max_model_len)
            requests.append((text, EngineRequest(str(next(self._request_ids)), token_ids, lora=lora, pooling=p)))
        self._add_all([request for _, request in requests])
        try:
            pooled = self._run_pooling({request.request_id for _, request in requests}, use_tqdm)
        except BaseException:
            for _, request in requests:
                self.engine.abort_request(request.request_id)
            raise
        return [(request.request_id, text, request.prompt_token_ids, *pooled[request.request_id])
                for text, request in requests]

    def _run_pooling(self, request_ids: set[str], use_tqdm: bool) -> dict[str, tuple[list[float], int]]:
        """Steps until every request has its pooled output: (vector, cached prompt tokens) by request id."""
        done: dict[str, tuple[list[float], int]] = {}
        progress = tqdm(total=len(request_ids), desc="Pooling", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while self.engine.has_unfinished():
                for update in self.engine.step():
                    if update.request_id not in request_ids:
                        continue
                    if update.error is not None:
                        raise ValueError(f"request {update.request_id} failed: {update.error}")
                    if update.embedding is not None:
                        done[update.request_id] = (update.embedding, update.num_cached_tokens)
                        progress.update(1)
        finally:
            progress.close()
        missing = request_ids - set(done)
        if missing:  # an engine that stops with requests unanswered is a bug, not an empty answer
            raise RuntimeError(f"the engine finished without embeddings for requests {sorted(missing)}")
        return done

    # --- internals ----------------------------------------------------------------------------------

    @staticmethod
    def _prompt_list(prompts) -> list[PromptType]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if isinstance(prompts, Iterable):  # a list, a tuple, a generator
            return list(prompts)
        raise ValueError(f"prompts must be a string, a prompt dict or a list of them, got {type(prompts).__name__}")

    @staticmethod
    def _params_per_prompt(sampling_params, count: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * count
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        if isinstance(sampling_params, dict) or not isinstance(sampling_params, Iterable):
            raise ValueError(f"sampling_params must be SamplingParams or a list of them, got "
                             f"{type(sampling_params).__name__}")
        params = list(sampling_params)
        if len(params) != count:
            raise ValueError(f"got {len(params)} sampling params for {count} prompts; give one, or one per prompt")
        return params

    @staticmethod
    def _pooling_per_prompt(pooling_params, count: int, task: str) -> list[PoolingParams]:
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            return [(pooling_params or PoolingParams()).with_task(task)] * count
        params = list(pooling_params) if isinstance(pooling_params, Iterable) and \
            not isinstance(pooling_params, (str, dict)) else None
        if params is None or len(params) != count or not all(isinstance(p, PoolingParams) for p in params):
            raise ValueError(f"pooling_params must be PoolingParams, or one PoolingParams per prompt ({count}), "
                             f"got {pooling_params!r:.200}")
        return [p.with_task(task) for p in params]

    @staticmethod
    def _loras_per_prompt(lora_request, count: int) -> list[LoRARequest | None]:
        if lora_request is None or isinstance(lora_request, LoRARequest):
            return [lora_request] * count
        if isinstance(lora_request, (str, dict)) or not isinstance(lora_request, Iterable):
            raise ValueError(f"lora_request must be a LoRARequest or a list of them, got {type(lora_request).__name__}")
        loras = list(lora_request)
        if len(loras) != count or not all(lora is None or isinstance(lora, LoRARequest) for lora in loras):
            raise ValueError(f"lora_request must be one LoRARequest, or one LoRARequest or None per prompt "
                             f"({count}), got {loras!r:.200}")
        return loras

    def _request(self, prompt: PromptType, params: SamplingParams, lora: LoRARequest | None,
                 priority: int = 0, add_special_tokens: bool = True) -> tuple[str | None, EngineRequest]:
        """(its text, its engine request) of a prompt, validated before a detokenizer per sequence is built."""
        text, token_ids, images = self._tokenize(prompt, add_special_tokens)
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        if images and params.truncate_prompt_tokens is not None:
            raise ValueError("truncate_prompt_tokens cannot cut a prompt with images (it could cut one in two)")
        token_ids = params.truncated(token_ids, self.engine.info.max_model_len)
        params = params.with_bad_words_tokenized(lambda word: self.tokenizer(word, add_special_tokens=False).input_ids)
        request = EngineRequest(str(next(self._request_ids)), token_ids, params, lora=lora, priority=priority,
                                images=images)
        validate(request, self.engine.request_limits)
        return text, request

    def _tokenize(self, prompt: PromptType, add_special_tokens: bool = True
                  ) -> tuple[str | None, list[int], tuple[ImageInput, ...]]:
        """(its text, its token ids, its images) of a prompt: a string, or a dict with 'prompt' and/or
        'prompt_token_ids', and with a 'prompt', vLLM's 'multi_modal_data' ({"image": a PIL image or a list})."""
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"}
            if unknown:
                raise ValueError(f"prompt keys {sorted(unknown)} are not supported (only 'prompt', 'prompt_token_ids' "
                                 "and 'multi_modal_data')")
            if "prompt" in prompt and not isinstance(prompt["prompt"], str):
                raise ValueError(f"a prompt's 'prompt' must be a string, got {type(prompt['prompt']).__name__}")
            if prompt.get("multi_modal_data") is not None:
                return self._tokenize_with_images(prompt, add_special_tokens)
        return (*self._tokenize_text(prompt, add_special_tokens), ())

    def _tokenize_with_images(self, prompt: dict, add_special_tokens: bool
                              ) -> tuple[str, list[int], tuple[ImageInput, ...]]:
        data = prompt["multi_modal_data"]
        if not isinstance(data, dict) or set(data) - {"image"}:
            raise ValueError(f"multi_modal_data takes 'image' (a PIL image or a list of them), got {data!r:.100}")
        if "prompt" not in prompt:
            raise ValueError("a prompt with multi_modal_data needs its 'prompt' text, with a placeholder where each "
                             "image goes (the model's processor expands it)")
        images = data.get("image", [])
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        if not images:
            return (*self._tokenize_text(prompt, add_special_tokens), ())
        token_ids, inputs = self._images().process(prompt["prompt"], images, add_special_tokens)
        return prompt["prompt"], token_ids, inputs

    def _tokenize_text(self, prompt: PromptType, add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, token_ids = prompt.get("prompt"), _token_ids(prompt["prompt_token_ids"])
        elif isinstance(prompt, dict) and "prompt" in prompt:
            text, token_ids = prompt["prompt"], self.tokenizer(prompt["prompt"],
                                                               add_special_tokens=add_special_tokens).input_ids
        else:
            raise ValueError(f"a prompt must be a string or a dict with 'prompt' or 'prompt_token_ids', got {prompt!r}")
        return text, token_ids

    def _add_all(self, requests: list[EngineRequest]) -> None:
        """All or nothing: one refused request leaves none of the others in the engine."""
        added = []
        try:
            for request in requests:
                self.engine.add_request(request)
                added.append(request.request_id)
        except Exception:
            for request_id in added:
                self.engine.abort_request(request_id)
            raise

    def _run(self, trackers: list[RequestTracker], use_tqdm: bool) -> None:
        by_id = {tracker.request_id: tracker for tracker in trackers}
        with (tqdm(total=len(trackers), desc="Generating", disable=not use_tqdm, dynamic_ncols=True) as progress,
              heap_frozen_while_running()):
            while self.engine.has_unfinished():
                for update in self.engine.step():
                    self._apply(update, by_id.get(update.request_id), progress)

    def _apply(self, update: SequenceUpdate, tracker: RequestTracker | None, progress: tqdm) -> None:
        """One engine output applied to its request's tracker (None: not one of this call's requests)."""
        if tracker is None:
            return
        if update.error is not None:  # (generate aborts the others)
            raise ValueError(f"request {tracker.request_id} failed: {update.error}")
        stop = tracker.apply(update)
        if stop is not None:
            self.engine.finish_by_stop_string(update.request_id, update.seq_index, stop)
        if tracker.finished:
            progress.update(1)


IMAGE_PARTS = ("image_url", "image_pil")  # a chat message's image parts offline (vLLM's)
OFFLINE_MEDIA = MediaOptions()  # image URLs in LLM.chat: data: and http(s) ones, as the gateway reads them by default


def _token_ids(value) -> list[int]:
    """prompt_token_ids as Python ints: a list or tuple of ints, or a 1-d numpy array or torch tensor."""
    try:
        if isinstance(value, (str, bytes)) or getattr(value, "ndim", 1) != 1:
            raise TypeError
        ids = [operator.index(t) for t in value]
        if any(isinstance(t, bool) for t in value):
            raise TypeError
        return ids
    except TypeError:
        raise ValueError(f"prompt_token_ids must be a sequence of integer token ids, got {value!r:.80}") from None
