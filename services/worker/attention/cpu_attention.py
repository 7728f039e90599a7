"""The CPU backend: decodes in the C++ kernel that reads K/V blocks in place, prompts in a C++ prefill kernel,
the rest as the torch backend.

Decode attention is memory-bound: the torch backend gathers each sequence's blocks into a buffer
and SDPA reads them back, so every K/V byte crosses the memory bus three times; the kernel in
csrc/cpu_attention.cpp reads it once (benchmarks/cpu_attention.py compares them). Prefill is
compute-bound: csrc/prefill_attention.cpp lays it out as small matrix multiplies (AVX-512 or AVX2), which
torch's fused SDPA kernel runs at a third of the speed on a few hundred tokens, except bfloat16 on a CPU with
AMX, whose tiles SDPA uses. What it does not take (that case, sliding windows, soft caps, images' two-way
spans, FP8 codes, other head sizes) keeps SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.attention.cpu_kernels import (
    cpu_kernels_unavailable_reason, has_prefill_attention, paged_decode_attention, prefill_attention, write_kv)
from services.worker.attention.kv_quant import KVScales
from services.worker.attention.metadata import AttentionMetadata
from services.worker.attention.spec import AttentionSpec
from services.worker.attention.torch_ref import TorchAttentionBackend, _Prefill
from services.worker.cpu_tuning import has_amx

PREFILL_HEAD_SIZES = (64, 128, 256)  # what the prefill kernel is compiled for


def sdpa_multiplies_on_amx() -> bool:
    """Whether this CPU has AMX, whose tiles torch's fused SDPA kernel multiplies bfloat16 on: there SDPA runs
    bfloat16 prefills faster than the C++ kernel's vector loops (measured on a Xeon with AMX, 2 threads,
    benchmarks/cpu_attention.py: prefill_mix 8.2 against 9.9 ms, first_chunks 3.6 against 5.6)."""
    return has_amx()


@dataclass
class _Decodes:
    """Every decode of the step, for one kernel call per layer."""
    rows: torch.Tensor  # [n] int64: each decode's row in q / out, the most keys seen first
    seqs: torch.Tensor  # [n] int64: its sequence index in the metadata's block_tables / seq_lens
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32 (the metadata's)
    seq_lens: torch.Tensor  # [num_seqs] int32 (the metadata's)
    window: int | None  # the layers' sliding window (None: whole contexts)


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], spec: AttentionSpec,
                 kv_scales: KVScales | None = None):
        reason = cpu_kernels_unavailable_reason()
        if reason is not None:
            raise ValueError(f"attention_backend='cpu' cannot run here: {reason}; use 'torch' or 'auto'")
        super().__init__(kv_caches, spec, kv_scales)
        self._prefill_kernel = has_prefill_attention() and spec.logit_softcap is None
        # (bfloat16 prefills run faster in SDPA where it multiplies on AMX)
        self._prefill_dtypes = (torch.float32,) if sdpa_multiplies_on_amx() else (torch.float32, torch.bfloat16)
        self._one_block = torch.zeros(1, dtype=torch.int32)  # a first chunk's new K/V, read as one block

    def _write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
        """One copy a token in C++ (index_put took ~50 us a layer call on the bench model), where each token's heads
        lie together, as the model's projections hand them over."""
        if all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (k, v)) and slot_mapping.dtype == torch.int64:
            write_kv(k_cache, v_cache, k, v, slot_mapping.contiguous())
        else:
            super()._write_kv(k_cache, v_cache, k, v, slot_mapping)

    def _plan_decodes(self, meta: AttentionMetadata, tables: torch.Tensor, order: list[int], rows: list[int],
                      dtype: torch.dtype, k_cache: torch.Tensor, window: int | None) -> list[_Decodes]:
        return [_Decodes(torch.tensor(rows, dtype=torch.int64), torch.tensor(order, dtype=torch.int64),
                         meta.block_tables.contiguous(), meta.seq_lens.contiguous(), window)]

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                decodes: list[_Decodes], out: torch.Tensor, scales: tuple[float, float]) -> None:
        for d in decodes:
            paged_decode_attention(out, q, k_cache, v_cache, d.block_tables, d.seq_lens, d.rows, d.seqs,
                                   self.spec.scale * scales[0], window=d.window, softcap=self.spec.logit_softcap,
                                   v_scale=scales[1])

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, prefills: list[_Prefill], out: torch.Tensor, window: int | None,
                 scales: tuple[float, float]) -> None:
        """Causal prefills in the C++ kernel where it applies, the others as the torch backend runs them."""
        if not self._kernel_prefills(q, k_cache, window):
            super()._prefill(q, k, v, k_cache, v_cache, prefills, out, window, scales)
            return
        rest = [p for p in prefills if p.key_limits is not None]  # (images that attend both ways)
        for p in prefills:
            if p.key_limits is not None:
                continue
            end = p.start + p.query_len
            if p.blocks is None:  # the context is the new tokens: their K/V rows as the one block
                keys, values = k[p.start:end].unsqueeze(0), v[p.start:end].unsqueeze(0)
                if keys.stride() != values.stride():
                    keys, values = keys.contiguous(), values.contiguous()
                table = self._one_block
            else:
                keys, values, table = k_cache, v_cache, p.blocks.to(torch.int32)
            prefill_attention(out[p.start:end], q[p.start:end], keys, values, table, p.context_len, self.spec.scale)
        if rest:
            super()._prefill(q, k, v, k_cache, v_cache, rest, out, window, scales)

    def _kernel_prefills(self, q: torch.Tensor, k_cache: torch.Tensor, window: int | None) -> bool:
        return (self._prefill_kernel and window is None and q.dtype in self._prefill_dtypes
                and k_cache.dtype == q.dtype and q.shape[-1] in PREFILL_HEAD_SIZES)
