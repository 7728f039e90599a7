"""A worker's start-up, one step per function. Each step takes what the earlier ones built, so their
order is the code's: Worker.__init__ runs them in turn.

1. read_model: the model directory, its configuration, a pooler for a pooling model, the dtype and
   the context length; what cannot run is refused here, before anything is built or joined.
2. place_on_device: the device, CUDA made current; on a CPU the allocator is tuned and the C++
   kernels are built, before any large allocation or step.
3. join_tensor_parallel: a model the ranks cannot share is refused before they meet.
4. load_weights: this rank's share of the model, LoRA adapter slots and a draft model: everything
   that takes device memory before the KV cache is sized.
5. allocate_kv_cache: as many blocks as the memory left holds, on the device and in host memory.
6. build_attention: the attention backend over those pools.
7. make_proposer: speculative decoding's drafts (it sizes its own pools by the KV cache's).
Then a CUDA worker warms up (cuda_startup.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from services.worker.attention.cpu_kernels import cpu_kernels_unavailable_reason
from services.worker.attention.kv_quant import KVScales, MeasuredKVScales, kv_cache_dtype
from services.worker.attention.selector import select_attention_backend
from services.worker.attention.spec import kv_window
from services.worker.block_moves import swap_blocks, whole_pool
from services.worker.cpu_tuning import keep_large_allocations_in_heap, runs_emulated
from services.worker.draft_model_proposer import DraftModel, DraftModelProposer, load_draft_model
from services.worker.kv_cache import allocate_host_pool, allocate_kv_pools, bytes_per_block, num_host_blocks, num_kv_blocks
from services.worker.lora_adapters import AdapterSlots
from services.worker.model_config import ModelConfig
from services.worker.model_factory import default_model_dir
from services.worker.model_impl import chosen_impl, model_config_for, refuse_on_transformers_path
from services.worker.model_loader import checkpoint_files, load_model
from services.worker.multimodal_config import image_token_id_of
from services.worker.models.transformers_model import load_transformers_model
from services.worker.ngram_proposer import NgramProposer
from services.worker.pooler import Pooler
from services.worker.swap_staging import SwapStaging
from services.worker.tensor_parallel import TensorParallel, join_group
from shared.config import EngineConfig
from shared.hub import local_model_and_tokenizer
from shared.pooling import read_pooler_config, resolve_runner

log = structlog.get_logger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BlockSwap = Callable[[torch.Tensor, torch.Tensor, list[tuple[int, int]]], None]  # (from pool, to pool, pairs)


@dataclass(frozen=True)
class ModelSource:
    """What the model directory and the configuration say, before any weight is loaded."""
    model_dir: Path
    model_config: ModelConfig  # the whole model's
    pooler: Pooler | None  # a pooling model's (embeddings or class scores instead of tokens)
    dtype: torch.dtype
    max_model_len: int
    impl: str = "native"  # or "transformers": its own modelling code (model_impl.py)


@dataclass(frozen=True)
class Weights:
    """Everything that takes device memory before the KV cache is sized."""
    model: torch.nn.Module
    model_config: ModelConfig  # this rank's share (its heads, KV pools and MLP columns); one rank: the whole
    adapters: AdapterSlots | None
    draft: DraftModel | None  # speculative decoding's draft model, when that is the method
    vision: torch.nn.Module | None = None  # a vision-language model's image encoder (None: text only)
    image_token_id: int | None = None  # the placeholder its features replace in the prompt


@dataclass(frozen=True)
class KVCache:
    num_blocks: int
    kv_pools: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (K, V) views of kv_pool
    kv_pool: torch.Tensor  # every layer's blocks in one tensor
    num_host_blocks: int  # swap space and the offload tier
    host_pool: torch.Tensor
    scales: KVScales | MeasuredKVScales | None = None  # an FP8 cache's scales (kv_quant.py); None: model dtype
    num_offload_blocks: int = 0  # of num_host_blocks, the prefix cache's offload tier


def read_model(config: EngineConfig) -> ModelSource:
    # A Hub id is resolved here only when this worker was started alone (serve and LLM pass the snapshot).
    model_dir = Path(local_model_and_tokenizer(config.model, config.tokenizer, revision=config.revision,
                                               tokenizer_revision=config.tokenizer_revision,
                                               download_dir=config.download_dir)[0]) \
        if config.model else default_model_dir()
    impl = chosen_impl(config.model_impl, model_dir)
    model_config = model_config_for(impl, model_dir, config.trust_remote_code)  # a bad directory fails before any build
    # A pooling model returns embeddings (or a classifier's class scores) instead of tokens
    # (shared/pooling.py): no logits head, no sampling.
    pooling = resolve_runner(config.runner, model_dir) == "pooling"
    if impl == "transformers":
        refuse_on_transformers_path(config.tensor_parallel_size, pooling, config.quantization)
    pooler = Pooler(read_pooler_config(model_dir, model_config.hidden_size)) if pooling else None
    if pooling and config.speculative_config is not None:
        raise ValueError("speculative decoding is for generation: a pooling model (runner 'pooling') samples "
                         "no tokens to draft")
    dtype = DTYPES[model_config.dtype if config.dtype == "auto" else config.dtype]
    return ModelSource(model_dir, model_config, pooler, dtype, _max_model_len(config, model_dir, model_config, pooler),
                       impl)


def _max_model_len(config: EngineConfig, model_dir: Path, model: ModelConfig, pooler: Pooler | None) -> int:
    limit = model.max_position_embeddings
    if pooler is not None and pooler.config.max_seq_length is not None:
        limit = min(limit, pooler.config.max_seq_length)  # what sentence-transformers would truncate to
    wanted = config.max_model_len
    if wanted is not None and wanted > limit:
        raise ValueError(f"max_model_len={wanted} exceeds what the model at {model_dir} supports ({limit})")
    return wanted or limit


def resolve_device(name: str) -> torch.device:
    """The worker's device; a CUDA one always with its index, as its tensors report it."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise ValueError(f"device {name!r} was asked for, but CUDA is not available")
    if device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    if device.index >= torch.cuda.device_count():
        raise ValueError(f"device {name!r} was asked for, but there are {torch.cuda.device_count()} CUDA devices")
    return device


