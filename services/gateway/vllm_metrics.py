"""vLLM's metric names on /metrics, beside pagedserve's own: dashboards, autoscalers (KEDA, an HPA through
prometheus-adapter) and routers made for vLLM read ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``
or ``vllm:time_to_first_token_seconds`` without a change.

Each is labelled with ``model_name`` (the served model, as vLLM labels them). The engine's come per
scheduler, labelled ``engine`` with its place in the gateway's --scheduler list (as vLLM's V1 labels its
engines): a scheduler that did not answer GetStats is missing from that scrape rather than lowering a sum,
and a restarted one's counters and histograms start again from 0, which Prometheus' rate() reads as a
reset of its own. The gateway's histograms and counters are the same series as pagedserve's, under
vLLM's names (not observed twice).

From the engine (GetStats; the scheduler observes them, services/scheduler/request_stats.py):
the request gauges (``num_requests_waiting_by_reason``: ``deferred`` are waiting sequences a LoRA
adapter beyond max_loras holds back, or a recomputed beam whose group has yet to decide; ``capacity``
the rest), the KV cache's usage (V1's name, V0's ``gpu_`` and ``cpu_cache_usage_perc``), the counters
(preemptions, prefix cache, prompt tokens by source, speculative decoding, also per draft position),
``cache_config_info``, ``lora_requests_info`` (with LoRA; labelled ``engine`` too, so schedulers do not
collide), and the histograms: ``iteration_tokens_total`` (tokens each step computed), the request
phases' times (queue, prefill, decode, inference, time per output token), ``request_num_preemptions``,
``request_params_n``, ``request_params_max_tokens``, ``request_max_num_generation_tokens`` and
``request_prefill_kv_computed_tokens``. An engine request is observed once (n > 1 together; vLLM
observes each of n apart). The prompt token sources count each sequence's prompt at its first
admission: a resumed request's sequences each prefill theirs.

vLLM's metrics not exported, and why:
- ``vllm:engine_sleep_state``: there is no sleep mode.
- ``vllm:corrupted_requests``: logits are not checked for NaNs.
- ``vllm:kv_offload_*`` and the KV connector's transfer metrics: the host tier is no connector; its blocks
  stored and loaded are ``pagedserve_engine_kv_offload_blocks_stored`` and ``_loaded``. (Its lookups are
  ``vllm:external_prefix_cache_queries`` and ``_hits``, and its tokens the ``external_kv_transfer`` source.)
- ``vllm:mm_cache_*``: no multimodal inputs.
- ``vllm:kv_block_lifetime_seconds``, ``vllm:kv_block_idle_before_evict_seconds``,
  ``vllm:kv_block_reuse_gap_seconds``: vLLM samples them only with --kv-cache-metrics; they would
  time every block on the allocation path.
- ``vllm:estimated_flops_per_gpu_total`` and the other MFU estimates (--enable-mfu-metrics): estimates
  from the model's shapes, not measurements.
- ``vllm:request_priority``, ``vllm:scheduler_policy_info`` and the ``priority`` label: the scheduler
  orders by priority under --scheduling-policy priority, but these are not measured yet.
- V0's ``gpu_``/``cpu_prefix_cache_hit_rate``, ``time_in_queue_requests``, ``model_forward_time_milliseconds``,
  ``model_execute_time_milliseconds``, ``request_params_best_of`` and ``spec_decode_draft_acceptance_rate``:
  retired by vLLM for the counters and histograms above (the engine's forward time is
  ``pagedserve_engine_forward_time_s``).
"""

from __future__ import annotations

import time

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.gateway.engine_histograms import histogram_family
from shared.proto import pagedserve_internal_pb2 as wire

# engine stat -> vLLM's gauge
_GAUGES = {"num_requests_running": "vllm:num_requests_running", "num_requests_waiting": "vllm:num_requests_waiting",
           "num_requests_swapped": "vllm:num_requests_swapped"}
