"""GGUF files laid out as llama.cpp's ``convert_hf_to_gguf.py`` followed by ``llama-quantize`` writes them.

``write_gguf`` turns a float32 Hugging Face Llama, Qwen2 or Qwen3 directory into one ``.gguf``: llama.cpp's
tensor names and metadata keys, Llama's q/k rows permuted as the converter does, and each tensor in the
GGML type asked for. gguf-py quantizes Q8_0 and Q4_0; it has no Q4_K or Q6_K quantizer, so simple
round-to-nearest ones live here, writing ggml's block layout byte for byte (``gguf.quants.dequantize`` is
their reference).

No tokenizer metadata is written: the engine takes the tokenizer from the HF directory, and transformers
needs none to build the model because ``{arch}.vocab_size`` is written for every architecture.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType, LlamaFileType
from safetensors.numpy import load_file

QK_K = 256  # elements per K-quant super-block
ARCHS = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3}
# what llama-quantize records as general.file_type for a file made with that type
FILE_TYPES = {"F32": LlamaFileType.ALL_F32, "F16": LlamaFileType.MOSTLY_F16, "Q8_0": LlamaFileType.MOSTLY_Q8_0,
              "Q4_0": LlamaFileType.MOSTLY_Q4_0, "Q4_K": LlamaFileType.MOSTLY_Q4_K_M,
              "Q6_K": LlamaFileType.MOSTLY_Q6_K}


def write_gguf(src: Path, path: Path, *, types: dict[str, str] | None = None, default: str = "Q8_0") -> Path:
    """Writes path (a .gguf) from the model in src. types: regex over GGUF tensor names -> GGML type name
    ("F32", "F16", "Q8_0", "Q4_0", "Q4_K", "Q6_K"); first match wins; 1-D tensors (norms) are always F32.
    Returns path."""
    src, path = Path(src), Path(path)
    config = json.loads((src / "config.json").read_text())
    arch = config["model_type"]
    if arch not in ARCHS:
        raise ValueError(f"unsupported model_type {arch!r}; supported: {', '.join(ARCHS)}")
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[ARCHS[arch]])
    _write_metadata(writer, config, src.name, default)
    for name, data in gguf_tensors(src, config):
        qtype = tensor_type(name, data, types or {}, default)
        writer.add_tensor(name, quantize(data, qtype), raw_dtype=qtype)
    factors = rope_freqs(src)
    if factors is not None:  # Llama 3's rope scaling: llama.cpp's converter stores it as a tensor, in float32
        writer.add_tensor("rope_freqs.weight", factors, raw_dtype=GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_metadata(writer: gguf.GGUFWriter, config: dict, name: str, default: str) -> None:
    """The keys convert_hf_to_gguf writes for these architectures, plus vocab_size for all of them."""
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // heads
    writer.add_type("model")
    writer.add_name(name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads") or heads)
    writer.add_rope_freq_base(_rope_theta(config))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    # the converter writes these when config.json states head_dim, as create_model_dir's configs do
    if config.get("head_dim") is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    # llama's converter writes it; for Qwen llama.cpp (and transformers) would count tokenizer.ggml.tokens,
    # which this file leaves out, so state it directly
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(FILE_TYPES[default])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _rope_theta(config: dict) -> float:
    """transformers 5 keeps rope_theta under rope_parameters; older configs at the top level."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if params.get("rope_type", params.get("type", "default")) not in ("default", "llama3"):
        raise ValueError(f"rope scaling {params} is not written by this helper")  # it would silently vanish
    return float(params.get("rope_theta", config.get("rope_theta", 10000.0)))


