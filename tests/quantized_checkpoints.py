"""Quantized checkpoints in the on-disk layouts real producers write, and their dequantized oracles.

``write_quantized`` turns a float32 Hugging Face Llama-family directory into two directories: the quantized
checkpoint (what AutoFP8, DeepSeek-V3's FP8 release, llm-compressor/compressed-tensors, AutoAWQ or AutoGPTQ
would have written) and a plain float32 model whose decoder projections are the format's own dequantization
of exactly the tensors written. The engine loads the first; transformers runs the second as the oracle, so
the two differ only by how the engine computes, never by quantization error.

Only ``model.layers.N.self_attn.{q,k,v,o}_proj.weight`` and ``model.layers.N.mlp.{gate,up,down}_proj.weight``
are quantized; biases, embeddings, norms and lm_head are copied as they are.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

SCHEMES = ("fp8", "fp8-block", "ct-w8a8-int8", "ct-w8a8-fp8", "ct-wNa16", "awq", "gptq")
# The decoder's projections, a sparse layer's experts and shared expert included (their router is not).
QUANTIZED_WEIGHT = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj"
                              r"|mlp\.(experts\.\d+\.|shared_expert\.)?(gate|up|down)_proj)\.weight")
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ GEMM: nibble i of a word holds column 8*word + AWQ_ORDER[i]
_STATIC_SCHEMES = ("fp8", "ct-w8a8-int8")
_CT_FORMATS = {"ct-w8a8-int8": "int-quantized", "ct-w8a8-fp8": "float-quantized", "ct-wNa16": "pack-quantized"}


@dataclass(frozen=True)
class _Options:
    scheme: str
    group_size: int
    symmetric: bool
    bits: int
    block: tuple[int, int]
    desc_act: bool
    static_activations: bool


def write_quantized(src: Path, dst: Path, scheme: str, *, group_size: int = 32, symmetric: bool = True,
                    bits: int = 4, block: tuple[int, int] = (32, 32), desc_act: bool = False,
                    static_activations: bool = False, seed: int = 0) -> tuple[Path, Path]:
    """Returns (quantized_dir, dequantized_dir), both created under dst.

    group_size 0 means per output channel (ct-wNa16, gptq); ``symmetric`` applies to ct-wNa16 and gptq
    (AWQ GEMM always stores zero points); ``bits`` to ct-wNa16 and gptq (AWQ is 4-bit only); ``block`` to
    fp8-block; ``desc_act`` to gptq; ``static_activations`` to fp8 and ct-w8a8-int8 (their per-layer
    input_scale is calibrated on seeded random tokens through the weight-quantized model). ``seed`` drives the
    act-order permutation and the calibration tokens.
    """
    src, dst = Path(src), Path(dst)
    opts = _Options(scheme, group_size, symmetric, bits, tuple(block), desc_act, static_activations)
    _validate(opts)
    generator = torch.Generator().manual_seed(seed)
    weights = _load_weights(src)
    quant_config = _quantization_config(opts)
    quantized, plain = {}, {}
    for name, tensor in weights.items():
        if not QUANTIZED_WEIGHT.fullmatch(name):
            quantized[name] = plain[name] = tensor
            continue
        prefix = name.removesuffix(".weight")
        stored = _QUANTIZERS[scheme](tensor.float(), opts, generator)
        stored = _ct_compress(stored, quant_config) if scheme in _CT_FORMATS else stored
        quantized.update({f"{prefix}.{key}": value for key, value in stored.items()})
        plain[name] = dequantize_linear(quant_config, stored).to(tensor.dtype)
    quantized_dir, plain_dir = dst / "quantized", dst / "dequantized"
    _write_dir(src, plain_dir, plain)
    if static_activations:  # observed with the weights already quantized, as AutoFP8 and llm-compressor do
        for prefix, (low, high) in _calibrate(plain_dir, generator).items():
            quantized[f"{prefix}.input_scale"] = _input_scale(opts, low, high)
    _write_dir(src, quantized_dir, quantized)
    _write_quantization_config(quantized_dir, opts, quant_config)
    return quantized_dir, plain_dir


def dequantize_linear(quant_config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The float32 [out, in] weight a format's published dequantization gives for one Linear's tensors.

    Reads only what is on disk (the config's quantization_config and the layer's tensors, local names), so
    the oracle is exactly the checkpoint's numbers.
    """
    method = quant_config["quant_method"]
    if method == "fp8" and "weight_block_size" in quant_config:
        return _dequantize_fp8_block(tensors["weight"], tensors["weight_scale_inv"],
                                     quant_config["weight_block_size"])
    if method == "fp8":
        return tensors["weight"].float() * tensors["weight_scale"].float()
    if method == "compressed-tensors":
        return _dequantize_ct(quant_config, tensors)
    if method == "awq":
        return _dequantize_awq(tensors, quant_config["group_size"])
    if method == "gptq":
        return _dequantize_gptq(tensors, quant_config["bits"])
    raise ValueError(f"unknown quant_method {method!r}")


