"""What a compiled Triton kernel became: read from ptxas's log and the kernel's TTGIR.

Used by triton_compile.py; every function takes text, so it needs no GPU and no compile.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# A dot lowered to Hopper's or Blackwell's tensor-core instructions carries its own TTGIR op; a tt.dot
# whose operands stay on a blocked layout is the CUDA-core FMA loop (float32 IEEE dots); else mma.sync.
DOT_OPS = {"ttng.warp_group_dot": "wgmma", "ttng.tc_gen5_mma": "tcgen05"}
FLOAT_TILE = r"(?:bf16|f16|f32)"
ASYNC_COPY_OPS = ("ttg.async_copy_global_to_local", "ttng.async_tma_copy_global_to_local")


@dataclass(frozen=True)
class RegisterUsage:
    registers: int
    spill_bytes: int  # spill stores
    stack_bytes: int


def register_usage(ptxas_log: str, kernel: str) -> RegisterUsage | None:
    """The entry function's line of ``ptxas -v``; None when the log does not have it."""
    start = ptxas_log.find(f"Function properties for {kernel}\n")
    if start < 0:
        return None
    block = ptxas_log[start:]
    end = block.find("Compile time")  # the next function's properties start after it
    block = block[:end] if end >= 0 else block
    numbers = [re.search(pattern, block) for pattern in
               (r"Used (\d+) registers", r"(\d+) bytes spill stores", r"(\d+) bytes stack frame")]
    if not all(numbers):
        return None
    return RegisterUsage(*(int(m.group(1)) for m in numbers))


def dot_instructions(ttgir: str) -> list[str]:
    found = {label for op, label in DOT_OPS.items() if op + " " in ttgir}
    for line in ttgir.splitlines():
        if " tt.dot " in line:
            found.add("fma" if "parent = #blocked" in line else "mma")
    return sorted(found)


def tile_copies(ttgir: str) -> int:
    """Asynchronous copies into shared memory of 2-D float tiles (K and V), block-table reads left out."""
    ops = "|".join(re.escape(op) for op in ASYNC_COPY_OPS)
    return len(re.findall(rf"(?:{ops}) [^\n]*-> <\d+x\d+x{FLOAT_TILE},", ttgir))


def tile_buffers(ttgir: str) -> list[int]:
    """Buffer count of every multi-buffered 2-D float tile in shared memory (K and V: one each)."""
    return [int(d) for d in re.findall(rf"ttg\.local_alloc : \(\) -> !ttg\.memdesc<(\d+)x\d+x\d+x{FLOAT_TILE},",
                                       ttgir)]


def readable_constexprs(compiled) -> str:
    """A compiled kernel's constexpr arguments by name (Triton keys them by argument position)."""
    names = list(compiled.src.signature)
    parts = []
    for key, value in compiled.src.constants.items():
        index = key[0] if isinstance(key, tuple) else key
        name = names[index] if isinstance(index, int) and index < len(names) else str(index)
        if str(compiled.src.signature.get(name)) == "constexpr":
            parts.append(f"{name}={value}")
    return ", ".join(sorted(parts))
