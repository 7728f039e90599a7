"""Decode steps replayed from CUDA graphs, one per batch size, captured when a CUDA worker starts.

A decode step of a small batch is mostly host time: every layer launches a dozen kernels and the GPU
waits on Python between them. A graph records the model's whole forward pass once; a replay is one
launch. A replay reads its inputs from the addresses it was captured with, so each step's inputs are
copied into fixed buffers first, and whatever the capture baked in must hold for every step replayed:

- the batch size: one graph per size in ``capture_sizes``; a smaller batch is padded up to the next
  size with rows that write no K/V (slot -1) and see a single key;
- the attention launch plan: made for the longest context the worker serves, so its split count holds
  for any context (each sequence spreads its own keys over the splits; the kernel reads the lengths
  from the buffer), and kept alive here, since the graph holds its tile tensor's address;
- the block-table width: the most blocks one sequence can hold.

Prefill and mixed steps, and batches larger than the largest graph, run eagerly. Only a backend that
reads every length from device tensors can be replayed (``supports_cuda_graphs``: the Triton one).
After capture every graph is checked against the eager forward pass on a random batch; a worker whose
graphs fail that check (or cannot be captured) serves eagerly and logs why.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from services.worker.attention.metadata import AttentionMetadata
from services.worker.input_batch import ScheduledSequence, build_model_inputs

MAX_CAPTURE_SIZE = 256  # larger decode batches keep the GPU busy without a graph
# How far a replay may drift from the eager pass, relative to the largest |hidden|: the same kernels run
# on the same inputs, so only a GEMM that picks another algorithm under capture may differ at all.
CHECK_TOLERANCE = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 5e-2}
CHECK_MAX_CONTEXT = 2048  # the check's random contexts, besides one at the full context length


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8, up to min(max_num_seqs, MAX_CAPTURE_SIZE), which is always one."""
    limit = min(max_num_seqs, MAX_CAPTURE_SIZE)
    return [s for s in [1, 2, 4, *range(8, limit, 8)] if s < limit] + [limit]


class GraphCapturer(Protocol):
    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        """Record ``fn``; returns (replay, the output tensor each replay rewrites)."""


class CudaGraphCapturer:
    """torch.cuda graphs sharing one memory pool (captured largest first, the smaller ones reuse it)."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        return graph.replay, out


@dataclass(frozen=True)
class DecodeBuffers:
    """The graphs' inputs, sized for the largest; a graph of size B reads the first B rows."""
    input_ids: torch.Tensor  # [max_size] int64
    positions: torch.Tensor  # [max_size] int64
    slot_mapping: torch.Tensor  # [max_size] int64; padding rows -1 (their K/V is not written)
    seq_lens: torch.Tensor  # [max_size] int32; padding rows 1
    block_tables: torch.Tensor  # [max_size, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor  # [max_size + 1] int32: 0, 1, 2, ... (one token per sequence)

    @classmethod
    def allocate(cls, max_size: int, max_blocks: int, device: torch.device) -> "DecodeBuffers":
        def zeros(*shape, dtype):
            return torch.zeros(*shape, dtype=dtype, device=device)

        return cls(input_ids=zeros(max_size, dtype=torch.int64), positions=zeros(max_size, dtype=torch.int64),
                   slot_mapping=torch.full((max_size,), -1, dtype=torch.int64, device=device),
                   seq_lens=torch.ones(max_size, dtype=torch.int32, device=device),
                   block_tables=zeros(max_size, max_blocks, dtype=torch.int32),
                   query_start_loc=torch.arange(max_size + 1, dtype=torch.int32, device=device))

    def metadata(self, size: int, max_seq_len: int) -> AttentionMetadata:
        """A decode of ``size`` sequences as long as ``max_seq_len``: what the launch plan is made for."""
        return AttentionMetadata(slot_mapping=self.slot_mapping[:size], query_start_loc=self.query_start_loc[:size + 1],
                                 seq_lens=self.seq_lens[:size], block_tables=self.block_tables[:size],
                                 query_lens_cpu=[1] * size, seq_lens_cpu=[max_seq_len] * size, max_query_len=1,
                                 max_seq_len=max_seq_len)

    def fill(self, batch: list[ScheduledSequence], block_size: int, size: int) -> None:
        """This step's decode inputs in the first rows, padding up to ``size`` after them."""
        inputs = build_model_inputs(batch, block_size, torch.device("cpu"))
        n, pad = len(batch), size - len(batch)
        meta = inputs.meta
        self.input_ids[:size].copy_(_padded(inputs.input_ids, pad, 0), non_blocking=True)
        self.positions[:size].copy_(_padded(inputs.positions, pad, 0), non_blocking=True)
        self.slot_mapping[:size].copy_(_padded(meta.slot_mapping, pad, -1), non_blocking=True)
        self.seq_lens[:size].copy_(_padded(meta.seq_lens, pad, 1), non_blocking=True)
        # Padding rows keep whatever table they had: every entry is a valid block, and they read one key.
        self.block_tables[:n, :meta.block_tables.shape[1]].copy_(meta.block_tables, non_blocking=True)


