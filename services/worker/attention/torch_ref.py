"""Paged attention in plain PyTorch: the readable reference and the CPU backend.

``paged_attention_reference`` is the oracle: one sequence at a time, float32
softmax, an explicit causal mask. ``TorchAttentionBackend`` computes the same
thing faster on CPU and is checked against it (tests/worker/test_torch_attention.py;
benchmarks/cpu_attention.py measures it against the previous version).

Cache layout, per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]``
for K and the same for V; token ``t`` of a sequence lives in block
``block_table[t // block_size]`` at offset ``t % block_size``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.attention.kv_quant import KVScales, is_fp8, quantize_kv
from services.worker.attention.metadata import AttentionMetadata
from services.worker.attention.sdpa import attend
from services.worker.attention.spec import AttentionSpec


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store new K/V ``[num_tokens, num_kv_heads, head_dim]`` into their slots."""
    num_blocks, block_size = k_cache.shape[:2]
    k_cache.view(num_blocks * block_size, *k_cache.shape[2:])[slot_mapping] = k
    v_cache.view(num_blocks * block_size, *v_cache.shape[2:])[slot_mapping] = v


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """One sequence's first ``context_len`` cached tokens, ``[context_len, heads, dim]``."""
    block_size = cache.shape[1]
    num_blocks = -(-context_len // block_size)
    blocks = cache[block_table[:num_blocks].long()]
    return blocks.reshape(num_blocks * block_size, *cache.shape[2:])[:context_len]


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              meta: AttentionMetadata, scale: float, *, window: int | None = None,
                              softcap: float | None = None) -> torch.Tensor:
    """Attention of every new token over its sequence's cached context; ``q`` is ``[T, H, D]``.

    ``window``: each query sees only the last ``window`` positions up to its own; ``softcap``: scores
    become ``softcap * tanh(score / softcap)`` (spec.py)."""
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    starts = meta.query_start_loc.tolist()
    for i, (query_len, context_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        start = starts[i]
        query = q[start:start + query_len].float()
        keys = gather_context(k_cache, meta.block_tables[i], context_len).float()
        values = gather_context(v_cache, meta.block_tables[i], context_len).float()
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", query, keys) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        # New token t sits at position context_len - query_len + t and sees keys up to it (or its key limit).
        query_pos = torch.arange(context_len - query_len, context_len, device=q.device).unsqueeze(1)
        key_pos = torch.arange(context_len, device=q.device).unsqueeze(0)
        last = query_pos if meta.key_limits is None else meta.key_limits[start:start + query_len].long().unsqueeze(1)
        hidden = key_pos > last
        if window is not None:
            hidden |= key_pos <= query_pos - window
        scores = scores.masked_fill(hidden, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:start + query_len] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
    return out


# Decode sequences are attended in chunks whose gathered K and V together stay about this size, so
# they are still in the last-level cache when SDPA reads them back (and the buffers are reused).
DECODE_CHUNK_BYTES = 8 << 20
# A sequence joins the current decode chunk unless padding it to the chunk's longest context would
# waste more than half of that length and more than this many tokens; then it starts a new chunk.
DECODE_PAD_SLACK = 64
# Gather buffers up to this many elements (each, K and V) are kept between calls; larger are not.
WORKSPACE_KEEP_ELEMENTS = 8 << 20
# Prefill causal masks up to this many elements are built once per step and shared by the layers.
MASK_KEEP_ELEMENTS = 4 << 20


@dataclass
class _DecodeChunk:
    """Sequences with one new token each, attended together over spans of blocks padded to ``length``."""
    rows: torch.Tensor  # [n] int64: their rows in q / out
    blocks: torch.Tensor  # [n * length / block_size] int64: block table rows, padded with the sequence's last block
    length: int  # padded span length, a multiple of block_size
    mask: torch.Tensor | None  # [n, 1, 1, length]: 0 where a key is seen, -inf elsewhere; None if all are


@dataclass
class _Prefill:
    """A sequence with several new tokens: rows [start, start + query_len) of q."""
    start: int
    query_len: int
    context_len: int
    blocks: torch.Tensor | None  # int64 block ids covering the keys seen; None: attend over the new k/v only
    first_key: int  # the position of the first key attended (the first gathered block's first slot)
    causal: bool  # the plain causal mask is exact (new k/v only, no window cut): SDPA's is_causal
    mask: torch.Tensor | None  # additive [query_len, keys]; None when causal, or too large to keep (built per call)
    key_limits: torch.Tensor | None = None  # [query_len]: the last key each sees, where some see past themselves


@dataclass
class _StepPlan:
    """Everything about one step's batch that every layer (of one window) would otherwise recompute."""
    decode: list  # the backend's decode work (here _DecodeChunk), from _plan_decodes
    prefill: list[_Prefill]


def _causal_mask(query_len: int, context_len: int, num_keys: int, dtype: torch.dtype, device: torch.device,
                 first_key: int = 0, window: int | None = None, key_limits: torch.Tensor | None = None) -> torch.Tensor:
    """Additive mask: new token t (at context_len - query_len + t) sees keys up to its own position, or up to
    ``key_limits[t]`` (and, with a window, none ``window`` or more before its position); column j is the key at
    ``first_key + j``."""
    query_pos = torch.arange(context_len - query_len, context_len, device=device).unsqueeze(1)
    key_pos = torch.arange(first_key, first_key + num_keys, device=device).unsqueeze(0)
    hidden = key_pos > (query_pos if key_limits is None else key_limits.long().unsqueeze(1))
    if window is not None:
        hidden |= key_pos <= query_pos - window
    return torch.zeros(query_len, num_keys, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))


