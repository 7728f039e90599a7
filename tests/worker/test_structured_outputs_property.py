"""Structured outputs as a property: random JSON schemas, sampled with random seeds, through chunked
prefill, preemption and steps planned ahead; every finished output parses (strict json.loads: no raw
control characters) and validates against its schema, and every output cut by max_tokens is a prefix
the grammar accepts. A fresh seed each run, named in every failure."""

from __future__ import annotations

import codecs
import json
import os
import random

import jsonschema
import pytest
import torch
import xgrammar as xgr
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve import LLM, SamplingParams
from services.worker.sampler import _exponentials_of_bits
from services.worker.utf8_mask import COMPLETE, Utf8Masks, after
from services.worker.model_loader import load_eos_token_ids
from shared.structured_outputs import xgrammar_schema
from shared.tokenizer import load_tokenizer
from tests.pipeline import Pipeline
from tests.worker.test_structured_outputs import reference_compiler
from shared.request import EngineRequest

WORDS = ("name", "age", "skills", "work_history", "company", "years", "id", "tags", "active", "score", "notes")


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """An object schema of strings (some bounded), integers and numbers (some ranged), booleans, enums,
    arrays and nested objects, some properties required."""
    names = rng.sample(WORDS, rng.randint(1, 4))
    properties = {name: random_value_schema(rng, depth) for name in names}
    schema = {"type": "object", "properties": properties,
              "required": [n for n in names if rng.random() < 0.7]}
    if rng.random() < 0.5:
        schema["additionalProperties"] = False
    return schema


def random_value_schema(rng: random.Random, depth: int) -> dict:
    kinds = ["string", "integer", "number", "boolean", "enum", "array"] + (["object"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 12)} if rng.random() < 0.5 else {"type": "string"}
    if kind in ("integer", "number"):
        low = rng.randint(-50, 50)
        return {"type": kind, "minimum": low, "maximum": low + rng.randint(0, 100)} if rng.random() < 0.5 \
            else {"type": kind}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "a b", "é", "x\"y"], rng.randint(1, 3))}
    if kind == "array":
        items = rng.choice([{"type": "string"}, {"type": "integer"}, random_schema(rng, depth + 1)])
        return {"type": "array", "items": items, "maxItems": rng.randint(1, 4)}
    return random_schema(rng, depth + 1)


def test_noise_is_never_zero_at_the_extremes_of_the_hash():
    """The largest hash used to give noise 0: a masked token's probability 0 / 0 was NaN, and argmax took it
    (a grammar's forbidden token once in 2**24 draws per token)."""
    bits = torch.tensor([0, 1, (1 << 32) - 1, (1 << 32) - 512, 1 << 31], dtype=torch.int64)
    noise = _exponentials_of_bits(bits.clone())
    assert torch.isfinite(noise).all() and (noise > 0).all(), noise
    assert float(noise[2]) < float(noise[4]) < float(noise[0])  # still decreasing in the uniform


@pytest.mark.parametrize("any_whitespace", [False, True])
def test_random_schemas_sampled_with_random_seeds_give_valid_json(llama_dir, any_whitespace):
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    schemas = [random_schema(rng) for _ in range(12)]
    # Tight KV and a small step budget: prompts are chunked and sequences preempted mid-output.
    engine = LLM(str(llama_dir), block_size=8, max_num_batched_tokens=48, num_gpu_blocks_override=40,
                 preemption_mode=rng.choice(["swap", "recompute"])).engine
    max_tokens = 160
    for i, schema in enumerate(schemas):
        prompt = [rng.randrange(1, 500) for _ in range(rng.randrange(3, 60))]
        params = SamplingParams(temperature=rng.choice([0.7, 1.0, 1.5]), seed=rng.randrange(1 << 31),
                                top_k=rng.choice([None, 40]), max_tokens=max_tokens,
                                structured_outputs={"json": schema, "disable_any_whitespace": not any_whitespace})
        engine.add_request(EngineRequest(str(i), prompt, params))
    driver, tokens, finish = Pipeline(engine), {}, {}
    while driver.has_unfinished():
        for update in driver.step():
            assert update.error is None, f"seed {seed}, request {update.request_id}: {update.error}"
            tokens.setdefault(update.request_id, []).extend(update.new_token_ids)
            if update.finish_reason is not None:
                finish[update.request_id] = update.finish_reason
    assert engine.get_stats()["kv_blocks_used"] == 0
    compiler, tokenizer = reference_compiler(llama_dir), load_tokenizer(llama_dir)
    eos = set(load_eos_token_ids(llama_dir))
    for i, schema in enumerate(schemas):
        ids, why = tokens[str(i)], finish[str(i)]
        context = f"seed {seed}, schema {json.dumps(schema)}, reason {why}"
        if why == "stop":
            text = tokenizer.decode([t for t in ids if t not in eos])
            try:
                jsonschema.validate(json.loads(text), schema)  # strict: a raw control character fails
            except (ValueError, jsonschema.ValidationError) as exc:
                raise AssertionError(f"{context}: {text!r} ({ids}): {exc}") from exc
        else:  # cut by max_tokens: the grammar accepts every token so far
            assert why == "length" and len(ids) == max_tokens, context
            matcher = xgr.GrammarMatcher(compiler.compile_json_schema(xgrammar_schema(json.dumps(schema)),
                                                                      any_whitespace=any_whitespace))
            assert all(matcher.accept_token(t) for t in ids), context


