"""vLLM's metric names on /metrics, beside pagedserve's own: dashboards, autoscalers (KEDA, an HPA through
prometheus-adapter) and routers made for vLLM read ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``
or ``vllm:time_to_first_token_seconds`` without a change.

Each is labelled with ``model_name`` (the served model, as vLLM labels them). The engine's come per
scheduler, labelled ``engine`` with its place in the gateway's --scheduler list (as vLLM's V1 labels its
engines): a scheduler that did not answer GetStats is missing from that scrape rather than lowering a sum,
and a restarted one's counters start again from 0, which Prometheus' rate() reads as a reset of its own.
The gateway's histograms and counters are the same series as pagedserve's, under vLLM's names (not
observed twice).
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# engine stat -> vLLM's gauge
_GAUGES = {"num_requests_running": "vllm:num_requests_running", "num_requests_waiting": "vllm:num_requests_waiting",
           "num_requests_swapped": "vllm:num_requests_swapped"}
# engine stat -> vLLM's counter (without the _total Prometheus adds)
_COUNTERS = {"num_preemptions": "vllm:num_preemptions", "prefix_cache_queries": "vllm:prefix_cache_queries",
             "prefix_cache_hits": "vllm:prefix_cache_hits", "spec_decode_num_drafts": "vllm:spec_decode_num_drafts",
             "spec_decode_num_draft_tokens": "vllm:spec_decode_num_draft_tokens",
             "spec_decode_num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens"}
# pagedserve's series -> vLLM's names for it
_RENAMED = {"pagedserve_prompt_tokens": ("vllm:prompt_tokens",),
            "pagedserve_generation_tokens": ("vllm:generation_tokens",),
            "pagedserve_time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
            "pagedserve_e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
            # V1's name, and the older one dashboards still read
            "pagedserve_time_per_output_token_seconds": ("vllm:inter_token_latency_seconds",
                                                         "vllm:time_per_output_token_seconds"),
            "pagedserve_request_prompt_tokens": ("vllm:request_prompt_tokens",),
            "pagedserve_request_generation_tokens": ("vllm:request_generation_tokens",),
            "pagedserve_request_success": ("vllm:request_success",)}


class VllmMetrics(Collector):
    def __init__(self, own: list):
        self.own = own  # pagedserve's collectors whose series _RENAMED names again
        self.model_name = ""
        self.engines: dict[str, dict[str, float]] = {}  # each answering scheduler's stats, by its engine label

    def update(self, engine_stats: dict[str, dict[str, float] | None], model_name: str | None) -> None:
        """Before a scrape: each scheduler's GetStats in --scheduler order (None: it did not answer), and
        the served model's name."""
        self.model_name = model_name or ""
        self.engines = {str(i): stats for i, stats in enumerate(engine_stats.values()) if stats is not None}

    def collect(self):
        labels = {"model_name": self.model_name}
        per_engine = ["engine", "model_name"]
        gauges = {name: GaugeMetricFamily(name, f"engine {stat} (pagedserve_engine_{stat})", labels=per_engine)
                  for stat, name in _GAUGES.items()}
        usages = [GaugeMetricFamily(name, "KV cache blocks in use, 0 to 1", labels=per_engine)
                  for name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")]  # V1's name, and V0's
        counters = {name: CounterMetricFamily(name, f"engine {stat} (pagedserve_engine_{stat})", labels=per_engine)
                    for stat, name in _COUNTERS.items()}
        for engine, stats in self.engines.items():
            values = [engine, self.model_name]
            for stat, name in _GAUGES.items():
                gauges[name].add_metric(values, stats.get(stat, 0.0))
            total = stats.get("kv_blocks_total", 0.0)
            for family in usages:
                family.add_metric(values, stats.get("kv_blocks_used", 0.0) / total if total else 0.0)
            for stat, name in _COUNTERS.items():
                counters[name].add_metric(values, stats.get(stat, 0.0))
        yield from gauges.values()
        yield from usages
        yield from counters.values()
        for collector in self.own:
            for family in collector.collect():
                for name in _RENAMED.get(family.name, ()):
                    yield _renamed(family, name, labels)


def _renamed(family: Metric, name: str, labels: dict[str, str]) -> Metric:
    """The family's samples under ``name``, with ``labels`` added (its _created samples left out)."""
    out = Metric(name, family.documentation, family.type)
    for sample in family.samples:
        if sample.name.endswith("_created"):
            continue
        out.add_sample(name + sample.name[len(family.name):], {**labels, **sample.labels}, sample.value)
    return out