# ---- validation, files ----------------------------------------------------------------------------------

def _validate(opts: _Options) -> None:
    if opts.scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {opts.scheme!r}; one of {SCHEMES}")
    if opts.static_activations and opts.scheme not in _STATIC_SCHEMES:
        raise ValueError(f"static activations are written only for {_STATIC_SCHEMES}")
    if opts.scheme == "awq" and (opts.bits != 4 or opts.group_size <= 0):
        raise ValueError("AutoAWQ GEMM is 4-bit with a positive group_size")
    if opts.scheme in ("ct-wNa16", "gptq") and opts.bits not in (4, 8):
        raise ValueError("bits must be 4 or 8")
    if opts.scheme == "gptq" and opts.desc_act and opts.group_size <= 0:
        raise ValueError("desc_act needs groups")  # act-order only matters with groups


def _load_weights(src: Path) -> dict[str, torch.Tensor]:
    """All tensors of the (maybe sharded) checkpoint, in name order."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(file))
    return dict(sorted(tensors.items()))


def _write_dir(src: Path, out: Path, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy every non-weight file (config, tokenizer, generation config) and write one safetensors file."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for file in src.iterdir():
        if file.is_file() and not file.name.endswith((".safetensors", ".safetensors.index.json")):
            shutil.copy2(file, out / file.name)
    save_file({k: v.contiguous() for k, v in tensors.items()}, out / "model.safetensors",
              metadata={"format": "pt"})


def _write_quantization_config(out: Path, opts: _Options, quant_config: dict[str, Any]) -> None:
    if opts.scheme in _CT_FORMATS:
        # The library writes its own block (version, sorted keys), as llm-compressor's save does.
        from compressed_tensors.compressors import ModelCompressor
        from compressed_tensors.quantization import QuantizationConfig

        qc = QuantizationConfig.model_validate({k: v for k, v in quant_config.items() if k != "quant_method"})
        ModelCompressor(quantization_config=qc).update_config(str(out))
        return
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = quant_config
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if opts.scheme == "gptq":  # AutoGPTQ also saves it alone; some loaders read only this file
        (out / "quantize_config.json").write_text(json.dumps(quant_config, indent=2) + "\n")


# ---- quantization_config blocks -------------------------------------------------------------------------

def _quantization_config(opts: _Options) -> dict[str, Any]:
    if opts.scheme == "fp8":  # AutoFP8
        return {"quant_method": "fp8", "activation_scheme": "static" if opts.static_activations else "dynamic",
                "fmt": "e4m3", "ignored_layers": ["lm_head"]}
    if opts.scheme == "fp8-block":  # DeepSeek-V3's config.json, block size ours
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                "weight_block_size": list(opts.block)}
    if opts.scheme == "awq":  # AutoAWQ's to_transformers_dict
        return {"quant_method": "awq", "zero_point": True, "group_size": opts.group_size, "bits": 4,
                "version": "gemm", "modules_to_not_convert": None}
    if opts.scheme == "gptq":  # AutoGPTQ's BaseQuantizeConfig.to_dict
        return {"bits": opts.bits, "group_size": opts.group_size if opts.group_size > 0 else -1,
                "damp_percent": 0.01, "desc_act": opts.desc_act, "static_groups": False, "sym": opts.symmetric,
                "true_sequential": True, "model_name_or_path": None, "model_file_base_name": None,
                "quant_method": "gptq", "checkpoint_format": "gptq"}
    return _ct_config(opts)


def _ct_config(opts: _Options) -> dict[str, Any]:
    """The config llm-compressor saves: one group of the library's preset scheme, lm_head ignored."""
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationStatus,
                                                 preset_name_to_scheme)

    fmt = _CT_FORMATS[opts.scheme]
    if opts.scheme == "ct-wNa16":
        scheme = preset_name_to_scheme(f"W{opts.bits}A16", ["Linear"])
        grouped = opts.group_size > 0
        scheme.weights = QuantizationArgs(
            num_bits=opts.bits, type="int", symmetric=opts.symmetric, dynamic=False,
            strategy="group" if grouped else "channel", group_size=opts.group_size if grouped else None)
    else:
        scheme = preset_name_to_scheme("W8A8" if opts.scheme == "ct-w8a8-int8" else "FP8_DYNAMIC", ["Linear"])
        if opts.static_activations:
            scheme.input_activations = QuantizationArgs(num_bits=8, type="int", symmetric=True,
                                                        strategy="tensor", dynamic=False)
    scheme.format = fmt  # compress_module records the format on the scheme, so saved groups carry it
    config = QuantizationConfig(config_groups={"group_0": scheme}, format=fmt, ignore=["lm_head"],
                                quantization_status=QuantizationStatus.COMPRESSED)
    return json.loads(json.dumps(config.model_dump()))  # plain JSON types, as read back from config.json


