"""Embeddings from a pooling engine: offline (LLM.embed) and over the gateway (/v1/embeddings, gRPC Embed),
against transformers' bare model pooled as sentence-transformers pools it."""

from __future__ import annotations

import base64
import json
import os
import random
import struct

import grpc
import openai
import pytest
import torch

from pagedserve import LLM, PoolingParams
from shared.pooling import PoolerConfig, read_pooler_config, resolve_runner
from shared.proto import pagedserve_api_pb2 as api
from shared.proto import pagedserve_api_pb2_grpc as api_grpc
from shared.sampling_params import SamplingParams
from shared.step_protocol import NewSequence, RunningSequence, StepPlan
from benchmarks.serving import parse_engine_stats
from tests.embedding_models import ST, hf_embedding, make_embedding_dir
from tests.services_harness import Stack, http_get

TOLERANCE = 1e-4  # float32 end to end: seen at most 3e-7


def fresh_rng() -> tuple[random.Random, int]:
    seed = int.from_bytes(os.urandom(4), "little")
    return random.Random(seed), seed


def random_prompts(rng: random.Random, count: int, longest: int, vocab: int = 500) -> list[list[int]]:
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(1, longest + 1))] for _ in range(count)]


def assert_close(ours: list[float], ref: torch.Tensor, what: str) -> None:
    ours_t = torch.tensor(ours)
    assert ours_t.shape == ref.shape, f"{what}: shape {tuple(ours_t.shape)}, transformers {tuple(ref.shape)}"
    error = (ours_t - ref).abs().max().item()
    assert error < TOLERANCE, f"{what}: max error {error:.2e}"


@pytest.fixture(scope="module")
def source(tiny_model_factory):
    # Qwen3: q/k norms, head_dim 32 unlike hidden / heads.
    return tiny_model_factory("qwen3", head_dim=32)


@pytest.fixture(scope="module")
def last_dir(source, tmp_path_factory):
    return make_embedding_dir(source, tmp_path_factory.mktemp("emb") / "last", pooling="lasttoken")


@pytest.fixture(scope="module")
def mean_dir(tiny_model_factory, tmp_path_factory):
    return make_embedding_dir(tiny_model_factory("llama"), tmp_path_factory.mktemp("emb") / "mean",
                              pooling="mean_tokens", normalize=False)


def small_engine(model_dir, **options) -> LLM:
    """Chunked prefill over several steps (16 tokens each), blocks of 8."""
    defaults = dict(block_size=8, max_num_batched_tokens=16, num_gpu_blocks_override=128, max_num_seqs=4)
    return LLM(str(model_dir), **{**defaults, **options})


@pytest.mark.parametrize("pooling", ["lasttoken", "mean_tokens", "cls_token"])
def test_embeddings_equal_transformers_pooled(pooling, source, mean_dir, tmp_path):
    model_dir = mean_dir if pooling == "mean_tokens" else make_embedding_dir(source, tmp_path / pooling,
                                                                              pooling=pooling)
    normalize = pooling != "mean_tokens"
    rng, seed = fresh_rng()
    prompts = random_prompts(rng, 7, 90)
    llm = small_engine(model_dir)
    try:
        outputs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    finally:
        llm.close()
    assert [o.prompt_token_ids for o in outputs] == prompts
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        assert out.finished and out.outputs.hidden_size == 64
        assert_close(out.outputs.embedding, hf_embedding(model_dir, prompt, pooling, normalize),
                     f"{pooling} prompt {i} of {len(prompt)} tokens (seed {seed})")


def test_a_bare_model_without_sentence_transformers_files_pools_its_last_token_normalized(source, tmp_path):
    model_dir = make_embedding_dir(source, tmp_path / "bare", sentence_transformers=False)
    assert resolve_runner("auto", model_dir) == "pooling"  # its architecture is Qwen3Model
    assert read_pooler_config(model_dir, 64) == PoolerConfig("last", True, 64)
    llm = small_engine(model_dir)
    try:
        (out,) = llm.embed("hello embeddings", use_tqdm=False)
        unnormalized = llm.embed("hello embeddings", PoolingParams(normalize=False), use_tqdm=False)[0]
    finally:
        llm.close()
    assert_close(out.outputs.embedding, hf_embedding(model_dir, out.prompt_token_ids), "default pooler")
    assert_close(unnormalized.outputs.embedding, hf_embedding(model_dir, out.prompt_token_ids, normalize=False),
                 "normalize=False")
    assert abs(torch.tensor(unnormalized.outputs.embedding).norm().item() - 1) > 1e-3  # it really is not normalized


