"""vLLM's metrics the engine measures: per-request times and shapes, tokens per step, prompt token sources,
waiting reasons, the KV cache's configuration and the LoRA adapters; through the engine (LLM.stats(),
GetStats) and on a real stack's /metrics, driven with known requests. Counts, never timings."""

from __future__ import annotations

import dataclasses
import random

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.scheduler.engine_core import EngineCore
from services.scheduler.executor import InProcessExecutor
from services.scheduler.scheduler import SchedulerLimits
from services.scheduler.stats import stats_to_proto
from shared.lora import LoRARequest
from shared.sampling_params import SamplingParams
from tests.fake_worker import FakeWorker
from tests.services_harness import Stack, http_get
from tests.scheduler.test_scheduler import make_engine
from shared.request import EngineRequest

PHASES = ("queue", "prefill", "decode", "inference")


def run(engine: EngineCore) -> None:
    while engine.has_unfinished():
        engine.step()


def counts(stats: dict, *names: str) -> list[int]:
    return [stats[name]["count"] for name in names]


def phase_counts(stats: dict) -> list[int]:
    return counts(stats, *(f"request_{phase}_time_seconds" for phase in PHASES))


# --- the engine ------------------------------------------------------------------------------------------


def test_a_request_is_observed_once_as_it_ends_with_its_preemptions():
    # Two sequences of 8 + 16 tokens need 2 shared blocks and 4 each: 10 of 4 tokens, and the pool has 8.
    engine, _ = make_engine(num_blocks=8, block_size=4)
    engine.add_request(EngineRequest("r", list(range(1, 9)), SamplingParams(n=2, max_tokens=16, ignore_eos=True)))
    run(engine)
    stats = engine.get_stats()
    assert stats["num_preemptions"] >= 1, "the pool was meant to force preemption"
    assert phase_counts(stats) == [1, 1, 1, 1]  # once for the request, not per sequence
    assert stats["request_time_per_output_token_seconds"]["count"] == 1
    preemptions = stats["request_num_preemptions"]
    assert preemptions["sum"] == stats["num_preemptions"] and preemptions["buckets"]["0"] == 0
    assert stats["request_params_n"]["sum"] == 2 and stats["request_params_n"]["buckets"] == \
        {"1": 0, "2": 1, "5": 1, "10": 1, "20": 1, "+Inf": 1}
    assert stats["request_params_max_tokens"]["sum"] == 16 == stats["request_max_num_generation_tokens"]["sum"]
    assert stats["request_prefill_kv_computed_tokens"]["sum"] == 8
    # A forked sibling recomputed after its preemption prefilled no prompt of its own.
    assert stats["prompt_tokens_computed"] == 8 and stats["prompt_tokens_cached"] == 0
    # Tokens per step: every step, every token it computed (recomputation included).
    steps = stats["iteration_tokens_total"]
    assert steps["count"] == stats["num_steps"] and steps["sum"] == stats["num_scheduled_tokens"] >= 8 + 2 * 15
    assert engine.scheduler.request_stats.times == {}  # forgotten with the request


def test_a_request_that_never_ran_has_no_times_and_one_without_a_token_only_its_queue_time():
    engine, _ = make_engine(max_num_seqs=1, budget=4)  # a 12-token prompt takes three steps
    engine.add_request(EngineRequest("started", list(range(1, 13)), SamplingParams(max_tokens=4)))
    engine.step()
    engine.add_request(EngineRequest("queued", [1, 2, 3], SamplingParams(max_tokens=4)))
    engine.step()  # the only place is taken
    stats = engine.get_stats()
    assert stats["num_requests_waiting"] == 1 and stats["num_requests_waiting_deferred"] == 0  # room, not a limit
    engine.abort_request("queued")
    stats = engine.get_stats()
    assert stats["request_params_n"]["count"] == 1 and phase_counts(stats) == [0, 0, 0, 0]
    assert stats["prompt_tokens_computed"] == 12  # the queued one's prompt was never prefilled
    engine.abort_request("started")
    stats = engine.get_stats()
    assert stats["request_params_n"]["count"] == 2 and phase_counts(stats) == [1, 0, 0, 0]


