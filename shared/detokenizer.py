"""Output processing shared by the gateway and the offline API: token ids -> text, stop strings.

Decoding is incremental: each new token decodes a short window of the tokens
before it, and text is released only once it no longer ends in a partial
UTF-8 character (U+FFFD), so a character split across tokens is never garbled.
Text that could still be the start of a stop string is held back until it
cannot be.
"""

from __future__ import annotations

from dataclasses import dataclass

# Tokens of context decoded before the new ones, so that word-initial spaces come out right.
_CONTEXT_TOKENS = 6


@dataclass
class TextDelta:
    text: str  # newly released text
    stop: str | None  # the stop string that ended the output, if one did


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], *, skip_special_tokens: bool = True,
                 stop: list[str] | None = None, include_stop_str_in_output: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._special = set(tokenizer.all_special_ids) if skip_special_tokens else set()
        self._ids = [t for t in prompt_token_ids[-_CONTEXT_TOKENS:] if t not in self._special]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
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
                self._ids.append(token_id)
                checked = len(self.text)
                self._decode_new_text()
                if self._check_stop(max(0, checked - self._hold)):
                    break
        return self._release(final=self.stopped is not None)

    def flush(self) -> TextDelta:
        """At the end of the output: release whatever was held back."""
        return self._release(final=True)

    def _decode_new_text(self) -> None:
        prefix = self.tokenizer.decode(self._ids[self._prefix_offset:self._read_offset],
                                       skip_special_tokens=self.skip_special_tokens)
        full = self.tokenizer.decode(self._ids[self._prefix_offset:], skip_special_tokens=self.skip_special_tokens)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix):]
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)

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
