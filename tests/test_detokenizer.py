"""Incremental detokenization and stop strings."""

from __future__ import annotations

import pytest

from shared.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    from shared.tokenizer import load_tokenizer

    return load_tokenizer(llama_dir)


TEXTS = ["Hello world, naïve café — 東京 🎉 done.", "  leading spaces\nand lines\n", "ünïcödé ✓✓✓ 👩‍👩‍👧"]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_decoding_all_at_once(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False).input_ids
    prompt = tokenizer("Prompt:", add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tokenizer, prompt)
    pieces = [detok.append([t]).text for t in ids]
    pieces.append(detok.flush().text)
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces), "a multi-byte character came out split"


def test_stop_string_cuts_the_text_and_holds_back_partial_matches(tokenizer):
    ids = tokenizer("one two STOP three", add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tokenizer, [], stop=["STOP"])
    released, stop = "", None
    for t in ids:
        delta = detok.append([t])
        released += delta.text
        assert "ST" not in released or stop is not None
        if delta.stop:
            stop = delta.stop
            break
    assert stop == "STOP"
    assert released == detok.text == "one two "


def test_include_stop_str_in_output(tokenizer):
    ids = tokenizer("alpha beta gamma", add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tokenizer, [], stop=["beta"], include_stop_str_in_output=True)
    for t in ids:
        if detok.append([t]).stop:
            break
    assert detok.text == "alpha beta"


def test_special_tokens_are_skipped_or_kept(tokenizer):
    ids = tokenizer("hi", add_special_tokens=False).input_ids + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    skip = IncrementalDetokenizer(tokenizer, [])
    skip.append(ids)
    keep = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    keep.append(ids)
    assert skip.text == "hi" and keep.text == "hi<|im_end|>"
