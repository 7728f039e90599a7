"""The scheduler -> worker step protocol: one plan in, one result out, per step.

Plain data only (ints, floats, strings, lists, SamplingParams), so the same
objects run through the in-process executor and, converted field by field,
over gRPC. The worker keeps a copy of every sequence it has been sent, so
sequences are sent in full once (``new``) and afterwards only as deltas
(``running``); ``finished_seq_ids`` tells it which copies to drop.

Order of execution on the worker: make ``forks`` (a child copies its parent's
state as it was before this step); drop ``finished_seq_ids``; move blocks
(``swap_out``, then ``swap_in``, then ``pulls`` from other workers, then ``copies``); register ``new``; apply
``running`` deltas; then run one forward pass over every scheduled token and
sample for each sequence whose computed tokens reach its end this step.

Speculative decoding: a running sequence may carry draft tokens, computed after its own. The
worker samples at each of their positions, keeps the drafts up to the first one its sample
disagrees with, and returns them (``accepted_token_ids``) before the token it sampled there. After
such a step both sides cut the sequence's block table to the blocks its computed tokens fill
(ceil(computed / block_size)): the blocks that held only rejected drafts go back to the pool.

A pooling engine's sequences (``pooling`` set: embedding requests) sample nothing: the step that computes
the rest of a prompt returns the prompt's embedding instead of a token, and the sequence is done.

A plan may be made while the step before it still runs (the scheduler plans ahead):
a sequence sampling in that step then gets ``append_last_sample`` instead of the
token, which the worker has and the scheduler does not know yet. Plans are executed
strictly in order, so blocks freed while a step runs are only reused after it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.columns import merge_by_position
from shared.lora import LoRARequest
from shared.multimodal import ImageInput
from shared.pooling import PoolerConfig, PoolingParams
from shared.proto import pagedserve_internal_pb2 as wire
from shared.sampling_params import SamplingParams
from shared.wire_version import INTERNAL_PROTOCOL_VERSION


@dataclass(slots=True)
class NewSequence:
    """A sequence the worker has not seen (or must forget and rebuild: recompute)."""

    request_id: str  # the client's request, for logs
    seq_id: int  # unique among live sequences; the key of every later delta
    index: int  # position among the request's n sequences; gives each sibling its own seeded stream
    prompt_token_ids: list[int]  # the prompt, in full
    output_token_ids: list[int]  # tokens generated before a recompute preemption; else empty
    sampling_params: SamplingParams  # how to sample; the worker needs penalties, seed, logprobs
    # Physical block ids, logical order; covers every token computed after this step. A block freed
    # behind the window (WorkerInfo.kv_window) is sent as 0: no kernel reads that far back.
    block_table: list[int]
    num_computed_tokens: int  # tokens whose KV is already in the cache (a prefix-cache hit); 0 otherwise
    num_scheduled_tokens: int  # tokens to compute this step, starting at num_computed_tokens
    # n > 1: when the prompt completes, also sample one token for each of this many siblings
    # (indexes 1..num_siblings), from the same logits; the siblings are then forked from this sequence.
    num_siblings: int = 0
    lora: LoRARequest | None = None  # the adapter its tokens run through (forks inherit it); None: the base model
    # An embedding request's: once its prompt is computed the worker pools its states (and samples nothing).
    pooling: PoolingParams | None = None
    # Its request's W3C trace context (shared/tracing.py), which the worker links its step spans to; None: untraced.
    trace_context: dict[str, str] | None = None
    # Its prompt's images (shared/multimodal.py): the worker encodes each as a step first computes its tokens.
    images: tuple[ImageInput, ...] = ()

    def to_proto(self) -> wire.NewSequence:
        return wire.NewSequence(
            request_id=self.request_id, seq_id=self.seq_id, index=self.index,
            prompt_token_ids=self.prompt_token_ids, output_token_ids=self.output_token_ids,
            sampling_params=self.sampling_params.to_proto(), block_table=self.block_table,
            num_computed_tokens=self.num_computed_tokens, num_scheduled_tokens=self.num_scheduled_tokens,
            num_siblings=self.num_siblings, lora=self.lora.to_proto() if self.lora is not None else None,
            pooling=self.pooling.to_proto() if self.pooling is not None else None, trace_context=self.trace_context,
            images=[image.to_proto() for image in self.images])

    @classmethod
    def from_proto(cls, m: wire.NewSequence) -> "NewSequence":
        return cls(request_id=m.request_id, seq_id=m.seq_id, index=m.index, prompt_token_ids=list(m.prompt_token_ids),
                   output_token_ids=list(m.output_token_ids),
                   sampling_params=SamplingParams.from_proto(m.sampling_params, grammar_checked=True),
                   block_table=list(m.block_table), num_computed_tokens=m.num_computed_tokens,
                   num_scheduled_tokens=m.num_scheduled_tokens, num_siblings=m.num_siblings,
                   lora=LoRARequest.from_proto(m.lora) if m.HasField("lora") else None,
                   pooling=PoolingParams.from_proto(m.pooling) if m.HasField("pooling") else None,
                   trace_context=dict(m.trace_context) or None,
                   images=tuple(ImageInput.from_proto(image) for image in m.images))


@dataclass(slots=True)
class RunningSequence:
    """The change to a sequence the worker already holds."""

    seq_id: int  # as sent in NewSequence
    new_token_ids: list[int]  # tokens the scheduler appended since the worker last heard (a sampled token, a beam's)
    new_block_ids: list[int]  # physical blocks appended to the block table
    num_computed_tokens: int  # tokens with KV in cache before this step (the worker checks its copy)
    num_scheduled_tokens: int  # tokens to compute this step
    # The whole table, when it changed other than by appending (copy-on-write, swap-in); then
    # new_block_ids is empty. None otherwise.
    new_block_table: list[int] | None = None
    # After new_token_ids, append the token the worker itself sampled for this sequence in the
    # step just before: the plan was made while that step ran, before its result came back.
    append_last_sample: bool = False
    # Speculative decoding: draft tokens to compute after the sequence's own tokens (they count in
    # num_scheduled_tokens); the worker keeps the longest prefix its own samples confirm.
    draft_token_ids: list[int] = field(default_factory=list)


def running_sequence(*, seq_id: int, new_token_ids: list[int], new_block_ids: list[int], num_computed_tokens: int,
                     num_scheduled_tokens: int, new_block_table: list[int] | None = None,
                     append_last_sample: bool = False, draft_token_ids: list[int] | None = None) -> RunningSequence:
    """A RunningSequence from its fields by name, at the cost of a positional call: the scheduler makes one per
    running sequence per step, and CPython builds a dict for every keyword call of a class (5% of a step at
    256 sequences). Its parameters are the fields in their order (tests/repo/test_step_protocol.py checks)."""
    return RunningSequence(seq_id, new_token_ids, new_block_ids, num_computed_tokens, num_scheduled_tokens,
                           new_block_table, append_last_sample, [] if draft_token_ids is None else draft_token_ids)


def running_to_proto(deltas: list[RunningSequence]) -> wire.RunningDeltas:
    """The deltas as columns (entry i is deltas[i]); see RunningDeltas in the proto."""
    m = wire.RunningDeltas(
        seq_ids=[d.seq_id for d in deltas], num_computed_tokens=[d.num_computed_tokens for d in deltas],
        num_scheduled_tokens=[d.num_scheduled_tokens for d in deltas],
        append_last_sample=[d.append_last_sample for d in deltas],
        num_new_tokens=[len(d.new_token_ids) for d in deltas],
        new_token_ids=[t for d in deltas for t in d.new_token_ids],
        num_new_blocks=[len(d.new_block_ids) for d in deltas],
        new_block_ids=[b for d in deltas for b in d.new_block_ids])
    for i, d in enumerate(deltas):
        if d.new_block_table is not None:
            m.new_block_tables[i].ids.extend(d.new_block_table)
    # Columns of speculative decoding only when some sequence uses them: plans without stay as small.
    if any(d.draft_token_ids for d in deltas):
        m.num_draft_tokens.extend(len(d.draft_token_ids) for d in deltas)
        m.draft_token_ids.extend(t for d in deltas for t in d.draft_token_ids)
    return m


def running_from_proto(m: wire.RunningDeltas) -> list[RunningSequence]:
    columns = (m.seq_ids, m.num_computed_tokens, m.num_scheduled_tokens, m.append_last_sample, m.num_new_tokens,
               m.num_new_blocks)
    count = len(m.seq_ids)
    if any(len(column) != count for column in columns) or sum(m.num_new_tokens) != len(m.new_token_ids) \
            or sum(m.num_new_blocks) != len(m.new_block_ids) or any(i >= count for i in m.new_block_tables) \
            or len(m.num_draft_tokens) not in (0, count) or sum(m.num_draft_tokens) != len(m.draft_token_ids):
        raise ValueError("malformed plan: the running sequences' columns do not line up")
    tokens, blocks, drafts = list(m.new_token_ids), list(m.new_block_ids), list(m.draft_token_ids)
    num_drafts = list(m.num_draft_tokens) or [0] * count
    tables = {i: list(table.ids) for i, table in m.new_block_tables.items()}
    deltas, t, b, d = [], 0, 0, 0
    for i, (seq_id, computed, scheduled, append, num_tokens, num_blocks) in enumerate(zip(*columns)):
        deltas.append(running_sequence(seq_id=seq_id, new_token_ids=tokens[t:t + num_tokens],
                                       new_block_ids=blocks[b:b + num_blocks], num_computed_tokens=computed,
                                       num_scheduled_tokens=scheduled, new_block_table=tables.get(i),
                                       append_last_sample=append, draft_token_ids=drafts[d:d + num_drafts[i]]))
        t += num_tokens
        b += num_blocks
        d += num_drafts[i]
    return deltas


@dataclass(slots=True)
class Fork:
    """A child sequence that starts as a copy of its parent (n > 1 siblings, beam search)."""

    parent_seq_id: int  # copied as it was before this step's deltas
    child_seq_id: int  # new on the worker
    child_index: int  # the child's position in its request (its seeded random stream)

    def to_proto(self) -> wire.Fork:
        return wire.Fork(parent_seq_id=self.parent_seq_id, child_seq_id=self.child_seq_id,
                         child_index=self.child_index)

    @classmethod
    def from_proto(cls, m: wire.Fork) -> "Fork":
        return cls(parent_seq_id=m.parent_seq_id, child_seq_id=m.child_seq_id, child_index=m.child_index)


BlockMove = tuple[int, int]  # (source block, destination block)


def moves_to_proto(moves: list[BlockMove]) -> list:
    return [wire.BlockMove(src=src, dst=dst) for src, dst in moves]


def moves_from_proto(moves) -> list[BlockMove]:
    return [(m.src, m.dst) for m in moves]


@dataclass(slots=True)
class KVPull:
    """Prefill/decode disaggregation: blocks this (decode) worker reads from a prefill worker's pools, worker to
    worker, before the step computes. A pull that fails leaves its destinations unfilled, as a failed swap-in."""

    source: str  # the prefill worker's address (its ReadBlocks)
    moves: list[BlockMove] = field(default_factory=list)  # (the source's device block, this worker's device block)

    def to_proto(self) -> wire.KVPull:
        return wire.KVPull(source=self.source, moves=moves_to_proto(self.moves))

    @classmethod
    def from_proto(cls, m: wire.KVPull) -> "KVPull":
        return cls(source=m.source, moves=moves_from_proto(m.moves))


@dataclass(slots=True)
class StepPlan:
    step_id: int  # increases by one per step; echoed in the result
    new: list[NewSequence] = field(default_factory=list)  # first scheduled (or resumed after recompute)
    running: list[RunningSequence] = field(default_factory=list)  # deltas for known sequences
    finished_seq_ids: list[int] = field(default_factory=list)  # finished, aborted or preempted: drop state
    forks: list[Fork] = field(default_factory=list)  # children to create, before anything else (even drops)
    swap_out: list[BlockMove] = field(default_factory=list)  # (device block, host block), first
    swap_in: list[BlockMove] = field(default_factory=list)  # (host block, device block), second
    copies: list[BlockMove] = field(default_factory=list)  # (device, device) for copy-on-write, fourth
    pulls: list[KVPull] = field(default_factory=list)  # from prefill workers' blocks into this worker's, third

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.new) + sum(s.num_scheduled_tokens for s in self.running)

    @property
    def is_empty(self) -> bool:
        """Nothing to compute; the plan may still carry drops and block moves."""
        return not self.new and not self.running

    @property
    def has_side_effects(self) -> bool:
        return bool(self.finished_seq_ids or self.forks or self.swap_out or self.swap_in or self.copies
                    or self.pulls)

    def to_proto(self) -> wire.StepPlan:
        return wire.StepPlan(step_id=self.step_id, new=[s.to_proto() for s in self.new],
                             running=running_to_proto(self.running), finished_seq_ids=self.finished_seq_ids,
                             forks=[f.to_proto() for f in self.forks], swap_out=moves_to_proto(self.swap_out),
                             swap_in=moves_to_proto(self.swap_in), copies=moves_to_proto(self.copies),
                             pulls=[p.to_proto() for p in self.pulls])

    @classmethod
    def from_proto(cls, m: wire.StepPlan) -> "StepPlan":
        return cls(step_id=m.step_id, new=[NewSequence.from_proto(s) for s in m.new],
                   running=running_from_proto(m.running), finished_seq_ids=list(m.finished_seq_ids),
                   forks=[Fork.from_proto(f) for f in m.forks], swap_out=moves_from_proto(m.swap_out),
                   swap_in=moves_from_proto(m.swap_in), copies=moves_from_proto(m.copies),
                   pulls=[KVPull.from_proto(p) for p in m.pulls])


@dataclass(slots=True)
class PositionLogprobs:
    """Log-probabilities at one position, from the model's raw distribution."""

    token_id: int  # the token at this position (sampled, or the prompt's own)
    logprob: float  # its log-probability
    rank: int  # 1 for the most likely token
    top_token_ids: list[int]  # the k most likely tokens, best first (k as the request asked)
    top_logprobs: list[float]  # their log-probabilities, same order

    def to_proto(self) -> wire.PositionLogprobs:
        return wire.PositionLogprobs(token_id=self.token_id, logprob=self.logprob, rank=self.rank,
                                     top_token_ids=self.top_token_ids, top_logprobs=self.top_logprobs)

    @classmethod
    def from_proto(cls, m: wire.PositionLogprobs) -> "PositionLogprobs":
        return cls(token_id=m.token_id, logprob=m.logprob, rank=m.rank, top_token_ids=list(m.top_token_ids),
                   top_logprobs=list(m.top_logprobs))


