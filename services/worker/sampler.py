"""The worker's sampler: one step's logits in, one token (and its logprobs) per sequence out.

Everything is vectorised over the batch. Per step, Python only walks the list of sequences
(to gather their parameters); all work over the vocabulary is tensor operations, and a stage
that no row of the batch needs is skipped entirely, so the common batch (all greedy, or plain
temperature sampling) costs one argmax, or one softmax and one exponential race.

Order of processing, as in vLLM: allowed_token_ids and logit_bias (one row added), bad_words, the min_tokens
mask, repetition / frequency / presence penalties, the structured-output grammar's mask; then
greedy rows take the argmax and the other rows are divided by their temperature, cut by top_k,
top_p and min_p, and sampled. Logprobs reported to the client come
from the raw model distribution, never from the processed one.

Randomness uses the exponential race: argmax(p / E) with E ~ Exp(1) draws from p. Rows without
a seed take E from the sampler's generator. Rows with a seed take E from a counter-based hash
of (seed, stream index, tokens generated so far, vocabulary index), so a seeded sequence
samples the same tokens whatever shares its batch and after a recompute preemption.
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Sequence

import torch
from torch import Tensor

from services.worker.grammar import SequenceGrammar, mask_to_grammars
from services.worker.models import cpu_layers
from shared.sampling_params import SamplingParams
from shared.step_protocol import PositionLogprobs

# Below this a temperature samples greedily (vLLM's rule): dividing by it could overflow float32.
GREEDY_TEMPERATURE = 1e-5

_MASK32 = 0xFFFFFFFF
_GOLDEN32 = 0x9E3779B1  # spreads consecutive vocabulary indices over all 32 bits
_FNV_PRIME32 = 0x01000193


class SamplingState:
    """Per-sequence sampling state the worker keeps between steps.

    Dense [vocab] tensors exist only when the parameters need them: token counts for the
    penalties, a prompt-token mask for the repetition penalty, a bias row for logit_bias.
    The worker can rebuild an identical state from prompt and output tokens (recompute).
    """

    def __init__(self, params: SamplingParams, prompt_token_ids: list[int], output_token_ids: list[int],
                 vocab_size: int, stream_index: int = 0, device: str | torch.device = "cpu",
                 grammar: SequenceGrammar | None = None):
        """grammar: structured outputs, a matcher that has accepted output_token_ids already."""
        _check_token_ids_fit(params, vocab_size)
        if (grammar is None) != (params.structured_outputs is None):
            raise ValueError("a sequence with structured outputs needs its grammar, and only it has one")
        self.grammar = grammar
        self.params = params
        self.vocab_size = vocab_size
        self.stream_index = stream_index
        self.device = torch.device(device)
        self._num_output_tokens = len(output_token_ids)
        self._counts = self._counts_of(output_token_ids) if _uses_penalties(params) else None
        self._drafts_before: list[int] = []  # a verification view: drafts counted on top of _counts
        self.prompt_mask = self._mask_of(prompt_token_ids) if params.repetition_penalty != 1.0 else None
        self.bias_row = self._bias_row_of(params.logit_bias or {}, params.allowed_token_ids) \
            if params.logit_bias or params.allowed_token_ids else None
        self.seed_key = _seed_key(params.seed, stream_index) if params.seed is not None else None
        # bad_words: their token sequences, and the last output tokens a sequence's prefix is matched against.
        self.bad_words = params.bad_words_token_ids
        if params.bad_words and self.bad_words is None:
            raise ValueError("bad_words reach the worker as token ids (bad_words_token_ids): the front end "
                             "tokenizes them")
        longest = max((len(w) for w in self.bad_words or ()), default=1) - 1
        self._recent = deque(output_token_ids[len(output_token_ids) - longest:] if longest else (),
                             maxlen=longest) if self.bad_words else None

    @property
    def num_output_tokens(self) -> int:
        return self._num_output_tokens

    def append(self, token_id: int) -> None:
        """Record a generated token: it feeds the penalties, min_tokens and the seeded counter."""
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} is outside the vocabulary (size {self.vocab_size})")
        self._num_output_tokens += 1
        if self._recent is not None:
            self._recent.append(token_id)
        if self._counts is not None:
            self._counts[token_id] += 1
        if self.grammar is not None:
            self.grammar.accept(token_id)

    def verification_states(self, draft_token_ids: list[int], device: torch.device) -> list["SamplingState"]:
        """The states of the len(drafts) + 1 positions a step verifying these drafts samples: position j
        as if drafts 0..j-1 had been accepted, so their counts feed the penalties, min_tokens and the
        seeded counter exactly as when those tokens had been sampled one step at a time."""
        if self.grammar is not None or self.bad_words:  # a view would share one history: such sequences get no drafts
            raise ValueError("drafts cannot be verified for a sequence with structured outputs or bad_words")
        if self.device != device:
            self.to(device)  # once, before the views share the dense rows
        views = []
        for j in range(len(draft_token_ids) + 1):
            view = copy.copy(self)
            view._num_output_tokens = self._num_output_tokens + j
            view._drafts_before = draft_token_ids[:j]
            views.append(view)
        return views

    def banned_token_ids(self) -> list[int]:
        """bad_words: the last token of every sequence whose other tokens the output ends with now."""
        recent = list(self._recent)
        return [w[-1] for w in self.bad_words if len(w) == 1 or recent[len(recent) - len(w) + 1:] == w[:-1]]

    @property
    def only_argmax(self) -> bool:
        """Whether this row's token is the raw logits' argmax: greedy, no logprobs, and no processing stage
        (each of Sampler._processed_scores's) that would change a score."""
        return (self.params.temperature < GREEDY_TEMPERATURE and self.params.logprobs is None
                and self.bias_row is None and not self.bad_words and not self.penalised and self.grammar is None
                and self._num_output_tokens >= self.params.min_tokens)

    @property
    def penalised(self) -> bool:
        """Whether the penalties apply (they need the output's token counts)."""
        return self._counts is not None

    @property
    def output_counts(self) -> Tensor | None:
        """[vocab] int32 counts of the output's tokens; a view's are made when asked (the sampler asks
        for the rows of one call, which the worker makes at most max_num_seqs), so verifying drafts
        holds no [drafts, vocab] copies for the whole step."""
        if self._counts is None or not self._drafts_before:
            return self._counts
        drafts = torch.tensor(self._drafts_before, dtype=torch.long, device=self._counts.device)
        return self._counts.index_add(0, drafts, torch.ones_like(drafts, dtype=self._counts.dtype))

    def to(self, device: torch.device) -> None:
        """Move the dense rows to the sampler's device (once, when it first sees this state)."""
        for name in ("_counts", "prompt_mask", "bias_row"):
            row = getattr(self, name)
            if row is not None:
                setattr(self, name, row.to(device))
        self.device = device

    def _counts_of(self, token_ids: list[int]) -> Tensor:
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        return torch.bincount(ids, minlength=self.vocab_size).to(torch.int32)

    def _mask_of(self, token_ids: list[int]) -> Tensor:
        mask = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
        mask[torch.tensor(token_ids, dtype=torch.long, device=self.device)] = True
        return mask

    def _bias_row_of(self, logit_bias: dict[int, float], allowed_token_ids: list[int] | None) -> Tensor:
        """What is added to the logits: the bias, and -inf for every token outside allowed_token_ids."""
        row = torch.zeros(self.vocab_size, dtype=torch.float32, device=self.device)
        if allowed_token_ids:
            row.fill_(float("-inf"))
            row[torch.tensor(allowed_token_ids, dtype=torch.long, device=self.device)] = 0.0
        if logit_bias:
            ids = torch.tensor(list(logit_bias.keys()), dtype=torch.long, device=self.device)
            row[ids] += torch.tensor(list(logit_bias.values()), dtype=torch.float32, device=self.device)
        return row


def greedy_tokens(scores: Tensor) -> Tensor:
    """Each row's argmax of ``scores [B, V]``, as torch.argmax chooses; on a CPU by the C++ kernel, which reads
    bfloat16 as it is and spreads the rows over the threads (200 rows of 32000 on 2 cores: 0.44 ms, where
    torch's took 3.8 ms in float32 and 12 ms in bfloat16)."""
    if scores.device.type == "cpu" and scores.dtype in cpu_layers.DTYPES and scores.shape[-1] > 0 \
            and scores.stride(-1) == 1 and cpu_layers.available():
        return cpu_layers.argmax_rows(scores)
    return scores.argmax(dim=-1)


class Sampler:
    """Chooses the next token for every sequence of a step, in one batch."""

    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int], seed: int = 0,
                 device: str | torch.device = "cpu"):
        self.vocab_size = vocab_size
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        bad = [t for t in self.eos_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"EOS token ids {bad} are outside the vocabulary (size {vocab_size})")
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self._vocab_positions = torch.arange(vocab_size, device=self.device)
        self._vocab_hash = _vocab_hash(vocab_size, self.device)
        self._no_prompt_tokens = torch.zeros(vocab_size, dtype=torch.bool, device=self.device)

    # ---- public API ----

    def sample(self, logits: Tensor, states: list[SamplingState]) -> list[tuple[int, PositionLogprobs | None]]:
        """One token per row of logits [B, V] (any float dtype), plus its logprobs when the row's request asks."""
        self._check_shape(logits, len(states))
        if not states:
            return []
        self._move_to_device(states)
        if all(s.only_argmax for s in states):  # the common greedy batch: no float32 copy of the logits
            return [(token_id, None) for token_id in greedy_tokens(logits.to(self.device)).tolist()]
        raw = self._checked_logits(logits, len(states))
        scores = self._processed_scores(raw, states)
        token_ids = self._choose_tokens(scores, states).tolist()
        return list(zip(token_ids, self._sampled_logprobs(raw, token_ids, states)))

    def prompt_logprobs(self, logits: Tensor, target_token_ids: list[int], num_top: int) -> list[PositionLogprobs]:
        """Raw-model logprobs of each prompt token given the positions before it; logits [N, V]."""
        raw = self._checked_logits(logits, len(target_token_ids))
        if not target_token_ids:
            return []
        return self._position_logprobs(raw, target_token_ids, [num_top] * len(target_token_ids))

    # ---- logits processing (for choosing the token only) ----

    def _processed_scores(self, raw: Tensor, states: list[SamplingState]) -> Tensor:
        # Each stage is out of place, so the raw logits stay intact for the logprobs.
        scores = self._add_logit_bias(raw, states)
        scores = self._ban_bad_words(scores, states)
        scores = self._mask_stops_before_min_tokens(scores, states)
        scores = self._apply_penalties(scores, states)
        if any(s.grammar is not None for s in states):
            scores = mask_to_grammars(scores, [s.grammar for s in states], self.eos_token_ids,
                                      in_place=scores is not raw)
        return scores

    def _add_logit_bias(self, scores: Tensor, states: list[SamplingState]) -> Tensor:
        rows = [i for i, s in enumerate(states) if s.bias_row is not None]
        if not rows:
            return scores
        biases = torch.stack([states[i].bias_row for i in rows])
        return scores.index_add(0, self._tensor(rows), biases)

    def _ban_bad_words(self, scores: Tensor, states: list[SamplingState]) -> Tensor:
        return self._ban(scores, [(i, s.banned_token_ids()) for i, s in enumerate(states) if s.bad_words])

    def _mask_stops_before_min_tokens(self, scores: Tensor, states: list[SamplingState]) -> Tensor:
        return self._ban(scores, [(i, self._stop_ids_of(s.params)) for i, s in enumerate(states)
                                  if s.num_output_tokens < s.params.min_tokens])

    def _ban(self, scores: Tensor, banned: list[tuple[int, list[int]]]) -> Tensor:
        """``scores`` with -inf at each (row, its tokens) pair; the same tensor when there are none."""
        rows = [row for row, tokens in banned for _ in tokens]
        if not rows:
            return scores
        tokens = [token for _, row_tokens in banned for token in row_tokens]
        minus_inf = torch.tensor(float("-inf"), device=scores.device)
        return scores.index_put((self._tensor(rows), self._tensor(tokens)), minus_inf)

    def _stop_ids_of(self, params: SamplingParams) -> list[int]:
        return params.stop_token_ids + ([] if params.ignore_eos else self.eos_token_ids)

    def _apply_penalties(self, scores: Tensor, states: list[SamplingState]) -> Tensor:
        rows = [i for i, s in enumerate(states) if s.penalised]
        if not rows:
            return scores
        penalised = [states[i] for i in rows]
        index = self._tensor(rows)
        counts = torch.stack([s.output_counts for s in penalised]).to(torch.float32)
        generated = counts > 0
        in_prompt = torch.stack([_or(s.prompt_mask, self._no_prompt_tokens) for s in penalised])
        row_scores = scores.index_select(0, index)
        # A penalty of 1 (or 0) leaves a score bit-identical, so rows share one formula.
        repetition = self._column([s.params.repetition_penalty for s in penalised])
        repeated = torch.where(row_scores > 0, row_scores / repetition, row_scores * repetition)
        row_scores = torch.where(generated | in_prompt, repeated, row_scores)
        row_scores = row_scores - self._column([s.params.frequency_penalty for s in penalised]) * counts
        row_scores = row_scores - self._column([s.params.presence_penalty for s in penalised]) * generated
        return scores.index_copy(0, index, row_scores)

    # ---- choosing the token ----

    def _choose_tokens(self, scores: Tensor, states: list[SamplingState]) -> Tensor:
        sampled = [i for i, s in enumerate(states) if s.params.temperature >= GREEDY_TEMPERATURE]
        if not sampled:
            return greedy_tokens(scores)
        if len(sampled) == len(states):
            return self._sample_rows(scores, states)
        index = self._tensor(sampled)
        tokens = self._sample_rows(scores.index_select(0, index), [states[i] for i in sampled])
        return greedy_tokens(scores).index_copy(0, index, tokens)

    def _sample_rows(self, scores: Tensor, states: list[SamplingState]) -> Tensor:
        scores = scores / self._column([s.params.temperature for s in states])
        if any(s.params.top_p < 1.0 for s in states):
            scores = self._keep_top_k_top_p(scores, states)
        elif any(s.params.top_k is not None for s in states):
            scores = self._keep_top_k(scores, states)
        if any(s.params.min_p > 0.0 for s in states):
            scores = self._keep_min_p(scores, states)
        probs = scores.softmax(dim=-1)
        return greedy_tokens(probs.div_(self._exponentials(states)))

    def _keep_top_k(self, scores: Tensor, states: list[SamplingState]) -> Tensor:
        # Without top_p no sort is needed: the k-th best score of a row is its cut-off
        # (tokens tied with the k-th all stay, as in vLLM's top-k-only path).
        vocab = scores.shape[-1]
        top_k = [min(s.params.top_k or vocab, vocab) for s in states]
        widest = max(k for k, s in zip(top_k, states) if s.params.top_k is not None)
        best = scores.topk(widest, dim=-1).values
        cutoff = best.gather(1, self._column([min(k, widest) - 1 for k in top_k], torch.long))
        limited = self._column([s.params.top_k is not None for s in states], torch.bool)
        return scores.masked_fill(limited & (scores < cutoff), float("-inf"))

    def _keep_top_k_top_p(self, scores: Tensor, states: list[SamplingState]) -> Tensor:
        vocab = scores.shape[-1]
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        top_k = self._column([min(s.params.top_k or vocab, vocab) for s in states], torch.long)
        drop = self._vocab_positions >= top_k  # by rank, in sorted order
        # Nucleus of the top-k-renormalised distribution: keep a token while the mass strictly
        # before it is below top_p (so the most likely token always stays).
        probs = sorted_scores.masked_fill(drop, float("-inf")).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        top_p = [s.params.top_p for s in states]
        # Rows with top_p == 1 are exempt: rounding in the cumsum must not clip their tail.
        uses_top_p = self._column([p < 1.0 for p in top_p], torch.bool)
        drop |= (mass_before >= self._column(top_p)) & uses_top_p
        drop_by_token = torch.empty_like(drop).scatter_(1, order, drop)
        return scores.masked_fill(drop_by_token, float("-inf"))

    def _keep_min_p(self, scores: Tensor, states: list[SamplingState]) -> Tensor:
        probs = scores.softmax(dim=-1)
        threshold = self._column([s.params.min_p for s in states]) * probs.amax(dim=-1, keepdim=True)
        return scores.masked_fill(probs < threshold, float("-inf"))

    def _exponentials(self, states: list[SamplingState]) -> Tensor:
        """Exp(1) noise per (row, token): hashed for seeded rows, from the generator for the rest."""
        seeded = [i for i, s in enumerate(states) if s.seed_key is not None]
        if not seeded:
            return self._generator_exponentials(len(states))
        if len(seeded) == len(states):
            return self._seeded_exponentials(states)
        noise = torch.empty(len(states), self.vocab_size, device=self.device)
        unseeded = [i for i, s in enumerate(states) if s.seed_key is None]
        noise[self._tensor(unseeded)] = self._generator_exponentials(len(unseeded))
        noise[self._tensor(seeded)] = self._seeded_exponentials([states[i] for i in seeded])
        return noise

    def _generator_exponentials(self, num_rows: int) -> Tensor:
        noise = torch.empty(num_rows, self.vocab_size, device=self.device)
        # Exp(1) as -log(U), U uniform in [0, 1): on a CPU five times faster than exponential_ (24 against 127 ms
        # for 200 x 32000, a third of a sampled step). E is never 0 (p / 0 would make any token win); U = 0 gives
        # E = inf, which drops that one token from the race (a chance of 2^-24), and p / inf = 0 for a masked one.
        return noise.uniform_(generator=self.generator).log_().neg_()

    def _seeded_exponentials(self, states: list[SamplingState]) -> Tensor:
        return _hashed_exponentials(self._vocab_hash,
                                    self._column([s.seed_key for s in states], torch.int64),
                                    self._column([s.num_output_tokens for s in states], torch.int64))

    # ---- logprobs (from the raw distribution) ----

    def _sampled_logprobs(self, raw: Tensor, token_ids: list[int],
                          states: list[SamplingState]) -> list[PositionLogprobs | None]:
        result: list[PositionLogprobs | None] = [None] * len(states)
        rows = [i for i, s in enumerate(states) if s.params.logprobs is not None]
        if rows:
            computed = self._position_logprobs(raw.index_select(0, self._tensor(rows)),
                                               [token_ids[i] for i in rows],
                                               [states[i].params.logprobs for i in rows])
            for i, position in zip(rows, computed):
                result[i] = position
        return result

    def _position_logprobs(self, logits: Tensor, token_ids: list[int], num_tops: list[int]) -> list[PositionLogprobs]:
        logprobs = torch.log_softmax(logits, dim=-1)
        chosen = logprobs.gather(1, self._tensor(token_ids).unsqueeze(1))
        ranks = (logprobs > chosen).sum(dim=-1) + 1  # ties share the better rank
        k = min(max(num_tops), logprobs.shape[-1])
        top_logprobs, top_ids = logprobs.topk(k, dim=-1)
        rows = zip(token_ids, chosen.squeeze(1).tolist(), ranks.tolist(), top_ids.tolist(),
                   top_logprobs.tolist(), num_tops)
        return [PositionLogprobs(token_id=token, logprob=logprob, rank=rank,
                                 top_token_ids=ids[:n], top_logprobs=lps[:n])
                for token, logprob, rank, ids, lps, n in rows]

    # ---- helpers ----

    def _checked_logits(self, logits: Tensor, num_rows: int) -> Tensor:
        """The logits in float32 on the sampler's device (the models return them in their own dtype)."""
        self._check_shape(logits, num_rows)
        return logits.to(device=self.device, dtype=torch.float32)

    def _check_shape(self, logits: Tensor, num_rows: int) -> None:
        if logits.dim() != 2 or logits.shape[0] != num_rows or logits.shape[1] != self.vocab_size:
            raise ValueError(f"expected logits of shape [{num_rows}, {self.vocab_size}], got {list(logits.shape)}")

    def _move_to_device(self, states: list[SamplingState]) -> None:
        for state in states:
            if state.device is not self.device:
                state.to(self.device)

    def _tensor(self, values: list[int]) -> Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _column(self, values: list, dtype: torch.dtype = torch.float32) -> Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device).unsqueeze(1)


