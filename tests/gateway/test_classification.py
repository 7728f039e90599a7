"""Sequence classifiers on a pooling engine: offline (LLM.classify, LLM.score with a cross-encoder) and over
the gateway (/classify, /score, /rerank, gRPC Classify), against transformers' *ForSequenceClassification."""

from __future__ import annotations

import json

import grpc
import pytest
import torch

from pagedserve import LLM, PoolingParams
from services.gateway.classify_api import best_label
from shared.pooling import PoolerConfig, read_pooler_config, resolve_runner
from shared.proto import pagedserve_api_pb2 as api
from shared.proto import pagedserve_api_pb2_grpc as api_grpc
from benchmarks.serving import parse_engine_stats
from tests.embedding_models import hf_class_scores, make_classifier_dir
from tests.services_harness import http_get
from tests.gateway.test_embeddings import assert_close, fresh_rng, post_json, random_prompts, start_pooling_stack


@pytest.fixture(scope="module")
def three_labels(tiny_model_factory, tmp_path_factory):
    # Llama: grouped-query attention; softmax over three labels.
    return make_classifier_dir(tiny_model_factory("llama"), tmp_path_factory.mktemp("cls") / "three",
                               labels=("negative", "neutral", "positive"))


@pytest.fixture(scope="module")
def cross_encoder(tiny_model_factory, tmp_path_factory):
    # Qwen3 (q/k norms) with one label: a reranker, scored through a sigmoid.
    return make_classifier_dir(tiny_model_factory("qwen3", head_dim=32), tmp_path_factory.mktemp("cls") / "cross",
                               labels=("relevant",), seed=1)


def small_engine(model_dir, **options) -> LLM:
    """Chunked prefill over several steps (16 tokens each), blocks of 8."""
    defaults = dict(block_size=8, max_num_batched_tokens=16, num_gpu_blocks_override=128, max_num_seqs=4)
    return LLM(str(model_dir), **{**defaults, **options})


def tokenizer_of(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def test_a_classifier_directory_gives_its_labels_and_activation(three_labels, cross_encoder, tmp_path):
    assert resolve_runner("auto", three_labels) == "pooling"
    config = read_pooler_config(three_labels, 64)
    assert (config.labels, config.activation, config.pooling_type, config.task) == \
        (("negative", "neutral", "positive"), "softmax", "last", "classify")
    assert read_pooler_config(cross_encoder, 64).activation == "sigmoid"
    assert PoolerConfig.from_proto(config.to_proto()) == config

    def config_with(**changes) -> PoolerConfig:
        raw = json.loads((three_labels / "config.json").read_text())
        raw.update(changes)
        (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in raw.items() if v is not None}))
        return read_pooler_config(tmp_path, 64)

    assert config_with(problem_type="multi_label_classification").activation == "sigmoid"
    assert config_with(problem_type="regression").activation == "identity"
    assert config_with(sentence_transformers={"activation_fn": "torch.nn.modules.linear.Identity"}).activation == \
        "identity"
    assert config_with(sbert_ce_default_activation_function="torch.nn.modules.activation.Sigmoid").activation == \
        "sigmoid"
    assert config_with(id2label=None, label2id=None).labels == ("LABEL_0", "LABEL_1")  # transformers' default
    for changes, error in (({"id2label": {"0": "a", "2": "b"}}, "id2label must map"),
                           ({"num_labels": 2}, "disagree"),
                           ({"sentence_transformers": {"activation_fn": "torch.nn.Tanh"}}, "not supported")):
        with pytest.raises(ValueError, match=error):
            config_with(**changes)
    with pytest.raises(ValueError, match="no language-model head"):
        resolve_runner("generate", three_labels)
    assert best_label(("a", "b", "c"), [0.2, 0.5, 0.3]) == "b" and best_label(("a", "b"), [0.9, 0.1]) == "a"