@dataclass(slots=True)
class Sample:
    """One sampled token, for a sibling sampled from its parent's logits."""

    token_id: int
    logprobs: PositionLogprobs | None = None

    def to_proto(self) -> wire.Sample:
        m = wire.Sample(token_id=self.token_id)
        if self.logprobs is not None:
            m.logprobs.CopyFrom(self.logprobs.to_proto())
        return m

    @classmethod
    def from_proto(cls, m: wire.Sample) -> "Sample":
        return cls(token_id=m.token_id,
                   logprobs=PositionLogprobs.from_proto(m.logprobs) if m.HasField("logprobs") else None)


@dataclass(slots=True)
class SequenceOutput:
    """What one sequence produced in one step."""

    seq_id: int
    token_id: int | None  # the sampled token; None mid-way through a chunked prefill
    logprobs: PositionLogprobs | None = None  # for token_id, when the request asked for logprobs
    # For requests with prompt_logprobs: prompt positions computed this step, in order,
    # starting at prompt index ``prompt_logprobs_start`` (index 0 has none: nothing precedes it).
    prompt_logprobs: list[PositionLogprobs] | None = None
    prompt_logprobs_start: int = 0
    siblings: list[Sample] = field(default_factory=list)  # first tokens of siblings 1..n-1 (see num_siblings)
    # Speculative decoding: the step's draft tokens the worker accepted, in order; the new tokens
    # are these followed by token_id. Their logprobs (when asked for), same order.
    accepted_token_ids: list[int] = field(default_factory=list)
    accepted_logprobs: list[PositionLogprobs] = field(default_factory=list)
    draft_token_ids: list[int] = field(default_factory=list)  # proposed for the sequence's next step
    # Set when this sequence cannot go on (its structured output grammar failed): the scheduler ends
    # its request with this error, and only it (token_id is then not to be kept).
    error: str = ""
    # A pooling sequence's embedding (a classifier's class scores), in the step that computed the rest of
    # its prompt (token_id is None).
    embedding: list[float] | None = None

    @property
    def is_plain(self) -> bool:
        """Sampled tokens (and drafts) without logprobs: the common output, sent as column entries."""
        return (self.token_id is not None and self.logprobs is None and self.prompt_logprobs is None
                and not self.siblings and self.prompt_logprobs_start == 0 and not self.accepted_logprobs
                and not self.error and self.embedding is None)

    def to_proto(self) -> wire.SequenceOutput:
        m = wire.SequenceOutput(seq_id=self.seq_id, prompt_logprobs_start=self.prompt_logprobs_start,
                                siblings=[s.to_proto() for s in self.siblings],
                                accepted_token_ids=self.accepted_token_ids,
                                accepted_logprobs=[p.to_proto() for p in self.accepted_logprobs],
                                draft_token_ids=self.draft_token_ids, error=self.error,
                                embedding=self.embedding)
        if self.token_id is not None:
            m.token_id = self.token_id
        if self.logprobs is not None:
            m.logprobs.CopyFrom(self.logprobs.to_proto())
        if self.prompt_logprobs is not None:
            m.prompt_logprobs.extend(p.to_proto() for p in self.prompt_logprobs)
        return m

    @classmethod
    def from_proto(cls, m: wire.SequenceOutput) -> "SequenceOutput":
        return cls(seq_id=m.seq_id, token_id=m.token_id if m.HasField("token_id") else None,
                   logprobs=PositionLogprobs.from_proto(m.logprobs) if m.HasField("logprobs") else None,
                   prompt_logprobs=[PositionLogprobs.from_proto(p) for p in m.prompt_logprobs] or None,
                   prompt_logprobs_start=m.prompt_logprobs_start, siblings=[Sample.from_proto(s) for s in m.siblings],
                   accepted_token_ids=list(m.accepted_token_ids),
                   accepted_logprobs=[PositionLogprobs.from_proto(p) for p in m.accepted_logprobs],
                   draft_token_ids=list(m.draft_token_ids), error=m.error,
                   embedding=list(m.embedding) if m.embedding else None)


