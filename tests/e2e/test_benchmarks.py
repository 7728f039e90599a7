"""The benchmark scripts still run against the current services (a stand-in that drifts from the
protocol would otherwise only show up as a failed or empty measurement)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.services_harness import REPO, RUN_LIMIT_S, free_port


def test_gateway_overhead_streams_through_the_real_gateway(tmp_path):
    out = tmp_path / "overhead.json"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "gateway_overhead.py"), "--num-requests", "6",
                    "--concurrency", "6", "--step-ms", "1", "--rounds", "1", "--out", str(out),
                    "--endpoints", "completions", "chat/completions", "responses"],
                   cwd=REPO, check=True, timeout=RUN_LIMIT_S, stdout=subprocess.DEVNULL)
    report = json.loads(out.read_text())
    assert [r["endpoint"] for r in report["rounds"]] == ["completions", "chat/completions", "responses"]
    for round_ in report["rounds"]:  # every API's stream carries (nearly) a text event per token
        assert round_["tokens"] > 0 and 0.5 * round_["tokens"] < round_["chunks_with_text"] <= round_["tokens"]
    assert set(report["median_cpu_us_per_token"]) == {"gateway", "stand-in scheduler", "load generator"}
    assert set(report["median_cpu_us_per_token_by_endpoint"]) == {"completions", "chat/completions", "responses"}


def test_offline_throughput_runs_the_bench_workload(tmp_path, llama_dir):
    out = tmp_path / "offline.json"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "offline_throughput.py"), "--num-requests", "3",
                    "--skip-hf", "--model", str(llama_dir), "--out", str(out)], cwd=REPO, check=True,
                   timeout=RUN_LIMIT_S, stdout=subprocess.DEVNULL)
    result = json.loads(out.read_text())["results"]["pagedserve"]
    assert result["output_tokens"] > 0 and result["num_steps"] > 0 and result["num_preemptions"] == 0


def test_projection_shapes_times_every_product_of_a_run(tmp_path, llama_dir):
    out = tmp_path / "projection_shapes.json"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "projection_shapes.py"), "--num-requests", "3",
                    "--model", str(llama_dir), "--repeats", "1", "--flush-mib", "8", "--out", str(out)], cwd=REPO,
                   check=True, timeout=RUN_LIMIT_S, stdout=subprocess.DEVNULL)
    report = json.loads(out.read_text())
    assert {g["layer"] for g in report["groups"]} == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"}
    assert all(g["calls"] > 0 and g["flop"] > 0 and g["run_s"] > 0 and g["hot_s"] > 0 and g["cold_s"] > 0
               for g in report["groups"])
    assert report["peak_gflops"] > 0 and report["run_gflops"] > 0


def test_model_impl_runs_both_implementations(tmp_path, llama_dir):
    out = tmp_path / "model_impl.json"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "model_impl.py"), "--model", str(llama_dir),
                    "--num-requests", "2", "--rounds", "1", "--out", str(out)], cwd=REPO, check=True,
                   timeout=RUN_LIMIT_S, stdout=subprocess.DEVNULL)
    report = json.loads(out.read_text())
    assert set(report["runs"]) == {"native", "transformers"} and report["transformers_vs_native"] > 0
    assert report["runs"]["native"][0]["output_tokens"] == report["runs"]["transformers"][0]["output_tokens"] > 0


def test_quantization_benchmark_runs_each_mode(tmp_path, llama_dir):
    out = tmp_path / "quantization.json"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "quantization.py"), "--model", str(llama_dir),
                    "--num-requests", "2", "--rounds", "1", "--modes", "float32", "fp8-kv", "w8a8-int8",
                    "--kv-cache-memory-bytes", str(1 << 20), "--out", str(out)], cwd=REPO, check=True,
                   timeout=RUN_LIMIT_S, stdout=subprocess.DEVNULL)
    report = json.loads(out.read_text())
    runs = {mode: mode_runs[0] for mode, mode_runs in report["runs"].items()}
    assert set(runs) == {"float32", "fp8-kv", "w8a8-int8"}
    assert runs["fp8-kv"]["kv_blocks"] == 4 * runs["float32"]["kv_blocks"]  # a float32 model's FP8 cache
    assert report["sizes"]["w8a8-int8"]["loaded_bytes"] < report["sizes"]["float32"]["loaded_bytes"]


def test_cpu_weight_only_times_every_layer_and_dtype(tmp_path):
    out = tmp_path / "cpu_weight_only.json"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "cpu_weight_only.py"), "--rows", "1", "--repeats", "1",
                    "--out", str(out)], cwd=REPO, check=True, timeout=RUN_LIMIT_S, stdout=subprocess.DEVNULL)
    cases = json.loads(out.read_text())["cases"]
    assert [(c["layer"], c["dtype"]) for c in cases] == [(layer, dtype) for layer in ("qkv", "gate_up", "down")
                                                         for dtype in ("float32", "bfloat16")]
    assert all(c[key] > 0 for c in cases for key in c if key.endswith("_us"))


def test_step_inputs_times_every_case(tmp_path):
    out = tmp_path / "step_inputs.json"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "step_inputs.py"), "--repeats", "1", "--json", str(out)],
                   cwd=REPO, check=True, timeout=RUN_LIMIT_S, stdout=subprocess.DEVNULL)
    rows = json.loads(out.read_text())
    assert [(r["num_seqs"], r["context"]) for r in rows] == [(1, 512), (32, 4096), (32, 32768), (256, 2048)]
    assert all(r[key] > 0 for r in rows for key in r if key.endswith("_us"))


def test_sampler_memory_measures_each_case_in_its_own_process(tmp_path):
    out = tmp_path / "sampler_memory.json"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "sampler_memory.py"), "--cases",
                    "greedy:8:5000,costliest:64:32000", "--json", str(out)],
                   cwd=REPO, check=True, timeout=RUN_LIMIT_S, stdout=subprocess.DEVNULL)
    greedy, costliest = json.loads(out.read_text())
    assert greedy["kind"] == "greedy" and costliest["rows"] == 64
    # The costliest path holds many [rows, vocab] temporaries at once; its bound in kv_cache.py covers them.
    from services.worker.kv_cache import SAMPLER_BYTES_PER_LOGIT

    assert 8 < costliest["bytes_per_entry"] <= SAMPLER_BYTES_PER_LOGIT - 4


def test_scheduler_overhead_decodes_every_sequence_every_step(tmp_path):
    # The script checks that each timed step gave every sequence one token (its worker stand-in keeps the protocol).
    out = tmp_path / "scheduler_overhead.json"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "scheduler_overhead.py"), "--batch", "8", "--steps", "5",
                    "--out", str(out)], cwd=REPO, check=True, timeout=RUN_LIMIT_S, stdout=subprocess.DEVNULL)
    rows = json.loads(out.read_text())["rows"]
    assert {(r["n"], r["plan_ahead"]) for r in rows} == {(1, False), (1, True), (4, False), (4, True)}
    assert all(r["sequences"] == 8 and r["plan_us"] > 0 and r["apply_us"] > 0 for r in rows)


def test_scheduler_overhead_compares_two_checkouts(tmp_path):
    # Against itself: both children run this checkout's scheduler, so the ratio is near 1.
    out = tmp_path / "compare.json"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "scheduler_overhead.py"), "--batch", "8",
                    "--against", str(REPO), "--bursts", "3", "--out", str(out)],
                   cwd=REPO, check=True, timeout=RUN_LIMIT_S, stdout=subprocess.DEVNULL)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["n"], r["plan_ahead"]) for r in rows] == [(1, False), (4, True)]
    assert all(r["this_us"] > 0 and r["other_us"] > 0 and 0.2 < r["ratio_median"] < 5 for r in rows)


def test_spec_decode_decodes_the_same_tokens_in_every_mode(tmp_path, tiny_model_factory):
    # The script asserts that every mode's tokens equal plain decoding's; a small model and run here.
    out = tmp_path / "spec.json"
    model = tiny_model_factory("llama")
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "spec_decode.py"), "--model", str(model), "--batches",
                    "1,3", "--output-len", "12", "--prompt-len", "8", "--rounds", "1", "--wrong", "0.0",
                    "--proposal-contexts", "256", "--out", str(out)], cwd=REPO, check=True, timeout=RUN_LIMIT_S, stdout=subprocess.DEVNULL)
    report = json.loads(out.read_text())
    first = report["batches"][0]["rows"]
    assert [r["mode"] for r in first] == ["plain", "ngram", "reference, 0% wrong"]
    assert first[2]["acceptance"] > 0.9 and first[2]["steps"] < first[0]["steps"]


def test_tensor_parallel_benchmark_runs_one_worker_against_two_ranks(tmp_path, tiny_model_factory):
    out = tmp_path / "tp.json"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "tensor_parallel.py"), "--model",
                    str(tiny_model_factory("llama")), "--num-requests", "2", "--output-len", "4", "--prompt-len", "6",
                    "--rounds", "1", "--out", str(out)], cwd=REPO, check=True, timeout=RUN_LIMIT_S, stdout=subprocess.DEVNULL)
    report = json.loads(out.read_text())
    assert [r["mode"] for r in report["rows"]] == ["one worker", "2 ranks"] and report["agree"] == 2


def test_resumption_benchmark_kills_a_worker_under_streams_that_all_go_on(tmp_path, llama_dir):
    out = tmp_path / "resumption.json"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "resumption.py"), "--model", str(llama_dir),
                    "--concurrency", "3", "--prompt-len", "16", "--max-tokens", "100", "--kill-after", "10",
                    "--modes", "resume", "--port", str(free_port(span=2)), "--out", str(out)],  # HTTP, then gRPC
                   cwd=REPO, check=True, timeout=RUN_LIMIT_S, stdout=subprocess.DEVNULL)
    (mode,) = json.loads(out.read_text())["modes"]
    assert mode["requests"] == mode["completed"] == mode["completed_with_uninterrupted_text"] == 3
    assert mode["resumed_requests"] == 3 and mode["kill_to_first_token_after_s"] > 0


def test_structured_outputs_benchmark_times_every_mode(tmp_path, llama_dir):
    out = tmp_path / "structured_outputs.json"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "structured_outputs.py"), "--model", str(llama_dir),
                    "--batch", "4", "--prompt-len", "8", "--max-tokens", "8", "--rounds", "1", "--out", str(out)],
                   cwd=REPO, check=True, timeout=RUN_LIMIT_S, stdout=subprocess.DEVNULL)
    report = json.loads(out.read_text())
    assert set(report["modes"]) == {"free", "regex", "json"}
    assert report["modes"]["regex"]["tokens"] == 4 * 8 and report["modes"]["json"]["throughput_vs_free"] > 0


def test_tool_parsing_times_each_parser_over_each_output(tmp_path):
    out = tmp_path / "tool_parsing.json"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "tool_parsing.py"), "--size", "3", "--repeats", "1",
                    "--out", str(out)], cwd=REPO, check=True, timeout=RUN_LIMIT_S, stdout=subprocess.DEVNULL)
    rows = json.loads(out.read_text())["rows"]
    assert {(r["parser"], r["output"]) for r in rows} == \
        {(p, o) for p in ("hermes", "llama3_json") for o in ("plain text", "one long call", "two calls")}
    assert all(r["cpu_us_per_delta"] > 0 and r["chars"] > 0 for r in rows)


def test_moe_layer_benchmark_checks_each_variant_against_transformers(tmp_path):
    out = tmp_path / "moe_layer.json"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "moe_layer.py"), "--hidden", "32", "--inter", "16",
                    "--experts", "6", "--top-k", "2", "--tokens", "1", "9", "--repeats", "1", "--out", str(out)],
                   cwd=REPO, check=True, timeout=RUN_LIMIT_S, stdout=subprocess.DEVNULL)
    rows = json.loads(out.read_text())["rows"]
    assert [r["tokens"] for r in rows] == [1, 9]
    for row in rows:
        for name in ("transformers", "grouped", "grouped+packed"):
            assert row[f"{name}_ms"] > 0 and row[f"{name}_error"] < 1e-4


def test_lora_benchmark_times_every_mode(tmp_path, llama_dir):
    out = tmp_path / "lora.json"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "lora.py"), "--model", str(llama_dir), "--requests", "3",
                    "--max-tokens", "4", "--rank", "4", "--max-loras", "2", "--rounds", "1", "--out", str(out)],
                   cwd=REPO, check=True, timeout=RUN_LIMIT_S, stdout=subprocess.DEVNULL)
    report = json.loads(out.read_text())
    assert set(report["rows"]) == {"base", "enabled_unused", "one_adapter", "mixed", "merged"}
    assert all(row["tokens_per_s"] > 0 for row in report["rows"].values())
    assert 0 <= report["one_adapter_equals_merged"] <= 1


def test_reranking_benchmark_checks_then_times_every_mode(tmp_path, llama_dir):
    out = tmp_path / "reranking.json"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "reranking.py"), "--model", str(llama_dir),
                    "--documents", "4", "--query-len", "16", "--min-len", "2", "--max-len", "20", "--hf-batch", "2",
                    "--rounds", "1", "--max-num-batched-tokens", "40", "--out", str(out)], cwd=REPO, check=True, timeout=RUN_LIMIT_S, stdout=subprocess.DEVNULL)
    report = json.loads(out.read_text())
    assert set(report["rows"]) == {"hf_one_at_a_time", "hf_batched", "engine", "engine_prefix_cache"}
    assert all(row["pairs_per_s"] > 0 for row in report["rows"].values())
    assert report["max_error_vs_transformers"] < 1e-4
    assert report["prefix_cache_hit_rate"] > 0  # the query's full block, for pairs after the first step's


def test_embeddings_benchmark_checks_then_times_every_mode(tmp_path, llama_dir):
    out = tmp_path / "embeddings.json"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "embeddings.py"), "--model", str(llama_dir),
                    "--requests", "4", "--instruction-len", "16", "--min-len", "2", "--max-len", "20", "--hf-batch", "2",
                    "--rounds", "1", "--out", str(out)], cwd=REPO, check=True, timeout=RUN_LIMIT_S, stdout=subprocess.DEVNULL)
    report = json.loads(out.read_text())
    assert set(report["rows"]) == {"hf_one_at_a_time", "hf_batched", "engine", "engine_prefix_cache"}
    assert all(row["prompt_tokens_per_s"] > 0 for row in report["rows"].values())
    assert report["max_error_vs_transformers"] < 1e-4
    assert report["prefix_cache_hit_rate"] > 0  # the shared instruction's full blocks


def test_cpu_attention_checks_both_backends_with_a_window():
    # The script asserts the two backends agree before it times them; a window exercises the spans it gathers.
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "cpu_attention.py"), "--cases",
                          "decode16,prefill_mix", "--repeats", "1", "--window", "100"],
                         cwd=REPO, check=True, timeout=RUN_LIMIT_S, capture_output=True, text=True)
    assert "window 100" in run.stdout and "prefill_mix" in run.stdout


def test_cpu_attention_compares_the_decode_loops():
    # --loops checks that the kernel's two decode loops agree, then times one against the other.
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "cpu_attention.py"), "--cases", "decode16",
                          "--repeats", "1", "--loops"],
                         cwd=REPO, check=True, timeout=RUN_LIMIT_S, capture_output=True, text=True)
    assert "median: 2-pass" in run.stdout and "decode16" in run.stdout
