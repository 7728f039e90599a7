"""One sequence of a run (one of a request's n): the tokens the engine sent for it, and their text as they
detokenize incrementally, ended at a stop string. The engine's own stops (EOS, stop token ids, max_tokens)
come as its output's finish reason; a stop string is found here, and its run tells the scheduler."""

from __future__ import annotations

from collections.abc import Callable

from services.gateway.deltas import SeqDelta, TokenLogprob
from shared.detokenizer import IncrementalDetokenizer
from shared.request import EngineRequest


class Sequence:
    __slots__ = ("index", "position", "token_ids", "done", "last_tokens_at", "_detok")

    def __init__(self, index: int, position: int, tokenizer, request: EngineRequest):
        params = request.params
        self.index, self.position = index, position  # its index in the prompt's n; its run's position
        self.token_ids: list[int] = []  # all the engine sent: a resumption carries on after them
        self.done = False
        self.last_tokens_at: float | None = None  # its latest tokens' arrival (inter-token latency)
        self._detok = IncrementalDetokenizer(tokenizer, request.prompt_token_ids, stop=params.stop,
                                             skip_special_tokens=params.skip_special_tokens,
                                             include_stop_str_in_output=params.include_stop_str_in_output,
                                             min_tokens=params.min_tokens)

    def take(self, message, logprob: Callable[..., TokenLogprob] | None) -> SeqDelta:
        """An engine output's new tokens as this sequence's delta: their text (the tokens after a stop
        string dropped), their logprobs through ``logprob`` (Model.logprob; None: not asked for) and, in
        its last, why it ended: "stop" with the stop string the text hit, or the engine's reason."""
        ids = list(message.new_token_ids)
        self.token_ids += ids  # all of them: a sequence that keeps fewer has stopped
        delta = SeqDelta(self.index, ids, "", position=self.position)
        finish_reason = message.finish_reason
        on_stop_token = finish_reason == "stop"  # the engine's stops are EOS and stop token ids
        if logprob is not None:
            self._take_with_logprobs(delta, message.new_logprobs, on_stop_token, logprob)
        else:
            text = self._detok.append(ids, on_stop_token)
            delta.text = text.text
            del ids[text.num_tokens_kept:]
        if self._detok.stopped is not None:
            delta.finish_reason, delta.stop_reason = "stop", self._detok.stopped
        elif finish_reason:
            delta.text += self._detok.flush().text
            delta.finish_reason = finish_reason
            which = message.WhichOneof("stop_reason")
            delta.stop_reason = getattr(message, which) if which else None
        self.done = delta.finish_reason is not None
        return delta

    def _take_with_logprobs(self, delta: SeqDelta, positions, on_stop_token: bool,
                            logprob: Callable[..., TokenLogprob]) -> None:
        """Token by token: each one's logprob entry says where its text starts."""
        ids, detok = delta.token_ids, self._detok
        if len(positions) != len(ids):  # zip would drop the text of the tokens without
            raise RuntimeError(f"the engine sent {len(ids)} tokens with {len(positions)} logprobs")
        delta.logprobs = []
        for i, (token_id, position) in enumerate(zip(ids, positions)):
            delta.logprobs.append(logprob(position, text_offset=len(detok.text)))
            delta.text += detok.append([token_id], on_stop_token and i == len(ids) - 1).text
            if detok.stopped is not None:  # several tokens at once (speculative decoding): the rest go
                del ids[i + 1:]
                break

    def aborted(self) -> SeqDelta:
        """Its last delta when its request ended before it did (the Abort RPC): the text held back."""
        self.done = True
        return SeqDelta(self.index, [], self._detok.flush().text, None, "abort", None, self.position)
