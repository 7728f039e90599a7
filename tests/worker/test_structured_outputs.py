"""Structured outputs: what the engine generates under a grammar equals transformers' greedy
decoding under the same grammar's mask (xgrammar, applied by hand here), through chunked prefill,
preemption by recompute and by swap, planning ahead and speculative decoding; seeded samples
follow their grammar and do not change with what shares their batch; bad constraints are refused."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

from pagedserve import LLM, SamplingParams
from services.worker.model_loader import load_eos_token_ids
from shared.structured_outputs import StructuredOutputs
from shared.tokenizer import load_tokenizer
from tests.engine_runs import run_to_end
from tests.oracle import assert_greedy_equal, hf_model
from tests.pipeline import Pipeline
from shared.request import EngineRequest

SCHEMA = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog", "bird"]}, "legs": {"type": "integer"},
                                           "tame": {"type": "boolean"}},
          "required": ["kind", "legs", "tame"], "additionalProperties": False}
CONSTRAINTS = {
    "json": StructuredOutputs(json=SCHEMA, disable_any_whitespace=True),
    "regex": StructuredOutputs(regex=r"(ab|cd)[0-9]{2,4}-[a-z]+"),
    "choice": StructuredOutputs(choice=["alpha", "beta", "gamma delta"]),
    "grammar": StructuredOutputs(grammar='root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "x"'),
}
MAX_TOKENS = 40


def reference_compiler(model_dir):
    import xgrammar as xgr

    tokenizer = load_tokenizer(model_dir)
    vocab = hf_model(str(model_dir)).config.vocab_size
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab,
                                              stop_token_ids=list(load_eos_token_ids(model_dir)))
    return xgr.GrammarCompiler(info)


def compiled(compiler, constraint: StructuredOutputs):
    if constraint.kind == "json":
        return compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    if constraint.kind == "regex":
        return compiler.compile_regex(constraint.regex)
    return compiler.compile_grammar(constraint.spec)


def hf_constrained_greedy(model_dir, compiler, prompt: list[int], constraint, max_tokens: int):
    """transformers' logits, the grammar's mask, argmax; the masked log-softmax at each step."""
    import xgrammar as xgr

    model = hf_model(str(model_dir))
    eos = set(load_eos_token_ids(model_dir))
    matcher = xgr.GrammarMatcher(compiled(compiler, constraint))
    tokens, logprobs = [], []
    for _ in range(max_tokens):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0, -1:].float()
        bitmask = xgr.allocate_token_bitmask(1, logits.shape[-1])
        matcher.fill_next_token_bitmask(bitmask)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        token = int(logits[0].argmax())
        tokens.append(token)
        logprobs.append(torch.log_softmax(logits[0], dim=-1))
        if token in eos:
            break
        assert matcher.accept_token(token)
    return tokens, logprobs


def prompts(seed: int, count: int = 4) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 500) for _ in range(rng.randrange(3, 40))] for _ in range(count)]


@pytest.fixture(scope="module")
def compiler(llama_dir):
    return reference_compiler(llama_dir)


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_constrained_greedy_equals_transformers_under_the_same_mask(llama_dir, compiler, preemption_mode):
    """Tight KV: sequences are preempted mid-output (a recomputed one rebuilds its matcher from its tokens)."""
    llm = LLM(str(llama_dir), block_size=8, max_num_batched_tokens=32, num_gpu_blocks_override=14,
              preemption_mode=preemption_mode)
    batch = prompts(seed=1)
    requests = [(prompt, constraint) for prompt in batch for constraint in CONSTRAINTS.values()]
    outputs = llm.generate([{"prompt_token_ids": p} for p, _ in requests],
                           [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=c)
                            for _, c in requests], use_tqdm=False)
    assert llm.stats()["num_preemptions"] > 0, "the KV budget was meant to force preemption"
    for (prompt, constraint), out in zip(requests, outputs):
        ref, ref_logprobs = hf_constrained_greedy(llama_dir, compiler, prompt, constraint, MAX_TOKENS)
        got = out.outputs[0]
        assert_greedy_equal(got.token_ids, ref, ref_logprobs, f"{constraint.kind}, prompt of {len(prompt)}")
        if got.token_ids == ref and got.finish_reason == "stop":
            assert_follows(constraint, got.text)


def assert_follows(constraint: StructuredOutputs, text: str) -> None:
    if constraint.kind == "json":
        value = json.loads(text)
        assert set(value) == {"kind", "legs", "tame"} and value["kind"] in ("cat", "dog", "bird")
        assert isinstance(value["legs"], int) and isinstance(value["tame"], bool)
    elif constraint.kind == "regex":
        assert re.fullmatch(constraint.regex, text), text
    elif constraint.kind == "choice":
        assert text in constraint.choice
    else:
        assert re.fullmatch(r"\(([0-9x])(,[0-9x])*\)", text), text


def test_seeded_constrained_samples_follow_their_grammar_whatever_shares_the_batch(llama_dir):
    """n = 3 seeded JSON objects: each valid, and the same alone as beside other requests planned ahead."""
    constraint = StructuredOutputs(json=SCHEMA, disable_any_whitespace=True)
    params = SamplingParams(n=3, temperature=1.0, top_k=50, seed=9, max_tokens=60, structured_outputs=constraint)
    prompt = prompts(seed=2, count=1)[0]
    alone = LLM(str(llama_dir), block_size=8).generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    texts = [c.text for c in alone.outputs]
    assert all(c.finish_reason == "stop" for c in alone.outputs), texts
    for text in texts:
        assert_follows(constraint, text)
    # Planned ahead (the worker appends its own samples; a step may be planned past an EOS), in a
    # batch with unconstrained and other constrained requests.
    engine = LLM(str(llama_dir), block_size=8, max_num_batched_tokens=48).engine
    engine.add_request(EngineRequest("seeded", prompt, params))
    for i, other in enumerate(prompts(seed=3)):
        other_params = SamplingParams(max_tokens=30, ignore_eos=True) if i % 2 else \
            SamplingParams(max_tokens=30, structured_outputs=CONSTRAINTS["regex"])
        engine.add_request(EngineRequest(f"other-{i}", other, other_params))
    driver, outputs = Pipeline(engine), {}
    while driver.has_unfinished():
        for update in driver.step():
            if update.request_id == "seeded":
                outputs.setdefault(update.seq_index, []).extend(update.new_token_ids)
    assert driver.ahead > 0
    assert [outputs[i] for i in range(3)] == [c.token_ids for c in alone.outputs]
    assert engine.get_stats()["kv_blocks_used"] == 0


def test_speculative_decoding_leaves_constrained_outputs_as_they_are(llama_dir):
    """Prompt-lookup drafts go to the unconstrained requests only; every output is as without them."""
    rng = random.Random(4)
    repeating = [t for _ in range(6) for t in [rng.randrange(1, 500) for _ in range(5)]]  # drafts find matches
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=c) for c in CONSTRAINTS.values()]
    params.append(SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    requests = [{"prompt_token_ids": repeating}] * len(params)
    plain = LLM(str(llama_dir), block_size=8).generate(requests, params, use_tqdm=False)
    speculating = LLM(str(llama_dir), block_size=8, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                                         "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    drafted = speculating.generate(requests, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in drafted] == [o.outputs[0].token_ids for o in plain]
    assert speculating.stats()["spec_decode_num_draft_tokens"] > 0


def test_bad_constraints_are_refused_with_the_field_named():
    cases = [({"regex": "a(b"}, "regex is not usable"), ({"json": {"type": "nope"}}, "json is not usable"),
             ({"json": "{not json"}, "json is not valid JSON"), ({"grammar": "root ::= missing"}, "grammar is not usable"),
             ({"choice": []}, "non-empty list"), ({"choice": "yes"}, "list of strings"), ({}, "exactly one"),
             ({"regex": "a", "choice": ["a"]}, "exactly one"), ({"json": [1]}, "JSON schema")]
    for fields, message in cases:
        with pytest.raises(ValueError, match=message):
            StructuredOutputs(**fields)
    with pytest.raises(ValueError, match="use_beam_search cannot be combined with structured_outputs"):
        SamplingParams(use_beam_search=True, n=2, structured_outputs={"regex": "a+"})
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=3, structured_outputs={"choice": ["a"]})
    with pytest.raises(ValueError, match="unknown field"):
        SamplingParams(structured_outputs={"xml": "a"})
    for constraint in [*CONSTRAINTS.values(), StructuredOutputs(json_object=True)]:
        params = SamplingParams(structured_outputs=constraint)
        assert SamplingParams.from_proto(params.to_proto()) == params



def test_a_grammar_that_cannot_go_on_fails_its_request_and_no_other(llama_dir):
    """A regex no string satisfies (a dead end after its first token), a schema that passes the check
    but does not compile on the worker: each request fails with its error, while the requests
    beside it, constrained or not, get what they get alone (the step never fails)."""
    llm = LLM(str(llama_dir), block_size=8)
    engine = llm.engine
    good = {"free": SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
            "choice": SamplingParams(temperature=0, max_tokens=12, structured_outputs=CONSTRAINTS["choice"])}
    bad = {"dead-end": SamplingParams(temperature=0, max_tokens=12, structured_outputs={"regex": r"a[^\s\S]"}),
           "no-compile": SamplingParams(temperature=0, max_tokens=12,
                                        structured_outputs={"json": {"type": "string", "minLength": -1}})}
    prompt = prompts(seed=5, count=1)[0]
    alone = {name: llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].token_ids
             for name, params in good.items()}
    for name, params in {**good, **bad}.items():
        engine.add_request(EngineRequest(name, prompt, params))
    tokens, errors = run_to_end(engine)
    assert set(errors) == set(bad)
    assert "allows no next token" in errors["dead-end"] and "cannot be used" in errors["no-compile"]
    assert {name: tokens[name] for name in good} == alone
    assert engine.get_stats()["kv_blocks_used"] == 0
    with pytest.raises(ValueError, match="failed: the structured output grammar allows no next token"):
        llm.generate({"prompt_token_ids": prompt}, bad["dead-end"], use_tqdm=False)



def test_a_schema_s_properties_come_in_the_order_it_gives(llama_dir):
    """A model asked for its reasoning before its answer must write them in that order."""
    schema = {"type": "object", "properties": {"zeta": {"enum": ["z"]}, "alpha": {"enum": ["a"]}},
              "required": ["zeta", "alpha"], "additionalProperties": False}
    llm = LLM(str(llama_dir), block_size=8)
    for given in (schema, json.dumps(schema)):
        params = SamplingParams(temperature=0, max_tokens=30,
                                structured_outputs={"json": given, "disable_any_whitespace": True})
        text = llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)[0].outputs[0].text
        assert text == '{"zeta": "z", "alpha": "a"}', text
