"""Structured outputs on the worker: each constrained sequence's place in its grammar, and the mask
that keeps a step's sampling to the tokens the grammar allows next.

xgrammar does the work (vLLM's default backend): its compiler turns a request's constraint
(shared/structured_outputs.py) into a grammar over this model's tokenizer, and a matcher per
sequence follows the tokens the sequence takes. The compiler needs the tokenizer, which a worker
otherwise never loads: it is built when the first constrained sequence comes. Compiling happens on
a thread of its own (xgrammar lets go of the GIL), beside the steps that compute the sequence's
prompt; the sequence waits for its grammar only when it first samples. Compiled grammars are
cached (within GRAMMAR_CACHE_BYTES).

A sequence's matcher is rebuilt from its tokens whenever its sampling state is (a recompute
preemption, a fork), so it always agrees with the tokens the worker holds. Once the grammar is
complete only EOS is allowed; after it (ignore_eos, or a step planned ahead of the EOS being seen)
the sequence is free again. A grammar that cannot go on (it does not compile, allows no next token,
or is handed a token it does not allow) never fails the step, which would fail every request: from
then on only EOS is allowed, and the step's output for the sequence carries the error, which ends
its request (and only it).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from services.worker.utf8_mask import COMPLETE, Utf8Masks
from shared.logging import setup_logging
from shared.structured_outputs import StructuredOutputs, engine_message, xgrammar_schema

log = setup_logging("worker")

GRAMMAR_CACHE_BYTES = 512 << 20  # compiled grammars kept for reuse (as vLLM's default cache)


class SequenceGrammar:
    """One sequence's matcher (made once its grammar is compiled): what it has accepted, and what it
    allows next; or, once it cannot go on, why. Its mask also keeps the output's bytes well-formed UTF-8
    (utf8_mask.py), which xgrammar alone does not."""

    def __init__(self, compiled: Future, output_token_ids: list[int], grammars: "Grammars"):
        self._compiled = compiled
        self._grammars = grammars  # its UTF-8 masks exist once anything has compiled
        self._replay = list(output_token_ids)  # accepted as soon as the matcher exists
        self._matcher = None
        self._utf8 = COMPLETE  # the character the output leaves unfinished, if any
        self.error: str | None = None

    def _ready(self):
        """The matcher, once (None when the grammar failed)."""
        if self._matcher is None and self.error is None:
            import xgrammar as xgr

            try:
                self._matcher = xgr.GrammarMatcher(self._compiled.result())
            except Exception as exc:  # does not compile, or no tokenizer here
                self.error = f"the structured output constraint cannot be used: {engine_message(exc)}"
                return None
            replay, self._replay = self._replay, []
            for token_id in replay:
                self.accept(token_id)
        return self._matcher

    @property
    def active(self) -> bool:
        """Whether it constrains the next token: not once it has accepted EOS (a failed one does,
        to EOS alone)."""
        matcher = self._ready()
        return matcher is None or not matcher.is_terminated()

    def accept(self, token_id: int) -> None:
        if self._matcher is None:
            if self.error is None:
                self._replay.append(token_id)  # not compiled yet
            return
        if self.error is None and not self._matcher.is_terminated() and not self._matcher.accept_token(token_id):
            self.error = f"token {token_id} is not allowed by the structured output grammar"
        self._utf8 = self._grammars.utf8_masks.next_state(self._utf8, token_id)

    def fill(self, bitmask: torch.Tensor, row: int, eos_token_ids: Sequence[int]) -> None:
        """Row ``row`` of the bitmask: the tokens allowed next (only EOS, once the grammar failed)."""
        matcher = self._ready()
        if matcher is not None:
            matcher.fill_next_token_bitmask(bitmask, row)
            if bool(bitmask[row].any()):
                self._grammars.utf8_masks.restrict(bitmask, row, self._utf8)
                return
            self.error = "the structured output grammar allows no next token"
        _allow_only(bitmask, row, eos_token_ids)


def _allow_only(bitmask: torch.Tensor, row: int, token_ids: Sequence[int]) -> None:
    bitmask[row] = 0
    for token_id in token_ids:
        word = int(bitmask[row, token_id // 32]) | (1 << (token_id % 32))
        bitmask[row, token_id // 32] = word - (1 << 32) if word >= 1 << 31 else word  # as int32


class Grammars:
    """The worker's grammar compiler, built from its tokenizer on a thread of its own when the first
    constrained sequence comes (a worker that serves none never loads the tokenizer or xgrammar)."""

    def __init__(self, tokenizer_path: str | Path, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.tokenizer_path, self.vocab_size, self.eos_token_ids = tokenizer_path, vocab_size, eos_token_ids
        self._compiler = None
        self.utf8_masks: Utf8Masks | None = None  # built with the compiler, from the same decoded vocabulary
        self._thread: ThreadPoolExecutor | None = None

    def for_sequence(self, constraint: StructuredOutputs, output_token_ids: list[int]) -> SequenceGrammar:
        """A grammar that will have accepted the sequence's output so far."""
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-compiler")
        return SequenceGrammar(self._thread.submit(self._compile, constraint), output_token_ids, self)

    def _compile(self, constraint: StructuredOutputs):
        compiler, kind = self._compiler_built(), constraint.kind
        if kind in ("json", "json_object"):
            return compiler.compile_json_schema(xgrammar_schema(constraint.spec),
                                                any_whitespace=constraint.any_whitespace)
        if kind == "regex":
            return compiler.compile_regex(constraint.regex)
        return compiler.compile_grammar(constraint.spec)  # an EBNF grammar, or a choice written as one

    def _compiler_built(self):
        if self._compiler is None:
            import xgrammar as xgr

            from shared.tokenizer import load_tokenizer

            try:
                tokenizer = load_tokenizer(self.tokenizer_path)
            except (OSError, ValueError) as exc:
                raise ValueError(f"structured outputs need the model's tokenizer on the worker (--tokenizer): "
                                 f"{exc}") from None
            started = time.perf_counter()
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=list(self.eos_token_ids))
            self.utf8_masks = Utf8Masks(info.decoded_vocab, self.vocab_size)
            self._compiler = xgr.GrammarCompiler(info, cache_limit_bytes=GRAMMAR_CACHE_BYTES)
            log.info("grammar compiler ready", tokenizer=str(self.tokenizer_path),
                     seconds=round(time.perf_counter() - started, 3))
        return self._compiler


