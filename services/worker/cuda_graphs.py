"""Decode steps replayed from CUDA graphs, captured when a CUDA worker starts.

A decode step of a small batch is mostly host time: every layer launches a dozen kernels and the GPU
waits on Python between them. A graph records the model's whole forward pass once; a replay is one
launch. A replay reads its inputs from the addresses it was captured with, so each step's inputs are
copied into fixed buffers first, and whatever the capture baked in must hold for every step replayed:

- the batch size: one graph per size in ``capture_sizes``; a smaller batch is padded up to the next
  size with rows that write no K/V (slot -1) and see a single key;
- the attention launch plan (its split count): made for the longest context of the graph's context
  class, so it holds for any shorter one (each sequence spreads its own keys over the splits; the
  kernel reads the lengths from the buffer). Two classes per size: contexts under
  ``2 * SPLIT_MIN_KEYS``, where the split heuristic never splits, so short decodes launch exactly what
  they would eagerly; and the rest, up to the full context length (a batch just past the short class
  gets the full length's split count, with short splits: more programs and partials than eager's
  two or so splits, all of it small next to the launches a replay saves). The plan is kept alive
  here: the graph holds its tile tensor's address;
- the block-table width: the most blocks one sequence can hold;
- with LoRA adapters, the adapter layers over every slot: each replay reads which slot each row uses from
  a mask buffer (all false for a row without an adapter, whose output the adapters then leave exactly as
  it was), so one graph serves any mix of adapters, and steps without one pay the small shrink and expand
  over all slots;
- with tensor parallelism, the all-reduces (NCCL, which a graph can hold): every rank captures the same
  graphs and replays the same one each step, as each is sent the same batch.

Prefill and mixed steps, and batches larger than the largest graph, run eagerly. Only a backend that
reads every length from device tensors can be replayed (``supports_cuda_graphs``: the Triton one).
After capture, every graph is replayed on random batches (full and padded) and compared with the eager
forward pass; a worker whose graphs fail that check, or cannot be captured, serves eagerly and logs why.
"""

from __future__ import annotations

import bisect
import gc
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from services.worker.attention.metadata import AttentionMetadata
from services.worker.attention.triton_attention import SPLIT_MIN_KEYS, LaunchPlan
from services.worker.input_batch import ScheduledSequence, build_model_inputs, padded_block_tables
from services.worker.models.lora_linear import LoRABatch

MAX_CAPTURE_SIZE = 256  # larger decode batches keep the GPU busy without a graph
SHORT_CONTEXT = 2 * SPLIT_MIN_KEYS - 1  # the longest context the split heuristic never splits
# How far a replay's hidden state may lie from the eager pass's, per row, relative to the row's norm. A
# long-context graph's plan may split where eager does not: the sums run in another order, nothing more.
CHECK_TOLERANCE = {torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 5e-2}
CHECK_MAX_CONTEXT = 2048  # the check's random contexts, besides one at its class's longest


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8, up to min(max_num_seqs, MAX_CAPTURE_SIZE), which is always one."""
    limit = min(max_num_seqs, MAX_CAPTURE_SIZE)
    return [s for s in [1, 2, 4, *range(8, limit, 8)] if s < limit] + [limit]


def context_classes(max_model_len: int) -> list[int]:
    """The longest context of each class: the short one, and the full length when it is longer."""
    return sorted({min(SHORT_CONTEXT, max_model_len), max_model_len})


class GraphCapturer(Protocol):
    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        """Record ``fn``; returns (replay, the output tensor each replay rewrites)."""


class CudaGraphCapturer:
    """torch.cuda graphs sharing one memory pool (captured largest first, the smaller ones reuse it)."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream()

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        # Our own stream context around torch's: when a capture fails, torch's exit raises before it
        # restores the current stream, and the worker would go on serving on the capture stream.
        with torch.cuda.stream(self.stream), collector_paused():
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
                out = fn()
        return graph.replay, out


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's garbage collector off: a Triton kernel object it frees mid-capture unloads its CUDA
    module, which a capture does not allow (the graph is then invalid)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@dataclass(frozen=True)
