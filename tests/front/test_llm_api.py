"""The offline API: shapes of the outputs, sampling through the whole engine, bad input."""

from __future__ import annotations

import gc
import weakref

import pytest

from pagedserve import LLM, SamplingParams
from shared.gc_heap import heap_frozen_while_running


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), block_size=8, max_num_batched_tokens=64, seed=1)


def test_outputs_in_input_order_with_strings_and_token_ids(llm):
    prompts = ["Hello there", {"prompt_token_ids": [5, 6, 7]}, {"prompt": "Again"}]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert [o.prompt for o in outs] == ["Hello there", None, "Again"]
    assert outs[1].prompt_token_ids == [5, 6, 7]
    for out in outs:
        (completion,) = out.outputs
        assert completion.index == 0 and len(completion.token_ids) == 5 and completion.finish_reason == "length"
        assert completion.text == llm.get_tokenizer().decode(completion.token_ids, skip_special_tokens=True)
        assert completion.logprobs is None and completion.cumulative_logprob is None
        assert out.finished


def test_greedy_is_independent_of_the_batch(llm):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = llm.generate("The quick brown fox", params, use_tqdm=False)[0].outputs[0].token_ids
    crowd = llm.generate(["Some other prompt"] * 3 + ["The quick brown fox"], params, use_tqdm=False)
    assert crowd[-1].outputs[0].token_ids == alone


def test_seeded_sampling_is_reproducible_across_batches(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=1234, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    alone = llm.generate("Once upon a time", seeded, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate(["Noise one", "Once upon a time", "Noise two, longer prompt here"],
                         [other, seeded, other], use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone
    different = llm.generate("Once upon a time", SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=99,
                                                                 ignore_eos=True), use_tqdm=False)
    assert different[0].outputs[0].token_ids != alone


def test_seeded_sampling_survives_preemption(llama_dir):
    params = SamplingParams(temperature=0.9, max_tokens=24, seed=7, ignore_eos=True, presence_penalty=0.5)
    prompts = [{"prompt_token_ids": list(range(10 + i, 60 + 7 * i))} for i in range(5)]
    roomy = LLM(str(llama_dir), block_size=8).generate(prompts, params, use_tqdm=False)
    tight_llm = LLM(str(llama_dir), block_size=8, num_gpu_blocks_override=14, max_num_batched_tokens=32)
    tight = tight_llm.generate(prompts, params, use_tqdm=False)
    assert tight_llm.stats()["num_preemptions"] > 0
    assert [o.outputs[0].token_ids for o in roomy] == [o.outputs[0].token_ids for o in tight]


def test_forked_siblings_past_max_num_seqs_are_sampled_max_num_seqs_rows_at_a_time(llama_dir, monkeypatch):
    llm = LLM(str(llama_dir), block_size=4, max_num_seqs=2)
    worker = llm.engine.executor.worker
    step_rows, sampler_rows = [], []
    sample_tokens, sample = worker._sample_tokens, worker.sampler.sample

    def recording_step(hidden, sampling, sample_rows, outputs):
        step_rows.append(len(sample_rows) + sum(len(seq.sibling_sampling) for _, seq in sampling))
        return sample_tokens(hidden, sampling, sample_rows, outputs)

    def recording_sampler(logits, states):
        sampler_rows.append(logits.shape[0])
        return sample(logits, states)

    monkeypatch.setattr(worker, "_sample_tokens", recording_step)
    monkeypatch.setattr(worker.sampler, "sample", recording_sampler)
    params = SamplingParams(n=2, seed=5, temperature=1.0, max_tokens=5, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 9, 13]}, {"prompt_token_ids": [7, 2]}]
    chunked = llm.generate(prompts, params, use_tqdm=False)
    assert max(step_rows) > 2 and max(sampler_rows) == 2  # two requests' siblings, sampled two rows at a time
    roomy = LLM(str(llama_dir), block_size=4).generate(prompts, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in chunked] == [[c.token_ids for c in o.outputs] for o in roomy]