def test_prefix_cache_hits_give_the_same_embedding_and_mean_pooling_skips_them(last_dir, mean_dir):
    rng, seed = fresh_rng()
    prompt = random_prompts(rng, 1, 1)[0] + [rng.randrange(3, 500) for _ in range(40)]
    for model_dir, pooling, hits in ((last_dir, "lasttoken", True), (mean_dir, "mean_tokens", False)):
        llm = small_engine(model_dir)
        try:
            first, again = (llm.embed({"prompt_token_ids": prompt}, use_tqdm=False)[0] for _ in range(2))
        finally:
            llm.close()
        assert first.num_cached_tokens == 0
        # Every full block but the last token's is a hit for last-token pooling; none for mean pooling.
        assert (again.num_cached_tokens > 0) == hits, (pooling, again.num_cached_tokens, seed)
        ref = hf_embedding(model_dir, prompt, pooling, normalize=pooling == "lasttoken")
        assert_close(again.outputs.embedding, ref, f"{pooling} after a prefix-cache lookup (seed {seed})")


def pooling_sequence(prompt: list[int], scheduled: int, table: list[int]) -> NewSequence:
    return NewSequence(request_id="r", seq_id=7, index=0, prompt_token_ids=prompt, output_token_ids=[],
                       sampling_params=SamplingParams(max_tokens=1), block_table=table, num_computed_tokens=0,
                       num_scheduled_tokens=scheduled, pooling=PoolingParams())


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_preempted_prompt_still_pools_each_token_once(mode, mean_dir):
    """The worker's side of preemption mid-prompt, as the scheduler plans it: recomputed, the sequence is
    dropped and sent again from its start (its mean starts over); swapped, it keeps its mean while its
    blocks go to host memory and come back elsewhere."""
    rng, seed = fresh_rng()
    prompt = [rng.randrange(3, 500) for _ in range(30)]
    llm = small_engine(mean_dir, swap_space=0.01)
    try:
        worker = llm.engine.executor.worker
        assert worker.execute(StepPlan(1, new=[pooling_sequence(prompt, 12, [0, 1])])).outputs == []  # mid-prompt
        if mode == "recompute":
            result = worker.execute(StepPlan(2, finished_seq_ids=[7], new=[pooling_sequence(prompt, 30, [4, 5, 6, 7])]))
        else:
            worker.execute(StepPlan(2, swap_out=[(0, 0), (1, 1)]))
            result = worker.execute(StepPlan(3, swap_in=[(0, 2), (1, 3)], running=[
                RunningSequence(7, [], [], 12, 18, new_block_table=[2, 3, 8, 9])]))
    finally:
        llm.close()
    (out,) = result.outputs
    assert out.token_id is None
    assert_close(out.embedding, hf_embedding(mean_dir, prompt, "mean_tokens", normalize=False),
                 f"mean after {mode} (seed {seed})")


def test_matryoshka_dimensions_cut_then_normalize(source, tmp_path):
    model_dir = make_embedding_dir(source, tmp_path / "mrl", matryoshka_dimensions=[16, 32, 64])
    llm = small_engine(model_dir)
    try:
        (out,) = llm.embed({"prompt_token_ids": [5, 6, 7, 8, 9]}, PoolingParams(dimensions=16), use_tqdm=False)
        assert_close(out.outputs.embedding, hf_embedding(model_dir, [5, 6, 7, 8, 9], dimensions=16), "dimensions=16")
        with pytest.raises(ValueError, match="not one the model was trained for: 16, 32, 64"):
            llm.embed("x", PoolingParams(dimensions=20), use_tqdm=False)
        assert llm.embed("x", PoolingParams(dimensions=64), use_tqdm=False)[0].outputs.hidden_size == 64
        assert llm.stats()["kv_blocks_used"] == 0
    finally:
        llm.close()