def _uses_penalties(params: SamplingParams) -> bool:
    return params.presence_penalty != 0.0 or params.frequency_penalty != 0.0 or params.repetition_penalty != 1.0


def _check_token_ids_fit(params: SamplingParams, vocab_size: int) -> None:
    if (outside := params.token_id_outside(vocab_size)) is not None:  # (SamplingParams refuses negative ids)
        name, bad = outside
        raise ValueError(f"{name} names token id {bad}, outside the vocabulary (size {vocab_size})")


def _or(row: Tensor | None, default: Tensor) -> Tensor:
    return default if row is None else row


# ---- the counter-based hash RNG ----
# int64 tensors hold 32-bit values; every operation works in place (with one scratch buffer)
# because on a CPU allocating a fresh [rows, vocab] tensor per operation costs more than the math.


def _mul32_(x: Tensor, constant: int, scratch: Tensor) -> None:
    """x = low 32 bits of x * constant; split in 16-bit halves so int64 never overflows."""
    torch.mul(x, constant >> 16, out=scratch)
    scratch &= 0xFFFF
    scratch <<= 16
    x *= constant & 0xFFFF
    x += scratch
    x &= _MASK32


def _xor_shift_(x: Tensor, bits: int, scratch: Tensor) -> None:
    x ^= torch.bitwise_right_shift(x, bits, out=scratch)