def outputs_to_proto(outputs: list[SequenceOutput]) -> wire.StepOutputs:
    """Plain outputs (tokens, nothing else) as columns, the others whole with their places."""
    m = wire.StepOutputs()
    plain = []
    for position, out in enumerate(outputs):
        if out.is_plain:
            plain.append(out)
        else:
            m.detailed.append(out.to_proto())
            m.detailed_positions.append(position)
    m.seq_ids.extend([out.seq_id for out in plain])
    m.token_ids.extend([out.token_id for out in plain])
    # The speculative columns only when some output uses them: results without stay as small.
    if any(out.accepted_token_ids for out in plain):
        m.num_accepted.extend([len(out.accepted_token_ids) for out in plain])
        m.accepted_token_ids.extend([t for out in plain for t in out.accepted_token_ids])
    if any(out.draft_token_ids for out in plain):
        m.num_drafts.extend([len(out.draft_token_ids) for out in plain])
        m.draft_token_ids.extend([t for out in plain for t in out.draft_token_ids])
    return m


def outputs_from_proto(m: wire.StepOutputs) -> list[SequenceOutput]:
    count = len(m.seq_ids)
    if len(m.token_ids) != count or len(m.num_accepted) not in (0, count) or len(m.num_drafts) not in (0, count) \
            or sum(m.num_accepted) != len(m.accepted_token_ids) or sum(m.num_drafts) != len(m.draft_token_ids):
        raise ValueError("malformed result: the output columns do not line up")
    # (Its first two fields by position: one per sequence per step, and a keyword call of a class costs a dict.)
    plain = [SequenceOutput(seq_id, token_id) for seq_id, token_id in zip(m.seq_ids, m.token_ids)]
    _split_column(plain, m.num_accepted, m.accepted_token_ids, "accepted_token_ids")
    _split_column(plain, m.num_drafts, m.draft_token_ids, "draft_token_ids")
    return merge_by_position(plain, [SequenceOutput.from_proto(o) for o in m.detailed], list(m.detailed_positions),
                             "result")