# engine stat -> vLLM's counter (without the _total Prometheus adds)
_COUNTERS = {"num_preemptions": "vllm:num_preemptions", "prefix_cache_queries": "vllm:prefix_cache_queries",
             "prefix_cache_hits": "vllm:prefix_cache_hits", "prompt_tokens_cached": "vllm:prompt_tokens_cached",
             "spec_decode_num_drafts": "vllm:spec_decode_num_drafts",
             "spec_decode_num_draft_tokens": "vllm:spec_decode_num_draft_tokens",
             "spec_decode_num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
             # the host tier (--kv-offloading-size): vLLM counts its offloading connector's lookups here
             "host_cache_queries": "vllm:external_prefix_cache_queries",
             "host_cache_hits": "vllm:external_prefix_cache_hits"}
# vLLM's sources of prompt tokens -> the engine stat counting them (None: none can come from there)
_PROMPT_SOURCES = {"local_compute": "prompt_tokens_computed", "local_cache_hit": "prompt_tokens_local_hit",
                   "external_kv_transfer": "prompt_tokens_loaded"}
_ACCEPTED_PER_POS = "spec_decode_num_accepted_tokens_per_pos_"  # + the draft position
# KV usage, 0 to 1: (vLLM's name, the engine's blocks used, its blocks in all)
_USAGES = (("vllm:kv_cache_usage_perc", "kv_blocks_used", "kv_blocks_total"),
           ("vllm:gpu_cache_usage_perc", "kv_blocks_used", "kv_blocks_total"),  # V0's name
           ("vllm:cpu_cache_usage_perc", "kv_host_blocks_used", "kv_host_blocks_total"))  # V0's: swap space
# pagedserve's series -> vLLM's names for it
_RENAMED = {"pagedserve_prompt_tokens": ("vllm:prompt_tokens",),
            "pagedserve_generation_tokens": ("vllm:generation_tokens",),
            "pagedserve_time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
            "pagedserve_e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
            # Each gap between a sequence's outputs, as V1's; under V1's name and the older one dashboards read
            "pagedserve_inter_token_latency_seconds": ("vllm:inter_token_latency_seconds",
                                                       "vllm:time_per_output_token_seconds"),
            "pagedserve_request_prompt_tokens": ("vllm:request_prompt_tokens",),
            "pagedserve_request_generation_tokens": ("vllm:request_generation_tokens",),
            "pagedserve_request_success": ("vllm:request_success",)}
_PER_ENGINE = ["engine", "model_name"]