def _fmix32_(x: Tensor, scratch: Tensor) -> None:
    """MurmurHash3's finaliser: a bijection on 32 bits in which every input bit moves every output bit."""
    _xor_shift_(x, 16, scratch)
    _mul32_(x, 0x85EBCA6B, scratch)
    _xor_shift_(x, 13, scratch)
    _mul32_(x, 0xC2B2AE35, scratch)
    _xor_shift_(x, 16, scratch)


def _absorb_(key: Tensor, word: Tensor | int, scratch: Tensor) -> None:
    """Fold one 32-bit word into a running key; order matters, so (seed, stream) != (stream, seed)."""
    _mul32_(key, _FNV_PRIME32, scratch)
    key ^= word
    _fmix32_(key, scratch)


def _seed_key(seed: int, stream_index: int) -> int:
    key = torch.tensor([0x811C9DC5], dtype=torch.int64)
    scratch = torch.empty_like(key)
    for word in (seed, seed >> 32, stream_index):  # the seed's low 64 bits, any sign
        _absorb_(key, word & _MASK32, scratch)
    return int(key)


def _vocab_hash(vocab_size: int, device: torch.device) -> Tensor:
    """Each vocabulary index times the golden ratio, mod 2**32: neighbours land far apart."""
    positions = torch.arange(vocab_size, dtype=torch.int64, device=device)
    _mul32_(positions, _GOLDEN32, torch.empty_like(positions))
    return positions


def _hashed_exponentials(vocab_hash: Tensor, seed_keys: Tensor, counters: Tensor) -> Tensor:
    """Exp(1) per (row, token) from (row seed key, row counter, token); seed_keys and counters are [R, 1]."""
    keys = seed_keys.clone()
    _absorb_(keys, counters, torch.empty_like(keys))
    bits = vocab_hash ^ keys
    scratch = torch.empty_like(bits)
    _fmix32_(bits, scratch)
    bits += keys  # a second keyed round, so rows that differ in few key bits still decorrelate
    bits &= _MASK32
    _fmix32_(bits, scratch)
    return _exponentials_of_bits(bits)


def _exponentials_of_bits(bits: Tensor) -> Tensor:
    """Exp(1) from uniform 32-bit words: the top 23 bits plus a half step, (k + 0.5) / 2**23, is exact in
    float32 and strictly inside (0, 1), so no noise is 0. (With 24 bits the largest value rounded to 1.0:
    its noise was 0, a masked token's 0 / 0 was NaN, and argmax took that token, breaking grammars,
    allowed_token_ids and top-k once in 2**24 draws.)"""
    bits >>= 9
    uniform = bits.to(torch.float32)
    return uniform.add_(0.5).mul_(2.0**-23).log_().neg_()