class DecodeBuffers:
    """The graphs' inputs, sized for the largest; a graph of size B reads the first B rows."""
    packed: torch.Tensor  # [3, max_size] int64: input ids, positions, slots (-1: padding, K/V not written)
    seq_lens: torch.Tensor  # [max_size] int32; padding rows 1
    block_tables: torch.Tensor  # [max_size, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor  # [max_size + 1] int32: 0, 1, 2, ... (one token per sequence)
    lora_mask: torch.Tensor | None  # [max_size, adapter slots] bool: row i uses slot j (None: no adapters)

    @classmethod
    def allocate(cls, max_size: int, max_blocks: int, device: torch.device,
                 lora_slots: int | None = None) -> "DecodeBuffers":
        with torch.inference_mode(False):  # plain tensors: steps may fill them in or out of inference mode
            packed = torch.zeros(3, max_size, dtype=torch.int64, device=device)
            packed[2] = -1
            lora_mask = None if lora_slots is None else torch.zeros(max_size, lora_slots, dtype=torch.bool,
                                                                    device=device)
            return cls(packed=packed, seq_lens=torch.ones(max_size, dtype=torch.int32, device=device),
                       block_tables=torch.zeros(max_size, max_blocks, dtype=torch.int32, device=device),
                       query_start_loc=torch.arange(max_size + 1, dtype=torch.int32, device=device),
                       lora_mask=lora_mask)

    @property
    def input_ids(self) -> torch.Tensor:
        return self.packed[0]

    @property
    def positions(self) -> torch.Tensor:
        return self.packed[1]

    def metadata(self, size: int, max_seq_len: int) -> AttentionMetadata:
        """A decode of ``size`` sequences as long as ``max_seq_len``: what the launch plan is made for."""
        return AttentionMetadata(slot_mapping=self.packed[2, :size], query_start_loc=self.query_start_loc[:size + 1],
                                 seq_lens=self.seq_lens[:size], block_tables=self.block_tables[:size],
                                 query_lens_cpu=[1] * size, seq_lens_cpu=[max_seq_len] * size, max_query_len=1,
                                 max_seq_len=max_seq_len)

    def fill(self, batch: list[ScheduledSequence], block_size: int, size: int,
             block_tables: torch.Tensor | None = None) -> None:
        """This step's decodes in the first rows, padding up to ``size`` after them: three host-to-device copies.

        ``block_tables`` as build_model_inputs takes them (None: built from the lists)."""
        pad = size - len(batch)
        ids, positions, slots, lens = [], [], [], []
        for s in batch:
            pos = s.num_computed_tokens
            ids.append(s.token_ids[pos])
            positions.append(pos + s.rope_offset)
            slots.append(s.block_table[pos // block_size] * block_size + pos % block_size)
            lens.append(pos + 1)
        packed = torch.tensor([ids + [0] * pad, positions + [0] * pad, slots + [-1] * pad], dtype=torch.int64)
        self.packed[:, :size].copy_(packed)
        self.seq_lens[:size].copy_(torch.tensor(lens + [1] * pad, dtype=torch.int32))
        # Padding rows keep whatever table they had: every entry is a valid block, and they read one key.
        tables = block_tables if block_tables is not None else padded_block_tables(batch)
        self.block_tables[:len(batch), :tables.shape[1]].copy_(tables)


@dataclass(frozen=True)
class _Graph:
    replay: Callable[[], None]
    output: torch.Tensor  # [size, hidden]
    meta: AttentionMetadata
    plan: LaunchPlan  # the graph reads its tile tensor


class DecodeGraphs:
    """The captured graphs of one worker, by (batch size, longest context of the class), and their buffers."""

    def __init__(self, graphs: dict[tuple[int, int], _Graph], buffers: DecodeBuffers, block_size: int,
                 lora: LoRABatch | None = None):
        self.graphs = graphs
        self.sizes = sorted({size for size, _ in graphs})
        self.contexts = sorted({context for _, context in graphs})
        self.buffers = buffers
        self.block_size = block_size
        self.lora = lora  # the adapters' step state, whose slots each replay reads (None: captured without)

    def can_replay(self, batch: list[ScheduledSequence]) -> bool:
        """A decode of at most the largest graph's size, every context and table within the graphs' reach."""
        width = self.buffers.block_tables.shape[1]
        return 0 < len(batch) <= self.sizes[-1] and all(
            s.num_scheduled_tokens == 1 and len(s.block_table) <= width and s.num_computed_tokens < self.contexts[-1]
            for s in batch)

    def graph_for(self, batch: list[ScheduledSequence]) -> tuple[int, int]:
        size = self.sizes[bisect.bisect_left(self.sizes, len(batch))]
        longest = max(s.num_computed_tokens + 1 for s in batch)
        return size, self.contexts[bisect.bisect_left(self.contexts, longest)]

    def forward(self, batch: list[ScheduledSequence], block_tables: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states ``[len(batch), hidden]``: a view of the graph's output, valid until the next replay."""
        key = self.graph_for(batch)
        self.buffers.fill(batch, self.block_size, key[0], block_tables)
        if self.lora is not None:  # the slots the worker set for this step
            self.buffers.lora_mask[:key[0]].copy_(self.lora.decode_mask(key[0]))
        graph = self.graphs[key]
        graph.replay()
        return graph.output[:len(batch)]


def capture_decode_graphs(model, attention, *, block_size: int, max_model_len: int, max_num_seqs: int,
                          device: torch.device, capturer: GraphCapturer, lora: LoRABatch | None = None
                          ) -> DecodeGraphs:
    """A graph per batch size in ``capture_sizes(max_num_seqs)`` and context class, largest first; call in
    inference mode. ``lora``: the model's adapter state, when it has adapter layers (their slots then go in
    through a mask buffer).

    Each runs eagerly once before its capture: the attention backend makes (and validates) its plan
    there, and any kernel not yet compiled is compiled outside the capture.
    """
    sizes = capture_sizes(max_num_seqs)
    buffers = DecodeBuffers.allocate(sizes[-1], -(-max_model_len // block_size), device,
                                     None if lora is None else lora.num_slots)
    graphs: dict[tuple[int, int], _Graph] = {}
    for size in reversed(sizes):
        for context in reversed(context_classes(max_model_len)):
            meta = buffers.metadata(size, context)

            def run(size=size, meta=meta) -> torch.Tensor:
                with nullcontext() if lora is None else lora.every_slot(buffers.lora_mask[:size]):
                    return model(buffers.input_ids[:size], buffers.positions[:size], attention, meta)

            run()
            plan = attention.plan_for(meta)
            if plan is None:  # a plan made inside the capture would copy its tiles from the host: fatal there
                raise RuntimeError(f"the {attention.name} attention backend made no launch plan for the graph's batch")
            _synchronize(device)
            replay, output = capturer.capture(run)
            graphs[size, context] = _Graph(replay=replay, output=output, meta=meta, plan=plan)
    _synchronize(device)
    return DecodeGraphs(graphs, buffers, block_size, lora)


def check_decode_graphs(graphs: DecodeGraphs, model, attention, *, num_blocks: int, vocab_size: int,
                        dtype: torch.dtype, device: torch.device, seed: int = 0) -> float:
    """Replays every graph on random batches, full and padded, against the eager forward pass over the same
    batch (its own inputs and plan); returns the largest row error relative to the row's norm, or raises
    ValueError past ``CHECK_TOLERANCE``.

    Writes K/V into random blocks: call it before any sequence owns one. With adapters, each sequence runs
    through a random slot or none (the same seed draws the same on every tensor-parallel rank).
    """
    generator = torch.Generator().manual_seed(seed)
    worst = 0.0
    for (size, context) in sorted(graphs.graphs):
        smallest = 1 + max([s for s in graphs.sizes if s < size], default=0)  # the most padding this graph gets
        for n in sorted({size, smallest}):
            batch = random_decode_batch(n, graphs.block_size, num_blocks, vocab_size, context, generator)
            if graphs.graph_for(batch) != (size, context):
                raise RuntimeError(f"a check batch of {n} sequences up to {context} keys missed its graph")
            if graphs.lora is not None:
                graphs.lora.set_token_slots(random_adapter_slots(n, graphs.lora.num_slots, generator), [1] * n)
            replayed = graphs.forward(batch).float()
            inputs = build_model_inputs(batch, graphs.block_size, device)
            eager = model(inputs.input_ids, inputs.positions, attention, inputs.meta).float()
            if graphs.lora is not None:
                graphs.lora.clear()
            error = ((replayed - eager).norm(dim=-1) / eager.norm(dim=-1).clamp_min(1e-6)).max().item()
            if not error <= CHECK_TOLERANCE[dtype]:  # also catches NaN
                raise ValueError(f"the decode graph for {size} sequences up to {context} keys differs from the eager "
                                 f"forward pass at {n} sequences: row error {error:.3g} of the row's norm")
            worst = max(worst, error)
    return worst


def random_adapter_slots(size: int, num_slots: int, generator: torch.Generator) -> list[int | None]:
    """A random slot or none (drawn as ``num_slots``) per sequence."""
    drawn = torch.randint(0, num_slots + 1, (size,), generator=generator).tolist()
    return [None if slot == num_slots else slot for slot in drawn]


def random_decode_batch(size: int, block_size: int, num_blocks: int, vocab_size: int, longest: int,
                        generator: torch.Generator) -> list[ScheduledSequence]:
    """Decodes of random tokens over random blocks (``size <= num_blocks``); the first ``longest`` keys long.

    Each sequence's last block, where its new token's K/V goes, is its own: two writes to one slot would
    race, and the two passes being compared could then read different values.
    """
    contexts = torch.randint(1, min(longest, CHECK_MAX_CONTEXT) + 1, (size,), generator=generator).tolist()
    contexts[0] = longest  # every split of the plan busy
    last_blocks = torch.randperm(num_blocks, generator=generator)[:size].tolist()
    new_tokens = torch.randint(0, vocab_size, (size,), generator=generator).tolist()
    batch = []
    for ctx, last, token in zip(contexts, last_blocks, new_tokens):
        table = torch.randint(0, num_blocks, (-(-ctx // block_size) - 1,), generator=generator).tolist() + [last]
        # The cached tokens' ids are never read (their K/V is what the pool holds), only the new one.
        batch.append(ScheduledSequence([0] * (ctx - 1) + [token], table, ctx - 1, 1))
    return batch


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