def _own_key_limits(meta: AttentionMetadata, start: int, query_len: int, first_query: int) -> torch.Tensor | None:
    """The key limits of one sequence's new tokens, when some see past their own position; None: causal."""
    if meta.key_limits is None:
        return None
    limits = meta.key_limits[start:start + query_len]
    own = torch.arange(first_query, first_query + query_len, device=limits.device)
    return limits if bool((limits != own).any()) else None


def _first_key(context_len: int, window: int | None) -> int:
    """The first key the token at ``context_len - 1`` sees."""
    return 0 if window is None else max(0, context_len - window)


def _span(context_len: int, window: int | None, block_size: int) -> int:
    """A decode's tokens from the first block it gathers: up to block_size - 1 more than the keys it sees."""
    return context_len - _first_key(context_len, window) // block_size * block_size


class TorchAttentionBackend:
    """Writes new K/V into the paged pool and attends over it, with PyTorch ops.

    Faster than the reference because it (1) gathers whole blocks with ``index_select`` into reused
    buffers, one chunk of similar-length decode sequences at a time, so padding stays small and the
    gathered K/V are read back from cache; (2) hands SDPA the gathered blocks as strided views, with the
    query heads that share a KV head folded into one [group, head_dim] query, so each K/V head is read
    once; (3) attends a first prefill chunk straight over its new k/v with ``is_causal``; (4) computes
    the per-step bookkeeping (sorting, chunking, block indices, masks) once per step and window, not per
    layer; (5) with a sliding window, gathers only the blocks the window reaches.
    Padding only ever reads the sequence's own blocks, whose unused slots hold finite stale values that
    the -inf mask turns into exact zeros.
    """

    name = "torch"
    supports_cuda_graphs = False  # plans each step from the host copies of the lengths

    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], spec: AttentionSpec,
                 kv_scales: KVScales | None = None):
        self.kv_caches = kv_caches  # per layer: (K pool, V pool)
        self.spec = spec
        # An FP8 cache's scales (kv_quant.py); pools in the model's dtype have none.
        self.kv_scales = kv_scales or KVScales.ones(len(kv_caches))
        self._plans_for: tuple | None = None  # (metadata, dtype, pool shape) the plans below were made for
        self._plans: dict[int | None, _StepPlan] = {}  # by window
        self._workspace: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        k_cache, v_cache = self.kv_caches[layer]
        scales = self.kv_scales.of_step(layer, k, v)
        if is_fp8(k_cache):  # the codes go in the cache, and the prefill attends over them as the decodes will
            k, v = quantize_kv(k, scales[0], k_cache.dtype), quantize_kv(v, scales[1], v_cache.dtype)
        self._write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        window = self.spec.window(layer)
        plan = self._step_plan(meta, q.dtype, k_cache, window)
        out = torch.empty_like(q)
        if plan.decode:
            self._decode(q, k_cache, v_cache, plan.decode, out, scales)
        if plan.prefill:
            self._prefill(q, k, v, k_cache, v_cache, plan.prefill, out, window, scales)
        return out

    def _write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
        write_kv(k_cache, v_cache, k, v, slot_mapping)

    # ---- per-step plan, shared by all layers of one window ----------------------------------------

    def _step_plan(self, meta: AttentionMetadata, dtype: torch.dtype, k_cache: torch.Tensor,
                   window: int | None) -> _StepPlan:
        key = (meta, dtype, tuple(k_cache.shape[1:]))
        if self._plans_for is None or self._plans_for[0] is not meta or self._plans_for[1:] != key[1:]:
            self._plans_for, self._plans = key, {}  # held here, so the `is` test cannot match a recycled id
        plan = self._plans.get(window)
        if plan is None:
            plan = self._plans[window] = self._make_plan(meta, dtype, k_cache, window)
        return plan

    def _make_plan(self, meta: AttentionMetadata, dtype: torch.dtype, k_cache: torch.Tensor,
                   window: int | None) -> _StepPlan:
        block_size = k_cache.shape[1]
        tables = meta.block_tables.long()
        seq_lens, query_lens = meta.seq_lens_cpu, meta.query_lens_cpu
        # When every sequence has exactly one new token, sequence i's token is row i of q.
        one_each = meta.is_decode_only and meta.num_tokens == meta.num_seqs
        starts = None if one_each else meta.query_start_loc.tolist()

        # Decodes, the longest span of gathered blocks first (rows: where each one's token sits in q).
        decodes = [i for i, n in enumerate(query_lens) if n == 1]
        order = sorted(decodes, key=lambda i: -_span(seq_lens[i], window, block_size))
        rows = order if one_each else [starts[i] for i in order]
        decode = self._plan_decodes(meta, tables, order, rows, dtype, k_cache, window) if order else []

        prefill = []
        for i, (query_len, context_len) in enumerate(zip(query_lens, seq_lens)):
            if query_len <= 1:
                continue
            first_query = context_len - query_len
            first_visible = _first_key(first_query + 1, window)  # what the chunk's first token sees
            limits = _own_key_limits(meta, starts[i], query_len, first_query)
            if context_len == query_len and (window is None or query_len <= window) and limits is None:
                prefill.append(_Prefill(starts[i], query_len, context_len, blocks=None, first_key=0, causal=True,
                                        mask=None))
                continue
            if context_len == query_len:  # no cached prefix, but the window cuts: the new k/v, masked
                first_block, blocks, num_keys = 0, None, query_len
            else:
                first_block = first_visible // block_size
                num_blocks = -(-context_len // block_size)
                blocks, num_keys = tables[i, first_block:num_blocks], (num_blocks - first_block) * block_size
            first_key = first_block * block_size
            mask = None
            if query_len * num_keys <= MASK_KEEP_ELEMENTS:
                mask = _causal_mask(query_len, context_len, num_keys, dtype, k_cache.device, first_key, window,
                                    limits)
            prefill.append(_Prefill(starts[i], query_len, context_len, blocks=blocks, first_key=first_key, causal=False,
                                    mask=mask, key_limits=limits))
        return _StepPlan(decode, prefill)

    def _plan_decodes(self, meta: AttentionMetadata, tables: torch.Tensor, order: list[int], rows: list[int],
                      dtype: torch.dtype, k_cache: torch.Tensor, window: int | None) -> list[_DecodeChunk]:
        """Cut the decodes (sequence indices ``order``, longest span first; ``tables``: the block tables
        as int64) into chunks of similar length. Each sequence's span runs from the block holding the
        first key it sees to its last block."""
        block_size, num_kv_heads, head_dim = k_cache.shape[1:]
        seq_lens, device = meta.seq_lens_cpu, k_cache.device
        first_key = [_first_key(seq_lens[i], window) for i in order]
        first_block = [f // block_size for f in first_key]
        spans = [_span(seq_lens[i], window, block_size) for i in order]
        token_bytes = 2 * num_kv_heads * head_dim * torch.empty((), dtype=k_cache.dtype).element_size()
        budget = max(block_size, DECODE_CHUNK_BYTES // token_bytes)
        chunks = []
        first = 0
        while first < len(order):
            num_blocks = -(-spans[first] // block_size)
            length = num_blocks * block_size
            end = first + 1
            while (end < len(order) and (end - first + 1) * length <= budget
                   and (length - spans[end] <= max(length // 2, DECODE_PAD_SLACK))):
                end += 1
            seqs = torch.tensor(order[first:end], device=device)
            lens = torch.tensor(spans[first:end], device=device)
            starts = torch.tensor(first_block[first:end], device=device)
            last_block = starts + (lens + block_size - 1) // block_size - 1
            columns = torch.minimum(starts.unsqueeze(1) + torch.arange(num_blocks, device=device).unsqueeze(0),
                                    last_block.unsqueeze(1))
            blocks = tables[seqs].gather(1, columns).flatten()
            skipped = [key - block * block_size for key, block in zip(first_key[first:end], first_block[first:end])]
            mask = None
            if any(n != length for n in spans[first:end]) or any(skipped):
                position = torch.arange(length, device=device).unsqueeze(0)
                hidden = (position >= lens.unsqueeze(1)) | (position < torch.tensor(skipped, device=device).unsqueeze(1))
                mask = torch.zeros(end - first, 1, 1, length, dtype=dtype, device=device).masked_fill_(
                    hidden.view(end - first, 1, 1, length), float("-inf"))
            chunks.append(_DecodeChunk(torch.tensor(rows[first:end], device=device), blocks, length, mask))
            first = end
        return chunks

    # ---- gathering ----------------------------------------------------------------------------

    def _gather(self, cache: torch.Tensor, blocks: torch.Tensor, slot: int) -> torch.Tensor:
        """Whole blocks ``[len(blocks), block_size, heads, dim]``, copied into a reused buffer."""
        flat = cache.view(cache.shape[0], -1)
        size = blocks.numel() * flat.shape[1]
        buffer = self._workspace.get((slot, cache.dtype))
        if buffer is None or buffer.numel() < size:
            buffer = torch.empty(size, dtype=cache.dtype, device=cache.device)
            if size <= WORKSPACE_KEEP_ELEMENTS:
                self._workspace[(slot, cache.dtype)] = buffer
        gathered = torch.index_select(flat, 0, blocks, out=buffer[:size].view(blocks.numel(), flat.shape[1]))
        return gathered.view(blocks.numel(), *cache.shape[1:])

    # ---- attention ----------------------------------------------------------------------------

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                chunks: list[_DecodeChunk], out: torch.Tensor, scales: tuple[float, float]) -> None:
        """One query per sequence. The ``group`` query heads of a KV head become one [group, dim] query."""
        num_heads, (num_kv_heads, head_dim) = q.shape[1], k_cache.shape[2:]
        group = num_heads // num_kv_heads
        for chunk in chunks:
            n = chunk.rows.numel()
            keys = self._gather(k_cache, chunk.blocks, 0).view(n, chunk.length, num_kv_heads, head_dim)
            values = self._gather(v_cache, chunk.blocks, 1).view(n, chunk.length, num_kv_heads, head_dim)
            query = q.index_select(0, chunk.rows).view(n, num_kv_heads, group, head_dim)
            attended = self._attend_codes(query, keys.transpose(1, 2), values.transpose(1, 2), scales,
                                          mask=chunk.mask)
            out.index_copy_(0, chunk.rows, attended.reshape(n, num_heads, head_dim))

    def _attend_codes(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      scales: tuple[float, float], **options) -> torch.Tensor:
        """attend() over K/V as the cache holds them: an FP8 cache's codes are upcast (exactly) to the query's
        dtype, K's scale folded into the softmax scale and V's into the output."""
        if not is_fp8(keys):
            return attend(query, keys, values, scale=self.spec.scale, softcap=self.spec.logit_softcap, **options)
        attended = attend(query, keys.to(query.dtype), values.to(query.dtype), scale=self.spec.scale * scales[0],
                          softcap=self.spec.logit_softcap, **options)
        return attended * scales[1]

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, prefills: list[_Prefill], out: torch.Tensor, window: int | None,
                 scales: tuple[float, float]) -> None:
        """Several new tokens: attend causally over the cached prefix (if any) and themselves."""
        # 4-D [1, heads, tokens, dim] views: with 3-D inputs SDPA falls back to its slow math path on CPU.
        enable_gqa = q.shape[1] != k_cache.shape[2]
        for p in prefills:
            end = p.start + p.query_len
            query = q[p.start:end].transpose(0, 1).unsqueeze(0)
            if p.blocks is None:  # the context is exactly the new tokens: no gather
                keys = k[p.start:end].to(k_cache.dtype).transpose(0, 1).unsqueeze(0)
                values = v[p.start:end].to(v_cache.dtype).transpose(0, 1).unsqueeze(0)
            else:
                keys = self._gather(k_cache, p.blocks, 0).flatten(0, 1).transpose(0, 1).unsqueeze(0)
                values = self._gather(v_cache, p.blocks, 1).flatten(0, 1).transpose(0, 1).unsqueeze(0)
            mask = p.mask
            if mask is None and not p.causal:
                mask = _causal_mask(p.query_len, p.context_len, keys.shape[2], q.dtype, q.device, p.first_key, window,
                                    p.key_limits)
            attended = self._attend_codes(query, keys, values, scales, mask=mask, is_causal=p.causal,
                                          enable_gqa=enable_gqa)
            out[p.start:end] = attended[0].transpose(0, 1)