def test_length_bounded_strings_keep_to_json_s_characters():
    """xgrammar's own lowering of minLength / maxLength admits raw control characters; the rewritten schema
    keeps the bounds (in a type list, propertyNames, $defs and anyOf too) and refuses them, and leaves
    enum and const values as they are."""
    accepts = xgr.testing._is_grammar_accept_string
    bounded = {"type": "object", "properties": {
        "short": {"type": "string", "minLength": 2, "maxLength": 3},
        "maybe": {"type": ["string", "null"], "maxLength": 2},
        "ref": {"$ref": "#/$defs/code"},
        "either": {"anyOf": [{"type": "integer"}, {"type": "string", "minLength": 1}]},
        "literal": {"enum": [{"type": "string", "maxLength": 1}]}},
        "propertyNames": {"maxLength": 7}, "$defs": {"code": {"type": "string", "maxLength": 1}},
        "required": ["short"]}
    spec = xgrammar_schema(json.dumps(bounded))
    assert json.loads(spec)["properties"]["literal"] == bounded["properties"]["literal"]
    grammar = xgr.Grammar.from_json_schema(spec, any_whitespace=False)
    for good in ['{"short": "ab"}', '{"short": "abc", "maybe": null}', '{"short": "ab", "maybe": "é"}',
                 '{"short": "ab", "ref": "x", "either": "y"}', '{"short": "ab", "either": 5}']:
        assert accepts(grammar, good), good
    for bad in ['{"short": "a"}', '{"short": "abcd"}', '{"short": "a\x12"}', '{"short": "ab", "maybe": "\x05"}',
                '{"short": "ab", "ref": "xy"}', '{"short": "ab", "ref": "\x0b"}', '{"short": "ab", "either": "\x1a"}',
                '{"short": "ab", "either": ""}', '{"short": "ab", "a\x12": 1}', '{"short": "ab", "toolongname": 1}']:
        assert not accepts(grammar, bad), bad
    plain = {"type": "string", "pattern": "^a+$", "maxLength": 2}  # a pattern is kept as given
    assert xgrammar_schema(json.dumps(plain)) == json.dumps(plain)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=12))
def test_utf8_states_agree_with_python_s_strict_decoder(data):
    """Bytes break UTF-8 exactly where Python's strict decoder refuses them (surrogates and overlong forms
    included), and a state owes exactly the bytes the decoder holds back."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        decoder.decode(data, final=False)
        held = decoder.getstate()[0]
    except UnicodeDecodeError:
        held = None
    state = after(COMPLETE, data)
    assert (state is None) == (held is None), (data, state)
    if state is not None:
        assert (state.remaining == 0) == (held == b"")
        if held:
            full = held + bytes([state.low]) + b"\x80" * (state.remaining - 1)
            assert full.decode("utf-8")  # the range it owes completes the character
            if state.low > 0x80:
                with pytest.raises(UnicodeDecodeError):
                    (held + bytes([state.low - 1]) + b"\x80" * (state.remaining - 1)).decode("utf-8")


def test_utf8_masks_keep_only_tokens_that_continue_a_character():
    tokens = [b"a", b"\xe2", b"\x82", b"\xac", b"\xe2\x82", b"\xac!", b"\xed", b"\xa0", b"\x80", b"\xc0", b"\xf0",
              b"\x8a", b"\x90"]
    masks = Utf8Masks(tokens, vocab_size=40)
    bitmask = torch.full((1, 2), -1, dtype=torch.int32)  # the grammar allows everything

    def allowed(state):
        row = bitmask.clone()
        masks.restrict(row, 0, state)
        return [t for t in range(len(tokens)) if (int(row[0, t // 32]) >> (t % 32)) & 1]

    assert allowed(COMPLETE) == [0, 1, 4, 6, 10]  # no lone continuation, no C0
    euro = masks.next_state(masks.next_state(COMPLETE, 1), 2)  # E2 82: one byte owed
    assert allowed(euro) == [2, 3, 5, 7, 8, 11, 12]  # any continuation byte
    assert allowed(masks.next_state(COMPLETE, 6)) == [2, 8, 11, 12]  # ED: 80..9F, no surrogate (A0)
    assert allowed(masks.next_state(COMPLETE, 10)) == [3, 7, 12]  # F0: 90..BF (no overlong 8A), then more
    assert masks.next_state(euro, 5) == COMPLETE
