"""Compile the Triton kernels for a CUDA GPU on a machine without one, and report what ptxas made.

    python benchmarks/triton_compile.py [--arch 90] [--quick] [--out benchmarks/results/triton_compile_sm90.json]

Why: the CPU tests run the kernels under the Triton interpreter, which executes their Python semantics
but never lowers them. A kernel can pass every interpreted test and still fail to compile for a GPU
(layouts, dot shapes, shared memory), or compile into one that spills registers or whose K/V loads
are not pipelined; either would sink the decode targets of benchmarks/gpu_kernels.py.

How: the real wrappers (paged_attention, write_kv, copy_blocks, fused_experts) are called with CPU tensors while a
compile-only driver stands in for CUDA. Every launch is compiled for ``--arch`` with the specialisation
a GPU launch of the same arguments gets (dtypes, 16-byte divisibility, constexprs) and is not run.
The arguments cover a fixed set of shapes (gpu_kernels.py's, the project's models', small test
shapes), dtypes, batches (decode, block tables of odd width, long decode, mixed prefill and decode)
and split-K choices, plus the 5-stage decode that gpu_kernels.py's decode section times (not its tune
sweep), sliding-window and soft-capped layers, an FP8 KV cache and the W4A16 GEMM; each distinct binary is
reported once.

For each variant: registers per thread, spilled bytes, the stack frame and shared memory (from ptxas),
whether the K/V tiles arrive by asynchronous copies (the software pipeline), in how many buffers, and
which matrix-multiply
instructions the dots use. Exits 1 when a variant fails to compile, needs more shared memory than the
architecture has, or (for head sizes of 16 and up: the broadcast-sum path below that only has to work)
spills more than SPILL_TOLERANCE bytes or, for attention, is not pipelined.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # compile for real; must precede the first triton import
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, said aloud (it warns otherwise)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402

from benchmarks.gpu_kernels import Shape  # noqa: E402
from benchmarks.triton_binary import (  # noqa: E402
    dot_instructions, readable_constexprs, register_usage, tile_buffers, tile_copies)
from services.worker.model_factory import BENCH_MODEL, DEFAULT_MODEL  # noqa: E402
from shared.config import EngineConfig  # noqa: E402

# Largest dynamic shared memory one program may use (CUDA programming guide, per compute capability).
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024, 100: 227 * 1024, 120: 99 * 1024}
SM_COUNT = {80: 108, 86: 84, 89: 142, 90: 132, 100: 148, 120: 170}  # A100, A40, L40S, H100/H200, B200, RTX PRO 6000
# Spills up to this many bytes are a few values parked outside the hot loop, and move with the ptxas
# version; kilobytes mean the tile does not fit in registers.
SPILL_TOLERANCE = 64


@dataclass
class Variant:
    kernel: str
    case: str  # what the wrapper was asked to do
    constexprs: str
    ok: bool = False
    error: str | None = None
    registers: int | None = None
    spill_bytes: int | None = None  # spill stores
    stack_bytes: int | None = None
    shared_bytes: int | None = None
    tile_copies: int | None = None  # asynchronous copies of K/V tiles into shared memory in the TTGIR
    tile_buffers: int | None = None  # most shared-memory buffers of one K or V tile
    dot: str | None = None
    compile_s: float = 0.0
    problems: tuple[str, ...] = ()


class CompileOnlyDriver:
    """Stands in for the CUDA driver: names the target, never touches a device."""

    def __init__(self, arch: int):
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


class Recorder:
    """Turns each kernel's launches into compile-only warm-ups and records each new binary."""

    def __init__(self, arch: int):
        self.arch = arch
        self.variants: list[Variant] = []
        self.case = ""
        self._seen: set[str] = set()  # binaries by hash: a launch the in-memory cache served adds nothing

    def instrument(self, kernel) -> None:
        compile_only = kernel.run

        def run(*args, grid, warmup, **kwargs):
            buffer = io.StringIO()
            started = time.perf_counter()
            with contextlib.redirect_stdout(buffer):  # the ptxas log Triton prints when asked
                compiled = compile_only(*args, grid=grid, warmup=True, **kwargs)
            self.record(kernel.fn.__name__, compiled, buffer.getvalue(), time.perf_counter() - started)
            return compiled

        kernel.run = run

    def record(self, name: str, compiled, ptxas_log: str, seconds: float) -> None:
        if compiled.hash in self._seen:
            return
        self._seen.add(compiled.hash)
        ttgir = compiled.asm["ttgir"]
        variant = Variant(name, self.case, readable_constexprs(compiled), ok=True, compile_s=round(seconds, 2),
                          shared_bytes=compiled.metadata.shared, tile_copies=tile_copies(ttgir),
                          tile_buffers=max(tile_buffers(ttgir), default=None),
                          dot="+".join(dot_instructions(ttgir)) or None)
        usage = register_usage(ptxas_log, name)
        if usage is not None:
            variant.registers, variant.spill_bytes, variant.stack_bytes = (
                usage.registers, usage.spill_bytes, usage.stack_bytes)
        variant.problems = tuple(self.problems_of(variant))
        self.variants.append(variant)

    def problems_of(self, v: Variant) -> list[str]:
        problems = []
        limit = SHARED_LIMIT.get(self.arch)
        if limit is not None and v.shared_bytes > limit:
            problems.append(f"needs {v.shared_bytes} B of shared memory, the GPU has {limit}")
        if v.registers is None:
            problems.append("no ptxas report for it: registers and spills unknown")
        if "USE_DOT=False" in v.constexprs:  # head_dim < 16: tiny test models only; must compile, need not be fast
            return problems
        if v.spill_bytes and v.spill_bytes > SPILL_TOLERANCE:
            problems.append(f"spills {v.spill_bytes} bytes")
        # An FP8 cache's one-byte K/V tiles are not pipelined yet (Triton 3.9 issues no asynchronous copies for
        # them): compiled and correct, its speed still to be measured on a GPU (docs/quantization.md).
        if v.kernel == "_paged_attention_kernel" and not v.tile_copies and "FP8_KV=True" not in v.constexprs:
            problems.append("K/V loads are not pipelined (no asynchronous tile copies)")
        return problems

    def failed(self, wrapper: str, error: Exception) -> None:
        """``wrapper`` raised before or while compiling (the message says which kernel, if one)."""
        self.variants.append(Variant(wrapper, self.case, "", error=f"{type(error).__name__}: {error}"[:4000],
                                     problems=("does not compile",)))


