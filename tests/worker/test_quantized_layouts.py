"""The quantized-checkpoint writer (tests/quantized_checkpoints.py) against the formats' own definitions:
compressed-tensors' decompressor and transformers' loader, bit-by-bit unpacking written here, tensor layouts
from the producers' sources, and quantization error within each format's step."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.quantized_checkpoints import QUANTIZED_WEIGHT, write_quantized

CASES = {
    "fp8": ("fp8", {}),
    "fp8-static": ("fp8", dict(static_activations=True)),
    "fp8-block-partial": ("fp8-block", dict(block=(48, 48))),  # 48 divides neither 64 nor 128
    "fp8-block": ("fp8-block", dict(block=(32, 32))),
    "ct-int8": ("ct-w8a8-int8", {}),
    "ct-int8-static": ("ct-w8a8-int8", dict(static_activations=True)),
    "ct-fp8": ("ct-w8a8-fp8", {}),
    "ct-w4-sym": ("ct-wNa16", dict(bits=4, group_size=32)),
    "ct-w4-asym": ("ct-wNa16", dict(bits=4, group_size=32, symmetric=False)),
    "ct-w8-channel-asym": ("ct-wNa16", dict(bits=8, group_size=0, symmetric=False)),
    "awq": ("awq", dict(group_size=32)),
    "gptq-w4-sym": ("gptq", dict(bits=4, group_size=32)),
    "gptq-w4-asym-act-order": ("gptq", dict(bits=4, group_size=32, symmetric=False, desc_act=True)),
    "gptq-w8-channel": ("gptq", dict(bits=8, group_size=0)),
}
CT_CASES = [case for case, (scheme, _) in CASES.items() if scheme.startswith("ct-")]
LAYER = "model.layers.0.self_attn.k_proj"  # [32, 64]: fewer outputs than inputs catches swapped axes
FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def source(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def written(source, tmp_path_factory):
    """case -> (quantized_dir, dequantized_dir), each written once."""
    made: dict[str, tuple[Path, Path]] = {}

    def get(case: str) -> tuple[Path, Path]:
        if case not in made:
            scheme, kwargs = CASES[case]
            made[case] = write_quantized(source, tmp_path_factory.mktemp(case), scheme, **kwargs)
        return made[case]

    return get


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(directory / "model.safetensors")


def _quant_config(directory: Path) -> dict:
    return json.loads((directory / "config.json").read_text())["quantization_config"]


def _layer(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k.removeprefix(f"{prefix}."): v for k, v in tensors.items() if k.startswith(f"{prefix}.")}


def _quantized_prefixes(source: Path) -> list[str]:
    return [k.removesuffix(".weight") for k in _tensors(source) if QUANTIZED_WEIGHT.fullmatch(k)]


# ---- layouts, from the producers' definitions -----------------------------------------------------------

def _expected_layout(scheme: str, kw: dict, out: int, cols: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    bits, g = kw.get("bits", 4), kw.get("group_size", 32) or cols
    static = {"input_scale": ((), torch.float32)} if kw.get("static_activations") else {}
    if scheme == "fp8":
        return {"weight": ((out, cols), FP8), "weight_scale": ((), torch.float32), **static}
    if scheme == "fp8-block":
        bo, bi = kw["block"]
        return {"weight": ((out, cols), FP8), "weight_scale_inv": ((-(-out // bo), -(-cols // bi)), torch.float32)}
    if scheme in ("ct-w8a8-int8", "ct-w8a8-fp8"):
        static = {"input_scale": ((1,), torch.float32)} if static else {}
        dtype = torch.int8 if scheme == "ct-w8a8-int8" else FP8
        return {"weight": ((out, cols), dtype), "weight_scale": ((out, 1), torch.float32), **static}
    if scheme == "ct-wNa16":
        zp = {} if kw.get("symmetric", True) else {"weight_zero_point": ((out * bits // 32, cols // g), torch.int32)}
        return {"weight_packed": ((out, cols * bits // 32), torch.int32), "weight_shape": ((2,), torch.int64),
                "weight_scale": ((out, cols // g), torch.float32), **zp}
    if scheme == "awq":
        return {"qweight": ((cols, out // 8), torch.int32), "qzeros": ((cols // g, out // 8), torch.int32),
                "scales": ((cols // g, out), torch.float16)}
    return {"qweight": ((cols * bits // 32, out), torch.int32), "qzeros": ((cols // g, out * bits // 32), torch.int32),
            "scales": ((cols // g, out), torch.float16), "g_idx": ((cols,), torch.int32)}


@pytest.mark.parametrize("case", CASES)
def test_every_tensor_has_the_formats_shape_and_dtype(case, source, written):
    scheme, kw = CASES[case]
    quantized = _tensors(written(case)[0])
    for prefix in _quantized_prefixes(source):
        out, cols = _tensors(source)[f"{prefix}.weight"].shape
        got = {k: (tuple(v.shape), v.dtype) for k, v in _layer(quantized, prefix).items()}
        assert got == _expected_layout(scheme, kw, out, cols), prefix


@pytest.mark.parametrize("case", CASES)
def test_other_tensors_and_files_are_copied_and_the_oracle_is_a_plain_float_model(case, source, written):
    quantized_dir, plain_dir = written(case)
    original, quantized, plain = _tensors(source), _tensors(quantized_dir), _tensors(plain_dir)
    assert plain.keys() == original.keys()
    for name, tensor in original.items():
        assert plain[name].dtype == tensor.dtype and plain[name].shape == tensor.shape
        if not QUANTIZED_WEIGHT.fullmatch(name):
            assert torch.equal(quantized[name], tensor) and torch.equal(plain[name], tensor), name
    for file in source.iterdir():
        if file.suffix != ".safetensors" and file.name != "config.json":
            assert (quantized_dir / file.name).read_bytes() == file.read_bytes() == (plain_dir / file.name).read_bytes()
    assert (plain_dir / "config.json").read_bytes() == (source / "config.json").read_bytes()
    source_config = json.loads((source / "config.json").read_text())
    quantized_config = json.loads((quantized_dir / "config.json").read_text())
    assert {k: v for k, v in quantized_config.items() if k != "quantization_config"} == source_config


def test_configs_are_what_the_producers_write(written):
    assert _quant_config(written("fp8-static")[0]) == {
        "quant_method": "fp8", "activation_scheme": "static", "fmt": "e4m3", "ignored_layers": ["lm_head"]}
    assert _quant_config(written("fp8-block-partial")[0]) == {
        "quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [48, 48]}
    assert _quant_config(written("awq")[0]) == {
        "quant_method": "awq", "zero_point": True, "group_size": 32, "bits": 4, "version": "gemm",
        "modules_to_not_convert": None}
    gptq_dir = written("gptq-w8-channel")[0]
    gptq = _quant_config(gptq_dir)
    keys = ("quant_method", "bits", "group_size", "desc_act", "sym", "checkpoint_format")
    assert {k: gptq[k] for k in keys} == {"quant_method": "gptq", "bits": 8, "group_size": -1, "desc_act": False,
                                          "sym": True, "checkpoint_format": "gptq"}
    assert json.loads((gptq_dir / "quantize_config.json").read_text()) == gptq


@pytest.mark.parametrize("case", CT_CASES)
def test_compressed_tensors_configs_name_the_library_scheme(case, written):
    scheme, kw = CASES[case]
    config = _quant_config(written(case)[0])
    group = config["config_groups"]["group_0"]
    fmt = {"ct-w8a8-int8": "int-quantized", "ct-w8a8-fp8": "float-quantized", "ct-wNa16": "pack-quantized"}[scheme]
    assert (config["quant_method"], config["format"], group["format"]) == ("compressed-tensors", fmt, fmt)
    assert (config["ignore"], group["targets"]) == (["lm_head"], ["Linear"])
    assert config["quantization_status"] == "compressed"
    weights, inputs = group["weights"], group["input_activations"]
    if scheme == "ct-wNa16":
        strategy = "group" if kw["group_size"] else "channel"
        assert (weights["num_bits"], weights["type"], weights["strategy"], weights["symmetric"]) == (
            kw["bits"], "int", strategy, kw.get("symmetric", True))
        assert weights["group_size"] == (kw["group_size"] or None) and inputs is None
        return
    kind = "int" if scheme == "ct-w8a8-int8" else "float"
    assert (weights["num_bits"], weights["type"], weights["strategy"]) == (8, kind, "channel")
    assert weights["symmetric"]
    expected = ("tensor", False) if kw.get("static_activations") else ("token", True)
    assert (inputs["num_bits"], inputs["type"], inputs["symmetric"]) == (8, kind, True)
    assert (inputs["strategy"], inputs["dynamic"]) == expected


# ---- compressed-tensors: the library's own decompression ------------------------------------------------

@pytest.mark.parametrize("case", CT_CASES)
def test_compressed_tensors_decompressor_gives_the_oracle_exactly(case, source, written):
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    quantized_dir, plain_dir = written(case)
    config = QuantizationConfig.model_validate(_quant_config(quantized_dir))
    scheme = config.config_groups["group_0"]
    compressor = BaseCompressor.get_value_from_registry(config.format)
    quantized, plain = _tensors(quantized_dir), _tensors(plain_dir)
    for prefix in _quantized_prefixes(source):
        weight = compressor.decompress(_layer(quantized, prefix), scheme)["weight"]
        assert weight.dtype == torch.float32 and torch.equal(weight, plain[f"{prefix}.weight"]), prefix


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`")  # dequantize=True is what we pass
@pytest.mark.parametrize("case", CT_CASES)
def test_transformers_loads_the_compressed_checkpoint_as_the_oracle(case, written):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    quantized_dir, plain_dir = written(case)
    # dequantize=True: transformers' compressed-tensors path decompresses every weight while loading.
    model = AutoModelForCausalLM.from_pretrained(quantized_dir, dtype=torch.float32,
                                                 quantization_config=CompressedTensorsConfig(dequantize=True))
    state = model.state_dict()
    for name, tensor in _tensors(plain_dir).items():
        assert torch.equal(state[name].float(), tensor), name


# ---- FP8 ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["fp8", "fp8-static", "ct-fp8"])
def test_fp8_scales_map_each_scales_amax_to_448(case, written):
    quantized = _layer(_tensors(written(case)[0]), LAYER)
    q = quantized["weight"].float()
    amax = q.abs().amax() if quantized["weight_scale"].dim() == 0 else q.abs().amax(dim=1)
    assert torch.all(amax == 448)


@pytest.mark.parametrize("case", ["fp8-block-partial", "fp8-block"])
def test_fp8_blocks_dequantize_block_by_block(case, source, written):
    """A loop over blocks, the last ones partial; every block's largest code is 448."""
    quantized_dir, plain_dir = written(case)
    bo, bi = CASES[case][1]["block"]
    quantized, plain = _tensors(quantized_dir), _tensors(plain_dir)
    for prefix in _quantized_prefixes(source):
        q, scale_inv = quantized[f"{prefix}.weight"].float(), quantized[f"{prefix}.weight_scale_inv"]
        expected = torch.empty_like(q)
        for i in range(scale_inv.shape[0]):
            for j in range(scale_inv.shape[1]):
                rows, cols = slice(i * bo, (i + 1) * bo), slice(j * bi, (j + 1) * bi)
                expected[rows, cols] = q[rows, cols] * scale_inv[i, j]
                assert q[rows, cols].abs().max() == 448
        assert torch.equal(expected, plain[f"{prefix}.weight"]), prefix


