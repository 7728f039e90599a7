"""Span attribute names: OpenTelemetry's GenAI semantic conventions where they name the thing, vLLM's
additions (vllm/tracing.py SpanAttributes) where they do not yet, then pagedserve's own."""

from __future__ import annotations

# OpenTelemetry's GenAI conventions (as vLLM spells them: usage.prompt_tokens, not input_tokens).
USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
REQUEST_TOP_P = "gen_ai.request.top_p"
REQUEST_TEMPERATURE = "gen_ai.request.temperature"
RESPONSE_MODEL = "gen_ai.response.model"
RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"

# vLLM's, until the conventions have them. Latencies in seconds.
REQUEST_ID = "gen_ai.request.id"
REQUEST_N = "gen_ai.request.n"
USAGE_NUM_SEQUENCES = "gen_ai.usage.num_sequences"
LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
LATENCY_E2E = "gen_ai.latency.e2e"
LATENCY_TIME_IN_MODEL_FORWARD = "gen_ai.latency.time_in_model_forward"
LATENCY_TIME_IN_MODEL_EXECUTE = "gen_ai.latency.time_in_model_execute"
LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"

# pagedserve's.
CACHED_PROMPT_TOKENS = "pagedserve.usage.cached_prompt_tokens"  # prompt tokens the prefix cache held
NUM_PREEMPTIONS = "pagedserve.num_preemptions"
NUM_RESUMES = "pagedserve.num_resumes"  # times the gateway resubmitted the request after losing its scheduler
STEP_ID = "pagedserve.step.id"
STEP_NUM_SEQUENCES = "pagedserve.step.num_sequences"
STEP_NUM_SCHEDULED_TOKENS = "pagedserve.step.num_scheduled_tokens"
TENSOR_PARALLEL_RANK = "pagedserve.tensor_parallel_rank"


def request_attributes(request) -> dict:
    """An engine request's own attributes (shared/request.py's EngineRequest), as vLLM sets them: its id, its
    prompt's length and, for generation, the sampling parameters it asked for."""
    attributes = {REQUEST_ID: request.request_id, USAGE_PROMPT_TOKENS: len(request.prompt_token_ids)}
    if request.pooling is None:
        params = request.params
        attributes.update({REQUEST_TEMPERATURE: float(params.temperature), REQUEST_TOP_P: float(params.top_p),
                           REQUEST_N: params.n})
        if params.max_tokens is not None:
            attributes[REQUEST_MAX_TOKENS] = params.max_tokens
    return attributes