# --- the cases: what the engine and benchmarks/gpu_kernels.py launch -------------------------------------------


def attention_inputs(shape: Shape, dtype: torch.dtype, specs: list[tuple[int, int]]):
    """(q, K/V pool, metadata) for (cached, new) sequences, as the worker builds them; every sequence
    on blocks 0, 1, ... (placement does not change the binary)."""
    from services.worker.input_batch import build_model_inputs
    from services.worker.kernel_warmup import dummy_sequence

    blocks = max(-(-(cached + new) // shape.block_size) for cached, new in specs)
    batch = [dummy_sequence(cached, new, shape.block_size, blocks) for cached, new in specs]
    meta = build_model_inputs(batch, shape.block_size, torch.device("cpu")).meta
    pool = torch.empty(1, 2, blocks, shape.block_size, shape.kv_heads, shape.head_dim, dtype=dtype)
    return torch.empty(meta.num_tokens, shape.heads, shape.head_dim, dtype=dtype), pool, meta


# Block-table widths 256, 251 (not a multiple of 16: Triton specialises on divisibility), 2048, 188.
BATCHES = {
    "decode": [(4095, 1), (511, 1), (100, 1)],
    "odd-decode": [(4000, 1), (700, 1), (33, 1)],  # as many sequences: the heuristic's split count rounds alike
    "long-decode": [(32767, 1)],
    "mixed": [(0, 384), (1000, 200), (3000, 1), (17, 1)],
}


def model_shape(config: dict) -> Shape:
    heads = config["num_attention_heads"]
    return Shape(heads, config["num_key_value_heads"], config["hidden_size"] // heads, EngineConfig().block_size)


def cases(quick: bool) -> list[tuple[Shape, str]]:
    """(shape, dtype): gpu_kernels.py's shapes, the built-in and bench models (float32, as the engine runs
    them), and small head sizes of test models."""
    main = Shape(32, 8, 128)
    own = [(model_shape(DEFAULT_MODEL), DEFAULT_MODEL["dtype"]), (model_shape(BENCH_MODEL), BENCH_MODEL["dtype"])]
    if quick:
        return [(main, d) for d in ("bfloat16", "float32")] + own[1:] + [
            (Shape(16, 16, 64), "float16"), (Shape(16, 2, 256), "bfloat16"), (Shape(4, 2, 32, 8), "float32")]
    shapes = [main, Shape(32, 8, 128, 32), Shape(16, 16, 64), Shape(8, 1, 128), Shape(16, 2, 256),
              Shape(4, 2, 32, 8), Shape(4, 4, 16, 4), Shape(8, 2, 8, 16)]
    return [(s, d) for s in shapes for d in ("bfloat16", "float16", "float32")] + own


def label(shape: Shape) -> str:
    return f"{shape.label}/B{shape.block_size}"


def split_choices(recorder: Recorder, meta, shape: Shape) -> list[tuple[bool, int | None]]:
    """Off, forced on (its default count), and the count the heuristic picks on this GPU's SM count."""
    from services.worker.attention.triton_attention import choose_num_splits

    programs = meta.num_seqs * shape.kv_heads  # decode: one query tile per sequence
    by_gpu = choose_num_splits(programs, meta.max_seq_len, meta.max_query_len, SM_COUNT.get(recorder.arch, 132))
    return [(False, None), (True, None)] + ([(True, by_gpu)] if by_gpu > 1 else [])


def compile_attention(recorder: Recorder, shape: Shape, dtype_name: str) -> None:
    from services.worker.attention.triton_attention import paged_attention

    for batch_name, specs in BATCHES.items():
        q, pool, meta = attention_inputs(shape, getattr(torch, dtype_name), specs)
        for split_k, num_splits in split_choices(recorder, meta, shape):
            recorder.case = (f"{label(shape)} {dtype_name} {batch_name} split={split_k}"
                             + (f"/{num_splits}" if num_splits else ""))
            try:
                paged_attention(q, pool[0, 0], pool[0, 1], meta, shape.head_dim ** -0.5, split_k=split_k,
                                num_splits=num_splits)
            except Exception as e:  # recorded, and the other variants still compile
                recorder.failed("paged_attention", e)


def compile_tuning_variants(recorder: Recorder) -> None:
    """What gpu_kernels.py times besides the defaults: decode with a 5-stage pipeline."""
    from services.worker.attention.triton_attention import paged_attention

    shape = Shape(32, 8, 128)
    q, pool, meta = attention_inputs(shape, torch.bfloat16, BATCHES["decode"])
    recorder.case = f"{label(shape)} bfloat16 decode stages=5"
    try:
        paged_attention(q, pool[0, 0], pool[0, 1], meta, shape.head_dim ** -0.5, num_stages=5)
    except Exception as e:
        recorder.failed("paged_attention", e)


def compile_window_and_cap_variants(recorder: Recorder) -> None:
    """Sliding-window layers (Mistral's shape, a 4096-key window) and Gemma 2's (head size 256, its window and
    its cap of 50 on the scores), off and on split-K."""
    from services.worker.attention.triton_attention import paged_attention

    for shape, window, softcap in ((Shape(32, 8, 128), 4096, None), (Shape(16, 8, 256), 4096, 50.0)):
        for batch_name in ("decode", "mixed"):
            q, pool, meta = attention_inputs(shape, torch.bfloat16, BATCHES[batch_name])
            for split_k in (False, True):
                recorder.case = f"{label(shape)} bfloat16 {batch_name} window={window} cap={softcap} split={split_k}"
                try:
                    paged_attention(q, pool[0, 0], pool[0, 1], meta, shape.head_dim ** -0.5, window=window,
                                    softcap=softcap, split_k=split_k)
                except Exception as e:
                    recorder.failed("paged_attention", e)


def compile_key_limit_variants(recorder: Recorder) -> None:
    """Gemma 3's prefill with images attending both ways (KEY_LIMIT): its 4B's heads (8 of 256, 4 KV heads), on its
    sliding layers (a 1024-key window) and full ones, off and on split-K."""
    import dataclasses

    from services.worker.attention.triton_attention import paged_attention

    shape = Shape(8, 4, 256)
    q, pool, meta = attention_inputs(shape, torch.bfloat16, BATCHES["mixed"])
    limits = torch.cat([torch.arange(length - new, length, dtype=torch.int32)
                        for new, length in zip(meta.query_lens_cpu, meta.seq_lens_cpu)])
    meta = dataclasses.replace(meta, key_limits=limits)
    for window in (1024, None):
        for split_k in (False, True):
            recorder.case = f"{label(shape)} bfloat16 mixed key-limits window={window} split={split_k}"
            try:
                paged_attention(q, pool[0, 0], pool[0, 1], meta, shape.head_dim ** -0.5, window=window,
                                split_k=split_k)
            except Exception as e:
                recorder.failed("paged_attention", e)


def compile_fp8_kv_variants(recorder: Recorder, arch: int) -> None:
    """An FP8 KV cache (--kv-cache-dtype) under bfloat16 queries: e5m2 everywhere, e4m3 from sm_89 (Triton
    has no e4m3 before it), decode and mixed batches, off and on split-K."""
    from services.worker.attention.triton_attention import paged_attention

    shape = Shape(32, 8, 128)
    formats = [torch.float8_e5m2] + ([torch.float8_e4m3fn] if arch >= 89 else [])
    for kv_dtype in formats:
        for batch_name in ("decode", "mixed"):
            q, pool, meta = attention_inputs(shape, torch.bfloat16, BATCHES[batch_name])
            pool = pool.to(kv_dtype)
            for split_k in (False, True):
                recorder.case = f"{label(shape)} bfloat16 {batch_name} kv={kv_dtype} split={split_k}"
                try:
                    paged_attention(q, pool[0, 0], pool[0, 1], meta, shape.head_dim ** -0.5, split_k=split_k,
                                    kv_scales=(0.5, 2.0))
                except Exception as e:
                    recorder.failed("paged_attention", e)


def compile_cache_ops(recorder: Recorder, shape: Shape, dtype_name: str) -> None:
    from services.worker.attention.triton_cache_ops import copy_blocks, write_kv

    dtype = getattr(torch, dtype_name)
    pool = torch.empty(2, 2, 8, shape.block_size, shape.kv_heads, shape.head_dim, dtype=dtype)
    kv = torch.empty(2, 5, shape.kv_heads, shape.head_dim, dtype=dtype)
    for name, launch in (
            ("write_kv", lambda: write_kv(pool[0, 0], pool[0, 1], kv[0], kv[1], torch.arange(5) - 1)),
            ("copy_blocks", lambda: copy_blocks(pool, [(0, 3), (1, 4)]))):
        recorder.case = f"{label(shape)} {dtype_name}"
        try:
            launch()
        except Exception as e:
            recorder.failed(name, e)


# (hidden, expert intermediate, experts): Qwen3-30B-A3B's layer, and widths no tile divides (masks, and no
# 16-byte divisibility for the compiler to assume).
EXPERT_SHAPES = ((2048, 768, 128), (48, 40, 6))


def compile_experts(recorder: Recorder, quick: bool) -> None:
    """The fused experts' grouped matmul: both projections, at every tile height the worker launches."""
    from services.worker.models.fused_moe import fused_experts

    dtypes = ("bfloat16", "float32") if quick else ("bfloat16", "float16", "float32")
    shapes = EXPERT_SHAPES[:1] if quick else EXPERT_SHAPES
    for (hidden, inter, experts), dtype_name in ((shape, d) for shape in shapes for d in dtypes):
        dtype = getattr(torch, dtype_name)
        w13, w2 = torch.empty(experts, 2 * inter, hidden, dtype=dtype), torch.empty(experts, hidden, inter, dtype=dtype)
        x, ids = torch.zeros(3, hidden, dtype=dtype), torch.arange(6).view(3, 2) % experts
        for block_m in (16, 32, 64):
            recorder.case = f"experts h{hidden} i{inter} e{experts} {dtype_name} rows={block_m}"
            try:
                fused_experts(x, w13, w2, torch.full((3, 2), 0.5), ids, block_m)
            except Exception as e:
                recorder.failed("fused_experts", e)


def compile_wna16_gemm(recorder: Recorder) -> None:
    """The W4A16 / W8A16 GEMM (quantization/wna16_gemm.py) on an 8B model's q/k/v shape, group 128, in the
    16-bit dtypes it serves (the row count is a run-time argument: one binary per dtype and width)."""
    from services.worker.quantization.wna16_gemm import wna16_matmul

    n, k, group = 6144, 4096, 128
    for bits in (4, 8):
        for dtype in (torch.bfloat16, torch.float16):
            recorder.case = f"w{bits}a16 n{n} k{k} g{group} {dtype}"
            try:
                wna16_matmul(torch.zeros(16, k, dtype=dtype), torch.zeros(n, k * bits // 32, dtype=torch.int32),
                             torch.ones(n, k // group, dtype=dtype), torch.zeros(n, k // group, dtype=dtype), group,
                             bits)
            except Exception as e:
                recorder.failed("wna16_matmul", e)


def compile_int8_gemm(recorder: Recorder) -> None:
    """The W8A8 int8 GEMM (quantization/int8_gemm.py) on an 8B model's q/k/v shape, in the dtypes it serves,
    with and without bias (the row count is a run-time argument: one binary per output dtype and bias)."""
    from services.worker.quantization.int8_gemm import w8a8_int8_matmul

    n, k = 6144, 4096
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for bias in (None, torch.zeros(n, dtype=dtype)):
            recorder.case = f"w8a8 int8 n{n} k{k} {dtype} bias={bias is not None}"
            try:
                w8a8_int8_matmul(torch.zeros(16, k, dtype=torch.int8), torch.ones(16, 1),
                                 torch.zeros(n, k, dtype=torch.int8), torch.ones(n, 1), bias, dtype)
            except Exception as e:
                recorder.failed("w8a8_int8_matmul", e)


def compile_fp8_block_gemm(recorder: Recorder, arch: int) -> None:
    """The block-wise W8A8 FP8 GEMM (quantization/fp8_gemm.py), 128-column blocks with scales per row (as
    Fp8Linear holds them), an 8B model's q/k/v shape, decode and prefill tiles, 16-bit outputs: from sm_89
    (no FP8 dot before it)."""
    if arch < 89:
        return
    from services.worker.quantization.fp8_gemm import w8a8_block_fp8_matmul

    n, k, block, e4m3 = 6144, 4096, (1, 128), torch.float8_e4m3fn
    for m in (16, 64):  # the 16 x 64 and 64 x 128 tiles
        for dtype in (torch.bfloat16, torch.float16):
            recorder.case = f"fp8 block n{n} k{k} 1x128 m{m} {dtype}"
            try:
                w8a8_block_fp8_matmul(torch.zeros(m, k, dtype=e4m3), torch.ones(m, k // 128),
                                      torch.zeros(n, k, dtype=e4m3), torch.ones(n, k // 128), block, dtype)
            except Exception as e:
                recorder.failed("w8a8_block_fp8_matmul", e)


def serving_batches(rng: random.Random, block_size: int, max_model_len: int, budget: int, count: int):
    """Steps as a scheduler makes them: the extremes (one decode at the full context, one prefill of the
    whole budget), then random ones: decodes at any context, prefill chunks after cached blocks, a third
    of them one sequence alone (the batches split-K serves: few programs, long context)."""
    from services.worker.kernel_warmup import dummy_sequence

    def sequence(cached: int, new: int):
        return dummy_sequence(cached, new, block_size, num_blocks=-(-max_model_len // block_size))

    longest = min(budget, max_model_len)
    batches = [[sequence(max_model_len - 1, 1)], [sequence(0, longest)]]
    for _ in range(count):
        batch, tokens = [], 0
        for _ in range(1 if rng.random() < 1 / 3 else rng.randint(2, 24)):
            new = 1 if rng.random() < 0.7 else rng.randint(2, min(300, longest))
            cached = rng.randint(0, max_model_len - new)
            if tokens + new > budget:
                break
            tokens += new
            batch.append(sequence(cached, new))
        batches.append(batch or [sequence(0, 1)])
    return batches


@dataclass(frozen=True)
class WarmUpCase:
    label: str
    dtype: str
    max_model_len: int
    token_budget: int
    model: dict | None = None  # create_model_dir arguments; None: the built-in model


# The built-in model (GQA 2:1) at its full length, and a multi-head one whose limits are not powers of
# two: the longest query rounds up to a tile height and the longest context to a split count that the
# powers of two alone would not reach.
WARM_UP_CASES = (
    WarmUpCase("built-in", "float32", 2048, 4096),
    WarmUpCase("MHA, odd limits", "bfloat16", 3000, 48,
               dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                    num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=3000)),
)


def check_warm_up(recorder: Recorder, case: WarmUpCase, rounds: int) -> dict:
    """The worker's kernel warm-up, then serving-like steps: those must compile nothing."""
    from services.worker.attention import triton_attention
    from services.worker.block_moves import whole_pool
    from services.worker.input_batch import build_model_inputs
    from services.worker.kernel_warmup import warm_up_kernels
    from services.worker.kv_cache import allocate_kv_pools
    from services.worker.model_loader import load_model
    from services.worker.model_factory import create_model_dir, default_model_dir

    # The split heuristic sizes splits by the GPU's SM count; the CPU stand-in would cap them at a few.
    sm_count = SM_COUNT.get(recorder.arch, 132)
    triton_attention._sm_count = lambda device: sm_count
    model_dir = default_model_dir() if case.model is None else create_model_dir(
        Path(tempfile.mkdtemp()) / "model", **case.model)
    dtype, device, block_size = getattr(torch, case.dtype), torch.device("cpu"), EngineConfig().block_size
    model, config = load_model(model_dir, dtype, device, pack=False)
    num_blocks = -(-case.max_model_len // block_size) * 24 + 1
    pools = allocate_kv_pools(config, num_blocks, block_size, dtype, device)
    attention = triton_attention.TritonAttentionBackend(pools, model.attention_spec())
    recorder.case = f"warm-up {case.label} {case.dtype}"
    before = len(recorder.variants)
    passes = warm_up_kernels(model, attention, whole_pool(pools), block_size, case.max_model_len, case.token_budget,
                             device)
    warmed = len(recorder.variants)
    recorder.case = f"serving after warm-up {case.label} {case.dtype}"
    with torch.inference_mode():
        for batch in serving_batches(random.Random(0), block_size, case.max_model_len, case.token_budget, rounds):
            inputs = build_model_inputs(batch, block_size, device)
            model(inputs.input_ids, inputs.positions, attention, inputs.meta)
    for v in recorder.variants[warmed:]:
        v.problems += ("compiled while serving: the warm-up missed it",)
    return {**asdict(case), "sm_count": sm_count, "warm_up_passes": passes, "warm_up_binaries": warmed - before,
            "serving_steps": rounds, "compiled_while_serving": len(recorder.variants) - warmed}


# --- report ----------------------------------------------------------------------------------------------------


def print_table(variants: list[Variant]) -> None:
    header = (f"{'kernel':<24}{'case':<52}{'regs':>5}{'spill':>6}{'stack':>6}{'smem KB':>8}{'copies':>7}"
              f"{'bufs':>5}  {'dot':<8}")
    print(header)
    for v in variants:
        kb = f"{v.shared_bytes / 1024:.1f}" if v.shared_bytes is not None else "-"
        cells = [v.registers, v.spill_bytes, v.stack_bytes]
        cells = ["-" if c is None else str(c) for c in cells]
        print(f"{v.kernel:<24}{v.case:<52}{cells[0]:>5}{cells[1]:>6}{cells[2]:>6}{kb:>8}"
              f"{'-' if v.tile_copies is None else v.tile_copies:>7}{v.tile_buffers or '-':>5}  {v.dot or '-':<8}"
              + (f"  PROBLEM: {'; '.join(v.problems)}" if v.problems else ""))
        if v.error:
            print(f"    {v.error.splitlines()[0]}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90,
                        help="compute capability x 10: 80 A100, 89 L4/L40, 90 H100/H200, 100 B200 (default 90)")
    parser.add_argument("--quick", action="store_true", help="six (shape, dtype) cases instead of twenty-six")
    parser.add_argument("--out", default=None, help="JSON report (default benchmarks/results/triton_compile_smARCH.json)")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    triton.knobs.nvidia.dump_ptxas_log = True  # registers and spills, as ptxas reports them
    triton.knobs.compilation.always_compile = True  # a binary from Triton's disk cache comes without that log
    driver.set_active(CompileOnlyDriver(args.arch))
    from services.worker.attention import triton_attention, triton_cache_ops
    from services.worker.models import fused_moe
    from services.worker.quantization import fp8_gemm, int8_gemm, wna16_gemm

    recorder = Recorder(args.arch)
    real_sm_count = triton_attention._sm_count
    for kernel in (triton_attention._paged_attention_kernel, triton_attention._reduce_splits_kernel,
                   triton_cache_ops._write_kv_kernel, triton_cache_ops._copy_blocks_kernel,
                   fused_moe._grouped_matmul_kernel, wna16_gemm._wna16_kernel, int8_gemm._w8a8_kernel,
                   fp8_gemm._w8a8_block_fp8_kernel):
        recorder.instrument(kernel)
    started = time.perf_counter()
    # First, while no kernel is compiled yet: a binary the matrix below made would hide a warm-up gap.
    warm_ups = [check_warm_up(recorder, case, rounds=20 if args.quick else 60) for case in WARM_UP_CASES]
    triton_attention._sm_count = real_sm_count
    for shape, dtype_name in cases(args.quick):
        compile_attention(recorder, shape, dtype_name)
        compile_cache_ops(recorder, shape, dtype_name)
    compile_tuning_variants(recorder)
    compile_window_and_cap_variants(recorder)
    compile_key_limit_variants(recorder)
    compile_fp8_kv_variants(recorder, args.arch)
    compile_experts(recorder, args.quick)
    compile_wna16_gemm(recorder)
    compile_int8_gemm(recorder)
    compile_fp8_block_gemm(recorder, args.arch)
    elapsed = time.perf_counter() - started
    print_table(recorder.variants)
    bad = [v for v in recorder.variants if v.problems]
    for w in warm_ups:
        print(f"warm-up ({w['label']}, {w['dtype']}, {w['sm_count']} SMs): {w['warm_up_passes']} forward passes, "
              f"{w['warm_up_binaries']} new binaries; {w['serving_steps']} serving-like steps after it compiled "
              f"{w['compiled_while_serving']}")
    print(f"\nsm_{args.arch}: {len(recorder.variants)} distinct binaries in {elapsed:.0f} s, "
          f"{len(bad)} with problems (triton {triton.__version__})")
    out = Path(args.out or Path(__file__).with_name("results") / f"triton_compile_sm{args.arch}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"arch": args.arch, "triton": triton.__version__, "elapsed_s": round(elapsed, 1),
                               "spill_tolerance": SPILL_TOLERANCE, "warm_ups": warm_ups,
                               "variants": [asdict(v) for v in recorder.variants]}, indent=2))
    print(f"wrote {out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