def _ct_scheme(quant_config: Mapping[str, Any]):
    from compressed_tensors.quantization import QuantizationConfig

    config = QuantizationConfig.model_validate({k: v for k, v in quant_config.items() if k != "quant_method"})
    return config.config_groups["group_0"]


# ---- FP8 ------------------------------------------------------------------------------------------------

def _to_fp8(scaled: torch.Tensor) -> torch.Tensor:
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _autofp8_scale(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoFP8's per_tensor_quantize: the multiplier 448 / amax and the stored 0-dim scale, its reciprocal."""
    multiplier = FP8_MAX / amax.clamp(min=1e-12)
    return multiplier, multiplier.float().reciprocal().reshape(())


def _quantize_fp8(w: torch.Tensor, opts: _Options, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """AutoFP8 per-tensor: a 0-dim float32 weight_scale (amax / 448)."""
    multiplier, scale = _autofp8_scale(w.abs().max())
    return {"weight": _to_fp8(w * multiplier), "weight_scale": scale}


def _expand_blocks(scales: torch.Tensor, block: tuple[int, int], shape: torch.Size) -> torch.Tensor:
    """One scale per element; edge blocks are partial, so the expansion is cut to the weight's shape."""
    rows, cols = block
    return scales.repeat_interleave(rows, 0).repeat_interleave(cols, 1)[: shape[0], : shape[1]]


def _quantize_fp8_block(w: torch.Tensor, opts: _Options, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """DeepSeek-V3: float32 weight_scale_inv [ceil(out/bo), ceil(in/bi)], the multiplier back to float."""
    rows, cols = opts.block
    padded = torch.nn.functional.pad(w.abs(), (0, -w.shape[1] % cols, 0, -w.shape[0] % rows))
    amax = padded.unflatten(1, (-1, cols)).unflatten(0, (-1, rows)).amax(dim=(1, 3))
    scale_inv = amax.clamp(min=1e-12) / FP8_MAX
    return {"weight": _to_fp8(w / _expand_blocks(scale_inv, opts.block, w.shape)),
            "weight_scale_inv": scale_inv.float()}


def _dequantize_fp8_block(q: torch.Tensor, scale_inv: torch.Tensor, block: list[int]) -> torch.Tensor:
    return q.float() * _expand_blocks(scale_inv.float(), tuple(block), q.shape)


# ---- compressed-tensors ---------------------------------------------------------------------------------

def _quantize_ct(w: torch.Tensor, opts: _Options, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Scales and zero points as llm-compressor's min-max observer computes them (the library's own
    calculate_qparams); the weight stays float here and the library's compressor quantizes it."""
    from compressed_tensors.quantization.utils import calculate_qparams

    args = _ct_scheme(_ct_config(opts)).weights
    grouped = args.strategy == "group"
    view = w.unflatten(1, (-1, args.group_size)) if grouped else w.unsqueeze(1)
    scale, zero_point = calculate_qparams(view.amin(-1), view.amax(-1), args)
    return {"weight": w, "weight_scale": scale, "weight_zero_point": zero_point}


def _ct_compress(stored: dict[str, torch.Tensor], quant_config: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The library's own compressor (int-quantized, float-quantized or pack-quantized) makes the tensors."""
    from compressed_tensors.compressors import BaseCompressor

    compressor = BaseCompressor.get_value_from_registry(quant_config["format"])
    return dict(sorted(compressor.compress(stored, _ct_scheme(quant_config)).items()))


def _unpack_sequential(words: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Values packed along the last dim, value j of each word at bits [j*bits, (j+1)*bits)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    values = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return values.flatten(-2)[..., :count]


def _dequantize_ct(quant_config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """(q - zero_point) * scale, each scale over its channel or group; packed values are offset by 2^(bits-1)."""
    args = quant_config["config_groups"]["group_0"]["weights"]
    scale = tensors["weight_scale"].float()
    if quant_config["format"] == "pack-quantized":
        bits = args["num_bits"]
        out, cols = tensors["weight_shape"].tolist()
        q = _unpack_sequential(tensors["weight_packed"], bits, cols).float() - 2 ** (bits - 1)
        if "weight_zero_point" in tensors:  # packed along the output dim
            zp = _unpack_sequential(tensors["weight_zero_point"].t(), bits, out).t().float() - 2 ** (bits - 1)
            q = q - zp.repeat_interleave(cols // zp.shape[1], dim=1)
    else:
        q = tensors["weight"].float()
    return q * scale.repeat_interleave(q.shape[1] // scale.shape[1], dim=1)


# ---- AWQ ------------------------------------------------------------------------------------------------

def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words (held in int64) as the int32 the formats store, same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _pack_awq(values: torch.Tensor) -> torch.Tensor:
    """[rows, cols] nibbles -> [rows, cols/8] int32 in AWQ's interleaved order."""
    grouped = values.long().unflatten(1, (-1, 8))
    words = sum(grouped[..., column] << (4 * i) for i, column in enumerate(AWQ_ORDER))
    return _to_int32(words)


def _unpack_awq(words: torch.Tensor) -> torch.Tensor:
    nibbles = (words.unsqueeze(-1) >> torch.arange(0, 32, 4, dtype=torch.int32)) & 0xF
    return nibbles[..., list(_inverse(AWQ_ORDER))].flatten(-2)


def _inverse(order: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(order.index(column) for column in range(len(order)))


def _quantize_awq(w: torch.Tensor, opts: _Options, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """AutoAWQ's asymmetric per-group min-max (no forced zero in range), scales stored float16; the integers
    are rounded against the stored float16 scales so they and the oracle agree."""
    g = opts.group_size
    groups = w.t().unflatten(0, (-1, g))  # [in/g, g, out]
    low, high = groups.amin(1), groups.amax(1)
    scales = ((high - low).clamp(min=1e-5) / 15).half()
    zeros = (-torch.round(low / scales.float())).clamp(0, 15)
    q = (torch.round(groups / scales.float().unsqueeze(1)) + zeros.unsqueeze(1)).clamp(0, 15).flatten(0, 1)
    return {"qweight": _pack_awq(q), "qzeros": _pack_awq(zeros), "scales": scales}


def _dequantize_awq(tensors: Mapping[str, torch.Tensor], group_size: int) -> torch.Tensor:
    q, zeros = _unpack_awq(tensors["qweight"]), _unpack_awq(tensors["qzeros"])
    scales = tensors["scales"].float()
    w = (q - zeros.repeat_interleave(group_size, 0)).float() * scales.repeat_interleave(group_size, 0)
    return w.t()  # AWQ stores [in, out]


# ---- GPTQ -----------------------------------------------------------------------------------------------

def _pack_gptq(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Sequential packing along ``dim``: value j of each run of 32/bits sits at bits j*bits of its word."""
    per_word = 32 // bits
    runs = values.long().unflatten(dim, (-1, per_word))
    words = sum(runs.select(dim + 1, j) << (bits * j) for j in range(per_word))
    return _to_int32(words)


def _gptq_groups(w: torch.Tensor, opts: _Options, generator: torch.Generator) -> torch.Tensor:
    """g_idx: input column -> group. With act-order GPTQ quantizes columns in a permuted order, so group i
    holds perm[i*g:(i+1)*g] and g_idx[perm[i]] = i // g."""
    columns = w.shape[1]
    g = opts.group_size if opts.group_size > 0 else columns
    perm = torch.randperm(columns, generator=generator) if opts.desc_act else torch.arange(columns)
    g_idx = torch.empty(columns, dtype=torch.int32)
    g_idx[perm] = (torch.arange(columns) // g).to(torch.int32)
    return g_idx


def _gptq_params(groups: torch.Tensor, opts: _Options) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ's Quantizer.find_params per output row and group: float16 scales, integer zeros [out, groups]."""
    maxq = 2**opts.bits - 1
    low = groups.amin(-1).clamp(max=0)
    high = groups.amax(-1).clamp(min=0)
    if opts.symmetric:
        high = torch.maximum(low.abs(), high)
        low = torch.where(low < 0, -high, low)
    both_zero = (low == 0) & (high == 0)
    low, high = torch.where(both_zero, -1.0, low), torch.where(both_zero, 1.0, high)
    scales = ((high - low) / maxq).half()
    if opts.symmetric:
        return scales, torch.full_like(low, (maxq + 1) // 2)
    # v1 stores zero - 1: a zero of 0 would underflow the packed word (AutoGPTQ's uint32 cast corrupts it),
    # so real v1 checkpoints never hold one; keep zeros >= 1.
    return scales, torch.round(-low / scales.float()).clamp(1, maxq)


def _quantize_gptq(w: torch.Tensor, opts: _Options, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """AutoGPTQ v1 layout, round-to-nearest against the stored float16 scales."""
    g_idx = _gptq_groups(w, opts, generator)
    n_groups = int(g_idx.max()) + 1
    order = torch.argsort(g_idx, stable=True)  # columns of group 0, then group 1, ...
    scales, zeros = _gptq_params(w[:, order].unflatten(1, (n_groups, -1)), opts)  # [out, n_groups]
    scale_per_col, zero_per_col = scales.float()[:, g_idx], zeros[:, g_idx]
    q = (torch.round(w / scale_per_col) + zero_per_col).clamp(0, 2**opts.bits - 1)
    return {"qweight": _pack_gptq(q.t(), opts.bits, 0), "qzeros": _pack_gptq(zeros.t() - 1, opts.bits, 1),
            "scales": scales.t().contiguous(), "g_idx": g_idx}


def _dequantize_gptq(tensors: Mapping[str, torch.Tensor], bits: int) -> torch.Tensor:
    """w[k, n] = (q[k, n] - (stored_zero[g_idx[k], n] + 1)) * scales[g_idx[k], n], then to [out, in]."""
    g_idx = tensors["g_idx"].long()
    scales = tensors["scales"].float()
    q = _unpack_sequential(tensors["qweight"].t(), bits, len(g_idx)).t()  # [in, out]
    zeros = _unpack_sequential(tensors["qzeros"], bits, scales.shape[1]) + 1  # [groups, out]
    return ((q - zeros[g_idx]).float() * scales[g_idx]).t()


_QUANTIZERS: dict[str, Callable[[torch.Tensor, _Options, torch.Generator], dict[str, torch.Tensor]]] = {
    "fp8": _quantize_fp8, "fp8-block": _quantize_fp8_block, "ct-w8a8-int8": _quantize_ct,
    "ct-w8a8-fp8": _quantize_ct, "ct-wNa16": _quantize_ct, "awq": _quantize_awq, "gptq": _quantize_gptq}


# ---- static activation scales ---------------------------------------------------------------------------

def _calibrate(model_dir: Path, generator: torch.Generator) -> dict[str, tuple[float, float]]:
    """(min, max) of each quantized projection's input over seeded random prompts through ``model_dir``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ranges: dict[str, tuple[float, float]] = {}

    def record(name: str):
        def hook(_module, inputs, _output):
            x = inputs[0].detach()
            low, high = ranges.get(name, (0.0, 0.0))
            ranges[name] = (min(low, x.min().item()), max(high, x.max().item()))
        return hook

    handles = [module.register_forward_hook(record(name)) for name, module in model.named_modules()
               if QUANTIZED_WEIGHT.fullmatch(f"{name}.weight")]
    tokens = torch.randint(0, model.config.vocab_size, (4, 32), generator=generator)
    with torch.no_grad():
        model(tokens)
    for handle in handles:
        handle.remove()
    return ranges


def _input_scale(opts: _Options, low: float, high: float) -> torch.Tensor:
    """fp8 (AutoFP8): 0-dim amax / 448. compressed-tensors: the library's qparams for a static tensor scale,
    shape [1]."""
    if opts.scheme == "fp8":
        return _autofp8_scale(torch.tensor(max(abs(low), abs(high))))[1]
    from compressed_tensors.quantization.utils import calculate_qparams

    args = _ct_scheme(_ct_config(opts)).input_activations
    scale, _ = calculate_qparams(torch.tensor(low), torch.tensor(high), args)
    return scale.float()
