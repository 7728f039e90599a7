"""Prometheus metrics of the gateway, plus the engine's own stats (GetStats) as gauges and histograms; and
the same again under vLLM's names (vllm_metrics.py).

Nothing here names an API key: /metrics is open to scrapers, so a key is labelled by its SHA-256's first
16 hex digits (what `pagedserve api-keys list` shows beside its name), never by its name.

Each gateway gets its own registry, so several can live in one process (tests).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from services.gateway.api_keys import ApiKey
from services.gateway.engine_histograms import EngineHistograms
from services.gateway.vllm_metrics import VllmMetrics
from shared.proto import pagedserve_internal_pb2 as wire

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)
TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class GatewayMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("pagedserve_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("pagedserve_prompt_tokens", "prompt tokens submitted", registry=r)
        self.generation_tokens = Counter("pagedserve_generation_tokens", "tokens generated", registry=r)
        self.ttft = Histogram("pagedserve_time_to_first_token_seconds", "arrival (the request read) to first output",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("pagedserve_e2e_request_latency_seconds",
                             "arrival (the request read) to last output, per engine request", buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("pagedserve_time_per_output_token_seconds",
                              "first output to last over the tokens after the first, per sequence of an engine "
                              "request (n > 1: their mean length; beam search: not observed)",
                              buckets=TOKEN_BUCKETS, registry=r)
        self.inter_token = Histogram("pagedserve_inter_token_latency_seconds",
                                     "between a sequence's outputs that bring tokens, as they reach the gateway "
                                     "(one per engine step, or per message when steps arrive together)",
                                     buckets=TOKEN_BUCKETS, registry=r)
        self.resumed = Counter("pagedserve_resumed_requests",
                               "engine requests submitted again, and taken, after their scheduler was lost", registry=r)
        self.resume_failures = Counter("pagedserve_resume_failures",
                                       "engine requests whose scheduler was lost and that no scheduler took again "
                                       "within the resume timeout (503)", registry=r)
        self.rate_limited = Counter("pagedserve_rate_limited_requests",
                                    "requests refused with 429 for an API key's rate limit, by the key's SHA-256 "
                                    "prefix (pagedserve api-keys list)", ["api_key_sha256"], registry=r)
        self.unauthenticated = Counter("pagedserve_unauthenticated_requests",
                                       "requests refused for a missing or unknown API key", registry=r)
        self.scheduler_up = Gauge("pagedserve_scheduler_up", "1 when the last GetStats succeeded", ["scheduler"],
                                  registry=r)
        self.scheduler_routable = Gauge("pagedserve_scheduler_routable",
                                        "1 while new requests may go to the scheduler (serving, same model)",
                                        ["scheduler"], registry=r)
        self.scheduler_prefix_blocks = Gauge("pagedserve_scheduler_prefix_blocks",
                                             "cached prefix blocks this gateway knows the scheduler holds (its "
                                             "Session stream tells it; the routing by cached prefix reads them)",
                                             ["scheduler"], registry=r)
        self.request_prompt_tokens = Histogram("pagedserve_request_prompt_tokens", "prompt tokens per engine request",
                                               buckets=TOKEN_COUNT_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram("pagedserve_request_generation_tokens",
                                                   "tokens generated per engine request (all its sequences)",
                                                   buckets=TOKEN_COUNT_BUCKETS, registry=r)
        self.request_success = Counter("pagedserve_request_success", "sequences ended, by why (stop, length, abort)",
                                       ["finished_reason"], registry=r)
        self._engine: dict[str, Gauge] = {}  # pagedserve_engine_<stat>, made as the scheduler reports them
        self.vllm = VllmMetrics([self.prompt_tokens, self.generation_tokens, self.ttft, self.e2e, self.inter_token,
                                 self.request_prompt_tokens, self.request_generation_tokens, self.request_success])
        r.register(self.vllm)
        self.engine_histograms = EngineHistograms()
        r.register(self.engine_histograms)

    def count_rate_limited(self, api_key: ApiKey) -> None:
        self.rate_limited.labels(api_key_sha256=api_key.key_id[:16]).inc()

    def finish(self, prompt_tokens: int, generation_tokens: int, seconds: float,
               first_output_s: float | None = None, num_sequences: int = 1, finish_reasons=()) -> None:
        for reason in finish_reasons:
            self.request_success.labels(finished_reason=reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generation_tokens)
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generation_tokens)
        self.e2e.observe(seconds)
        per_sequence = generation_tokens / num_sequences  # n > 1: the sequences decode side by side
        if first_output_s is not None and per_sequence > 1:
            self.tpot.observe((seconds - first_output_s) / (per_sequence - 1))

    def render(self, engine_stats: dict[str, wire.EngineStats | None], routable: dict[str, bool],
               model_name: str | None = None, prefix_blocks: dict[str, int] | None = None) -> bytes:
        """engine_stats: each scheduler's GetStats by address (None: it did not answer); routable:
        whether new requests go to it (the gateway's health poll found it serving its model);
        model_name: the served model's (vLLM's names' label), once known; prefix_blocks: the cached
        blocks the gateway knows of at each scheduler."""
        for address, blocks in (prefix_blocks or {}).items():
            self.scheduler_prefix_blocks.labels(scheduler=address).set(blocks)
        self.vllm.update(engine_stats, model_name)
        self.engine_histograms.update(engine_stats)
        for address, stats in engine_stats.items():
            self.scheduler_up.labels(scheduler=address).set(0 if stats is None else 1)
            self.scheduler_routable.labels(scheduler=address).set(1 if routable.get(address) else 0)
            for name, value in (stats.values.items() if stats is not None else ()):
                if name not in self._engine:
                    self._engine[name] = Gauge(f"pagedserve_engine_{name}", f"engine stat {name} (GetStats)",
                                               ["scheduler"], registry=self.registry)
                self._engine[name].labels(scheduler=address).set(value)
        return generate_latest(self.registry)