def test_n_sequences_differ_and_are_indexed(llm):
    out = llm.generate("Pick", SamplingParams(n=3, temperature=1.0, max_tokens=10, seed=5, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_stop_string_ends_the_output(llm):
    base = llm.generate("Tell me", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    text = base[0].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    if not stop.strip():
        pytest.skip("greedy text has no usable middle")
    out = llm.generate("Tell me", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:text.index(stop)]
    assert llm.stats()["kv_blocks_used"] == 0


def test_stop_token_and_min_tokens(llm):
    greedy = llm.generate("Count", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    out = llm.generate("Count", SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[greedy[3]]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == greedy[3]
    end = greedy.index(greedy[3])
    assert out.token_ids == greedy[:end + 1]
    # As vLLM: the stop token's text is left out (it is not a stop string), unless asked for.
    assert out.text == llm.tokenizer.decode(greedy[:end])
    kept = llm.generate("Count", SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[greedy[3]],
                                                include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == llm.tokenizer.decode(greedy[:end + 1]) != out.text
    late = llm.generate("Count", SamplingParams(temperature=0, max_tokens=10, min_tokens=10,
                                                stop_token_ids=[greedy[0]]), use_tqdm=False)[0].outputs[0]
    assert len(late.token_ids) == 10 and greedy[0] not in late.token_ids


def test_logit_bias_forces_a_token(llm):
    out = llm.generate("Anything", SamplingParams(temperature=0, max_tokens=4, logit_bias={42: 100.0}),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [42] * 4


def test_chat_uses_the_template(llm):
    out = llm.chat([{"role": "user", "content": "Hi!"}], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert "<|im_start|>user" in out[0].prompt and out[0].prompt.rstrip().endswith("assistant")


def test_chat_shows_tools_to_the_template(llm):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    out = llm.chat([{"role": "user", "content": "Hi!"}], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False,
                   tools=tools)[0]
    assert '"name": "get_weather"' in out.prompt and "<tool_call>" in out.prompt
    with pytest.raises(ValueError, match="tools must be a list"):
        llm.chat([{"role": "user", "content": "Hi!"}], use_tqdm=False, tools={"name": "get_weather"})


def test_chat_takes_openai_message_shapes_and_refuses_bad_ones_clearly(llm):
    params = SamplingParams(temperature=0, max_tokens=3)
    plain = llm.chat([{"role": "user", "content": "Hi\nthere"}], params, use_tqdm=False)[0]
    parts = llm.chat([{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}],
                     params, use_tqdm=False)[0]
    assert parts.prompt == plain.prompt and parts.outputs[0].token_ids == plain.outputs[0].token_ids
    empty = llm.chat([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None},
                      {"role": "user", "content": "more"}], params, use_tqdm=False)[0]
    assert "more" in empty.prompt
    for messages, match in (([{"role": 5, "content": "hi"}], "string 'role'"),
                            ([{"content": "hi"}], "string 'role'"),
                            ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "takes no images"),
                            ([{"role": "user", "content": 7}], "message 0"),
                            ("hello", "list of dicts")):
        with pytest.raises(ValueError, match=match):
            llm.chat(messages, params, use_tqdm=False)
    with pytest.raises(ValueError, match="cannot render"):  # a template that fails, or that refuses the messages
        llm.chat([{"role": "user", "content": "hi"}], params, chat_template="{% for m in messages %}", use_tqdm=False)
    with pytest.raises(ValueError, match="roles must alternate"):
        llm.chat([{"role": "user", "content": "hi"}], params, use_tqdm=False,
                 chat_template="{{ raise_exception('roles must alternate') }}")
    assert llm.chat([{"role": "user", "content": "hi"}], params, use_tqdm=False)[0].outputs[0].token_ids


def test_prompts_as_numpy_or_torch_ids_and_numpy_scalars_in_params(llm):
    import numpy as np
    import torch
    ids = [5, 17, 99, 3]
    params = SamplingParams(temperature=np.float32(0.0), max_tokens=np.int64(4), ignore_eos=True)
    assert params.max_tokens == 4 and type(params.max_tokens) is int and type(params.temperature) is float
    outs = llm.generate([{"prompt_token_ids": ids}, {"prompt_token_ids": np.array(ids)},
                         {"prompt_token_ids": torch.tensor(ids)}], params, use_tqdm=False)
    assert all(o.prompt_token_ids == ids and o.outputs[0].token_ids == outs[0].outputs[0].token_ids for o in outs)
    from_generator = llm.generate(({"prompt_token_ids": p} for p in (ids, ids[:2])), (params for _ in range(2)),
                                  use_tqdm=False)
    assert [o.prompt_token_ids for o in from_generator] == [ids, ids[:2]]
    assert SamplingParams(stop_token_ids=np.array([3, 4])).stop_token_ids == [3, 4]


@pytest.mark.parametrize("prompts, params, match", [
    (None, SamplingParams(), "prompts must be"),
    (5, SamplingParams(), "prompts must be"),
    ({"prompt_token_ids": None}, SamplingParams(), "prompt_token_ids must be a sequence"),
    ({"prompt_token_ids": "abc"}, SamplingParams(), "prompt_token_ids must be a sequence"),
    ({"prompt_token_ids": [1, 2.5]}, SamplingParams(), "prompt_token_ids must be a sequence"),
    ({"prompt": None}, SamplingParams(), "must be a string"),
    ({"prompt": "hi", "multi_modal_data": {"video": []}}, SamplingParams(), "multi_modal_data takes 'image'"),
    ({"prompt": "hi", "multi_modal_data": {"image": [object()]}}, SamplingParams(), "takes no images"),
    ("hi", {"max_tokens": 2}, "sampling_params must be"),
])
def test_malformed_generate_arguments_are_value_errors(llm, prompts, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts, params, use_tqdm=False)
    assert llm.stats()["kv_blocks_used"] == 0


def test_stats_report_the_cache(llm):
    stats = llm.stats()
    for key in ("num_preemptions", "kv_blocks_total", "kv_blocks_used", "kv_waste_pct", "kv_waste_pct_peak"):
        assert key in stats
    assert stats["kv_blocks_used"] == 0 and stats["kv_blocks_total"] > 0
    assert 0 < stats["kv_waste_pct_peak"] < 100


@pytest.mark.parametrize("prompt, params, match", [
    ("", SamplingParams(), "empty"),
    ({"prompt_token_ids": [1] * 600}, SamplingParams(), "context length"),
    ({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=600), "exceeds the context"),
    ({"prompt_token_ids": [1, 10**6]}, SamplingParams(), "vocabulary"),
    ("ok", SamplingParams(logprobs=21, max_tokens=2), "logprobs=21 exceeds the maximum of 20"),
    ("ok", SamplingParams(logprobs=20, max_tokens=2), None),
    ("ok", SamplingParams(n=2**31, max_tokens=2), r"n \(2147483648\) exceeds the engine's max_num_seqs"),
    ("ok", SamplingParams(use_beam_search=True, beam_width=300, max_tokens=2), "beam_width"),
    ("ok", SamplingParams(use_beam_search=True, n=300, max_tokens=2), r"SamplingParams\.n \(300\)"),  # the width n gave
])
def test_bad_prompts_are_refused_and_the_engine_keeps_serving(llm, prompt, params, match):
    if match is not None:
        with pytest.raises(ValueError, match=match):
            llm.generate(["fine prompt", prompt], params, use_tqdm=False)
        assert llm.stats()["kv_blocks_used"] == 0 and llm.stats()["num_requests_waiting"] == 0
    out = llm.generate("still serving", SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) >= 1


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_tokens=-1), "max_tokens"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(temperature=-0.1), "temperature"),
    (dict(top_k=-5), "top_k"),
    (dict(min_p=2.0), "min_p"),
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(logprobs=-1), "logprobs"),
    (dict(n=0), "n"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(logit_bias={3: 1000.0}), "logit_bias"),
    (dict(top_p=1e-300), "top_p must be 0 or of magnitude"),  # 0.0 after the float32 wire
    (dict(temperature=1e308), "temperature must be 0 or of magnitude"),  # infinity after it
    (dict(stop_token_ids=5), "stop_token_ids must be a list"),
    (dict(stop=5), "stop must be a string or a list"),
    (dict(logit_bias={"a": 1.0}), "logit_bias must map token ids to numbers"),
    (dict(use_beam_search=True, top_p=0.5), "use_beam_search cannot be combined with top_p"),
    (dict(use_beam_search=True, repetition_penalty=1.2, top_k=3), "combined with top_k, repetition_penalty"),
    (dict(use_beam_search=True, prompt_logprobs=1), "combined with prompt_logprobs"),
    (dict(use_beam_search=True, seed=3), "combined with seed"),
])
def test_invalid_sampling_params_name_the_parameter(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_missing_model_and_unsupported_architecture(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nope")):
        LLM(str(tmp_path / "nope"))
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ValueError, match="gpt2.*--model-impl transformers"):  # (auto would run it through it)
        LLM(str(tmp_path), model_impl="native")


def test_unknown_engine_option():
    with pytest.raises(TypeError, match="unknown engine option"):
        LLM(block_sise=8)


def test_truncate_prompt_tokens_keeps_the_prompt_s_last_tokens(llm):
    prompt = list(range(5, 45))
    params = dict(temperature=0, max_tokens=5)
    whole_tail = llm.generate([{"prompt_token_ids": prompt[-12:]}], SamplingParams(**params), use_tqdm=False)[0]
    cut = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(**params, truncate_prompt_tokens=12),
                       use_tqdm=False)[0]
    assert cut.prompt_token_ids == prompt[-12:] and cut.outputs[0].token_ids == whole_tail.outputs[0].token_ids
    short = llm.generate([{"prompt_token_ids": prompt[:3]}], SamplingParams(**params, truncate_prompt_tokens=12),
                         use_tqdm=False)[0]
    assert short.prompt_token_ids == prompt[:3]  # shorter prompts stay whole
    limit = llm.engine.info.max_model_len
    long = [7] * (limit + 50)
    assert SamplingParams(truncate_prompt_tokens=-1).truncated(long, limit) == [7] * limit
    with pytest.raises(ValueError, match="context length"):  # -1 leaves no room to generate: refused, clearly
        llm.generate([{"prompt_token_ids": long}], SamplingParams(truncate_prompt_tokens=-1), use_tqdm=False)
    for bad in (0, -2, 1.5, 1 << 31):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=bad)
    with pytest.raises(ValueError, match="exceeds the context length"):
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(truncate_prompt_tokens=limit + 1), use_tqdm=False)
    for name, value in (("seed", 1 << 63), ("top_k", 1 << 31), ("max_tokens", 1 << 32)):  # what the wire cannot carry
        with pytest.raises(ValueError, match=name):
            SamplingParams(**{name: value})
    assert SamplingParams.from_proto(SamplingParams(truncate_prompt_tokens=-1).to_proto()).truncate_prompt_tokens == -1