def rope_freqs(src: Path) -> np.ndarray | None:
    """A llama3-scaled model's rope_freqs: what transformers' own llama3 rope divides each frequency by (the
    plain inverse frequencies over its scaled ones), as llama.cpp's converter writes them. None: no scaling."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = AutoConfig.from_pretrained(src)
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if params.get("rope_type") != "llama3":
        return None
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    plain = 1.0 / (_rope_theta(config.to_dict()) ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    return (plain / scaled.double()).float().numpy()


def gguf_tensors(src: Path, config: dict) -> list[tuple[str, np.ndarray]]:
    """(GGUF name, float32 array in HF [out, in] order) in the converter's order (sorted HF names);
    Llama's q/k already permuted."""
    weights: dict[str, np.ndarray] = {}
    for file in sorted(src.glob("*.safetensors")):
        weights.update(load_file(file))
    arch = config["model_type"]
    name_map = gguf.get_tensor_name_map(ARCHS[arch], config["num_hidden_layers"])
    tensors = []
    for hf_name in sorted(weights):
        if hf_name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue  # tied: llama.cpp writes no output.weight and reuses token_embd
        name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"no GGUF name for {hf_name}")
        data = weights[hf_name].astype(np.float32)
        if arch == "llama":
            data = _permute_llama(hf_name, data, config)
        tensors.append((name, data))
    return tensors


def _permute_llama(hf_name: str, data: np.ndarray, config: dict) -> np.ndarray:
    """LlamaModel.modify_tensors: q rows permuted with n_head, k rows with n_head_kv (weights and biases)."""
    heads = config["num_attention_heads"]
    if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
        return permute(data, heads, heads)
    if hf_name.endswith(("k_proj.weight", "k_proj.bias")):
        return permute(data, heads, config.get("num_key_value_heads") or heads)
    return data


def permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute: each head's rotary halves (HF, rotate_half) interleaved into
    pairs (GGML's rope over adjacent elements)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2)
            .reshape(weights.shape))


def unpermute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """The inverse of ``permute`` (what transformers' LlamaTensorProcessor does on load)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, weights.shape[0] // n_head // 2, 2, *weights.shape[1:])
            .swapaxes(1, 2)
            .reshape(weights.shape))


def tensor_type(name: str, data: np.ndarray, types: dict[str, str], default: str) -> GGMLQuantizationType:
    if data.ndim == 1:
        return GGMLQuantizationType.F32
    chosen = next((qtype for pattern, qtype in types.items() if re.search(pattern, name)), default)
    qtype = GGMLQuantizationType[chosen]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if data.shape[-1] % block:
        raise ValueError(f"{name}: rows of {data.shape[-1]} elements do not split into {chosen} blocks of {block}")
    return qtype


def quantize(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """Rows of data as ggml stores them in qtype: float arrays for F32/F16, uint8 blocks otherwise."""
    if qtype == GGMLQuantizationType.Q4_K:
        return _rows(data, quantize_q4_k_blocks)
    if qtype == GGMLQuantizationType.Q6_K:
        return _rows(data, quantize_q6_k_blocks)
    return gguf.quants.quantize(data, qtype)


def _rows(data: np.ndarray, quantize_blocks) -> np.ndarray:
    blocks = quantize_blocks(data.reshape(-1, QK_K).astype(np.float32))
    return blocks.reshape(*data.shape[:-1], -1)


def _round(x: np.ndarray) -> np.ndarray:
    """ggml's nearest_int rounds halves away from zero (np.round would go to even)."""
    return np.sign(x) * np.floor(np.abs(x) + 0.5)


