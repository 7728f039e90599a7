"""The engines' histograms (GetStats) as Prometheus families: pagedserve_engine_<name>{scheduler}, and
the same histograms under vLLM's names (vllm_metrics.py). Each scrape shows what the schedulers sent
for it: cumulative since each one started, like their counters."""

from __future__ import annotations

from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from shared.proto import pagedserve_internal_pb2 as wire


def histogram_family(name: str, documentation: str, label_names: list[str],
                     series: list[tuple[list[str], wire.Histogram]]) -> HistogramMetricFamily:
    """One family, a series per (label values, histogram)."""
    family = HistogramMetricFamily(name, documentation, labels=label_names)
    for label_values, histogram in series:
        buckets = [(floatToGoString(b), c) for b, c in zip(histogram.bounds, histogram.cumulative_counts)]
        family.add_metric(label_values, [*buckets, ("+Inf", histogram.count)], histogram.sum)
    return family


class EngineHistograms(Collector):
    """pagedserve_engine_<name>, labelled by scheduler address."""

    def __init__(self):
        self.stats: dict[str, wire.EngineStats] = {}  # each answering scheduler's, by address

    def update(self, engine_stats: dict[str, wire.EngineStats | None]) -> None:
        self.stats = {address: stats for address, stats in engine_stats.items() if stats is not None}

    def collect(self):
        for name in sorted({name for stats in self.stats.values() for name in stats.histograms}):
            yield histogram_family(f"pagedserve_engine_{name}", f"engine histogram {name} (GetStats)", ["scheduler"],
                                   [([address], stats.histograms[name]) for address, stats in self.stats.items()
                                    if name in stats.histograms])
