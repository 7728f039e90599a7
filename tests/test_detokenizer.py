"""Incremental detokenization and stop strings."""

from __future__ import annotations

import random

import pytest

from shared.detokenizer import IncrementalDetokenizer, StreamDecoder, WindowDecoder


class WindowOnly:
    """The same tokenizer without its `tokenizers` backend: the detokenizer must take the window path."""
    backend_tokenizer = None

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def __call__(self, *args, **kwargs):
        return self._tokenizer(*args, **kwargs)


@pytest.fixture(scope="module")
def fast_tokenizer(llama_dir):
    from shared.tokenizer import load_tokenizer

    return load_tokenizer(llama_dir)


@pytest.fixture(scope="module", params=["stream", "window"])
def tokenizer(request, fast_tokenizer):
    """Every test runs on both decoders."""
    return fast_tokenizer if request.param == "stream" else WindowOnly(fast_tokenizer)


def test_the_decoder_follows_the_tokenizer(fast_tokenizer):
    assert isinstance(IncrementalDetokenizer(fast_tokenizer, [1, 2])._decoder, StreamDecoder)
    assert isinstance(IncrementalDetokenizer(WindowOnly(fast_tokenizer), [1, 2])._decoder, WindowDecoder)


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


def test_random_outputs_decode_as_a_whole(tokenizer, fast_tokenizer):
    """Random ids, as a random-weight model emits them (invalid byte runs, ids the tokenizer does not
    know) after a text prompt: wherever the output decodes cleanly as a whole, the streamed pieces
    add up to exactly that, and no piece ends inside a character."""
    rng = random.Random()
    known = len(fast_tokenizer)
    words = ["alpha", " beta", "東京", " café", "🎉", "\n", " 42"]
    checked = 0
    for _ in range(300):
        prompt = fast_tokenizer("".join(rng.choices(words, k=rng.randrange(1, 5))), add_special_tokens=False).input_ids
        if rng.random() < 0.3:  # a prompt that ends inside a character
            emoji = fast_tokenizer("🎉", add_special_tokens=False).input_ids
            prompt += emoji[:rng.randrange(1, len(emoji))]
        if rng.random() < 0.5:
            ids = [rng.randrange(known + 50) for _ in range(rng.randrange(1, 30))]
        else:  # text the model could have meant, split into tokens as the tokenizer would
            ids = fast_tokenizer("".join(rng.choices(words, k=rng.randrange(1, 8))), add_special_tokens=False).input_ids
        detok = IncrementalDetokenizer(tokenizer, prompt)
        pieces = [detok.append([t]).text for t in ids] + [detok.flush().text]
        whole = fast_tokenizer.decode([t for t in ids if t < known], skip_special_tokens=True)
        if "\ufffd" not in whole:
            checked += 1
            assert "".join(pieces) == whole, (prompt, ids)
    assert checked > 100


def test_a_prompt_ending_inside_a_character_does_not_leak_into_the_output(tokenizer, fast_tokenizer):
    emoji = fast_tokenizer("🎉", add_special_tokens=False).input_ids
    assert len(emoji) > 1, "the test needs a character split over tokens"
    word = fast_tokenizer(" done", add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tokenizer, fast_tokenizer("Hi ", add_special_tokens=False).input_ids + emoji[:1])
    assert detok.append(word).text + detok.flush().text == " done" and detok.text == " done"


def test_an_output_that_completes_the_prompts_character_shows_it_whole(tokenizer, fast_tokenizer):
    emoji = fast_tokenizer("🎉", add_special_tokens=False).input_ids
    for split in range(1, len(emoji)):
        prompt = fast_tokenizer("Hi ", add_special_tokens=False).input_ids + emoji[:split]
        detok = IncrementalDetokenizer(tokenizer, prompt)
        output = emoji[split:] + fast_tokenizer(" done 🎉", add_special_tokens=False).input_ids
        pieces = [detok.append([t]).text for t in output] + [detok.flush().text]
        assert "".join(pieces) == detok.text == "🎉 done 🎉", split
        assert all("\ufffd" not in p for p in pieces)


class Refusing:
    """A DecodeStream that refuses every token, as tokenizers does on byte runs it cannot extend."""

    def __init__(self, **kwargs):
        pass

    def step(self, tokenizer, token_id):
        raise Exception("Invalid prefix encountered")


def test_a_stream_that_refuses_a_token_falls_back_to_the_window(fast_tokenizer):
    """Wherever the stream gives up, inside a character or not, no text is lost or repeated."""
    text = "naïve café — 東京 🎉 done"
    ids = fast_tokenizer(text, add_special_tokens=False).input_ids
    prompt = fast_tokenizer("Say:", add_special_tokens=False).input_ids
    for cut in range(len(ids) + 1):
        detok = IncrementalDetokenizer(fast_tokenizer, prompt)
        pieces = [detok.append([t]).text for t in ids[:cut]]
        detok._decoder._stream = Refusing()
        pieces += [detok.append([t]).text for t in ids[cut:]] + [detok.flush().text]
        assert "".join(pieces) == detok.text == text, cut
        assert all("\ufffd" not in p for p in pieces), cut


def test_a_stream_that_refuses_the_prompt_falls_back_to_the_window(fast_tokenizer, monkeypatch):
    import tokenizers.decoders

    monkeypatch.setattr(tokenizers.decoders, "DecodeStream", Refusing)
    detok = IncrementalDetokenizer(fast_tokenizer, fast_tokenizer("Say:", add_special_tokens=False).input_ids)
    assert isinstance(detok._decoder, StreamDecoder)
    detok.append(fast_tokenizer(" café 東京", add_special_tokens=False).input_ids)
    assert detok.flush() is not None and detok.text == " café 東京"