def test_bad_requests_are_refused_and_the_engine_serves_on(last_dir, llama_dir):
    llm = small_engine(last_dir)
    try:
        assert llm.engine.info.max_model_len == 256  # sentence_bert_config.json's max_seq_length
        with pytest.raises(ValueError, match="does not support matryoshka"):
            llm.embed("x", PoolingParams(dimensions=8), use_tqdm=False)
        with pytest.raises(ValueError, match="dimensions must be a positive integer"):
            PoolingParams(dimensions=0)
        with pytest.raises(ValueError, match="prompt is empty"):
            llm.embed({"prompt_token_ids": []}, use_tqdm=False)
        with pytest.raises(ValueError, match="257 tokens, but the context length is 256"):
            llm.embed({"prompt_token_ids": [5] * 257}, use_tqdm=False)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            llm.embed({"prompt_token_ids": [5, 10**6]}, use_tqdm=False)
        with pytest.raises(ValueError, match="pooling model"):
            llm.generate("hello", use_tqdm=False)
        # The whole context is a valid input (no output token needs room), and truncation keeps the last tokens.
        full = llm.embed({"prompt_token_ids": [7] * 256}, use_tqdm=False)[0]
        cut = llm.embed({"prompt_token_ids": [9] * 20 + [7] * 256}, truncate_prompt_tokens=-1, use_tqdm=False)[0]
        assert cut.prompt_token_ids == [7] * 256
        assert_close(cut.outputs.embedding, torch.tensor(full.outputs.embedding), "truncated to the context")
        assert llm.stats()["kv_blocks_used"] == 0
    finally:
        llm.close()
    generative = LLM(str(llama_dir), block_size=16, num_gpu_blocks_override=64)
    try:
        with pytest.raises(ValueError, match="serves no embeddings"):
            generative.embed("hello", use_tqdm=False)
    finally:
        generative.close()


def write_st_files(model_dir, modules, pooling_config=None):
    (model_dir / "modules.json").write_text(json.dumps(modules))
    if pooling_config is not None:
        (model_dir / "1_Pooling").mkdir(exist_ok=True)
        (model_dir / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config))


@pytest.mark.parametrize("modules, pooling_config, error", [
    ([{"path": "", "type": ST + "Transformer"}, {"path": "1_Pooling", "type": ST + "Pooling"},
      {"path": "2_Dense", "type": ST + "Dense"}], {"pooling_mode_lasttoken": True}, "Dense projection"),
    ([{"path": "", "type": ST + "Transformer"}, {"path": "1_Pooling", "type": ST + "Pooling"}],
     {"pooling_mode_max_tokens": True}, "other pooling modes are not supported"),
    ([{"path": "", "type": ST + "Transformer"}, {"path": "1_Pooling", "type": ST + "Pooling"}],
     {"pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": True}, "exactly one of"),
    ([{"path": "", "type": ST + "Transformer"}, {"path": "1_Pooling", "type": ST + "Pooling"}],
     {"pooling_mode_lasttoken": True, "include_prompt": False}, "include_prompt"),
    ([{"path": "", "type": ST + "Transformer"}, {"path": "1_Pooling", "type": ST + "Pooling"}],
     {"pooling_mode_cls_token": True, "word_embedding_dimension": 32}, "differs from the model's hidden_size"),
    ([{"path": "", "type": ST + "Transformer"}], None, "no Pooling module"),
    ([{"path": "sub", "type": ST + "Transformer"}, {"path": "1_Pooling", "type": ST + "Pooling"}],
     {"pooling_mode_lasttoken": True}, "must be the directory itself"),
])
def test_sentence_transformers_configs_it_cannot_honour_are_refused_by_name(tmp_path, modules, pooling_config, error):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    write_st_files(tmp_path, modules, pooling_config)
    with pytest.raises(ValueError, match=error):
        read_pooler_config(tmp_path, 64)


def test_runner_choice(tmp_path, llama_dir):
    assert resolve_runner("auto", llama_dir) == "generate"  # LlamaForCausalLM
    assert resolve_runner("pooling", llama_dir) == "pooling"
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    write_st_files(tmp_path, [])
    assert resolve_runner("auto", tmp_path) == "pooling"  # a sentence-transformers directory
    with pytest.raises(ValueError, match="runner must be one of"):
        resolve_runner("embed", tmp_path)