def test_pooling_params_keep_each_task_s_fields_to_it():
    for bad, error in ((dict(task="classify", dimensions=8), "dimensions does not apply"),
                       (dict(task="classify", normalize=True), "normalize does not apply"),
                       (dict(task="embed", use_activation=False), "use_activation does not apply"),
                       (dict(task="rank"), "task must be one of"), (dict(task="classify", use_activation=1), "true")):
        with pytest.raises(ValueError, match=error):
            PoolingParams(**bad)
    # As in vLLM, the task is the entry point's: a request's fields are checked against it then.
    with pytest.raises(ValueError, match="use_activation does not apply to the embed task"):
        PoolingParams(use_activation=False).with_task("embed")
    with pytest.raises(ValueError, match="task is 'embed', but this asks for 'classify'"):
        PoolingParams(task="embed").with_task("classify")
    for params in (PoolingParams(use_activation=False).with_task("classify"), PoolingParams(dimensions=4)):
        assert PoolingParams.from_proto(params.to_proto()) == params


def test_class_scores_equal_transformers_across_chunks_and_prefix_cache_hits(three_labels):
    rng, seed = fresh_rng()
    llm = small_engine(three_labels, enable_prefix_caching=True)
    # Long prompts take several 16-token steps; the shared 24-token prefix is found in the cache the second time.
    shared = [rng.randrange(3, 500) for _ in range(24)]
    prompts = random_prompts(rng, 6, 60) + [shared + p for p in random_prompts(rng, 3, 20)]
    first = llm.classify([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    again = llm.classify([{"prompt_token_ids": p} for p in prompts[-3:]], use_tqdm=False)
    raw = llm.classify([{"prompt_token_ids": p} for p in prompts[:2]], PoolingParams(use_activation=False),
                       use_tqdm=False)
    for i, (prompt, out) in enumerate(zip(prompts, first)):
        assert out.outputs.num_classes == 3
        assert_close(out.outputs.probs, hf_class_scores(three_labels, prompt), f"prompt {i} (seed {seed})")
    for prompt, out in zip(prompts[-3:], again):
        # A cache hit computes in other chunks, so it rounds otherwise: held to the oracle, not to the first run.
        assert out.num_cached_tokens >= 24 - 8
        assert_close(out.outputs.probs, hf_class_scores(three_labels, prompt), f"cache hit (seed {seed})")
    for prompt, out in zip(prompts, raw):
        assert_close(out.outputs.probs, hf_class_scores(three_labels, prompt, activation=None), f"logits (seed {seed})")
    # A classifier gives no embeddings and no tokens, and scores no pairs with three labels; it serves on.
    with pytest.raises(ValueError, match="classifier: it serves the classify task, not embed"):
        llm.embed("hello", use_tqdm=False)
    with pytest.raises(ValueError, match="serves class scores only"):
        llm.generate("hello", use_tqdm=False)
    with pytest.raises(ValueError, match="one label"):
        llm.score("a", ["b"], use_tqdm=False)
    with pytest.raises(ValueError, match="task is 'embed'"):
        llm.classify("a", PoolingParams(task="embed"), use_tqdm=False)
    assert llm.classify("hello", use_tqdm=False)[0].outputs.probs == pytest.approx(
        hf_class_scores(three_labels, tokenizer_of(three_labels)("hello").input_ids).tolist(), abs=1e-4)
    assert llm.stats()["kv_blocks_used"] == 0
    llm.close()


def test_encode_gives_vllm_s_pooling_outputs(three_labels, tiny_model_factory):
    """LLM.encode, vLLM's generic pooling call: a tensor per prompt, the model's own task by default."""
    rng, seed = fresh_rng()
    prompts = random_prompts(rng, 3, 30)
    classifier = small_engine(three_labels)
    outputs = classifier.encode([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        assert isinstance(out.outputs.data, torch.Tensor) and out.outputs.data.dtype == torch.float32
        assert out.prompt_token_ids == prompt and out.finished
        assert_close(out.outputs.data.tolist(), hf_class_scores(three_labels, prompt), f"seed {seed}")
    raw = classifier.encode({"prompt_token_ids": prompts[0]}, PoolingParams(use_activation=False),
                            pooling_task="classify", use_tqdm=False)[0]
    assert_close(raw.outputs.data.tolist(), hf_class_scores(three_labels, prompts[0], activation=None), "logits")
    with pytest.raises(ValueError, match="serves the classify task, not embed"):
        classifier.encode("hello", pooling_task="embed", use_tqdm=False)
    with pytest.raises(ValueError, match="pooling_task must be"):
        classifier.encode("hello", pooling_task="token_embed", use_tqdm=False)
    classifier.close()
    embedder = LLM(str(tiny_model_factory("llama")), runner="pooling", block_size=16, num_gpu_blocks_override=64)
    embedded = embedder.encode({"prompt_token_ids": prompts[1]}, use_tqdm=False)[0].outputs.data
    assert embedded.tolist() == pytest.approx(
        embedder.embed({"prompt_token_ids": prompts[1]}, use_tqdm=False)[0].outputs.embedding, abs=1e-6)
    embedder.close()


def test_an_embedding_model_does_not_classify(tiny_model_factory):
    llm = LLM(str(tiny_model_factory("llama")), runner="pooling", block_size=16, num_gpu_blocks_override=64)
    with pytest.raises(ValueError, match="embedding model: it serves the embed task, not classify"):
        llm.classify("hello", use_tqdm=False)
    llm.close()


def test_a_cross_encoder_scores_each_pair_tokenized_together(cross_encoder):
    rng, seed = fresh_rng()
    llm = small_engine(cross_encoder, enable_prefix_caching=True)
    tokenizer = tokenizer_of(cross_encoder)
    query = " ".join(rng.choice(["cat", "dog", "bird", "sky", "blue"]) for _ in range(rng.randrange(3, 12)))
    documents = [" ".join(rng.choice(["red", "sun", "tree", "dog"]) for _ in range(rng.randrange(1, 20)))
                 for _ in range(4)]
    scored = llm.score(query, documents, use_tqdm=False)
    for i, (document, out) in enumerate(zip(documents, scored)):
        ref = hf_class_scores(cross_encoder, tokenizer(query, document).input_ids, activation="sigmoid")
        assert_close([out.outputs.score], ref, f"pair {i} (seed {seed})")
    pair = llm.score([documents[0], documents[1]], [query, query], use_tqdm=False,
                     pooling_params=PoolingParams(use_activation=False))
    ref = hf_class_scores(cross_encoder, tokenizer(documents[1], query).input_ids, activation=None)
    assert_close([pair[1].outputs.score], ref, f"pair by pair, the logit (seed {seed})")
    # Truncation trims the longer text of a pair (the document), as the tokenizer does: the query stays whole.
    short_query, long_document = "blue sky", " ".join(["tree sun"] * 40)
    (cut,) = llm.score(short_query, long_document, use_tqdm=False, truncate_prompt_tokens=24)
    kept = tokenizer(short_query, long_document, truncation=True, max_length=24).input_ids
    assert len(kept) == 24 and kept[:len(tokenizer(short_query).input_ids)] == tokenizer(short_query).input_ids
    assert_close([cut.outputs.score], hf_class_scores(cross_encoder, kept, "sigmoid"), f"truncated (seed {seed})")
    llm.close()


def test_a_bfloat16_classifier_scores_as_transformers_does(three_labels):
    # The head runs in the model's dtype on the float32 pooled state, as transformers' bfloat16 classifier. Against
    # it (400 fresh prompts): at most 0.014 apart; each lies up to 0.049 from float32 (which once failed 0.05).
    rng, seed = fresh_rng()
    llm = small_engine(three_labels, dtype="bfloat16")
    prompts = random_prompts(rng, 4, 40)
    for i, (prompt, out) in enumerate(zip(prompts, llm.classify([{"prompt_token_ids": p} for p in prompts],
                                                                use_tqdm=False))):
        expected = hf_class_scores(three_labels, prompt, dtype=torch.bfloat16)
        error = (torch.tensor(out.outputs.probs) - expected).abs().max().item()
        assert error < 0.03 and sum(out.outputs.probs) == pytest.approx(1.0, abs=1e-5), \
            f"prompt {i}: error {error:.3f} (seed {seed})"
    llm.close()


# --- over the gateway ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stack(cross_encoder, tmp_path_factory):
    stack = start_pooling_stack(cross_encoder, tmp_path_factory.mktemp("classifier-logs"))
    try:
        yield stack
    finally:
        stack.stop()


def test_classify_score_and_rerank_over_http(stack, cross_encoder):
    rng, seed = fresh_rng()
    tokenizer = tokenizer_of(cross_encoder)
    texts = ["".join(rng.choice("abcdefgh ") for _ in range(rng.randrange(1, 80))).strip() or "a" for _ in range(3)]
    for path in ("/classify", "/v1/classify"):
        status, body = post_json(stack, path, {"model": stack.model_name, "input": texts})
        assert status == 200, body
        assert [d["index"] for d in body["data"]] == [0, 1, 2] and body["id"].startswith("classify-")
        for i, (text, item) in enumerate(zip(texts, body["data"])):
            assert item["label"] == "relevant" and item["num_classes"] == 1
            assert_close(item["probs"], hf_class_scores(cross_encoder, tokenizer(text).input_ids, "sigmoid"),
                         f"input {i} (seed {seed})")
        assert body["usage"]["prompt_tokens"] == sum(len(tokenizer(t).input_ids) for t in texts)
    status, body = post_json(stack, "/classify", {"input": [[5, 6, 7]], "use_activation": False})
    assert status == 200 and body["data"][0]["probs"] == pytest.approx(
        hf_class_scores(cross_encoder, [5, 6, 7], None).tolist(), abs=1e-4), body
    status, body = post_json(stack, "/classify", {"messages": [{"role": "user", "content": texts[0]}]})
    assert status == 200 and len(body["data"]) == 1, body

    query, documents = texts[0], texts[1:] + ["zz top"]
    expected = [hf_class_scores(cross_encoder, tokenizer(query, d).input_ids, "sigmoid").item() for d in documents]
    status, scored = post_json(stack, "/score", {"text_1": query, "text_2": documents})
    assert status == 200, scored
    assert_close([d["score"] for d in scored["data"]], torch.tensor(expected), f"/score (seed {seed})")
    status, raw = post_json(stack, "/v1/score", {"text_1": query, "text_2": documents[:1], "use_activation": False})
    assert status == 200 and raw["data"][0]["score"] == pytest.approx(
        hf_class_scores(cross_encoder, tokenizer(query, documents[0]).input_ids, None).item(), abs=1e-4), raw
    status, ranked = post_json(stack, "/v1/rerank", {"query": query, "documents": documents, "top_n": 2})
    assert status == 200, ranked
    best = sorted(range(3), key=lambda i: -expected[i])[:2]
    assert [r["index"] for r in ranked["results"]] == best or \
        abs(expected[best[1]] - expected[[r["index"] for r in ranked["results"]][1]]) < 1e-4
    assert ranked["results"][0]["relevance_score"] == pytest.approx(expected[best[0]], abs=1e-4)

    # What a classifier cannot do is refused with a 400 naming the field; nothing is left holding blocks.
    for path, bad, param in (("/v1/embeddings", {"input": "x"}, "model"),
                             ("/classify", {"input": []}, "input"),
                             ("/classify", {"input": "x", "use_activation": "maybe"}, "use_activation"),
                             ("/classify", {"input": [3] * 600}, "input"),
                             ("/v1/completions", {"prompt": "x", "max_tokens": 2}, "model")):
        status, body = post_json(stack, path, bad)
        assert status == 400 and body["error"]["param"] == param, (path, bad, body)
    status, metrics = http_get(f"{stack.base_url}/metrics")
    assert status == 200 and parse_engine_stats(metrics)["kv_blocks_used"] == 0


def test_grpc_classify(stack, cross_encoder):
    with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:
        stub = api_grpc.GenerationStub(channel)
        reply = stub.Classify(api.ClassifyRequest(inputs=[api.EmbedInput(token_ids=api.TokenIds(ids=[4, 5, 6])),
                                                          api.EmbedInput(text="grpc")], use_activation=False),
                              timeout=30)
        assert [c.index for c in reply.classifications] == [0, 1] and reply.model == stack.model_name
        assert reply.classifications[0].label == "relevant"
        assert_close(list(reply.classifications[0].probs), hf_class_scores(cross_encoder, [4, 5, 6], None), "gRPC")
        assert reply.usage.prompt_tokens == 3 + reply.classifications[1].prompt_tokens
        for call, request in ((stub.Embed, api.EmbedRequest(inputs=[api.EmbedInput(text="x")])),
                              (stub.Classify, api.ClassifyRequest())):
            with pytest.raises(grpc.RpcError) as refused:
                call(request, timeout=30)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