def place_on_device(name: str) -> torch.device:
    device = resolve_device(name)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # Triton launches and timing events use the current device's stream
    else:
        keep_large_allocations_in_heap()
        cpu_kernels_unavailable_reason()  # build (or load) the C++ kernels now, not inside the first step
    return device


def warn_if_emulated(dtype: torch.dtype, device: torch.device) -> bool:
    """Logs a warning where this CPU has no instructions for the model's dtype (a bfloat16 checkpoint with
    --dtype auto on a CPU before AVX512-BF16, say): it serves, several times slower than float32 would.
    Returns whether it warned."""
    if not runs_emulated(dtype, device):
        return False
    name = str(dtype).removeprefix("torch.")
    log.warning("dtype_emulated_on_this_cpu", dtype=name,
                hint=f"this CPU has no {name} matrix instructions (oneDNN's test): --dtype float32 runs several "
                     "times faster here")
    return True


def join_tensor_parallel(config: EngineConfig, source: ModelSource, rank: int, init_method: str | None,
                         device: torch.device) -> TensorParallel:
    """With config.tensor_parallel_size > 1, this rank meets the others at ``init_method`` (tcp://host:port)."""
    TensorParallel(rank, config.tensor_parallel_size).shard(source.model_config)  # raises if it cannot be shared
    return join_group(rank, config.tensor_parallel_size, init_method, device)


def load_weights(config: EngineConfig, source: ModelSource, tp: TensorParallel, device: torch.device) -> Weights:
    warn_if_emulated(source.dtype, device)
    pooler = source.pooler
    if source.impl == "transformers":
        model, model_config = load_transformers_model(source.model_dir, source.model_config, source.dtype, device,
                                                      config.trust_remote_code)
    else:
        model, model_config = load_model(source.model_dir, source.dtype, device, tp=tp, with_head=pooler is None,
                                         num_labels=len(pooler.config.labels) if pooler is not None else 0,
                                         max_model_len=source.max_model_len, quantization=config.quantization)
    adapters = AdapterSlots(model, config.max_loras, config.max_lora_rank, tp) if config.enable_lora else None
    spec = config.speculative_config
    draft = load_draft_model(spec.model, model_config, source.max_model_len, source.dtype, device) \
        if spec is not None and spec.method == "draft_model" else None
    vision, image_token_id = load_vision(source, device, getattr(model, "hf", None))
    return Weights(model, model_config, adapters, draft, vision, image_token_id)


def load_vision(source: ModelSource, device: torch.device, hf_model: torch.nn.Module | None = None
                ) -> tuple[torch.nn.Module | None, int | None]:
    """A vision-language checkpoint's image encoder and image token (multimodal_config.py); (None, None) for a text
    model. ``hf_model``: transformers' whole model (--model-impl transformers), whose vision modules the encoder
    takes rather than loading its own. With tensor parallelism every rank holds the whole encoder, as it holds the
    whole embedding table: each puts the same features in."""
    raw = json.loads((source.model_dir / "config.json").read_text())
    image_token_id = image_token_id_of(raw)
    if image_token_id is None:
        return None, None
    from services.worker.models.vision_encoders import load_vision_encoder, vision_encoder_of

    if hf_model is not None:
        return vision_encoder_of(raw, hf_model), image_token_id
    return load_vision_encoder(raw, checkpoint_files(source.model_dir), source.dtype, device), image_token_id


