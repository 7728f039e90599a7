"""Engine configuration: what the user chose, validated once. Values found at run time
(the number of KV blocks, the EOS ids, the resolved context length) live elsewhere."""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

from shared.pooling import RUNNERS
from shared.speculative_config import SpeculativeConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")
DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # a Hugging Face model directory; None: the built-in default model
    tokenizer: str | None = None  # defaults to the model directory
    runner: str = "auto"  # "generate" tokens, or "pooling": embeddings; "auto": as the directory looks (shared/pooling.py)
    dtype: str = "auto"  # "auto" takes the checkpoint's dtype
    seed: int = 0  # for requests without a seed of their own
    device: str = "auto"  # "auto": CUDA when available, else CPU
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    block_size: int = 16  # tokens per KV block
    max_num_seqs: int = 256  # sequences running at once
    max_num_batched_tokens: int | None = None  # None: 4096 with chunked prefill, else max_model_len
    enable_chunked_prefill: bool = True
    gpu_memory_utilization: float = 0.9  # fraction of device memory the worker may use (CUDA)
    kv_cache_memory_bytes: int | None = None  # explicit KV budget; default on CPU: 4 GiB
    num_gpu_blocks_override: int | None = None  # exact block count, for tests and experiments
    max_logprobs: int = 20  # most logprobs a request may ask for
    watermark: float = 0.01  # fraction of blocks new admissions leave free
    enable_prefix_caching: bool = True  # reuse the KV of full blocks whose prefix was computed before
    swap_space: float = 4.0  # GiB of host memory for swapped-out KV blocks (0: no swapping)
    preemption_mode: str | None = None  # "swap", "recompute", or None: chosen per victim
    attention_backend: str = "auto"  # "auto": Triton on CUDA, the C++ kernels on CPU (torch if they cannot build)
    enforce_eager: bool = False  # True: no CUDA graphs (a CUDA worker with the Triton backend replays decodes from them)
    # Speculative decoding (a dict or its JSON is parsed into a SpeculativeConfig); None: off.
    speculative_config: SpeculativeConfig | None = None
    tensor_parallel_size: int = 1  # workers holding one model between them (its heads and MLP columns split)
    # LoRA adapters (shared/lora.py): requests may name one; each step runs at most max_loras distinct ones,
    # each of rank at most max_lora_rank (the worker sets aside that much room for them).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        _require(self.runner in RUNNERS, "runner", f"must be one of {RUNNERS}, got {self.runner!r}")
        _require(self.dtype in DTYPES, "dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        _require(DEVICE_PATTERN.fullmatch(self.device) is not None, "device",
                 f"must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        _require(self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0, "block_size",
                 f"must be a power of two, got {self.block_size}")
        _require(self.max_num_seqs >= 1, "max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        _require(self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
                 "max_num_batched_tokens", f"must be >= 1, got {self.max_num_batched_tokens}")
        _require(self.max_model_len is None or self.max_model_len >= 2, "max_model_len",
                 f"must be >= 2, got {self.max_model_len}")
        _require(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization",
                 f"must be in (0, 1], got {self.gpu_memory_utilization}")
        _require(self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0, "kv_cache_memory_bytes",
                 f"must be > 0, got {self.kv_cache_memory_bytes}")
        _require(self.num_gpu_blocks_override is None or self.num_gpu_blocks_override >= 1,
                 "num_gpu_blocks_override", f"must be >= 1, got {self.num_gpu_blocks_override}")
        _require(0 <= self.watermark < 1, "watermark", f"must be in [0, 1), got {self.watermark}")
        _require(self.swap_space >= 0, "swap_space", f"must be >= 0 GiB, got {self.swap_space}")
        _require(self.preemption_mode in (None, "swap", "recompute"), "preemption_mode",
                 f"must be 'swap', 'recompute' or None, got {self.preemption_mode!r}")
        _require(0 <= self.max_logprobs, "max_logprobs", f"must be >= 0, got {self.max_logprobs}")
        _require(self.attention_backend in ATTENTION_BACKENDS, "attention_backend",
                 f"must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        _require(isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1,
                 "tensor_parallel_size", f"must be an integer >= 1, got {self.tensor_parallel_size!r}")
        _require(isinstance(self.max_loras, int) and 1 <= self.max_loras <= 64, "max_loras",
                 f"must be an integer in [1, 64], got {self.max_loras!r}")
        _require(isinstance(self.max_lora_rank, int) and 1 <= self.max_lora_rank <= 512, "max_lora_rank",
                 f"must be an integer in [1, 512], got {self.max_lora_rank!r}")

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**kwargs)

    def token_budget(self, max_model_len: int) -> int:
        """The per-step token budget, given the context length found at start-up."""
        return token_budget(self.max_num_batched_tokens, self.enable_chunked_prefill, max_model_len)


def token_budget(max_num_batched_tokens: int | None, enable_chunked_prefill: bool, max_model_len: int) -> int:
    """The tokens one step may compute: as asked, or 4096 (at least the context without chunked prefill)."""
    if max_num_batched_tokens is not None:
        if not enable_chunked_prefill and max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) is smaller than max_model_len "
                f"({max_model_len}) with chunked prefill disabled: long prompts could never be scheduled; "
                "raise it, lower max_model_len or enable chunked prefill")
        return max_num_batched_tokens
    return 4096 if enable_chunked_prefill else max(4096, max_model_len)


def _require(ok: bool, name: str, why: str) -> None:
    if not ok:
        raise ValueError(f"{name} {why}")