def test_a_cached_prompt_counts_as_a_cache_hit_and_a_lone_token_has_no_time_per_token():
    engine, _ = make_engine(caching=True)
    prompt = list(range(1, 10))  # two full blocks of 4, and one token
    for request_id in ("cold", "warm"):
        engine.add_request(EngineRequest(request_id, prompt, SamplingParams(max_tokens=1)))
        run(engine)
    stats = engine.get_stats()
    assert stats["prompt_tokens_cached"] == stats["prefix_cache_hits"] == 8
    assert stats["prompt_tokens_computed"] == 9 + 1
    assert stats["request_prefill_kv_computed_tokens"]["sum"] == 9 + 1
    assert counts(stats, "request_decode_time_seconds", "request_time_per_output_token_seconds") == [2, 0]


def test_waiting_behind_a_lora_adapter_is_deferred_and_the_adapters_are_named():
    worker = FakeWorker(16, 4)
    worker.info = dataclasses.replace(worker.info, max_loras=1)
    engine = EngineCore(InProcessExecutor(worker), SchedulerLimits(8, 32, True), watermark=0.0)
    engine.add_request(EngineRequest("sql", [1, 2, 3], SamplingParams(max_tokens=8),
                                     lora=LoRARequest("sql", "/adapters/sql")))
    engine.step()
    engine.add_request(EngineRequest("chat", [1, 2, 3], SamplingParams(max_tokens=8),
                                     lora=LoRARequest("chat", "/adapters/chat")))
    engine.step()  # one adapter per step: chat waits for sql to finish
    stats = engine.get_stats()
    assert stats["num_requests_waiting"] == 1 == stats["num_requests_waiting_deferred"]
    assert stats["running_lora_adapters"] == "sql" and stats["waiting_lora_adapters"] == "chat"
    message = stats_to_proto(stats)  # text values travel as labels, histograms as histograms
    assert dict(message.labels) == {"running_lora_adapters": "sql", "waiting_lora_adapters": "chat"}
    assert message.values["max_loras"] == 1 and message.histograms["iteration_tokens_total"].count == 2
    run(engine)
    assert engine.get_stats()["num_requests_waiting_deferred"] == 0


def test_accepted_drafts_are_counted_by_position():
    engine, worker = make_engine(num_blocks=64, speculate=3)
    for i in range(4):
        engine.add_request(EngineRequest(f"r{i}", [1 + i, 2, 3, 4, 5], SamplingParams(max_tokens=24, ignore_eos=True)))
    run(engine)
    stats = engine.get_stats()
    per_pos = [stats.get(f"spec_decode_num_accepted_tokens_per_pos_{i}", 0) for i in range(4)]
    assert sum(per_pos) == stats["spec_decode_num_accepted_tokens"] == worker.num_accepted > 0
    assert per_pos == sorted(per_pos, reverse=True) and per_pos[3] == 0  # a prefix is accepted; at most 3 drafts


# --- a real stack's /metrics ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stack(llama_dir, tmp_path_factory):
    # 8 blocks of 4 tokens: one sequence of 24 tokens fits, two sharing an 8-token prompt do not.
    with Stack(llama_dir, tmp_path_factory.mktemp("vllm-metrics-logs"),
               worker_args=("--block-size", "4", "--num-gpu-blocks-override", "8")) as stack:
        yield stack


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def scrape(stack) -> dict[tuple[str, frozenset], float]:
    status, text = http_get(f"{stack.base_url}/metrics")
    assert status == 200
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


class Delta:
    """What the engine's series moved by between two scrapes."""

    def __init__(self, stack, before: dict, after: dict):
        self.engine = {"engine": "0", "model_name": stack.model_name}
        self.before, self.after = before, after

    def __call__(self, name: str, **labels: str) -> float:
        key = (name, frozenset({**self.engine, **labels}.items()))
        assert key in self.after, key
        return self.after[key] - self.before.get(key, 0.0)


def fresh_prompt(seed: int) -> list[int]:
    return random.Random(seed).sample(range(10, 500), 8)


