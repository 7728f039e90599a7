"""Structured outputs on the worker: each constrained sequence's place in its grammar, and the mask
that keeps a step's sampling to the tokens the grammar allows next.

xgrammar does the work (vLLM's default backend): its compiler turns a request's constraint
(shared/structured_outputs.py) into a grammar over this model's tokenizer, caching what it
compiled, and a matcher per sequence follows the tokens the sequence takes. The compiler needs
the tokenizer, which a worker otherwise never loads: it is built when the first constrained
sequence comes.

A sequence's matcher is rebuilt from its tokens whenever its sampling state is (a recompute
preemption, a fork), so it always agrees with the tokens the worker holds. Once the grammar is
complete only EOS is allowed; after it (ignore_eos, or a step planned ahead of the EOS being
seen) the sequence is free again.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from shared.logging import setup_logging
from shared.structured_outputs import StructuredOutputs, engine_message

log = setup_logging("worker")


class SequenceGrammar:
    """One sequence's matcher: what it has accepted, and what it allows next."""

    def __init__(self, matcher):
        self._matcher = matcher

    @property
    def active(self) -> bool:
        """Whether it constrains the next token (not once it has accepted EOS)."""
        return not self._matcher.is_terminated()

    def accept(self, token_id: int) -> None:
        if self.active and not self._matcher.accept_token(token_id):
            raise ValueError(f"token {token_id} is not allowed by the sequence's structured output grammar")

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)


class Grammars:
    """The worker's grammar compiler, built from its tokenizer when the first constrained sequence
    comes (a worker that serves none never loads the tokenizer or xgrammar)."""

    def __init__(self, tokenizer_path: str | Path, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.tokenizer_path, self.vocab_size, self.eos_token_ids = tokenizer_path, vocab_size, eos_token_ids
        self._compiler = None

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
            self._compiler = xgr.GrammarCompiler(info)
            log.info("grammar compiler ready", tokenizer=str(self.tokenizer_path),
                     seconds=round(time.perf_counter() - started, 3))
        return self._compiler

    def for_sequence(self, constraint: StructuredOutputs, output_token_ids: list[int]) -> SequenceGrammar:
        """A matcher that has accepted the sequence's output so far."""
        import xgrammar as xgr

        try:
            compiled = self._compile(self._compiler_built(), constraint)
        except RuntimeError as exc:  # checked at admission with the same library: not expected
            raise ValueError(f"the {constraint.kind} constraint does not compile: {engine_message(exc)}") from None
        grammar = SequenceGrammar(xgr.GrammarMatcher(compiled))
        for token_id in output_token_ids:
            grammar.accept(token_id)
        return grammar

    @staticmethod
    def _compile(compiler, constraint: StructuredOutputs):
        kind = constraint.kind
        if kind in ("json", "json_object"):
            return compiler.compile_json_schema(constraint.spec, any_whitespace=constraint.any_whitespace)
        if kind == "regex":
            return compiler.compile_regex(constraint.regex)
        return compiler.compile_grammar(constraint.spec)  # an EBNF grammar, or a choice written as one


def mask_to_grammars(scores: torch.Tensor, grammars: list[SequenceGrammar | None], in_place: bool) -> torch.Tensor:
    """scores [B, V] with the tokens each row's grammar does not allow next at -inf. Written into
    scores itself only where in_place (they are the sampler's own copy, not the raw logits the
    logprobs come from)."""
    import xgrammar as xgr

    rows = [i for i, g in enumerate(grammars) if g is not None and g.active]
    if not rows:
        return scores
    bitmask = xgr.allocate_token_bitmask(len(rows), scores.shape[-1])
    for j, i in enumerate(rows):
        grammars[i].fill(bitmask, j)
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
