"""The C++ CPU kernels (csrc/cpu_attention.cpp, csrc/cpu_layers.cpp): built once per machine, on first
use, then loaded in milliseconds.

The first process that needs them compiles them with the machine's C++ compiler (20-50 s) through
torch's extension builder and publishes the library under ``TORCH_EXTENSIONS_DIR`` (default
``~/.cache/torch_extensions``) as ``pagedserve_cpu_kernels_<digest>/``, the digest covering the sources,
this CPU, the compiler, the flags, Python and torch (build_once.py: published by an atomic rename,
so other processes and other checkouts load it without rebuilding or locking; concurrent starts wait
for one build, logging that they do, and after BUILD_WAIT_S fall back to the PyTorch backend, as
they do without a compiler). ``python -m services.worker.attention.cpu_kernels`` builds them ahead of
any start.

Why not at ``pip install`` time, as vLLM ships compiled kernels: an extension must be compiled against
the torch it will run with, and pip's build isolation runs setup.py (or any build-backend hook) in a
throwaway environment with a torch of its own (unpinned: a CUDA wheel of gigabytes on Linux, and
possibly not the version a GPU user installed), while ``pip install torch==2.13.0 -e .`` builds the
project before it installs any torch at all. Turning isolation off would make the README's one-line install two steps, and forgetting
the flag would bring that back silently; ``-march=native`` code built into an image would also bind
it to the CPU that built the image. A build on the machine that runs, against the torch that is
loaded, is right for a CPU user and a GPU user with their own torch alike; the tests build once per
run before any service starts (tests/conftest.py).
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import sys
from pathlib import Path

import torch

from services.worker.attention.build_once import build_once
from services.worker.attention.file_lock import LockTimeout
from services.worker.cpu_tuning import has_avx512, l2_cache_bytes

# Decode attention; the models' fused elementwise layers and panel projections (wrapped in
# services/worker/models/cpu_layers.py); prefill attention; the K/V cache write.
SOURCES = [Path(__file__).with_name("csrc") / name
           for name in ("cpu_attention.cpp", "cpu_layers.cpp", "panel_linear.cpp", "prefill_attention.cpp",
                        "write_kv.cpp")]
LIBRARY = "pagedserve_cpu"  # the torch.library namespace the sources register


def cpu_kernels_unavailable_reason() -> str | None:
    """Why the C++ kernels cannot run in this process; None once they are loaded."""
    return _build()


BLOCKED_DECODE_MIN_L2 = 1 << 20  # without AVX-512, float32 decodes read blocks where a core's L2 is this or more


@functools.cache
def decode_reads_blocks(dtype: torch.dtype) -> bool:
    """Whether paged_decode_attention reads a ``dtype`` cache's K and V together, a block at a time under an online
    softmax, rather than in two passes (K, then V); the results agree to float32 rounding.

    Measured with benchmarks/cpu_attention.py (2 threads, the bench model's shapes, ms a layer call): the blocked
    loops win with AVX-512 at both dtypes, and for bfloat16 with AVX2 (16 % less on a Zen 3). float32 with AVX2 is
    the one split: they lost on a Zen 3 with 512 KiB of L2 a core (decode200 10.1 against 8.4 ms) and won on a Zen 4
    whose AVX-512 the hypervisor hid, 1 MiB of L2 (7.3-8.6 against 8.5-9.7). Both are AVX2 to the compiler (GCC 12
    takes either for a Zen 3), and the L2 size is the difference the process can read, so it decides.
    """
    if dtype != torch.float32 or has_avx512():
        return True
    l2 = l2_cache_bytes()
    return l2 is not None and l2 >= BLOCKED_DECODE_MIN_L2


def paged_decode_attention(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
                           value_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           rows: torch.Tensor, seqs: torch.Tensor, scale: float, *, window: int | None = None,
                           softcap: float | None = None, v_scale: float = 1.0) -> None:
    """Writes ``out[rows[i]]``: the query ``query[rows[i]]`` of sequence ``seqs[i]`` over its paged context
    (its last ``window`` tokens only, with a window; scores capped at ``softcap``, see spec.py). An FP8 cache
    (kv_quant.py) holds codes: ``scale`` then includes K's scale, and ``v_scale`` multiplies the output.

    out, query [T, H, D] (unit stride along D); key_cache, value_cache [num_blocks, block_size, Hkv, D]
    contiguous; block_tables [S, max_blocks] int32; seq_lens [S] int32 (context including the new token);
    rows, seqs [n] int64, longest context first for the best balance across threads.
    """
    getattr(torch.ops, LIBRARY).paged_decode_attention(out, query, key_cache, value_cache, block_tables,
                                                       seq_lens, rows, seqs, scale, window or 0, softcap or 0.0,
                                                       v_scale, decode_reads_blocks(query.dtype))


def write_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """``key_cache`` / ``value_cache`` token row ``slot_mapping[t]`` = ``key[t]`` / ``value[t]`` (torch_ref.write_kv's
    index_put, one copy a token). Caches [N, B, Hkv, D] contiguous; key, value [T, Hkv, D] of their dtype, each
    token's heads adjacent (strides [any, D, 1]); slot_mapping int64 [T] within N * B (IndexError if not)."""
    getattr(torch.ops, LIBRARY).write_kv(key_cache, value_cache, key, value, slot_mapping)


def has_prefill_attention() -> bool:
    """Whether the kernels were built with prefill_attention's vector loops (AVX-512 or AVX2) (else it refuses every call)."""
    return cpu_kernels_unavailable_reason() is None and getattr(torch.ops, LIBRARY).has_prefill_attention()


def prefill_attention(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      block_table: torch.Tensor, context_len: int, scale: float) -> None:
    """Writes ``out``: one sequence's new tokens ``query`` attending causally over its first ``context_len``
    keys, which ``block_table`` finds in the pools (new token i sits at context_len - L + i).

    out, query [L, H, D] (unit stride along D), D 64, 128 or 256; key_cache, value_cache [N, B, Hkv, D] with the
    same strides (unit along D) and the query's dtype, float32 or bfloat16; block_table [>= context_len / B]
    int32, contiguous.
    """
    getattr(torch.ops, LIBRARY).prefill_attention(out, query, key_cache, value_cache, block_table, context_len, scale)


@functools.cache
def _build() -> str | None:
    """Load (building first if need be) the kernels once per process; the reason on failure."""
    return load_cpu_kernels(build_root(), BUILD_WAIT_S)


def load_cpu_kernels(root: Path, wait_s: float) -> str | None:
    """Loads the kernels published under ``root``, building them there first if no process has (waiting
    at most ``wait_s`` for another builder); the reason they cannot run on failure, else None."""
    if shutil.which(_compiler()) is None:
        return "no C++ compiler found (install g++, or set CXX)"
    name = build_name()
    try:
        library = build_once(root, name, f"{name}.so", functools.partial(_compile, name), wait_s)
        if not _registered():  # a process that built them has them loaded already
            torch.ops.load_library(str(library))
    except LockTimeout as e:
        return f"gave up waiting for another process's build of the C++ CPU kernels: {e}"
    except (RuntimeError, OSError, ImportError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return f"building or loading the C++ CPU kernels failed: {first_line}"
    return None


def build_name() -> str:
    """The published build's directory (under build_root()) for this checkout's sources on this machine."""
    return f"pagedserve_cpu_kernels_{build_digest()}"


def build_root() -> Path:
    """Where builds are published: torch's extensions directory (TORCH_EXTENSIONS_DIR overrides it)."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())


BUILD_WAIT_S = 180.0  # a build takes 20-50 s; a builder past this has hung (and the launcher waits 300 s)
# -fopenmp: the kernel's parallel loop; the libgomp.so.1 it links is the one torch has already loaded
# (same soname), so both share one thread pool. -fno-trapping-math: without it GCC leaves every loop that
# clamps (exp_clamped's min and max, so softmax and SiLU) scalar on CPUs without AVX-512's masks (measured
# on a Zen 3: SiLU-and-mul 4x slower); it changes no result, only lets compares run on lanes not needed.
CFLAGS, LDFLAGS = ("-O3", "-march=native", "-fno-trapping-math", "-fopenmp"), ("-fopenmp",)


def _compile(name: str, directory: Path) -> None:
    """Builds ``directory/<name>.so`` (and loads it into this process: torch's builder always does)."""
    from torch.utils.cpp_extension import load

    load(name=name, sources=[str(source) for source in SOURCES], build_directory=str(directory),
         is_python_module=False, extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS))


def _registered() -> bool:
    return hasattr(getattr(torch.ops, LIBRARY), "paged_decode_attention")


def _compiler() -> str:
    return os.environ.get("CXX", "c++")


def build_digest() -> str:
    """A hash of what the library depends on: every file in csrc/ (headers included), this CPU's model
    and feature flags (the build is -march=native: a cache shared with another kind of CPU must not hand
    it this machine's binary), the compiler, the flags, Python and torch (it links against torch)."""
    digest = hashlib.sha256(_cpu_fingerprint().encode())
    for path in sorted(SOURCES[0].parent.iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    for part in (_compiler(), *CFLAGS, *LDFLAGS, sys.implementation.cache_tag, torch.__version__):
        digest.update(b"\0" + part.encode())
    return digest.hexdigest()[:16]


def _cpu_fingerprint() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine() + platform.processor()
    wanted = ("model name", "flags", "Features", "CPU part")  # x86 and Arm spellings
    return platform.machine() + "".join(sorted({line for line in lines if line.startswith(wanted)}))


def main() -> int:
    """Builds (or finds) the kernels now: one line saying where, or why not (exit code 1)."""
    reason = load_cpu_kernels(build_root(), BUILD_WAIT_S)
    print(reason or f"the C++ CPU kernels are ready in {build_root() / build_name()}")
    return 1 if reason else 0


if __name__ == "__main__":
    sys.exit(main())
