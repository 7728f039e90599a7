"""Collects one request's sequence updates into a RequestOutput: tokens, text, logprobs."""

from __future__ import annotations

from services.scheduler.sequence import SequenceUpdate
from shared.detokenizer import IncrementalDetokenizer
from shared.outputs import CompletionOutput, Logprob, PositionLogprobDict, RequestOutput
from shared.sampling_params import SamplingParams
from shared.step_protocol import PositionLogprobs


class RequestTracker:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 tokenizer):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.tokenizer = tokenizer
        self.prompt_logprobs: list[PositionLogprobDict | None] | None = \
            [None] if params.prompt_logprobs is not None else None
        self.num_cached_tokens = 0
        self.completions = [CompletionOutput(i, "", [], 0.0 if params.logprobs is not None else None,
                                             [] if params.logprobs is not None else None) for i in range(params.n)]
        self.detokenizers = [IncrementalDetokenizer(tokenizer, prompt_token_ids,
                                                    skip_special_tokens=params.skip_special_tokens, stop=params.stop,
                                                    include_stop_str_in_output=params.include_stop_str_in_output,
                                                    min_tokens=params.min_tokens)
                             for _ in range(params.n)]

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)

    def apply(self, update: SequenceUpdate) -> str | None:
        """Take one update; returns a stop string if the new text hit one (the engine must stop the sequence)."""
        completion = self.completions[update.seq_index]
        self.num_cached_tokens = max(self.num_cached_tokens, min(update.num_cached_tokens, len(self.prompt_token_ids)))
        if completion.finish_reason is not None:
            return None
        if update.prompt_logprobs and self.prompt_logprobs is not None:
            self.prompt_logprobs.extend(self._logprob_dict(p) for p in update.prompt_logprobs)
        detokenizer = self.detokenizers[update.seq_index]
        delta = detokenizer.append(update.new_token_ids, ends_on_stop_token=update.finish_reason == "stop")
        # A stop string in the text of one of several new tokens (speculative decoding) ends the output there.
        completion.token_ids.extend(update.new_token_ids[:delta.num_tokens_kept])
        for position in update.new_logprobs[:delta.num_tokens_kept]:
            completion.logprobs.append(self._logprob_dict(position))
            completion.cumulative_logprob += position.logprob
        if delta.stop is not None:
            completion.finish_reason, completion.stop_reason = "stop", delta.stop
        elif update.finish_reason is not None:
            detokenizer.flush()
            completion.finish_reason, completion.stop_reason = update.finish_reason, update.stop_reason
        completion.text = detokenizer.text
        return delta.stop

    def _logprob_dict(self, position: PositionLogprobs) -> PositionLogprobDict:
        entries = {tid: Logprob(lp, rank, self.tokenizer.decode([tid]))
                   for rank, (tid, lp) in enumerate(zip(position.top_token_ids, position.top_logprobs), start=1)}
        if position.token_id not in entries:
            entries[position.token_id] = Logprob(position.logprob, position.rank,
                                                 self.tokenizer.decode([position.token_id]))
        return entries

    def output(self) -> RequestOutput:
        return RequestOutput(request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
                             prompt_logprobs=self.prompt_logprobs, outputs=self.completions, finished=self.finished,
                             num_cached_tokens=self.num_cached_tokens)
