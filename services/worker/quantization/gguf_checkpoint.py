"""A GGUF file's tensors as the model loads them: llama.cpp's names mapped to Hugging Face's, each tensor
dequantized to float32 by gguf-py (the format's reference arithmetic, as transformers' GGUF loader uses it),
and Llama's q/k rows put back in Hugging Face's order (llama.cpp's converter interleaves the two rotary halves
of each head; Qwen's it leaves alone).

Dequantized once at load, as every other weight-only format here (quantization/dequantize.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import torch

from shared.gguf_view import ROPE_FREQS

# What gguf-py dequantizes and this loader was checked with (F32/F16/Q8_0/Q4_0/Q4_K/Q6_K in the tests);
# the importance-matrix (IQ*), ternary and MXFP4 types are refused by name.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                   "Q6_K")
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
_PERMUTED = ("llama",)  # architectures whose q/k rows llama.cpp's converter interleaves
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
          "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
          "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_NAME = re.compile(r"(?:blk\.(?P<layer>\d+)\.)?(?P<base>[a-z_]+)\.(?P<suffix>weight|bias)")


def gguf_names(file: Path) -> list[str]:
    """Hugging Face names of the file's tensors, and every type and architecture checked (cheap: the file is
    memory-mapped and nothing is dequantized)."""
    reader, arch = _open(file)
    return [hf_name(t.name) for t in reader.tensors if t.name != ROPE_FREQS]


def gguf_tensors(file: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 tensor) for each tensor of the file."""
    from gguf import dequantize

    reader, arch = _open(file)
    heads = _field(reader, f"{arch}.attention.head_count")
    kv_heads = _field(reader, f"{arch}.attention.head_count_kv", heads)
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS:  # Llama 3's rope scaling: config.json has it (shared/gguf_view.py)
            continue
        name = hf_name(tensor.name)
        shape = [int(n) for n in reversed(tensor.shape.tolist())]  # ggml lists the innermost dimension first
        values = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).copy()).float().reshape(shape)
        if arch in _PERMUTED and name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
            values = unpermute_rotary_rows(values, heads if ".q_proj." in name else kv_heads)
        yield name, values


def hf_name(name: str) -> str:
    match = _NAME.fullmatch(name)
    base = match and (_LAYER.get(match["base"]) if match["layer"] else _TOP.get(match["base"]))
    if base is None:
        raise ValueError(f"GGUF tensor {name!r} is not one this loader maps")
    prefix = f"model.layers.{match['layer']}." if match["layer"] else ""
    return f"{prefix}{base}.{match['suffix']}"


def unpermute_rotary_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's converter, which stores each head's rows as (pair, half) where Hugging Face has
    (half, pair)."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _open(file: Path):
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(file))
    except (ValueError, OSError) as exc:
        raise ValueError(f"cannot read GGUF file {file}: {exc}") from None
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    for tensor in reader.tensors:
        if tensor.tensor_type.name not in SUPPORTED_TYPES:
            raise ValueError(f"GGUF tensor {tensor.name} is {tensor.tensor_type.name}, a type not supported; "
                             f"supported: {', '.join(SUPPORTED_TYPES)}")
    return reader, arch


def _field(reader, key: str, default=None):
    field = reader.get_field(key)
    if field is None:
        if default is None:
            raise ValueError(f"GGUF metadata has no {key}")
        return default
    return field.contents()
