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


def test_no_stop_string_ends_the_output_before_min_tokens(tokenizer):
    ids = tokenizer("a b a b a b", add_special_tokens=False).input_ids
    first_b = next(i for i in range(len(ids)) if "b" in tokenizer.decode(ids[:i + 1]))
    for min_tokens in (0, first_b + 1, first_b + 2):
        detok = IncrementalDetokenizer(tokenizer, [], stop=["b"], min_tokens=min_tokens)
        used = next((i + 1 for i, t in enumerate(ids) if detok.append([t]).stop), None)
        # The first "b" to end in a token after the min_tokens-th stops it, as in vLLM (whose
        # min_tokens=5 keeps every stop string in the first five tokens' text).
        ends = [i + 1 for i in range(len(ids)) if tokenizer.decode(ids[:i + 1]).endswith("b")]
        assert used == next(n for n in ends if n > min_tokens), min_tokens
        assert detok.text == tokenizer.decode(ids[:used])[:-1]


def test_the_stop_token_that_ends_the_output_is_left_out_of_its_text_unless_asked_for(tokenizer):
    ids = tokenizer("alpha beta gamma", add_special_tokens=False).input_ids
    for include, expected in ((False, tokenizer.decode(ids[:-1])), (True, tokenizer.decode(ids))):
        detok = IncrementalDetokenizer(tokenizer, [], include_stop_str_in_output=include)
        detok.append(ids[:2])
        detok.append(ids[2:], ends_on_stop_token=True)  # the engine stopped on the last id (a stop token id)
        assert detok.flush().stop is None and detok.text == expected, include
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")  # EOS, shown with skip_special_tokens=False
    kept = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    kept.append(ids + [end], ends_on_stop_token=True)
    assert kept.text == tokenizer.decode(ids)


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


def _byte_level_token(tokenizer, byte: int) -> int:
    """The byte-level BPE token of one raw byte (GPT-2's byte-to-character table)."""
    printable = [*range(33, 127), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = dict(zip(printable, printable))
    chars.update((b, 256 + i) for i, b in enumerate(b for b in range(256) if b not in chars))
    return tokenizer.convert_tokens_to_ids(chr(chars[byte]))


def test_a_prompt_with_stray_bytes_keeps_their_replacement_characters(tokenizer, fast_tokenizer):
    """The prompt ends in an invalid byte and half of 杀 (E6 9D 80); the output's 0x80 completes it:
    the output shows 杀, not the prompt's U+FFFD before it."""
    raw = [_byte_level_token(fast_tokenizer, b) for b in (0x80, 0xE6, 0x9D)]
    detok = IncrementalDetokenizer(tokenizer, fast_tokenizer("Hi", add_special_tokens=False).input_ids + raw)
    output = [_byte_level_token(fast_tokenizer, 0x80)] + fast_tokenizer(" ok", add_special_tokens=False).input_ids
    pieces = [detok.append([t]).text for t in output] + [detok.flush().text]
    assert "".join(pieces) == "杀 ok"


@pytest.fixture(scope="module")
def byte_fallback_tokenizer():
    """A Llama/Mistral-style tokenizer: SentencePiece pieces, bytes as <0xNN> tokens, whose decoder
    turns a whole run of byte tokens into U+FFFD once the run is invalid."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ["▁", "a", "d", "t", "ta", "▁d", "o", "n", "e", "on", "one", "▁done"]:
        vocab.setdefault(piece, len(vocab))
    merges = [("t", "a"), ("▁", "d"), ("o", "n"), ("on", "e"), ("▁d", "one")]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens([AddedToken(t, special=True) for t in ("<s>", "</s>", "<unk>")])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("decoder", ["stream", "window"])
@pytest.mark.parametrize("prompt_bytes, output, text", [
    ([], [0xF0, 0x9F, 0x8E, 0x89, 0x41, 0x9F, "a"], "🎉A\ufffda"),  # a stray byte after released text
    ([0xE6, 0x9D], [0x8E, 0xB1, "ta"], "李\ufffdta"),  # the prompt's half character, then a stray byte
    ([0xC3], [0x86, 0xDE, 0xAF], "Æޯ"),  # the character after the completed one is not swallowed
])
def test_byte_fallback_runs(byte_fallback_tokenizer, decoder, prompt_bytes, output, text):
    tok = byte_fallback_tokenizer if decoder == "stream" else WindowOnly(byte_fallback_tokenizer)
    ids = lambda items: [3 + x if isinstance(x, int) else tok.convert_tokens_to_ids(x) for x in items]  # noqa: E731
    detok = IncrementalDetokenizer(tok, ids(prompt_bytes))
    pieces = [detok.append([t]).text for t in ids(output)] + [detok.flush().text]
    assert "".join(pieces) == text


def test_byte_fallback_decoders_agree_on_random_byte_runs(byte_fallback_tokenizer):
    """tokenizers' stream refuses many of these (it cannot extend a run that turned invalid); its
    fallback must then give what the window decoder gives. (No ASCII byte tokens: when one is
    followed by invalid bytes, DecodeStream itself releases it a second time, as U+FFFD.)"""
    rng = random.Random()
    pieces = [3 + b for b in (0x80, 0x9F, 0x8E, 0x89, 0xE6, 0x9D, 0xB1, 0xF0, 0xC3, 0xA9)]
    pieces += [byte_fallback_tokenizer.convert_tokens_to_ids(p) for p in ("ta", "▁done", "a")]
    for _ in range(200):
        prompt = rng.choices(pieces, k=rng.randrange(0, 4))
        output = rng.choices(pieces, k=rng.randrange(1, 30))
        texts = []
        for tok in (byte_fallback_tokenizer, WindowOnly(byte_fallback_tokenizer)):
            detok = IncrementalDetokenizer(tok, prompt)
            texts.append("".join(detok.append([t]).text for t in output) + detok.flush().text)
        assert texts[0] == texts[1], (prompt, output)