def test_generate_freezes_the_heap_only_while_it_runs(llm, monkeypatch):
    # Full collections would walk the model and tokenizer again during a run; after it, or when it fails,
    # everything is collectable as before.
    counts = []
    real_step = llm.engine.step
    monkeypatch.setattr(llm.engine, "step", lambda: counts.append(gc.get_freeze_count()) or real_step())
    assert gc.get_freeze_count() == 0
    llm.generate("Hello there", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert counts and all(c > 0 for c in counts) and gc.get_freeze_count() == 0
    monkeypatch.setattr(llm.engine, "step", _failing_step)
    with pytest.raises(RuntimeError, match="step failed"):
        llm.generate("Hello there", SamplingParams(max_tokens=3), use_tqdm=False)
    assert gc.get_freeze_count() == 0


def _failing_step():
    raise RuntimeError("step failed")


def test_a_heap_frozen_before_the_run_stays_as_it_was(monkeypatch):
    # (The count itself moves whenever a frozen object is freed: what matters is that nothing freezes or thaws.)
    calls = []
    monkeypatch.setattr(gc, "get_freeze_count", lambda: 1000)
    monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze"))
    monkeypatch.setattr(gc, "unfreeze", lambda: calls.append("unfreeze"))
    with heap_frozen_while_running():
        pass
    assert calls == []


class _Node:
    pass


def test_garbage_made_while_frozen_is_collected():
    freed = []
    with heap_frozen_while_running():
        cycle = _Node()
        cycle.self = cycle  # only the collector frees it
        weakref.finalize(cycle, freed.append, "cycle")
        del cycle
        gc.collect()
        assert freed == ["cycle"]


def _worker_of_a_finished_llm(llama_dir) -> weakref.ref:
    llm = LLM(str(llama_dir), block_size=8, max_num_batched_tokens=64)
    llm.generate("Hello there", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    return weakref.ref(llm.engine.executor.worker)


def test_an_llm_frees_its_worker_and_kv_cache_with_its_last_reference(llama_dir):
    # No cycle through the engine: the KV cache (GiBs at real size) goes with the LLM, not at some later
    # full collection, so a second LLM made in the same process does not run beside the first one's memory.
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        assert _worker_of_a_finished_llm(llama_dir)() is None
    finally:
        if enabled:
            gc.enable()