def test_a_generative_checkpoint_serves_embeddings_with_runner_pooling(llama_dir):
    """Its head is not loaded; the last token's normalized state, as the bare model computes it."""
    llm = LLM(str(llama_dir), runner="pooling", block_size=16, num_gpu_blocks_override=64)
    try:
        model = llm.engine.executor.worker.model
        assert not model.with_head and not hasattr(model, "lm_head")
        (out,) = llm.embed({"prompt_token_ids": [11, 12, 13, 14]}, use_tqdm=False)
    finally:
        llm.close()
    assert_close(out.outputs.embedding, hf_embedding(llama_dir, [11, 12, 13, 14]), "runner pooling")


# --- over the gateway ------------------------------------------------------------------------------------


def start_pooling_stack(model_dir, log_dir) -> Stack:
    """Blocks of 8 and 32-token steps: long inputs take several."""
    return Stack(model_dir, log_dir, worker_args=("--block-size", "8", "--num-gpu-blocks-override", "256",
                                                  "--max-num-batched-tokens", "32")).start()


@pytest.fixture(scope="module")
def stack(last_dir, tmp_path_factory):
    stack = start_pooling_stack(last_dir, tmp_path_factory.mktemp("embedding-logs"))
    try:
        yield stack
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=30)


def test_openai_client_embeddings_in_input_order_as_float_and_base64(stack, client, last_dir):
    rng, seed = fresh_rng()
    texts = ["".join(rng.choice("abcdefgh ") for _ in range(rng.randrange(1, 120))).strip() or "a" for _ in range(5)]
    as_floats = client.embeddings.create(model=stack.model_name, input=texts, encoding_format="float")
    as_base64 = client.embeddings.create(model=stack.model_name, input=texts)  # the client asks base64 and decodes
    assert [d.index for d in as_floats.data] == list(range(5))
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(last_dir))
    prompts = [tokenizer(t).input_ids for t in texts]
    for i, prompt in enumerate(prompts):
        ref = hf_embedding(last_dir, prompt)
        assert_close(as_floats.data[i].embedding, ref, f"input {i} (seed {seed})")
        assert_close(as_base64.data[i].embedding, ref, f"input {i} as base64 (seed {seed})")
    assert as_floats.usage.prompt_tokens == as_floats.usage.total_tokens == sum(map(len, prompts))
    assert as_floats.model == stack.model_name