class VllmMetrics(Collector):
    def __init__(self, own: list):
        self.own = own  # pagedserve's collectors whose series _RENAMED names again
        self.model_name = ""
        self.engines: dict[str, wire.EngineStats] = {}  # each answering scheduler's stats, by its engine label

    def update(self, engine_stats: dict[str, wire.EngineStats | None], model_name: str | None) -> None:
        """Before a scrape: each scheduler's GetStats in --scheduler order (None: it did not answer), and
        the served model's name."""
        self.model_name = model_name or ""
        self.engines = {str(i): stats for i, stats in enumerate(engine_stats.values()) if stats is not None}

    def collect(self):
        yield from self._gauges()
        yield from self._counters()
        yield from self._infos()
        yield from self._histograms()
        labels = {"model_name": self.model_name}
        for collector in self.own:
            for family in collector.collect():
                for name in _RENAMED.get(family.name, ()):
                    yield _renamed(family, name, labels)

    def _gauges(self):
        gauges = {name: GaugeMetricFamily(name, f"engine {stat} (pagedserve_engine_{stat})", labels=_PER_ENGINE)
                  for stat, name in _GAUGES.items()}
        by_reason = GaugeMetricFamily("vllm:num_requests_waiting_by_reason",
                                      "waiting requests by why they wait: deferred (a passing limit: a LoRA adapter "
                                      "beyond max_loras) or capacity (the rest); they add up to num_requests_waiting",
                                      labels=[*_PER_ENGINE, "reason"])
        usages = {name: GaugeMetricFamily(name, f"{used} / {total}, 0 to 1", labels=_PER_ENGINE)
                  for name, used, total in _USAGES}
        for engine, stats in self.engines.items():
            values, label_values = stats.values, [engine, self.model_name]
            for stat, name in _GAUGES.items():
                gauges[name].add_metric(label_values, values.get(stat, 0.0))
            deferred = values.get("num_requests_waiting_deferred", 0.0)
            by_reason.add_metric([*label_values, "capacity"], values.get("num_requests_waiting", 0.0) - deferred)
            by_reason.add_metric([*label_values, "deferred"], deferred)
            for name, used, total in _USAGES:
                blocks = values.get(total, 0.0)
                usages[name].add_metric(label_values, values.get(used, 0.0) / blocks if blocks else 0.0)
        yield from gauges.values()
        yield by_reason
        yield from usages.values()

    def _counters(self):
        counters = {name: CounterMetricFamily(name, f"engine {stat} (pagedserve_engine_{stat})", labels=_PER_ENGINE)
                    for stat, name in _COUNTERS.items()}
        by_source = CounterMetricFamily("vllm:prompt_tokens_by_source", "prompt tokens by where their KV came from",
                                        labels=[*_PER_ENGINE, "source"])
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "accepted draft tokens by their position in the draft",
                                      labels=[*_PER_ENGINE, "position"])
        for engine, stats in self.engines.items():
            values, label_values = stats.values, [engine, self.model_name]
            for stat, name in _COUNTERS.items():
                counters[name].add_metric(label_values, values.get(stat, 0.0))
            for source, stat in _PROMPT_SOURCES.items():
                by_source.add_metric([*label_values, source], values.get(stat, 0.0) if stat else 0.0)
            for stat, value in values.items():
                if stat.startswith(_ACCEPTED_PER_POS):
                    per_pos.add_metric([*label_values, stat.removeprefix(_ACCEPTED_PER_POS)], value)
        yield from counters.values()
        yield by_source
        yield per_pos

    def _infos(self):
        """vLLM's info gauges: the value 1 (the LoRA one: the time of the scrape), the facts in the labels."""
        cache = GaugeMetricFamily("vllm:cache_config_info", "the KV cache's configuration",
                                  labels=["block_size", "enable_prefix_caching", "engine", "num_cpu_blocks",
                                          "num_gpu_blocks"])
        lora = GaugeMetricFamily("vllm:lora_requests_info", "the LoRA adapters of running and of waiting requests",
                                 labels=["engine", "max_lora", "running_lora_adapters", "waiting_lora_adapters"])
        for engine, stats in self.engines.items():
            values = stats.values
            cache.add_metric([_integer(values, "block_size"), str(bool(values.get("enable_prefix_caching"))), engine,
                              _integer(values, "kv_host_blocks_total"), _integer(values, "kv_blocks_total")], 1)
            if values.get("max_loras"):
                lora.add_metric([engine, _integer(values, "max_loras"), stats.labels.get("running_lora_adapters", ""),
                                 stats.labels.get("waiting_lora_adapters", "")], time.time())
        yield cache
        if lora.samples:
            yield lora

    def _histograms(self):
        for name in sorted({name for stats in self.engines.values() for name in stats.histograms}):
            yield histogram_family(f"vllm:{name}", f"engine histogram {name} (pagedserve_engine_{name})", _PER_ENGINE,
                                   [([engine, self.model_name], stats.histograms[name])
                                    for engine, stats in self.engines.items() if name in stats.histograms])


def _integer(values, stat: str) -> str:
    """A count as vLLM's info labels write it ("16")."""
    return str(int(values.get(stat, 0)))


def _renamed(family: Metric, name: str, labels: dict[str, str]) -> Metric:
    """The family's samples under ``name``, with ``labels`` added (its _created samples left out)."""
    out = Metric(name, family.documentation, family.type)
    for sample in family.samples:
        if sample.name.endswith("_created"):
            continue
        out.add_sample(name + sample.name[len(family.name):], {**labels, **sample.labels}, sample.value)
    return out
