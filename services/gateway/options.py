"""The gateway's options (`pagedserve gateway`, the gateway group of `pagedserve serve`), declared once:
their flags and PAGEDSERVE_* variables derive from here (shared/options.py)."""

from __future__ import annotations

from dataclasses import dataclass

from services.gateway.api_keys import DEFAULT_PREFIX
from services.gateway.http_limits import HttpLimits
from services.gateway.reasoning_parsers import REASONING_PARSERS
from services.gateway.tool_parsers import TOOL_CALL_PARSERS
from shared.config import EngineConfig
from shared.options import Option, option, options_of, read_by
from shared.tracing import TracingOptions

_HTTP = HttpLimits()  # the limits' defaults are declared there
ROUTING_POLICIES = ("cached-prefix", "prompt-hash")  # services/gateway/scheduler_pool.py's rules


@dataclass(frozen=True)
class GatewayOptions:
    host: str = option("127.0.0.1", "address to listen on (HTTP and gRPC)")
    port: int = option(8000, "HTTP (OpenAI API) port")
    grpc_port: int = option(50050, "public gRPC API port")
    scheduler: list[str] | None = option(
        None, "scheduler address, host:port (default: 127.0.0.1:50051); repeat (or comma-separate in "
              "PAGEDSERVE_SCHEDULER) for several, each with its own worker: requests are spread over them "
              "(services/gateway/scheduler_pool.py)")
    routing: str = option("cached-prefix", "how a request picks among several schedulers: cached-prefix (the one "
                                           "holding the longest cached start of its prompt, within a load slack), "
                                           "or prompt-hash (by its first 32 tokens only)", choices=ROUTING_POLICIES)
    served_model_name: list[str] | None = option(
        None, "model ids clients use (default: the model directory's name); with several, as vLLM's, requests may "
              "name any and answers carry the first", several=True)
    max_concurrent_requests: int | None = option(None, "requests in flight beyond this get 429 (default: no limit)")
    connect_timeout: float = option(2.0, "seconds to wait for a connection to the scheduler before answering 503")
    backend_timeout: float = option(
        120.0, "seconds the scheduler may stay silent while requests are in flight before they are abandoned with "
               "503 (while its engine steps it speaks at least once a second, so keep this well above 1)")
    max_resumes: int = option(
        3, "times a request whose scheduler is lost (it died, hung or stopped, or its worker died) is submitted "
           "again to a scheduler that serves, carrying on after the tokens it had produced; 0: such requests fail "
           "with 503")
    resume_timeout: float = option(
        30.0, "seconds one resumption waits for a scheduler to take the request (a restarted one, or another) "
              "before the request fails with 503")
    enable_auto_tool_choice: bool = option(
        False, "answer tool_choice 'auto' (the default with tools): the model's own tool calls are read from its "
               "text with --tool-call-parser and returned as tool_calls")
    tool_call_parser: str | None = option(
        None, "the model's tool-call format: hermes (Hermes, Qwen 2.5/3, the built-in model), llama3_json "
              "(Llama 3.1-3.3)", choices=tuple(sorted(TOOL_CALL_PARSERS)))
    reasoning_parser: str | None = option(
        None, "the model's reasoning format: chat answers carry the text between <think> and </think> as "
              "reasoning (and reasoning_content), apart from the content: deepseek_r1 (R1 and its distills, QwQ), "
              "qwen3", choices=tuple(sorted(REASONING_PARSERS)))
    allowed_origins: str = option("*", "comma-separated origins browsers may call the HTTP API from (CORS); '' "
                                       "turns CORS off")
    api_key: list[str] | None = option(
        None, "a key every request must carry as 'Authorization: Bearer <key>' (HTTP) or 'authorization' metadata "
              "(gRPC); repeat for several, or comma-separate them in PAGEDSERVE_API_KEY", secret=True)
    api_key_store: str | None = option(
        None, "Redis URL (redis://host:6379/0) of the API keys made with 'pagedserve api-keys', with their "
              "per-minute request and token limits; requests must carry one of them (or an --api-key)", secret=True)
    api_key_store_prefix: str = option(DEFAULT_PREFIX, "where in Redis the keys and their rate counters live "
                                                       "(deployments sharing one Redis keep apart with their own)")
    drain_timeout: float = option(10.0, "seconds in-flight requests get to finish on shutdown")
    lora_modules: list[str] | None = option(
        None, "LoRA adapters served beside the model, each as name=path (or JSON with name, path and "
              "base_model_name): requests whose model is the name run with it; several, or the flag repeated "
              "(PAGEDSERVE_LORA_MODULES: comma-separated, or a JSON list); the workers need --enable-lora",
        several=True)
    trust_request_chat_template: bool = option(
        False, "let a chat request (and /tokenize) bring its own chat_template, as vLLM's flag; without it such "
               "requests get a 400")
    return_tokens_as_token_ids: bool = option(
        False, "logprobs name each token 'token_id:<id>' (vLLM's flag; a request's return_tokens_as_token_ids "
               "overrides it): a token whose text is part of a character stays identifiable")
    allow_runtime_lora_updating: bool = option(
        False, "serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
               "VLLM_ALLOW_RUNTIME_LORA_UPDATING): adapters added and removed while serving, at this gateway")
    # The HTTP server's limits on what a client may send and hold (http_limits.py).
    http_max_body_size: int = option(_HTTP.max_body_bytes, "bytes a request body may have: a larger one gets 413 "
                                                           "before any of it is parsed")
    http_max_header_size: int = option(_HTTP.max_header_bytes, "bytes a request's line and headers may have: more "
                                                               "get 431 and the connection closes")
    http_header_timeout: float = option(
        _HTTP.header_timeout_s, "seconds a request's line and headers may take to arrive (from its first byte, or "
                                "the connection's opening): then 408 and the connection closes")
    http_body_timeout: float = option(_HTTP.body_timeout_s, "seconds a request's body may take to arrive after its "
                                                            "headers: then 408 and the connection closes")
    http_max_connections: int = option(
        _HTTP.max_connections, "client connections the HTTP server keeps open: a request on one beyond them gets "
                               "503 (with Retry-After) and the connection closes")
    # Images in chat messages (media.py), as vLLM's flags.
    limit_mm_per_prompt: str | None = option(
        None, "the most images one prompt may hold, as JSON: '{\"image\": 4}' (default: 8)")
    allowed_media_domains: list[str] | None = option(
        None, "hosts (with their subdomains) whose http(s) image URLs the gateway fetches (default: any host)")
    allowed_local_media_path: str | None = option(
        None, "a folder whose files requests may name as file:// image URLs (default: no file URL is taken)")
    media_fetch_timeout: float = option(10.0, "seconds an image URL may take to fetch")
    max_image_bytes: int = option(20 << 20, "bytes an image may have, as sent or fetched")
    # vLLM's extra endpoints.
    enable_server_load_tracking: bool = option(
        False, "count the requests in flight at the endpoints that run the engine and serve the count at GET /load "
               "({\"server_load\": N}), as vLLM's flag")
    enable_tokenizer_info_endpoint: bool = option(
        False, "serve GET /tokenizer_info (the tokenizer's configuration and chat template), as vLLM's flag")


def gateway_options() -> tuple[Option, ...]:
    """Every option `pagedserve gateway` takes: its own, the engine's it reads (--tokenizer), and tracing."""
    return options_of(GatewayOptions) + read_by(EngineConfig, "gateway") + options_of(TracingOptions)