def test_stack_observes_a_preempted_n2_request_once(stack, client):
    client.completions.create(model=stack.model_name, prompt=fresh_prompt(1), max_tokens=1)  # names the model
    before = scrape(stack)
    reply = client.completions.create(model=stack.model_name, prompt=fresh_prompt(2), n=2, max_tokens=16,
                                      temperature=1.0, seed=3, extra_body={"ignore_eos": True})
    assert [len(choice.text) > 0 for choice in reply.choices] == [True, True]
    delta = Delta(stack, before, scrape(stack))
    for phase in PHASES:
        assert delta(f"vllm:request_{phase}_time_seconds_count") == 1, phase
    assert delta("vllm:request_time_per_output_token_seconds_count") == 1
    assert delta("vllm:request_params_n_count") == 1 and delta("vllm:request_params_n_bucket", le="1.0") == 0
    assert delta("vllm:request_params_max_tokens_sum") == 16 == delta("vllm:request_max_num_generation_tokens_sum")
    assert delta("vllm:request_params_max_tokens_bucket", le="10.0") == 0
    assert delta("vllm:request_params_max_tokens_bucket", le="20.0") == 1
    preemptions = delta("vllm:num_preemptions_total")
    assert preemptions >= 1, "the pool was meant to force preemption"
    assert delta("vllm:request_num_preemptions_sum") == preemptions
    assert delta("vllm:request_num_preemptions_bucket", le="0.0") == 0
    assert delta("vllm:request_prefill_kv_computed_tokens_sum") == 8
    assert delta("vllm:prompt_tokens_by_source_total", source="local_compute") == 8
    assert delta("vllm:prompt_tokens_by_source_total", source="local_cache_hit") == 0
    assert delta("vllm:iteration_tokens_total_count") >= 16 and delta("vllm:iteration_tokens_total_sum") >= 8 + 2 * 15
    # pagedserve's own series of the same histogram, by scheduler address
    ours = ("pagedserve_engine_request_queue_time_seconds_count", frozenset({("scheduler", stack.scheduler_address)}))
    assert delta.after[ours] == delta.after[("vllm:request_queue_time_seconds_count",
                                             frozenset(delta.engine.items()))] >= 1


def test_stack_counts_cached_prompt_tokens_and_one_token_has_no_time_per_token(stack, client):
    prompt = fresh_prompt(4)
    client.completions.create(model=stack.model_name, prompt=prompt, max_tokens=1)
    before = scrape(stack)
    client.completions.create(model=stack.model_name, prompt=prompt, max_tokens=1)
    delta = Delta(stack, before, scrape(stack))
    hits = delta("vllm:prefix_cache_hits_total")
    assert hits > 0 and delta("vllm:prompt_tokens_cached_total") == hits
    assert delta("vllm:prompt_tokens_by_source_total", source="local_cache_hit") == hits
    assert delta("vllm:prompt_tokens_by_source_total", source="local_compute") == 8 - hits
    assert delta("vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 0
    assert delta("vllm:request_prefill_kv_computed_tokens_sum") == 8 - hits
    assert delta("vllm:request_decode_time_seconds_count") == 1
    assert delta("vllm:request_time_per_output_token_seconds_count") == 0
    assert delta("vllm:request_num_preemptions_bucket", le="0.0") == 1


def test_stack_shows_the_waiting_reasons_and_the_cache_config(stack, client):
    client.completions.create(model=stack.model_name, prompt=fresh_prompt(5), max_tokens=1)
    samples = scrape(stack)
    engine = {"engine": "0", "model_name": stack.model_name}

    def value(name: str, **labels: str) -> float:
        return samples[(name, frozenset(labels.items()))]

    reasons = [value("vllm:num_requests_waiting_by_reason", **engine, reason=r) for r in ("capacity", "deferred")]
    assert sum(reasons) == value("vllm:num_requests_waiting", **engine)
    scheduler = {"scheduler": stack.scheduler_address}
    gpu_blocks = int(value("pagedserve_engine_kv_blocks_total", **scheduler))
    cpu_blocks = int(value("pagedserve_engine_kv_host_blocks_total", **scheduler))
    assert gpu_blocks == 8 and cpu_blocks > 0
    assert value("vllm:cache_config_info", block_size="4", enable_prefix_caching="True", engine="0",
                 num_cpu_blocks=str(cpu_blocks), num_gpu_blocks=str(gpu_blocks)) == 1
    assert 0 <= value("vllm:cpu_cache_usage_perc", **engine) <= 1
    assert not any(name == "vllm:lora_requests_info" for name, _ in samples)  # LoRA is off