def test_token_id_inputs_raw_base64_and_vllm_fields(stack, last_dir):
    import urllib.request

    def post(body):
        return post_json(stack, "/v1/embeddings", body)

    status, body = post({"input": [[5, 6, 7], [8, 9]], "encoding_format": "base64", "normalize": False})
    assert status == 200, body
    raw = base64.b64decode(body["data"][1]["embedding"])
    assert_close(list(struct.unpack(f"<{len(raw) // 4}f", raw)), hf_embedding(last_dir, [8, 9], normalize=False),
                 "base64 of token ids")
    status, body = post({"input": [3] * 300, "truncate_prompt_tokens": 256})
    assert status == 200 and body["usage"]["prompt_tokens"] == 256, body
    for bad, param in (({"input": []}, "input"), ({"input": ""}, "input"), ({"input": [[]]}, "input"),
                       ({"input": "x", "dimensions": 8}, "dimensions"), ({"input": [3] * 300}, "input"),
                       ({"input": [10**6]}, "input"), ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
                       ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens")):
        status, body = post(bad)
        assert status == 400 and body["error"]["param"] == param, (bad, body)
    status, body = post({"input": "x", "model": "nope"})
    assert status == 404, body
    status, body = post_json(stack, "/classify", {"input": "x"})
    assert status == 400 and body["error"]["param"] == "model" and "embedding model" in body["error"]["message"]
    status, body = post({"model": stack.model_name, "prompt": "hello", "max_tokens": 4})
    assert status == 400, body  # (no input)
    request = urllib.request.Request(f"{stack.base_url}/v1/completions",
                                     json.dumps({"prompt": "hello", "max_tokens": 4}).encode(),
                                     {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 400 and "pooling" in json.loads(refused.value.read())["error"]["message"]
    status, metrics = http_get(f"{stack.base_url}/metrics")
    assert status == 200 and parse_engine_stats(metrics)["kv_blocks_used"] == 0


def test_grpc_embed(stack, last_dir):
    with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:
        stub = api_grpc.GenerationStub(channel)
        reply = stub.Embed(api.EmbedRequest(inputs=[api.EmbedInput(token_ids=api.TokenIds(ids=[4, 5, 6])),
                                                    api.EmbedInput(text="grpc")],
                                            params=api.PoolingParameters(normalize=False)), timeout=30)
        assert [e.index for e in reply.embeddings] == [0, 1] and reply.model == stack.model_name
        assert_close(list(reply.embeddings[0].values), hf_embedding(last_dir, [4, 5, 6], normalize=False), "gRPC")
        assert reply.usage.prompt_tokens == 3 + reply.embeddings[1].prompt_tokens
        with pytest.raises(grpc.RpcError) as refused:
            stub.Embed(api.EmbedRequest(inputs=[api.EmbedInput(text="x")],
                                        params=api.PoolingParameters(dimensions=3)), timeout=30)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as refused:
            stub.Embed(api.EmbedRequest(), timeout=30)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as refused:  # an embedding model does not classify
            stub.Classify(api.ClassifyRequest(inputs=[api.EmbedInput(text="x")]), timeout=30)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "embedding model" in refused.value.details()


def post_json(stack, path: str, body: dict) -> tuple[int, dict]:
    import urllib.request

    request = urllib.request.Request(f"{stack.base_url}{path}", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def hf_text_embedding(model_dir, text: str) -> torch.Tensor:
    from transformers import AutoTokenizer

    return hf_embedding(model_dir, AutoTokenizer.from_pretrained(str(model_dir))(text).input_ids)


def test_score_and_rerank_are_cosine_similarities_of_the_embeddings(stack, last_dir):
    rng, seed = fresh_rng()
    query = "".join(rng.choice("abcdef ") for _ in range(30)).strip() or "q"
    documents = [("".join(rng.choice("abcdef ") for _ in range(rng.randrange(5, 60))).strip() or "d") for _ in range(4)]
    ref_query = hf_text_embedding(last_dir, query)
    expected = [torch.nn.functional.cosine_similarity(ref_query, hf_text_embedding(last_dir, d), dim=0).item()
                for d in documents]
    status, scored = post_json(stack, "/v1/score", {"model": stack.model_name, "text_1": query, "text_2": documents})
    assert status == 200, scored
    assert [d["index"] for d in scored["data"]] == [0, 1, 2, 3] and scored["object"] == "list"
    for got, want in zip(scored["data"], expected):
        assert abs(got["score"] - want) < TOLERANCE, (got, want, seed)
    status, pairwise = post_json(stack, "/score", {"text_1": documents[:2], "text_2": documents[2:]})
    assert status == 200 and len(pairwise["data"]) == 2, pairwise
    status, ranked = post_json(stack, "/v1/rerank", {"query": query, "documents": documents, "top_n": 2})
    assert status == 200, ranked
    best = sorted(range(4), key=lambda i: -expected[i])[:2]
    assert [r["index"] for r in ranked["results"]] == best, (ranked, expected, seed)
    assert ranked["results"][0]["document"]["text"] == documents[best[0]]
    assert abs(ranked["results"][0]["relevance_score"] - expected[best[0]]) < TOLERANCE
    status, cohere = post_json(stack, "/v2/rerank", {"query": query, "documents": [{"text": d} for d in documents]})
    assert status == 200 and len(cohere["results"]) == 4, cohere
    for path, bad, param in (("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
                             ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
                             ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
                             ("/v1/score", {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 0},
                              "truncate_prompt_tokens"),
                             ("/v1/score", {"text_1": "a", "text_2": "b", "use_activation": False}, "use_activation")):
        status, body = post_json(stack, path, bad)
        assert status == 400 and body["error"]["param"] == param, (path, bad, body)


def test_an_adapter_trained_on_the_bare_model_embeds_as_the_merged_model(source, tmp_path):
    """PEFT on AutoModel saves base_model.model.layers...: its modules have no ``model.`` prefix."""
    from safetensors.torch import load_file, save_file

    from shared.lora import LoRARequest
    from tests.lora_adapters import make_adapter, merged_model

    adapter = make_adapter(source, tmp_path / "adapter", rank=4, seed=3)
    merged = make_embedding_dir(merged_model(source, adapter, tmp_path / "merged"), tmp_path / "merged-emb")
    weights = load_file(str(adapter / "adapter_model.safetensors"))
    save_file({name.replace("base_model.model.model.", "base_model.model."): t for name, t in weights.items()},
              str(adapter / "adapter_model.safetensors"))
    model_dir = make_embedding_dir(source, tmp_path / "emb")
    llm = small_engine(model_dir, enable_lora=True, max_lora_rank=4)
    try:
        prompt = {"prompt_token_ids": [21, 22, 23, 24, 25, 26]}
        (with_adapter,) = llm.embed(prompt, use_tqdm=False, lora_request=LoRARequest("bare", str(adapter)))
        (without,) = llm.embed(prompt, use_tqdm=False)
    finally:
        llm.close()
    assert_close(with_adapter.outputs.embedding, hf_embedding(merged, [21, 22, 23, 24, 25, 26]), "adapter")
    assert_close(without.outputs.embedding, hf_embedding(model_dir, [21, 22, 23, 24, 25, 26]), "base model")
    assert (torch.tensor(with_adapter.outputs.embedding) - torch.tensor(without.outputs.embedding)).abs().max() > 1e-3


def test_do_lower_case_lowercases_texts_and_per_prompt_params(source, tmp_path):
    model_dir = make_embedding_dir(source, tmp_path / "lower")
    (model_dir / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 256, "do_lower_case": True}))
    llm = small_engine(model_dir)
    try:
        upper, lower = llm.embed(["Hello World", "hello world"], [PoolingParams(normalize=False), PoolingParams()],
                                 use_tqdm=False)
        with pytest.raises(ValueError, match="one PoolingParams per prompt"):
            llm.embed(["a", "b"], [PoolingParams()], use_tqdm=False)
    finally:
        llm.close()
    assert upper.prompt_token_ids == lower.prompt_token_ids
    assert_close(upper.outputs.embedding, hf_embedding(model_dir, lower.prompt_token_ids, normalize=False), "lowercased")
    assert_close(lower.outputs.embedding, hf_embedding(model_dir, lower.prompt_token_ids), "normalized")


@pytest.mark.parametrize("config, error", [({"matryoshka_dimensions": 768}, "must be a list of integers"),
                                           ({"is_matryoshka": "false"}, "must be true or false")])
def test_matryoshka_settings_of_the_wrong_type_are_refused(tmp_path, config, error):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64, **config}))
    with pytest.raises(ValueError, match=error):
        read_pooler_config(tmp_path, 64)


