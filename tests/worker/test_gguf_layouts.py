"""The GGUF writer (tests/gguf_checkpoints.py) against its readers: transformers' GGUF loader recovers the
source weights exactly from F32 files (so Llama's q/k permutation is llama.cpp's), and the stored blocks of
each quantized type, as gguf-py dequantizes them, are what transformers loads and are close to the source.
The K-quant blocks are also read by a transliteration of ggml's C dequantizers, independent of gguf-py."""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.gguf_checkpoints import QK_K, quantize, tensor_type, unpermute, write_gguf

SHAPE = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512)
# transformers reads no head_dim for qwen3 GGUFs (its GGUF_CONFIG_MAPPING["qwen3"] lacks attention.key_length)
# and Qwen3Config defaults it to 128, so a loadable Qwen3 has head_dim 128 (here != hidden / heads, as in real ones)
MODELS = {"llama": dict(model_type="llama"), "qwen2": dict(model_type="qwen2", head_dim=64),
          "qwen3": dict(model_type="qwen3", head_dim=128),
          "qwen2-tied": dict(model_type="qwen2", head_dim=64, tie_word_embeddings=True)}
# relative RMS error of round-to-nearest on N(0, σ) weights: ~0.5%, ~8.5%, ~7.5%, ~1.9%
TOLERANCE = {"Q8_0": 0.01, "Q4_0": 0.12, "Q4_K": 0.10, "Q6_K": 0.03}
QK = re.compile(r"\.attn_([qk])\.")


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    from services.worker.model_factory import create_model_dir

    root = tmp_path_factory.mktemp("gguf-sources")
    return {name: create_model_dir(root / name, **SHAPE, **kwargs) for name, kwargs in MODELS.items()}


def _load(gguf_path: Path) -> dict[str, torch.Tensor]:
    """The state dict transformers builds from the file (its config from the file's metadata too)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    return model.state_dict()


def _stored(gguf_path: Path, model_type: str) -> dict[str, np.ndarray]:
    """Each tensor as gguf-py dequantizes its bytes, in HF [out, in] order, Llama's q/k un-permuted."""
    reader = gguf.GGUFReader(gguf_path)
    tensors = {}
    for tensor in reader.tensors:
        data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if model_type == "llama" and (match := QK.search(tensor.name)):
            kv = SHAPE["num_key_value_heads"] if match[1] == "k" else SHAPE["num_attention_heads"]
            data = unpermute(data, SHAPE["num_attention_heads"], kv)
        tensors[tensor.name] = data
    return tensors


@pytest.mark.parametrize("name", list(MODELS))
def test_f32_round_trips_exactly(sources, tmp_path, name):
    src = sources[name]
    loaded = _load(write_gguf(src, tmp_path / "model.gguf", default="F32"))
    original = load_file(src / "model.safetensors")
    if MODELS[name].get("tie_word_embeddings"):
        original.setdefault("lm_head.weight", original["model.embed_tokens.weight"])
    assert loaded.keys() == original.keys()
    for key, value in original.items():
        assert torch.equal(loaded[key], value), key


def test_llama_q_k_are_stored_permuted(sources, tmp_path):
    """Without this the round trip above could pass with no permutation on either side."""
    path = write_gguf(sources["llama"], tmp_path / "model.gguf", default="F32")
    stored = {t.name: np.array(t.data) for t in gguf.GGUFReader(path).tensors}
    original = load_file(sources["llama"] / "model.safetensors")
    q = original["model.layers.0.self_attn.q_proj.weight"].numpy()
    assert not np.array_equal(stored["blk.0.attn_q.weight"], q)
    # head 0, rotary pair 0: HF rows 0 and head_dim/2 become GGML rows 0 and 1
    np.testing.assert_array_equal(stored["blk.0.attn_q.weight"][:2], q[[0, 32]])
    np.testing.assert_array_equal(stored["blk.0.attn_v.weight"],
                                  original["model.layers.0.self_attn.v_proj.weight"].numpy())


@pytest.mark.parametrize("qtype", list(TOLERANCE))
@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_quantized_loads_as_gguf_py_dequantizes(sources, tmp_path, name, qtype):
    src = sources[name]
    path = write_gguf(src, tmp_path / "model.gguf", default=qtype)
    loaded, original = _load(path), load_file(src / "model.safetensors")
    stored = _stored(path, MODELS[name]["model_type"])
    assert stored.keys() == {_gguf_name(key, name) for key in original}
    for key, source in original.items():
        data = stored[_gguf_name(key, name)]
        np.testing.assert_array_equal(loaded[key].numpy(), data, err_msg=key)
        error = np.linalg.norm(data - source.numpy()) / np.linalg.norm(source.numpy())
        assert error <= (TOLERANCE[qtype] if data.ndim == 2 else 0), (key, error)


def _gguf_name(hf_name: str, name: str) -> str:
    arch = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2,
            "qwen3": gguf.MODEL_ARCH.QWEN3}[MODELS[name]["model_type"]]
    return gguf.get_tensor_name_map(arch, SHAPE["num_hidden_layers"]).get_name(hf_name, (".weight", ".bias"))


