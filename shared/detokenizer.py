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

import os
from dataclasses import dataclass

# Tokens of context decoded before the new ones, so that word-initial spaces come out right.
_CONTEXT_TOKENS = 6


@dataclass
class TextDelta:
    text: str  # newly released text
    stop: str | None  # the stop string that ended the output, if one did
    # Of the tokens just appended, how many the output keeps: all of them, or those up to the one
    # whose text completed a stop string (several arrive at once with speculative decoding).
    num_tokens_kept: int = 0


class WindowDecoder:
    """Decodes a window of recent tokens through tokenizer.decode (any transformers tokenizer)."""

    def __init__(self, tokenizer, context_ids: list[int], skip_special_tokens: bool, unreleased: int = 0):
        """The last `unreleased` of context_ids were decoded but their text not yet handed out (a
        stream that fell back in the middle of a character)."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids = list(context_ids)
        self._prefix_offset = 0
        self._read_offset = len(self._ids) - unreleased

    def step(self, token_id: int) -> str:
        """The text this token completes ("" while a character is still partial)."""
        self._ids.append(token_id)
        prefix = self._decode(self._prefix_offset, self._read_offset)
        full = self._decode(self._prefix_offset, len(self._ids))
        if full.endswith("\ufffd"):
            return ""
        prefix_offset = self._read_offset
        if full.startswith(prefix):
            text = full[len(prefix):]
        elif not prefix[(common := len(os.path.commonprefix([prefix, full]))):].strip("\ufffd"):
            # The context ended in bytes that decoded to U+FFFD and the new tokens completed them
            # into a character: it is the output's. The window keeps its start, a character boundary.
            text, prefix_offset = full[common:], self._prefix_offset
        else:
            # The decoder rendered text already released differently (byte-fallback decoders turn a
            # whole run of byte tokens into U+FFFD once it is invalid): the new tokens on their own.
            text = self._decode(self._read_offset, len(self._ids))
        if not text or text.endswith("\ufffd"):
            return ""
        self._prefix_offset, self._read_offset = prefix_offset, len(self._ids)
        self._forget_old_tokens()
        return text

    def since_last_release(self) -> list[int]:
        """The tokens of the last release and its context: they end on a whole character."""
        return self._ids[self._prefix_offset:]

    def _forget_old_tokens(self) -> None:
        old = min(self._prefix_offset, len(self._ids) - _CONTEXT_TOKENS)
        if old > 4 * _CONTEXT_TOKENS:
            del self._ids[:old]
            self._prefix_offset -= old
            self._read_offset -= old

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self._ids[start:end], skip_special_tokens=self.skip_special_tokens)


class StreamDecoder:
    """tokenizers' DecodeStream, with a WindowDecoder in two cases:

    - while the context ends inside a character, until the output has released text: a stream
      primed with those bytes would show the prompt's half of the character as U+FFFD (when the
      output does not complete it), one primed without them the output's half;
    - for good once the stream refuses a token or the context (it raises on some byte sequences it
      cannot extend); the window then starts where the stream last released text.
    """

    def __init__(self, tokenizer, context_ids: list[int], skip_special_tokens: bool):
        from tokenizers.decoders import DecodeStream

        self.tokenizer = tokenizer
        self._backend = tokenizer.backend_tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._new_stream = lambda: DecodeStream(skip_special_tokens=skip_special_tokens)
        self._recent: list[int] = []  # the latest tokens, what a fallback window needs as its context
        self._pending = 0  # tokens of _recent the stream took without releasing text yet
        self._window: WindowDecoder | None = None
        self._for_good = False  # the stream refused: no going back to it
        self._stream = None
        self._start_stream(context_ids)

    def _start_stream(self, context_ids: list[int]) -> None:
        """A stream that has decoded the context (its text dropped); the window while the context
        ends inside a character or the stream refuses it."""
        try:
            stream, pending = self._new_stream(), 0
            for token_id in context_ids:
                pending = 0 if stream.step(self._backend, token_id) is not None else pending + 1
        except Exception:  # tokenizers raises plain Exception ("Invalid prefix encountered", ...)
            self._for_good, pending = True, 1
        if pending:
            self._window = WindowDecoder(self.tokenizer, context_ids, self.skip_special_tokens)
            return
        self._stream, self._window, self._recent, self._pending = stream, None, list(context_ids), 0

    def step(self, token_id: int) -> str:
        if self._window is not None:
            text = self._window.step(token_id)
            if text and not self._for_good:
                self._start_stream(self._window.since_last_release()[-_CONTEXT_TOKENS:])
            return text
        try:
            text = self._stream.step(self._backend, token_id)
        except Exception:
            context = self._recent[-(_CONTEXT_TOKENS + self._pending):]
            self._window = WindowDecoder(self.tokenizer, context, self.skip_special_tokens, self._pending)
            self._for_good = True
            return self._window.step(token_id)
        self._recent.append(token_id)
        self._pending = 0 if text is not None else self._pending + 1
        if len(self._recent) > 4 * _CONTEXT_TOKENS + self._pending:
            del self._recent[:-(_CONTEXT_TOKENS + self._pending)]
        return text or ""


def make_decoder(tokenizer, context_ids: list[int], skip_special_tokens: bool):
    """A StreamDecoder where the tokenizer allows one, else a WindowDecoder."""
    if getattr(tokenizer, "backend_tokenizer", None) is not None and \
            not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return StreamDecoder(tokenizer, context_ids, skip_special_tokens)
    return WindowDecoder(tokenizer, context_ids, skip_special_tokens)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], *, skip_special_tokens: bool = True,
                 stop: list[str] | None = None, include_stop_str_in_output: bool = False, min_tokens: int = 0):
        self._special = set(tokenizer.all_special_ids) if skip_special_tokens else set()
        context = [t for t in prompt_token_ids[-_CONTEXT_TOKENS:] if t not in self._special]
        self._decoder = make_decoder(tokenizer, context, skip_special_tokens)
        self.stop = list(stop or [])
        self.include_stop = include_stop_str_in_output
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        # As vLLM: the first min_tokens tokens are kept whatever they say, so a match must end in
        # the text of a later token (it may start earlier).
        self._min_tokens = min_tokens
        self._num_tokens = 0
        self.text = ""  # all decoded output text (after a stop: cut at it)
        self._released = 0  # characters of self.text already handed out
        self.stopped: str | None = None

    def append(self, token_ids: list[int], ends_on_stop_token: bool = False) -> TextDelta:
        """Feed new output tokens; returns the text that is now safe to show.

        ends_on_stop_token: the engine ended the output on the last of them (EOS or a stop token
        id). As vLLM, that token's text is left out unless include_stop_str_in_output."""
        kept = 0 if self.stopped is not None else len(token_ids)
        if ends_on_stop_token and not self.include_stop:
            token_ids = token_ids[:-1]
        if self.stopped is None:
            for i, token_id in enumerate(token_ids):
                self._num_tokens += 1
                if token_id in self._special:
                    continue
                checked = len(self.text)
                self.text += self._decoder.step(token_id)
                past_min = self._num_tokens > self._min_tokens
                if self.stop and past_min and self._check_stop(max(0, checked - self._hold)):
                    kept = i + 1
                    break
        delta = self._release(final=self.stopped is not None)
        delta.num_tokens_kept = kept
        return delta

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