def test_fp8_whole_blocks_match_transformers_dequantization(source, written):
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    quantized_dir, plain_dir = written("fp8-block")
    quantized, plain = _tensors(quantized_dir), _tensors(plain_dir)
    for prefix in _quantized_prefixes(source):
        ours = plain[f"{prefix}.weight"]
        theirs = Fp8Dequantize(None)._dequantize_one(quantized[f"{prefix}.weight"],
                                                     quantized[f"{prefix}.weight_scale_inv"], torch.float32)
        assert torch.equal(theirs, ours), prefix


@pytest.mark.parametrize("case", ["fp8-static", "ct-int8-static"])
def test_static_input_scales_are_positive_and_per_layer(case, source, written):
    quantized = _tensors(written(case)[0])
    scales = [quantized[f"{prefix}.input_scale"] for prefix in _quantized_prefixes(source)]
    assert all(s.item() > 0 and math.isfinite(s.item()) for s in scales)
    assert len({s.item() for s in scales}) > 1  # calibrated per layer, not one constant


# ---- AWQ / GPTQ: unpacked bit by bit here ---------------------------------------------------------------

def _bits(word: int, shift: int, width: int) -> int:
    return ((word & 0xFFFFFFFF) >> shift) & ((1 << width) - 1)


def test_awq_unpacked_bit_by_bit_is_the_oracle(written):
    quantized_dir, plain_dir = written("awq")
    layer, plain = _layer(_tensors(quantized_dir), LAYER), _tensors(plain_dir)[f"{LAYER}.weight"]
    qweight, qzeros, scales = layer["qweight"].tolist(), layer["qzeros"].tolist(), layer["scales"].float()
    nibble_of_column = [0, 4, 1, 5, 2, 6, 3, 7]  # AutoAWQ packs columns 0..7 as nibbles 0,2,4,6,1,3,5,7
    out, cols = plain.shape
    expected = torch.empty(out, cols)
    for k in range(cols):
        for n in range(out):
            shift = 4 * nibble_of_column[n % 8]
            q, z = _bits(qweight[k][n // 8], shift, 4), _bits(qzeros[k // 32][n // 8], shift, 4)
            expected[n, k] = (q - z) * scales[k // 32, n]
    assert torch.equal(expected, plain)


@pytest.mark.parametrize("case", ["gptq-w4-sym", "gptq-w4-asym-act-order", "gptq-w8-channel"])
def test_gptq_unpacked_bit_by_bit_is_the_oracle(case, written):
    quantized_dir, plain_dir = written(case)
    bits = CASES[case][1]["bits"]
    per_word = 32 // bits
    layer, plain = _layer(_tensors(quantized_dir), LAYER), _tensors(plain_dir)[f"{LAYER}.weight"]
    qweight, qzeros, g_idx = layer["qweight"].tolist(), layer["qzeros"].tolist(), layer["g_idx"].tolist()
    scales = layer["scales"].float()
    out, cols = plain.shape
    expected = torch.empty(out, cols)
    for k in range(cols):
        for n in range(out):
            q = _bits(qweight[k // per_word][n], bits * (k % per_word), bits)
            zero = _bits(qzeros[g_idx[k]][n // per_word], bits * (n % per_word), bits) + 1  # v1 stores zero - 1
            expected[n, k] = (q - zero) * scales[g_idx[k], n]
    assert torch.equal(expected, plain)


@pytest.mark.parametrize("case, word", [("gptq-w4-sym", 0x77777777), ("gptq-w8-channel", 0x7F7F7F7F)])
def test_gptq_symmetric_zero_is_stored_as_half_range_minus_one(case, word, written):
    qzeros = _tensors(written(case)[0])[f"{LAYER}.qzeros"]
    assert torch.all(qzeros == word)


def test_gptq_group_index(written):
    plain = _tensors(written("gptq-w4-sym")[0])[f"{LAYER}.g_idx"]
    assert torch.equal(plain, torch.arange(64, dtype=torch.int32) // 32)
    act_order = _tensors(written("gptq-w4-asym-act-order")[0])[f"{LAYER}.g_idx"]
    assert not torch.all(act_order[1:] >= act_order[:-1])  # a permuted assignment, as act-order writes
    assert torch.bincount(act_order).tolist() == [32, 32]  # still whole groups


# ---- quantization error ---------------------------------------------------------------------------------

def _steps(scheme: str, kw: dict, layer: dict[str, torch.Tensor], shape: torch.Size) -> torch.Tensor:
    """The quantization step behind each weight element, [out, in]."""
    if scheme in ("ct-w8a8-int8", "ct-wNa16"):
        scale = layer["weight_scale"]
        return scale.repeat_interleave(shape[1] // scale.shape[1], dim=1)
    scales = layer["scales"].float()  # [groups, out]
    groups = layer["g_idx"].long() if scheme == "gptq" else torch.arange(shape[1]) // kw["group_size"]
    return scales[groups].t()


INT_CASES = [case for case, (scheme, _) in CASES.items() if scheme in ("ct-w8a8-int8", "ct-wNa16", "awq", "gptq")]


@pytest.mark.parametrize("case", INT_CASES)
def test_integer_formats_round_to_nearest_within_half_a_step(case, source, written):
    scheme, kw = CASES[case]
    quantized, plain, original = _tensors(written(case)[0]), _tensors(written(case)[1]), _tensors(source)
    # A float16 scale is within 2^-11 of its float value, so the grid can fall (2^bits - 1) * 2^-11 steps
    # short of a group's extremes; GPTQ v1 asymmetric zeros are kept >= 1, which can clip one more half step.
    slack = 0.5 + (2 ** kw.get("bits", 4) - 1) * 2**-11 if scheme in ("awq", "gptq") else 0.5
    slack += 0.5 if case == "gptq-w4-asym-act-order" else 0.0
    for prefix in _quantized_prefixes(source):
        w = original[f"{prefix}.weight"]
        steps = _steps(scheme, kw, _layer(quantized, prefix), w.shape)
        error = (plain[f"{prefix}.weight"] - w).abs()
        assert torch.all(error <= slack * steps + 1e-7), (prefix, (error / steps).max())


@pytest.mark.parametrize("case", ["fp8", "fp8-static", "fp8-block-partial", "fp8-block", "ct-fp8"])
def test_fp8_error_is_e4m3_rounding(case, source, written):
    """Three mantissa bits: at most 1/16 relative, plus half the subnormal spacing (2^-10 of a scale)."""
    quantized, plain, original = _tensors(written(case)[0]), _tensors(written(case)[1]), _tensors(source)
    for prefix in _quantized_prefixes(source):
        w, ours = original[f"{prefix}.weight"], plain[f"{prefix}.weight"]
        largest_scale = max(v.max().item() for k, v in _layer(quantized, prefix).items() if "scale" in k)
        assert torch.all((ours - w).abs() <= w.abs() / 16 + largest_scale * 2**-10 + 1e-7), prefix


@pytest.mark.parametrize("case, bound", [
    ("fp8", 0.05), ("fp8-block-partial", 0.05), ("ct-fp8", 0.05), ("ct-int8", 0.01), ("ct-w8-channel-asym", 0.01),
    ("gptq-w8-channel", 0.01), ("ct-w4-sym", 0.15), ("ct-w4-asym", 0.12), ("awq", 0.12), ("gptq-w4-sym", 0.15),
    ("gptq-w4-asym-act-order", 0.12)])
def test_relative_error_is_the_formats(case, bound, source, written):
    original, plain = _tensors(source), _tensors(written(case)[1])
    for prefix in _quantized_prefixes(source):
        w = original[f"{prefix}.weight"]
        relative = ((plain[f"{prefix}.weight"] - w).norm() / w.norm()).item()
        assert 0 < relative < bound, (prefix, relative)


def test_the_oracle_loads_in_transformers(written):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(written("gptq-w4-asym-act-order")[1], dtype=torch.float32,
                                                       output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched weights
    assert getattr(model.config, "quantization_config", None) is None


@pytest.mark.parametrize("scheme, kwargs", [
    ("int4", {}), ("awq", dict(bits=8)), ("gptq", dict(bits=3)), ("ct-wNa16", dict(static_activations=True)),
    ("gptq", dict(desc_act=True, group_size=0))])
def test_unsupported_requests_are_refused(scheme, kwargs, source, tmp_path):
    with pytest.raises(ValueError):
        write_quantized(source, tmp_path, scheme, **kwargs)
