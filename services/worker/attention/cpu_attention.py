"""The CPU backend: decodes in the C++ kernel that reads K/V blocks in place, the rest as the torch backend.

Decode attention is memory-bound: the torch backend gathers each sequence's blocks into a buffer
and SDPA reads them back, so every K/V byte crosses the memory bus three times; the kernel in
csrc/cpu_attention.cpp reads it once (benchmarks/cpu_attention.py compares them). Prefill chunks
are compute-bound and keep the torch backend's SDPA path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.attention.cpu_kernels import cpu_kernels_unavailable_reason, paged_decode_attention
from services.worker.attention.kv_quant import KVScales
from services.worker.attention.metadata import AttentionMetadata
from services.worker.attention.spec import AttentionSpec
from services.worker.attention.torch_ref import TorchAttentionBackend


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