def _padded(values: torch.Tensor, pad: int, fill: int) -> torch.Tensor:
    return torch.cat([values, values.new_full((pad,), fill)]) if pad else values


@dataclass(frozen=True)
class _Graph:
    replay: Callable[[], None]
    output: torch.Tensor  # [size, hidden]
    meta: AttentionMetadata
    plan: object  # the attention backend's launch plan: the graph reads its tensors


class DecodeGraphs:
    """The captured graphs of one worker and the buffers they read."""

    def __init__(self, graphs: dict[int, _Graph], buffers: DecodeBuffers, block_size: int):
        self.graphs = graphs
        self.sizes = sorted(graphs)
        self.buffers = buffers
        self.block_size = block_size

    def can_replay(self, batch: list[ScheduledSequence]) -> bool:
        """A decode of at most the largest graph's size, every table within the buffer's width."""
        width = self.buffers.block_tables.shape[1]
        return 0 < len(batch) <= self.sizes[-1] and all(
            s.num_scheduled_tokens == 1 and len(s.block_table) <= width for s in batch)

    def forward(self, batch: list[ScheduledSequence]) -> torch.Tensor:
        """Hidden states ``[len(batch), hidden]``: a view of the graph's output, valid until the next replay."""
        size = self.sizes[bisect.bisect_left(self.sizes, len(batch))]
        self.buffers.fill(batch, self.block_size, size)
        graph = self.graphs[size]
        graph.replay()
        return graph.output[:len(batch)]


def capture_decode_graphs(model, attention, *, block_size: int, max_model_len: int, max_num_seqs: int,
                          device: torch.device, capturer: GraphCapturer) -> DecodeGraphs:
    """One graph per size in ``capture_sizes(max_num_seqs)``, largest first; call in inference mode.

    Each size runs eagerly once before its capture: the attention backend makes (and validates) its
    plan there, and any kernel not yet compiled is compiled outside the capture.
    """
    sizes = capture_sizes(max_num_seqs)
    buffers = DecodeBuffers.allocate(sizes[-1], -(-max_model_len // block_size), device)
    graphs: dict[int, _Graph] = {}
    for size in reversed(sizes):
        meta = buffers.metadata(size, max_model_len)

        def run(size=size, meta=meta) -> torch.Tensor:
            return model(buffers.input_ids[:size], buffers.positions[:size], attention, meta)

        run()
        plan = attention.plan_for(meta)
        _synchronize(device)
        replay, output = capturer.capture(run)
        graphs[size] = _Graph(replay=replay, output=output, meta=meta, plan=plan)
    _synchronize(device)
    return DecodeGraphs(graphs, buffers, block_size)


def check_decode_graphs(graphs: DecodeGraphs, model, attention, *, num_blocks: int, vocab_size: int,
                        max_model_len: int, dtype: torch.dtype, seed: int = 0) -> float:
    """Replays every graph on a random full batch and runs the same batch eagerly; returns the largest
    error relative to max |hidden|, or raises ValueError past ``CHECK_TOLERANCE``.

    Writes K/V into random blocks: call it before any sequence owns one.
    """
    generator = torch.Generator().manual_seed(seed)
    worst = 0.0
    for size in graphs.sizes:
        batch = random_decode_batch(size, graphs.block_size, num_blocks, vocab_size, max_model_len, generator)
        replayed = graphs.forward(batch).clone()
        graph = graphs.graphs[size]
        eager = model(graphs.buffers.input_ids[:size], graphs.buffers.positions[:size], attention, graph.meta)
        scale = eager.abs().max().float().clamp_min(1e-6)
        error = ((replayed.float() - eager.float()).abs().max() / scale).item()
        if not error <= CHECK_TOLERANCE[dtype]:  # also catches NaN
            raise ValueError(f"the decode graph of batch size {size} differs from the eager forward pass: "
                             f"max error {error:.3g} of max |hidden|")
        worst = max(worst, error)
    return worst


def random_decode_batch(size: int, block_size: int, num_blocks: int, vocab_size: int, max_model_len: int,
                        generator: torch.Generator) -> list[ScheduledSequence]:
    """Decodes of random tokens over random blocks (``size <= num_blocks``); the first at the full context.

    Each sequence's last block, where its new token's K/V goes, is its own: two writes to one slot would
    race, and the two passes being compared could then read different values.
    """
    contexts = torch.randint(1, min(max_model_len, CHECK_MAX_CONTEXT) + 1, (size,), generator=generator).tolist()
    contexts[0] = max_model_len  # every split of the plan busy
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