def mask_to_grammars(scores: torch.Tensor, grammars: list[SequenceGrammar | None], eos_token_ids: Sequence[int],
                     in_place: bool) -> torch.Tensor:
    """scores [B, V] with the tokens each row's grammar does not allow next at -inf. Written into
    scores itself only where in_place (they are the sampler's own copy, not the raw logits the
    logprobs come from)."""
    import xgrammar as xgr

    rows = [i for i, g in enumerate(grammars) if g is not None and g.active]
    if not rows:
        return scores
    bitmask = xgr.allocate_token_bitmask(len(rows), scores.shape[-1])
    for j, i in enumerate(rows):
        grammars[i].fill(bitmask, j, eos_token_ids)
    bitmask = bitmask.to(scores.device)
    vocab = scores.shape[-1]
    if len(rows) == len(grammars):  # every row: no gather and scatter
        masked = scores if in_place else scores.clone()
        xgr.apply_token_bitmask_inplace(masked, bitmask, vocab_size=vocab)
        return masked
    index = torch.tensor(rows, dtype=torch.long, device=scores.device)
    constrained = scores.index_select(0, index)
    xgr.apply_token_bitmask_inplace(constrained, bitmask, vocab_size=vocab)
    return scores.index_copy_(0, index, constrained) if in_place else scores.index_copy(0, index, constrained)