def _split_column(outputs: list[SequenceOutput], counts, flat, name: str) -> None:
    """Output i's ``name`` is the next counts[i] ids of ``flat`` (no column: every list stays empty)."""
    if not counts:
        return
    ids, start = list(flat), 0
    for out, count in zip(outputs, counts):
        setattr(out, name, ids[start:start + count])
        start += count


@dataclass(slots=True)
class StepResult:
    step_id: int  # the plan's
    outputs: list[SequenceOutput] = field(default_factory=list)
    forward_time_s: float = 0.0  # model forward pass, including the KV writes
    sample_time_s: float = 0.0  # logits processing and sampling (and verifying drafts)
    propose_time_s: float = 0.0  # proposing the next step's drafts (speculative decoding)
    # Device blocks a swap-in (a swapped sequence's, the host tier's load, or a pull) failed to fill: their prefixes
    # leave the caches. The worker left every sequence whose table names one out of the step (recompute_seq_ids:
    # its own tables, which keep the ids of entries released behind a window, so they may name more than the
    # scheduler's); the scheduler recomputes exactly those, and no computed sequence read such a block.
    failed_block_ids: list[int] = field(default_factory=list)
    recompute_seq_ids: list[int] = field(default_factory=list)

    def to_proto(self) -> wire.StepResult:
        return wire.StepResult(step_id=self.step_id, outputs=outputs_to_proto(self.outputs),
                               forward_time_s=self.forward_time_s, sample_time_s=self.sample_time_s,
                               propose_time_s=self.propose_time_s, failed_block_ids=self.failed_block_ids,
                               recompute_seq_ids=self.recompute_seq_ids)

    @classmethod
    def from_proto(cls, m: wire.StepResult) -> "StepResult":
        return cls(step_id=m.step_id, outputs=outputs_from_proto(m.outputs), forward_time_s=m.forward_time_s,
                   sample_time_s=m.sample_time_s, propose_time_s=m.propose_time_s,
                   failed_block_ids=list(m.failed_block_ids), recompute_seq_ids=list(m.recompute_seq_ids))


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """Facts a worker finds at start-up and reports once; the scheduler sizes its pool from them."""

    model: str  # the model path or name it loaded
    num_kv_blocks: int  # blocks in its KV pools
    block_size: int  # tokens per block
    max_model_len: int  # longest sequence (prompt + output) it serves
    vocab_size: int  # logits width; token ids must be below it
    eos_token_ids: tuple[int, ...]  # from generation_config.json / the tokenizer
    device: str  # e.g. "cpu", "cuda:0"
    dtype: str  # e.g. "float32"
    num_cpu_blocks: int = 0  # host memory's KV blocks: swap space and the offload tier (0: neither)
    protocol_version: int = INTERNAL_PROTOCOL_VERSION  # the wire format the worker's release speaks
    num_speculative_tokens: int = 0  # the most draft tokens it proposes per sequence (0: no speculative decoding)
    tensor_parallel_rank: int = 0  # its place among the workers that hold the model between them
    tensor_parallel_size: int = 1  # how many they are
    max_loras: int = 0  # distinct LoRA adapters one step may run (0: adapters are not enabled)
    max_lora_rank: int = 0  # the largest adapter rank it takes
    pooler: PoolerConfig | None = None  # set: it runs a pooling model (embeddings or class scores); None: it generates
    # Every attention layer (a draft model's too) sees at most this many keys back from a query, so the
    # scheduler frees the blocks behind a sequence's window; None: some layer sees the whole context.
    kv_window: int | None = None
    num_cpu_offload_blocks: int = 0  # of num_cpu_blocks, the prefix cache's host tier (--kv-offloading-size)
    image_token_id: int | None = None  # the placeholder of image features; None: the model takes no images
    kv_cache_dtype: str = ""  # how its KV cache stores K and V (--kv-cache-dtype as resolved, e.g. fp8_e4m3)
    kv_scales_measured: bool = False  # an FP8 cache whose scales it measured itself (--calculate-kv-scales)
    # Each image's placeholders attend to each other both ways (Gemma 3): a step must compute an image whole.
    whole_images: bool = False

    def to_proto(self) -> wire.WorkerInfo:
        return wire.WorkerInfo(model=self.model, num_kv_blocks=self.num_kv_blocks, block_size=self.block_size,
                               max_model_len=self.max_model_len, vocab_size=self.vocab_size,
                               eos_token_ids=self.eos_token_ids, device=self.device, dtype=self.dtype,
                               num_cpu_blocks=self.num_cpu_blocks, protocol_version=self.protocol_version,
                               num_speculative_tokens=self.num_speculative_tokens,
                               tensor_parallel_rank=self.tensor_parallel_rank,
                               tensor_parallel_size=self.tensor_parallel_size, max_loras=self.max_loras,
                               max_lora_rank=self.max_lora_rank,
                               pooler=self.pooler.to_proto() if self.pooler is not None else None,
                               kv_window=self.kv_window, num_cpu_offload_blocks=self.num_cpu_offload_blocks,
                               image_token_id=self.image_token_id, kv_cache_dtype=self.kv_cache_dtype,
                               kv_scales_measured=self.kv_scales_measured, whole_images=self.whole_images)

    @classmethod
    def from_proto(cls, m: wire.WorkerInfo) -> "WorkerInfo":
        return cls(model=m.model, num_kv_blocks=m.num_kv_blocks, block_size=m.block_size,
                   max_model_len=m.max_model_len, vocab_size=m.vocab_size, eos_token_ids=tuple(m.eos_token_ids),
                   device=m.device, dtype=m.dtype, num_cpu_blocks=m.num_cpu_blocks,
                   protocol_version=m.protocol_version, num_speculative_tokens=m.num_speculative_tokens,
                   tensor_parallel_rank=m.tensor_parallel_rank, tensor_parallel_size=m.tensor_parallel_size or 1,
                   max_loras=m.max_loras, max_lora_rank=m.max_lora_rank,
                   pooler=PoolerConfig.from_proto(m.pooler) if m.HasField("pooler") else None,
                   kv_window=m.kv_window if m.HasField("kv_window") else None,
                   num_cpu_offload_blocks=m.num_cpu_offload_blocks,
                   image_token_id=m.image_token_id if m.HasField("image_token_id") else None,
                   kv_cache_dtype=m.kv_cache_dtype, kv_scales_measured=m.kv_scales_measured,
                   whole_images=m.whole_images)