def test_a_pooling_module_without_its_path_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    write_st_files(tmp_path, [{"path": "", "type": ST + "Transformer"}, {"type": ST + "Pooling"}])
    with pytest.raises(ValueError, match="Pooling module needs the path"):
        read_pooler_config(tmp_path, 64)


def test_chat_messages_are_embedded_as_their_rendered_conversation(stack, last_dir):
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "find the capital of France"}]
    status, body = post_json(stack, "/v1/embeddings", {"messages": messages, "encoding_format": "float"})
    assert status == 200 and len(body["data"]) == 1, body
    ids = AutoTokenizer.from_pretrained(str(last_dir)).apply_chat_template(messages, add_generation_prompt=True,
                                                                           tokenize=True)
    ids = list(ids["input_ids"]) if isinstance(ids, dict) or hasattr(ids, "keys") else list(ids)
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert_close(body["data"][0]["embedding"], hf_embedding(last_dir, ids), "chat embedding")
    for bad, param in (({"messages": messages, "input": "x"}, "input"), ({"messages": []}, "messages"),
                       ({"messages": messages, "continue_final_message": True}, "continue_final_message"),
                       ({"messages": messages, "chat_template": "{{ 1 }}"}, "chat_template")):
        status, body = post_json(stack, "/v1/embeddings", bad)
        assert status == 400 and body["error"]["param"] == param, (bad, body)


def test_offline_score_is_the_cosine_of_the_embeddings(last_dir):
    llm = small_engine(last_dir)
    try:
        outputs = llm.score("the query", ["a document", "the query", "another one"], use_tqdm=False)
        a, b = llm.embed(["the query", "another one"], use_tqdm=False)
        with pytest.raises(ValueError, match="give one text_1, or as many as text_2"):
            llm.score(["a", "b"], ["c", "d", "e"], use_tqdm=False)
    finally:
        llm.close()
    assert len(outputs) == 3 and abs(outputs[1].outputs.score - 1) < 1e-6  # a text against itself
    expected = torch.nn.functional.cosine_similarity(torch.tensor(a.outputs.embedding),
                                                     torch.tensor(b.outputs.embedding), dim=0).item()
    assert abs(outputs[2].outputs.score - expected) < 1e-6