def _fp16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the value as stored, its 2 little-endian bytes): later steps must use the rounded value."""
    half = x.astype(np.float16)
    return half.astype(np.float32), half.view(np.uint8).reshape(len(x), 2)


def _safe_div(x: np.ndarray, d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(d == 0, 0.0, x / np.where(d == 0, 1.0, d))


def quantize_q4_k_blocks(x: np.ndarray) -> np.ndarray:
    """[n, 256] floats -> [n, 144] block_q4_K: fp16 d, fp16 dmin, 12 bytes of 6-bit scales/mins, 128 nibbles.

    Each of the 8 sub-blocks of 32 gets x ~ d*sc*q - dmin*m with q in 0..15, sc and m 6-bit (min clamped to
    <= 0, as ggml's make_qkx2_quants does), round-to-nearest without ggml's search for better scales.
    """
    n = len(x)
    sub = x.reshape(n, 8, 32)
    lo = np.minimum(sub.min(axis=2), 0.0)  # [n, 8]
    scales, mins = (sub.max(axis=2) - lo) / 15, -lo
    d, d_bytes = _fp16(scales.max(axis=1) / 63)
    dmin, dmin_bytes = _fp16(mins.max(axis=1) / 63)
    sc = np.clip(_round(_safe_div(scales, d[:, None])), 0, 63).astype(np.uint8)
    m = np.clip(_round(_safe_div(mins, dmin[:, None])), 0, 63).astype(np.uint8)
    step, offset = (d[:, None] * sc)[..., None], (dmin[:, None] * m)[..., None]
    q = np.clip(_round(_safe_div(sub + offset, step)), 0, 15).astype(np.uint8)
    return np.concatenate([d_bytes, dmin_bytes, _pack_scale_min_k4(sc, m), _pack_q4_nibbles(q)], axis=1)


def _pack_scale_min_k4(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """ggml's get_scale_min_k4 layout: bytes 0-3 hold sc[0:4] plus sc[4:8]'s top 2 bits, bytes 4-7 m[0:4]
    plus m[4:8]'s top 2 bits, bytes 8-11 the low nibbles of sc[4:8] (low) and m[4:8] (high)."""
    return np.concatenate([
        sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
        m[:, :4] | ((m[:, 4:] >> 4) << 6),
        (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4),
    ], axis=1)


def _pack_q4_nibbles(q: np.ndarray) -> np.ndarray:
    """[n, 8, 32] -> [n, 128]: per 64 elements, 32 bytes with the first 32 in low nibbles, the next in high."""
    pairs = q.reshape(len(q), 4, 2, 32)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(len(q), 128)


def quantize_q6_k_blocks(x: np.ndarray) -> np.ndarray:
    """[n, 256] floats -> [n, 210] block_q6_K: 128 bytes ql, 64 bytes qh, 16 int8 scales, fp16 d.

    Each of the 16 sub-blocks of 16 gets x ~ d*sc*q with q in -32..31 and sc an int8; as in ggml's
    make_qx_quants, the element of largest magnitude lands on -32 (sign folded into the scale).
    """
    n = len(x)
    sub = x.reshape(n, 16, 16)
    peak = np.take_along_axis(sub, np.abs(sub).argmax(axis=2)[..., None], axis=2)[..., 0]  # [n, 16]
    scales = -peak / 32
    d, d_bytes = _fp16(np.abs(scales).max(axis=1) / 127)
    sc = np.clip(_round(_safe_div(scales, d[:, None])), -128, 127)
    step = (d[:, None] * sc)[..., None]
    q = (np.clip(_round(_safe_div(sub, step)), -32, 31) + 32).astype(np.uint8).reshape(n, 256)
    ql, qh = _pack_q6_bits(q)
    return np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), d_bytes], axis=1)


def _pack_q6_bits(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[n, 256] values 0..63 -> ql [n, 128], qh [n, 64], per 128 elements (quarters a, b, c, d of 32):
    ql[0:32] = a | c<<4, ql[32:64] = b | d<<4 (low 4 bits), qh[0:32] = a | b<<2 | c<<4 | d<<6 (top 2 bits)."""
    a, b, c, d = (q.reshape(len(q), 2, 4, 32)[:, :, i] for i in range(4))
    low = lambda v: v & 0xF  # noqa: E731
    high = lambda v: v >> 4  # noqa: E731
    ql = np.concatenate([low(a) | (low(c) << 4), low(b) | (low(d) << 4)], axis=2)  # [n, 2, 64]
    qh = high(a) | (high(b) << 2) | (high(c) << 4) | (high(d) << 6)  # [n, 2, 32]
    return ql.reshape(len(q), 128), qh.reshape(len(q), 64)
