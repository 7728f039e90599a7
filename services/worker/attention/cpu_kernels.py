"""The C++ CPU kernels (csrc/cpu_attention.cpp, csrc/cpu_layers.cpp): built once per machine, then loaded
from cache.

torch's extension builder compiles the source with the machine's C++ compiler the first time a
worker needs it (about 20 s here) and keeps the library under ``TORCH_EXTENSIONS_DIR``
(default ``~/.cache/torch_extensions``); later loads take milliseconds, and a changed source is
rebuilt. Where there is no compiler, the "auto" backend falls back to the pure-PyTorch one.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
from pathlib import Path

import torch

# Decode attention; the models' fused elementwise layers (wrapped in services/worker/models/cpu_layers.py).
SOURCES = [Path(__file__).with_name("csrc") / name for name in ("cpu_attention.cpp", "cpu_layers.cpp")]
LIBRARY = "pagedserve_cpu"  # the torch.library namespace the sources register


def cpu_kernels_unavailable_reason() -> str | None:
    """Why the C++ kernels cannot run in this process; None once they are loaded."""
    return _build()


def paged_decode_attention(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
                           value_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           rows: torch.Tensor, seqs: torch.Tensor, scale: float, *, window: int | None = None,
                           softcap: float | None = None) -> None:
    """Writes ``out[rows[i]]``: the query ``query[rows[i]]`` of sequence ``seqs[i]`` over its paged context
    (its last ``window`` tokens only, with a window; scores capped at ``softcap``, see spec.py).

    out, query [T, H, D] (unit stride along D); key_cache, value_cache [num_blocks, block_size, Hkv, D]
    contiguous; block_tables [S, max_blocks] int32; seq_lens [S] int32 (context including the new token);
    rows, seqs [n] int64, longest context first for the best balance across threads.
    """
    getattr(torch.ops, LIBRARY).paged_decode_attention(out, query, key_cache, value_cache, block_tables,
                                                       seq_lens, rows, seqs, scale, window or 0, softcap or 0.0)


@functools.cache
def _build() -> str | None:
    """Compile (or load the cached build of) the kernels once per process; the reason on failure."""
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler found (install g++, or set CXX)"
    from torch.utils.cpp_extension import load

    try:
        load(name=f"pagedserve_cpu_kernels_{_source_digest()}", sources=[str(source) for source in SOURCES],
             is_python_module=False,
             # -fopenmp: the kernel's parallel loop; the libgomp.so.1 it links is the one torch has
             # already loaded (same soname), so both share one thread pool.
             extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"])
    except (RuntimeError, OSError, ImportError, FileNotFoundError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return f"building the C++ CPU kernels failed: {first_line}"
    return None


def _source_digest() -> str:
    """A hash of every file in csrc/ (headers included: torch's own change detection hashes only the
    listed sources) and of this CPU's model and feature flags (the build is -march=native, so a cache
    shared with another kind of CPU must not hand it this machine's binary), in the build's name."""
    digest = hashlib.sha256(_cpu_fingerprint().encode())
    for path in sorted(SOURCES[0].parent.iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:12]


def _cpu_fingerprint() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine() + platform.processor()
    wanted = ("model name", "flags", "Features", "CPU part")  # x86 and Arm spellings
    return platform.machine() + "".join(sorted({line for line in lines if line.startswith(wanted)}))
