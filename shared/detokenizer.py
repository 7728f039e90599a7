"""Output processing shared by the gateway and the offline API: token ids -> text, stop strings.

Decoding is incremental and never releases half a multi-byte character. Where the tokenizer is
backed by the `tokenizers` library, its own streaming decoder (`DecodeStream`, in Rust, primed
with the prompt's last tokens) does it at a few microseconds a token: the gateway decodes every
token of every stream, so this is its hot path. Otherwise (a slow tokenizer, or one that cleans
up spaces after decoding, which a stream cannot do) each new token decodes a short window of the
tokens before it and text is released once it no longer ends in U+FFFD. Text that could still be
the start of a stop string is held back until it cannot be.
"""

from __future__ import annotations

from dataclasses import dataclass

# Tokens of context decoded before the new ones, so that word-initial spaces come out right.
_CONTEXT_TOKENS = 6


@dataclass
class TextDelta:
    text: str  # newly released text
    stop: str | None  # the stop string that ended the output, if one did


class WindowDecoder:
    """Decodes a window of recent tokens through tokenizer.decode (any transformers tokenizer)."""

    def __init__(self, tokenizer, context_ids: list[int], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids = list(context_ids)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def step(self, token_id: int) -> str:
        """The text this token completes ("" while a character is still partial)."""
        self._ids.append(token_id)
        prefix = self.tokenizer.decode(self._ids[self._prefix_offset:self._read_offset],
                                       skip_special_tokens=self.skip_special_tokens)
        full = self.tokenizer.decode(self._ids[self._prefix_offset:], skip_special_tokens=self.skip_special_tokens)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            return full[len(prefix):]
        return ""


class StreamDecoder:
    """tokenizers' DecodeStream; falls back to a WindowDecoder for good if the stream ever refuses a
    token (it raises on some byte sequences it cannot extend)."""

    def __init__(self, tokenizer, context_ids: list[int], skip_special_tokens: bool):
        from tokenizers.decoders import DecodeStream

        self.tokenizer = tokenizer
        self._backend = tokenizer.backend_tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._recent = list(context_ids)  # what a fallback needs as its context
        self._fallback: WindowDecoder | None = None
        self._stream = self._primed(DecodeStream, context_ids)

    def _primed(self, new_stream, context_ids: list[int]):
        """A stream that has decoded the context (its text dropped) up to its last whole character:
        prompt bytes that never formed a character are not the output's to show."""
        stream, whole = new_stream(skip_special_tokens=self.skip_special_tokens), 0
        for i, token_id in enumerate(context_ids):
            if stream.step(self._backend, token_id) is not None:
                whole = i + 1
        if whole == len(context_ids):
            return stream
        stream = new_stream(skip_special_tokens=self.skip_special_tokens)
        for token_id in context_ids[:whole]:
            stream.step(self._backend, token_id)
        return stream

    def step(self, token_id: int) -> str:
        if self._fallback is not None:
            return self._fallback.step(token_id)
        try:
            text = self._stream.step(self._backend, token_id)
        except Exception:  # tokenizers raises plain Exception ("Invalid prefix encountered", ...)
            self._fallback = WindowDecoder(self.tokenizer, self._recent[-_CONTEXT_TOKENS:], self.skip_special_tokens)
            return self._fallback.step(token_id)
        self._recent.append(token_id)
        if len(self._recent) > 4 * _CONTEXT_TOKENS:
            del self._recent[:-_CONTEXT_TOKENS]
        return text or ""


def make_decoder(tokenizer, context_ids: list[int], skip_special_tokens: bool):
    """A StreamDecoder where the tokenizer allows one, else a WindowDecoder."""
    if getattr(tokenizer, "backend_tokenizer", None) is not None and \
            not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return StreamDecoder(tokenizer, context_ids, skip_special_tokens)
    return WindowDecoder(tokenizer, context_ids, skip_special_tokens)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], *, skip_special_tokens: bool = True,
                 stop: list[str] | None = None, include_stop_str_in_output: bool = False):
        self._special = set(tokenizer.all_special_ids) if skip_special_tokens else set()
        context = [t for t in prompt_token_ids[-_CONTEXT_TOKENS:] if t not in self._special]
        self._decoder = make_decoder(tokenizer, context, skip_special_tokens)
        self.stop = list(stop or [])
        self.include_stop = include_stop_str_in_output
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # all decoded output text (after a stop: cut at it)
        self._released = 0  # characters of self.text already handed out
        self.stopped: str | None = None

    def append(self, token_ids: list[int]) -> TextDelta:
        """Feed new output tokens; returns the text that is now safe to show."""
        if self.stopped is None:
            for token_id in token_ids:
                if token_id in self._special:
                    continue
                checked = len(self.text)
                self.text += self._decoder.step(token_id)
                if self.stop and self._check_stop(max(0, checked - self._hold)):
                    break
        return self._release(final=self.stopped is not None)

    def flush(self) -> TextDelta:
        """At the end of the output: release whatever was held back."""
        return self._release(final=True)

    def _check_stop(self, search_from: int) -> bool:
        # A new match must end in the new text, so it starts at most len(stop) - 1 before it.
        for stop in self.stop:
            at = self.text.find(stop, search_from)
            if at >= 0:
                self.text = self.text[:at + len(stop)] if self.include_stop else self.text[:at]
                self.stopped = stop
                return True
        return False

    def _release(self, final: bool) -> TextDelta:
        end = len(self.text) if final else max(self._released, len(self.text) - self._hold)
        delta = self.text[self._released:end]
        self._released = end
        return TextDelta(delta, self.stopped)