def allocate_kv_cache(config: EngineConfig, source: ModelSource, weights: Weights, device: torch.device) -> KVCache:
    """Sized by what the weights left (on a GPU, measured now); each block holds a draft model's K/V too
    (in the model's dtype, whatever --kv-cache-dtype says of the target's)."""
    model_config, dtype, draft = weights.model_config, source.dtype, weights.draft
    kv_dtype = kv_cache_dtype(config.kv_cache_dtype, dtype)
    draft_block_bytes = bytes_per_block(draft.config, config.block_size, dtype) if draft else 0
    scratch_bytes = draft_block_bytes * DraftModelProposer.num_scratch_blocks(
        config.speculative_config.num_speculative_tokens, config.block_size, config.max_num_seqs) if draft else 0
    num_blocks = num_kv_blocks(model_config, config, device, kv_dtype, config.token_budget(source.max_model_len),
                               source.max_model_len, draft_block_bytes, scratch_bytes)
    kv_pools = allocate_kv_pools(model_config, num_blocks, config.block_size, kv_dtype, device)
    swap_blocks, offload_blocks = num_host_blocks(model_config, config, kv_dtype, num_blocks, draft_block_bytes)
    host_blocks = swap_blocks + offload_blocks
    scales = _kv_scales(config, weights.model, model_config.num_hidden_layers, kv_dtype, device) \
        if kv_dtype != dtype else None
    return KVCache(num_blocks, kv_pools, whole_pool(kv_pools), host_blocks,
                   allocate_host_pool(model_config, host_blocks, config.block_size, kv_dtype), scales, offload_blocks)


def _kv_scales(config: EngineConfig, model: torch.nn.Module, num_layers: int, kv_dtype: torch.dtype,
               device: torch.device) -> KVScales | MeasuredKVScales:
    """Measured from the first batch (--calculate-kv-scales), else the checkpoint's (1.0 where none;
    transformers' models read none)."""
    if config.calculate_kv_scales:
        if device.type == "cuda" and not config.enforce_eager:
            # A CUDA graph would keep the warm-up's scales in its captured launches.
            raise ValueError("calculate_kv_scales on CUDA needs enforce_eager (no CUDA graphs)")
        return MeasuredKVScales(num_layers, kv_dtype)
    return model.kv_scales() if hasattr(model, "kv_scales") else KVScales.ones(num_layers)


def build_attention(config: EngineConfig, kv: KVCache, model: torch.nn.Module, device: torch.device):
    """The attention backend's class and its instance over the KV pools."""
    backend = select_attention_backend(config.attention_backend, device)
    attention = backend(kv.kv_pools, model.attention_spec(), kv_scales=kv.scales)
    if backend.name == "triton":
        model.use_fused_experts()
    return backend, attention


def make_proposer(config: EngineConfig, source: ModelSource, weights: Weights, kv: KVCache, attention_backend: type,
                  device: torch.device) -> NgramProposer | DraftModelProposer | None:
    """The proposer of drafts for the next step; None: no speculation."""
    spec = config.speculative_config
    if spec is None:
        return None
    if weights.draft is None:
        return NgramProposer(spec)
    return DraftModelProposer(weights.draft, spec.num_speculative_tokens, attention_backend, kv.num_blocks,
                              kv.num_host_blocks, config.block_size, config.max_num_seqs, source.max_model_len,
                              source.dtype, device)


def block_swaps(device: torch.device) -> tuple[BlockSwap, BlockSwap]:
    """(swap out, swap in). With a GPU they pass through a reused page-locked buffer; on a CPU both pools
    are host memory."""
    if device.type == "cuda":
        staging = SwapStaging(pin=True)
        return staging.swap_out, staging.swap_in
    return swap_blocks, swap_blocks


def worker_kv_window(weights: Weights, proposer) -> int | None:
    """The most keys any attention layer sees back, over the target and a draft model (which shares
    the block tables); None if a layer sees the whole context."""
    specs = [(weights.model.attention_spec(), weights.model_config.num_hidden_layers)]
    if isinstance(proposer, DraftModelProposer):
        draft = proposer.draft
        specs.append((draft.model.attention_spec(), draft.config.num_hidden_layers))
    return kv_window(*specs)
