"""A CUDA worker's last start-up steps, once its model, KV cache, attention, sampler and proposer
exist: compile the kernels' variants, run the largest step (measuring its memory), then capture the
decode graphs (checked against the eager pass). What each took is kept for the start-up report."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import structlog
import torch

from services.worker.attention.kv_quant import MeasuredKVScales
from services.worker.draft_model_proposer import DraftModelProposer
from services.worker.kv_cache import activation_bytes_estimate
from services.worker.sampler import Sampler
from services.worker.tensor_parallel import TensorParallel
from services.worker.worker_startup import KVCache, ModelSource, Weights
from shared.config import EngineConfig

if TYPE_CHECKING:
    from services.worker.cuda_graphs import DecodeGraphs

log = structlog.get_logger(__name__)


@dataclass
class CudaStartup:
    seconds: dict[str, float] = field(default_factory=dict)  # what the worker did before serving, and how long
    memory: dict[str, int] = field(default_factory=dict)  # the largest step's measured peak beside its set-aside
    decode_graphs: DecodeGraphs | None = None  # None: decode steps run eagerly


@dataclass(frozen=True)
class BuiltWorker:
    """Everything a step runs through, as the earlier start-up steps built it."""
    config: EngineConfig
    source: ModelSource
    weights: Weights
    kv: KVCache
    attention: object
    sampler: Sampler | None  # None for a pooling model: it samples nothing
    proposer: object | None
    tp: TensorParallel
    device: torch.device


def start_up_cuda(built: BuiltWorker) -> CudaStartup:
    """Warm-up, the largest step and the decode graphs, in that order (graphs are captured with the
    allocator's memory for the largest step already cached); nothing on another device."""
    startup = CudaStartup()
    if built.device.type != "cuda":
        return startup
    token_budget = built.config.token_budget(built.source.max_model_len)
    _warm_up_kernels(built, token_budget, startup)
    _run_largest_step(built, token_budget, startup)
    if isinstance(built.kv.scales, MeasuredKVScales):
        built.kv.scales.forget()  # measured over made-up inputs: the first real batch measures again
    if _wants_cuda_graphs(built):
        startup.decode_graphs = _capture_decode_graphs(built, startup)
    return startup


def _warm_up_kernels(built: BuiltWorker, token_budget: int, startup: CudaStartup) -> None:
    from services.worker.kernel_warmup import warm_up_kernels

    block_size, max_model_len = built.config.block_size, built.source.max_model_len
    started = time.perf_counter()
    passes = warm_up_kernels(built.weights.model, built.attention, built.kv.kv_pool, block_size, max_model_len,
                             token_budget, built.device)
    if isinstance(built.proposer, DraftModelProposer):  # the draft's shapes bring variants of their own
        draft = built.proposer
        passes += warm_up_kernels(draft.draft.model, draft.attention, draft.kv_pool, block_size, max_model_len,
                                  token_budget, built.device)
    torch.cuda.synchronize(built.device)
    startup.seconds["kernel_warm_up"] = time.perf_counter() - started
    log.info("triton_kernels_warmed_up", forward_passes=passes, seconds=round(startup.seconds["kernel_warm_up"], 2))


def _run_largest_step(built: BuiltWorker, token_budget: int, startup: CudaStartup) -> None:
    from services.worker.largest_step import run_largest_step

    config = built.config
    peak = run_largest_step(built.weights.model, built.attention, built.sampler,
                            block_size=config.block_size, num_blocks=built.kv.num_blocks,
                            max_model_len=built.source.max_model_len, token_budget=token_budget,
                            max_num_seqs=config.max_num_seqs, max_logprobs=config.max_logprobs, device=built.device)
    set_aside = activation_bytes_estimate(built.weights.model_config, config, token_budget)
    startup.memory = {"largest_step_peak_bytes": peak, "set_aside_bytes": set_aside}
    fields = dict(peak_gib=round(peak / 2**30, 3), set_aside_gib=round(set_aside / 2**30, 3), tokens=token_budget)
    if peak > set_aside and config.num_gpu_blocks_override is None and config.kv_cache_memory_bytes is None:
        # It ran, with what is free now; less free later (another process) and a step fails.
        log.warning("largest_step_exceeds_set_aside", hint="lower gpu_memory_utilization", **fields)
    else:
        log.info("largest_step_measured", **fields)


def _wants_cuda_graphs(built: BuiltWorker) -> bool:
    # A pooling model never decodes: nothing to replay. transformers' modelling code (--model-impl
    # transformers) is not known to be capturable: it runs eagerly.
    return (not built.config.enforce_eager and built.source.pooler is None and built.source.impl == "native"
            and getattr(built.attention, "supports_cuda_graphs", False))


def _capture_decode_graphs(built: BuiltWorker, startup: CudaStartup) -> DecodeGraphs | None:
    """Decode graphs, checked against the eager pass; None (serve eagerly) when either fails, on any rank.

    Tensor-parallel ranks capture and check the same graphs over the same random batches, all-reducing as
    they go; then they agree, so that all replay or none does. (A failure partway is the same on every
    rank, as their shapes and code are: they reach the vote together.)"""
    from services.worker.cuda_graphs import CudaGraphCapturer, capture_decode_graphs, check_decode_graphs

    config, model, num_blocks = built.config, built.weights.model, built.kv.num_blocks
    adapters = built.weights.adapters
    started = time.perf_counter()
    graphs = None
    try:
        with torch.inference_mode():
            # A decode batch has a block of its own per sequence: no more sequences than blocks.
            graphs = capture_decode_graphs(model, built.attention, block_size=config.block_size,
                                           max_model_len=built.source.max_model_len,
                                           max_num_seqs=min(config.max_num_seqs, num_blocks),
                                           device=built.device, capturer=CudaGraphCapturer(),
                                           lora=None if adapters is None else adapters.batch)
            error = check_decode_graphs(graphs, model, built.attention, num_blocks=num_blocks,
                                        vocab_size=built.weights.model_config.vocab_size, dtype=built.source.dtype,
                                        device=built.device)
    except Exception as exc:  # a graph that cannot be trusted makes a slower worker, not a dead one
        log.warning("cuda_graphs_disabled", reason=repr(exc), fallback="eager", exc_info=True)
        torch.cuda.synchronize(built.device)  # but a broken CUDA context (a fault in a replay) is fatal: this raises
        graphs = None
    if not built.tp.all_agree(graphs is not None, built.device):
        if graphs is not None:
            log.warning("cuda_graphs_disabled", reason="another tensor-parallel rank could not capture them",
                        fallback="eager")
        return None
    startup.seconds["cuda_graphs"] = time.perf_counter() - started
    log.info("cuda_graphs_captured", batch_sizes=graphs.sizes, context_classes=graphs.contexts,
             max_row_error=round(error, 6), seconds=round(startup.seconds["cuda_graphs"], 2))
    return graphs
