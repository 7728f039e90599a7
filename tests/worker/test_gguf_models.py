"""GGUF files (services/worker/quantization/gguf_checkpoint.py, shared/gguf_view.py) against transformers
loading the same file: greedy tokens equal, token for token, over each quantized type the tests can write
(tests/gguf_checkpoints.py: llama.cpp's layout, Llama's q/k rows permuted as its converter does)."""

from __future__ import annotations

import functools
import json

import gguf
import numpy as np
import pytest
import torch

from pagedserve import LLM, SamplingParams
from services.worker.model_loader import load_model
from tests.front.test_cli_startup import refused
from tests.gguf_checkpoints import write_gguf
from tests.oracle import assert_greedy_equal

SHAPE = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512)
# name -> (the source model's settings, the types of its tensors by GGUF name, the default type)
FILES = {
    "llama, K-quants and legacy types": (dict(model_type="llama"),
                                         {r".*attn_[qk]\.": "Q4_K", r".*ffn_down": "Q6_K", r".*attn_v": "Q4_0",
                                          r"token_embd": "F16"}, "Q8_0"),
    "qwen2 with biases, tied": (dict(model_type="qwen2", head_dim=64, tie_word_embeddings=True), {}, "Q8_0"),
    "qwen3, q/k norms": (dict(model_type="qwen3", head_dim=128), {r".*ffn_": "Q6_K"}, "Q4_K"),
}
PROMPTS = [[3 + (7 * i + 11 * j) % 500 for j in range(n)] for i, n in enumerate((9, 4, 21))]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from services.worker.model_factory import create_model_dir

    made = {}

    def make(name: str):
        if name not in made:
            settings, types, default = FILES[name]
            root = tmp_path_factory.mktemp("gguf")
            source = create_model_dir(root / "src", **SHAPE, **settings)
            made[name] = (write_gguf(source, root / "model.gguf", types=types, default=default), source)
        return made[name]

    return make


@functools.lru_cache(maxsize=4)
def transformers_greedy(path: str, prompt: tuple[int, ...], max_new_tokens: int):
    """transformers' own GGUF loader (gguf-py's dequantization), greedy."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    file = Path(path)
    model = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens,
                             min_new_tokens=0, eos_token_id=None, pad_token_id=0, return_dict_in_generate=True,
                             output_logits=True)
    return out.sequences[0, len(prompt):].tolist(), [torch.log_softmax(s[0].float(), -1) for s in out.logits]


@pytest.mark.parametrize("name", FILES)
def test_greedy_equals_transformers_on_the_same_file(name, files, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))  # the file's model directory is made here
    path, source = files(name)
    llm = LLM(str(path), tokenizer=str(source), kv_cache_memory_bytes=8 << 20)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                               SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    finally:
        llm.close()
    for prompt, out in zip(PROMPTS, outputs):
        ref, logprobs = transformers_greedy(str(path), tuple(prompt), 10)
        assert_greedy_equal(out.outputs[0].token_ids, ref, logprobs, name)


def test_a_head_dim_transformers_does_not_map_is_read_from_the_file(tmp_path, monkeypatch):
    """Qwen3 with head_dim 64: transformers' GGUF config would say 128; F32, so the weights are the source's."""
    from services.worker.model_factory import create_model_dir
    from shared.hub import local_model_and_tokenizer, model_name

    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    source = create_model_dir(tmp_path / "src", **SHAPE, model_type="qwen3", head_dim=64)
    path = write_gguf(source, tmp_path / "model.gguf", default="F32")
    model_dir, _ = local_model_and_tokenizer(str(path), str(source))
    assert json.loads((tmp_path / "cache" / model_dir / "config.json").read_text())["head_dim"] == 64
    assert model_name(model_dir) == "model.gguf"  # served under the file's name
    ours, _ = load_model(model_dir, torch.float32, torch.device("cpu"), pack=False)
    theirs, _ = load_model(source, torch.float32, torch.device("cpu"), pack=False)
    expected = dict(theirs.named_parameters())
    for param, value in ours.named_parameters():
        assert torch.equal(value, expected[param]), param


def _raw_gguf(path, arch: str, tensors: dict[str, tuple[np.ndarray, str]]):
    """A file with the bare metadata and the given raw tensors (bytes of any ggml type)."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_head_count(4)
    for name, (data, kind) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_what_is_not_built_is_refused_by_name(files, tmp_path, monkeypatch, capsys):
    """serve says it in one line and exits with 1, before any child starts."""
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    path, source = files("qwen2 with biases, tied")
    nl = np.zeros((4, 18), dtype=np.uint8)  # four IQ4_NL blocks (32 values in 18 bytes each)
    iq4 = _raw_gguf(tmp_path / "iq4.gguf", "llama", {"blk.0.ffn_up.weight": (nl, "IQ4_NL")})
    gpt2 = _raw_gguf(tmp_path / "gpt2.gguf", "gpt2", {"token_embd.weight": (np.zeros((4, 8), np.float32), "F32")})
    capsys.readouterr()  # the files' writing
    for file, error in ((iq4, "GGUF tensor blk.0.ffn_up.weight is IQ4_NL, a type not supported; supported: F32"),
                        (gpt2, "GGUF architecture 'gpt2' is not supported; supported: llama, qwen2, qwen3")):
        assert error in refused(monkeypatch, capsys, ["--model", str(file), "--tokenizer", str(source)])
    assert "a GGUF model needs --tokenizer" in refused(monkeypatch, capsys, ["--model", str(path)])


