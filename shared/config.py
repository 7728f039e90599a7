"""Engine configuration: what the user chose, validated once. Values found at run time
(the number of KV blocks, the EOS ids, the resolved context length) live elsewhere.

Each field is also an option (shared/options.py), with vLLM's name where it means the same thing: every
worker takes all of them (`pagedserve worker`, `pagedserve generate`, the engine group of `pagedserve
serve`), and the scheduler and the gateway those that say so in read_by."""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass, fields

from shared.generation_defaults import parse_override
from shared.invalid_parameter import require as _require
from shared.options import option
from shared.pooling import RUNNERS
from shared.speculative_config import SpeculativeConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")
PREEMPTION_MODES = ("swap", "recompute")
SCHEDULING_POLICIES = ("fcfs", "priority")  # vLLM's --scheduling-policy
MODEL_IMPLS = ("auto", "native", "transformers")
QUANTIZATION_METHODS = ("fp8", "compressed-tensors", "awq", "gptq")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")
# The scheduler's limits: it plans steps within them, and the worker sizes its memory for the largest step
# they allow (activations, the sampler's logprobs, CUDA graphs), so both must be given the same values.
LIMIT = ("scheduler",)


def speculative_config_text(raw: "str | SpeculativeConfig") -> str | None:
    """--speculative-config checked when the flags are read (a clear usage error), kept as JSON; empty: off
    (compose passes an unset variable as the empty string)."""
    if isinstance(raw, str) and not raw.strip():
        return None
    try:
        return SpeculativeConfig.parse(raw).to_json()
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def generation_override_text(raw: "str | dict | None") -> str | None:
    """--override-generation-config checked when the flags are read, kept as JSON; empty: none."""
    try:
        fields = parse_override(raw)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return json.dumps(fields) if fields else None


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = option(None, "a Hugging Face model: a local directory, or a Hub id (org/name) taken from "
                                     "the Hugging Face cache or downloaded into it (default: the built-in model, made "
                                     "on first use; its weights are random)")
    tokenizer: str | None = option(None, "tokenizer directory or Hub id (default: the model's)", read_by=("gateway",))
    revision: str | None = option(None, "the model's branch, tag or commit on the Hub (default: main)")
    tokenizer_revision: str | None = option(None, "the tokenizer's branch, tag or commit on the Hub (default: main)",
                                            read_by=("gateway",))
    download_dir: str | None = option(None, "where Hub models are cached (default: huggingface_hub's, $HF_HUB_CACHE "
                                            "or $HF_HOME/hub)", read_by=("gateway",))
    generation_config: str = option(
        "auto", "the model's sampling defaults: auto reads its generation_config.json (temperature, top_p, top_k, "
                "min_p, repetition_penalty; max_new_tokens caps max_tokens) for requests that do not set them; vllm "
                "ignores it; or a directory holding one", read_by=("gateway",))
    override_generation_config: str | None = option(
        None, 'JSON object of generation_config.json fields that replace the model\'s: \'{"temperature": 0.5}\'',
        parse=generation_override_text, render=generation_override_text, read_by=("gateway",))
    model_impl: str = option("auto", "native: this project's models; transformers: transformers' own modelling code "
                                     "over the paged KV cache (any causal LM whose attention goes through its "
                                     "attention interface); auto: native where there is one", choices=MODEL_IMPLS)
    trust_remote_code: bool = option(False, "run a checkpoint's own Python code (auto_map in its config.json) "
                                            "with --model-impl transformers")
    runner: str = option("auto", "generate tokens, or pool prompts into embeddings (/v1/embeddings); auto: pooling "
                                 "for a sentence-transformers directory or a bare *Model architecture",
                         choices=RUNNERS)
    dtype: str = option("auto", "weights' and activations' type; auto: the checkpoint's", choices=DTYPES)
    quantization: str | None = option(None, "how the weights are quantized (default: the checkpoint's "
                                            "quantization_config); fp8 also quantizes a float checkpoint as it "
                                            "loads", choices=QUANTIZATION_METHODS, short="-q")
    seed: int = option(0, "sampling seed of requests that bring none")
    device: str = option("auto", "auto (CUDA when available, else CPU), cpu, cuda or cuda:N")
    max_model_len: int | None = option(None, "longest context, prompt and output together (default: the model's "
                                             "max_position_embeddings)")
    block_size: int = option(16, "tokens per KV-cache block (a power of two)")
    max_num_seqs: int = option(256, "most sequences one step runs", read_by=LIMIT)
    max_num_batched_tokens: int | None = option(None, "most tokens one step computes (default: 4096; without "
                                                      "chunked prefill at least --max-model-len)", read_by=LIMIT)
    enable_chunked_prefill: bool = option(True, "split long prompts over several steps, beside running decodes",
                                          read_by=LIMIT)
    gpu_memory_utilization: float = option(0.9, "share of the GPU's memory the worker may use, KV cache included "
                                                "(CUDA)")
    kv_cache_memory_bytes: int | None = option(None, "bytes for the KV cache (default: on CPU 4 GiB; on CUDA what "
                                                     "--gpu-memory-utilization leaves)")
    num_gpu_blocks_override: int | None = option(None, "exact KV-cache block count, for tests and experiments "
                                                       "(default: from the memory budget)")
    max_logprobs: int = option(20, "most logprobs a request may ask for", read_by=LIMIT)
    encoder_cache_size: int | None = option(None, "rows of image features a vision-language model's worker keeps, "
                                                  "by image (default: a step's token budget, at least the "
                                                  "context); 0 keeps none: each step encodes the images it reads")
    watermark: float = option(0.01, "share of the KV blocks that admitting new requests leaves free", read_by=LIMIT)
    enable_prefix_caching: bool = option(True, "reuse the KV of full blocks whose prefix was computed before",
                                         read_by=LIMIT)
    kv_cache_dtype: str = option("auto", "the KV cache's type: auto (the model's), or FP8 (fp8 is fp8_e4m3): half "
                                         "a 16-bit cache's bytes per block, with per-layer scales from the "
                                         "checkpoint (else 1.0)", choices=KV_CACHE_DTYPES)
    calculate_kv_scales: bool = option(False, "with an FP8 KV cache: each layer's K and V scales measured from "
                                              "the first batch (on CUDA, with --enforce-eager), not the "
                                              "checkpoint's or 1.0")
    swap_space: float = option(4.0, "GiB of host memory for swapped-out KV")
    kv_offloading_size: float = option(0.0, "GiB of host memory for the prefix cache's offload tier: blocks the "
                                            "device cache evicts are kept there and copied back on a later hit, "
                                            "not recomputed (0: off; needs prefix caching)")
    preemption_mode: str | None = option(None, "how preempted sequences give back their blocks (default: chosen "
                                               "per victim)", choices=PREEMPTION_MODES, read_by=LIMIT)
    scheduling_policy: str = option("fcfs", "fcfs: first come, first served; priority: by each request's priority "
                                            "(lower first, vLLM's), then arrival", choices=SCHEDULING_POLICIES,
                                    read_by=LIMIT)
    attention_backend: str = option("auto", "auto: Triton on CUDA, the C++ kernels on CPU (torch where they cannot "
                                            "build)", choices=ATTENTION_BACKENDS)
    enforce_eager: bool = option(False, "never replay decode steps from CUDA graphs (they are captured at a CUDA "
                                        "worker's start)")
    # A dict or its JSON, parsed into a SpeculativeConfig.
    speculative_config: SpeculativeConfig | None = option(
        None, 'speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": '
              '4, "prompt_lookup_min": 2} (default: off)', parse=speculative_config_text, render=speculative_config_text)
    tensor_parallel_size: int = option(1, "workers that hold the model between them (its heads and MLP columns "
                                          "split)", short="-tp")
    # LoRA adapters (shared/lora.py): the worker sets aside room for max_loras of rank max_lora_rank.
    enable_lora: bool = option(False, "serve LoRA adapters: requests may name one (the gateway's --lora-modules)")
    max_loras: int = option(1, "distinct LoRA adapters one step may run")
    max_lora_rank: int = option(16, "the largest LoRA rank taken")

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        overrides = parse_override(self.override_generation_config)  # a dict (offline) or its JSON
        object.__setattr__(self, "override_generation_config", json.dumps(overrides) if overrides else None)
        _require(self.model_impl in MODEL_IMPLS, "model_impl",
                 f"must be one of {MODEL_IMPLS}, got {self.model_impl!r}")
        _require(self.runner in RUNNERS, "runner", f"must be one of {RUNNERS}, got {self.runner!r}")
        _require(self.dtype in DTYPES, "dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        _require(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype",
                 f"must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        _require(not self.calculate_kv_scales or self.kv_cache_dtype != "auto", "calculate_kv_scales",
                 "needs an FP8 kv_cache_dtype (fp8, fp8_e4m3 or fp8_e5m2): a cache in the model's dtype has no scales")
        _require(self.quantization is None or self.quantization in QUANTIZATION_METHODS, "quantization",
                 f"must be one of {QUANTIZATION_METHODS}, got {self.quantization!r}")
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
        _require(self.encoder_cache_size is None or self.encoder_cache_size >= 0, "encoder_cache_size",
                 f"must be >= 0 rows, got {self.encoder_cache_size}")
        _require(self.kv_offloading_size >= 0, "kv_offloading_size", f"must be >= 0 GiB, got {self.kv_offloading_size}")
        _require(self.preemption_mode in (None, *PREEMPTION_MODES), "preemption_mode",
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