def test_types_by_pattern_and_ggml_shapes(sources, tmp_path):
    """First matching pattern wins, norms stay F32, and an HF [out, in] weight has ggml ne = [in, out]."""
    types = {r"attn_v|ffn_down": "Q6_K", r"^token_embd": "F16", r"blk\.\d+\.attn_": "Q8_0"}
    path = write_gguf(sources["qwen2"], tmp_path / "model.gguf", types=types, default="Q4_K")
    reader = gguf.GGUFReader(path)
    kinds = {t.name: t.tensor_type.name for t in reader.tensors}
    assert kinds["blk.0.attn_v.weight"] == kinds["blk.1.ffn_down.weight"] == "Q6_K"
    assert kinds["blk.0.attn_q.weight"] == kinds["blk.0.attn_output.weight"] == "Q8_0"
    assert kinds["blk.0.attn_q.bias"] == kinds["blk.0.attn_norm.weight"] == kinds["output_norm.weight"] == "F32"
    assert (kinds["token_embd.weight"], kinds["output.weight"], kinds["blk.0.ffn_up.weight"]) == ("F16", "Q4_K", "Q4_K")
    shapes = {t.name: [int(n) for n in t.shape] for t in reader.tensors}  # ne: fastest-moving first
    assert shapes["blk.0.ffn_down.weight"] == [512, 256] and shapes["blk.0.attn_k.weight"] == [256, 128]
    assert reader.get_field("general.file_type").contents() == gguf.LlamaFileType.MOSTLY_Q4_K_M
    tied = gguf.GGUFReader(write_gguf(sources["qwen2-tied"], tmp_path / "tied.gguf", default="F32"))
    assert "output.weight" not in {t.name for t in tied.tensors}  # llama.cpp reuses token_embd


@pytest.mark.parametrize("name", list(MODELS))
def test_metadata_gives_the_source_config(sources, tmp_path, name):
    from transformers import AutoConfig

    src = sources[name]
    path = write_gguf(src, tmp_path / "model.gguf")
    config, expected = AutoConfig.from_pretrained(tmp_path, gguf_file=path.name), AutoConfig.from_pretrained(src)
    fields = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings")
    assert {f: getattr(config, f) for f in fields} == {f: getattr(expected, f) for f in fields}
    assert _head_dim(config) == _head_dim(expected)  # Qwen2's GGUF config has none: hidden / heads, as modeled
    assert config.rope_parameters["rope_theta"] == expected.rope_parameters["rope_theta"]
    assert config.rms_norm_eps == pytest.approx(expected.rms_norm_eps, rel=1e-6)  # stored as float32
    fields = gguf.GGUFReader(path).fields
    arch = MODELS[name]["model_type"]
    assert fields[f"{arch}.rope.dimension_count"].contents() == fields[f"{arch}.attention.key_length"].contents()
    assert not any(key.startswith("tokenizer.") for key in fields)


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def test_rows_that_do_not_split_into_blocks_are_refused():
    with pytest.raises(ValueError, match="blocks of 256"):
        tensor_type("blk.0.ffn_down.weight", np.zeros((4, 320), np.float32), {}, "Q4_K")


# ggml-quants.c's dequantize_row_q4_K and dequantize_row_q6_K, element by element.
def _ggml_q4_k(block: bytes) -> list[float]:
    d, dmin = np.frombuffer(block[:4], np.float16).astype(np.float32)
    scales, q = block[4:16], block[16:]

    def scale_min(j: int) -> tuple[int, int]:
        if j < 4:
            return scales[j] & 63, scales[j + 4] & 63
        return (scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4), (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4)

    out = []
    for j in range(0, QK_K // 64):
        (sc1, m1), (sc2, m2) = scale_min(2 * j), scale_min(2 * j + 1)
        chunk = q[32 * j: 32 * j + 32]
        out += [d * sc1 * (b & 0xF) - dmin * m1 for b in chunk]
        out += [d * sc2 * (b >> 4) - dmin * m2 for b in chunk]
    return out


def _ggml_q6_k(block: bytes) -> list[float]:
    ql, qh = block[:128], block[128:192]
    sc = np.frombuffer(block[192:208], np.int8)
    d = float(np.frombuffer(block[208:210], np.float16)[0])
    out = [0.0] * QK_K
    for half in range(2):
        l_, h_, s_, y = ql[64 * half:], qh[32 * half:], sc[8 * half:], 128 * half
        for e in range(32):
            i = e // 16
            q1 = ((l_[e] & 0xF) | (((h_[e] >> 0) & 3) << 4)) - 32
            q2 = ((l_[e + 32] & 0xF) | (((h_[e] >> 2) & 3) << 4)) - 32
            q3 = ((l_[e] >> 4) | (((h_[e] >> 4) & 3) << 4)) - 32
            q4 = ((l_[e + 32] >> 4) | (((h_[e] >> 6) & 3) << 4)) - 32
            out[y + e], out[y + e + 32] = d * s_[i] * q1, d * s_[i + 2] * q2
            out[y + e + 64], out[y + e + 96] = d * s_[i + 4] * q3, d * s_[i + 6] * q4
    return out


@pytest.mark.parametrize("qtype, reference, tolerance", [("Q4_K", _ggml_q4_k, 0.10), ("Q6_K", _ggml_q6_k, 0.03)])
def test_k_quant_blocks_read_as_ggml_reads_them(qtype, reference, tolerance):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((3, QK_K)) * np.array([[0.02], [1.0], [30.0]])).astype(np.float32)
    x[0, 64:96] = np.abs(x[0, 64:96])  # a sub-block with no negative value: its min clamps to 0
    blocks = quantize(x, gguf.GGMLQuantizationType[qtype])
    assert blocks.shape == (3, gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][1])
    ggml = np.array([reference(bytes(row)) for row in blocks], np.float32)
    np.testing.assert_allclose(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[qtype]), ggml,
                               rtol=1e-6, atol=1e-6 * np.abs(x).max())
    for row, approx in zip(x, ggml):
        assert np.linalg.norm(approx - row) / np.linalg.norm(row) < tolerance