def test_llama_3_rope_scaling_stored_as_rope_freqs(tmp_path, monkeypatch):
    """llama.cpp stores Llama 3.1's rope scaling as the rope_freqs tensor, which transformers' GGUF reading
    drops: the file's config recovers the llama3 settings, and greedy tokens equal transformers on the model
    the (float32) file was made from. Without the scaling the model rotates low frequencies 8x too fast."""
    from services.worker.model_factory import create_model_dir
    from shared.gguf_view import gguf_config
    from tests.gguf_checkpoints import rope_freqs
    from tests.oracle import hf_greedy

    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    source = create_model_dir(tmp_path / "src", **SHAPE, model_type="llama", rope_scaling=scaling)
    path = write_gguf(source, tmp_path / "model.gguf", default="F32")
    factors = rope_freqs(source)
    between = (factors > 1.001) & (factors < 7.99)
    assert factors.min() == pytest.approx(1) and factors.max() == pytest.approx(8) and between.sum() >= 2
    recovered = gguf_config(path)["rope_scaling"]
    assert recovered["rope_type"] == "llama3" and recovered["factor"] == pytest.approx(8.0, rel=1e-5)
    prompts = [[3 + (5 * i + 13 * j) % 500 for j in range(n)] for i, n in enumerate((40, 7))]
    llm = LLM(str(path), tokenizer=str(source), kv_cache_memory_bytes=8 << 20)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    finally:
        llm.close()
    for prompt, out in zip(prompts, outputs):
        ref, logprobs = hf_greedy(source, prompt, 10)
        assert_greedy_equal(out.outputs[0].token_ids, ref, logprobs, "llama 3 rope from rope_freqs")


@pytest.mark.parametrize("low, high, original", [(1.0, 4.0, 8192), (2.0, 6.0, 4096), (1.0, 4.0, 64)])
def test_rope_freqs_give_back_the_llama3_settings_that_made_them(low, high, original):
    from shared.gguf_rope import llama3_divisors, llama3_rope_scaling

    theta, head_dim = 500000.0, 128
    wavelengths = 2 * np.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)
    made = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": low, "high_freq_factor": high,
            "original_max_position_embeddings": original}
    factors = llama3_divisors(made, wavelengths).astype(np.float32)
    recovered = llama3_rope_scaling(factors, theta, head_dim, original)
    np.testing.assert_allclose(llama3_divisors(recovered, wavelengths), factors, rtol=1e-5)
    assert llama3_rope_scaling(np.ones(64, np.float32), theta, head_dim, original) is None
    with pytest.raises(ValueError, match="no llama3 rope scaling gives"):
        llama3_rope_scaling(np.linspace(1, 8, 64), theta, head_dim, original)
    with pytest.raises(ValueError, match="holds 10 values"):
        llama3_rope_scaling(np.ones(10), theta, head_dim, original)
