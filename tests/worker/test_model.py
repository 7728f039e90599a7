"""The model against transformers (the oracle), the loader's errors, and the attention reference."""

from __future__ import annotations

import json
import os
import math
import shutil

import pytest
import torch

from services.worker.attention.spec import AttentionSpec
from services.worker.attention.torch_ref import TorchAttentionBackend, paged_attention_reference, write_kv
from services.worker.model_loader import load_eos_token_ids, load_model
from services.worker.model_config import ModelConfig
from tests.attention_inputs import build_metadata
from tests.checkpoint_edits import rewrite_weights

CPU = torch.device("cpu")
ARCH_FIXTURES = ["llama_dir", "mistral_dir", "qwen2_dir", "qwen3_dir", "tied_dir", "mixtral_dir", "qwen2_moe_dir",
                 "qwen3_moe_dir", "gemma_dir", "gemma2_dir", "gemma3_dir", "phi3_dir", "yarn_dir", "granite_dir",
                 "olmo2_dir", "smollm3_dir"]


class PagedRunner:
    """Runs a model step by step over a small KV pool, handing out blocks in scattered order."""

    def __init__(self, model, config: ModelConfig, dtype=torch.float32, num_blocks: int = 24,
                 block_size: int = 4):
        shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        pools = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
                 for _ in range(config.num_hidden_layers)]
        self.model, self.block_size = model, block_size
        self.backend = TorchAttentionBackend(pools, model.attention_spec())
        # Reversed and interleaved: a sequence's blocks are never contiguous or ascending.
        self.free = list(range(num_blocks - 1, -1, -2)) + list(range(num_blocks - 2, -1, -2))
        self.tables: dict[int, list[int]] = {}
        self.tokens: dict[int, list[int]] = {}

    def step(self, new_tokens: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Compute the given new tokens of each sequence in one batch; logits [new, vocab] per sequence."""
        seqs, ids, positions = [], [], []
        for seq, tokens in new_tokens.items():
            history, table = self.tokens.setdefault(seq, []), self.tables.setdefault(seq, [])
            cached = len(history)
            history += tokens
            while len(table) * self.block_size < len(history):
                table.append(self.free.pop(0))
            seqs.append((table, cached, len(tokens)))
            ids += tokens
            positions += range(cached, len(history))
        meta = build_metadata(seqs, self.block_size)
        with torch.no_grad():
            hidden = self.model(torch.tensor(ids), torch.tensor(positions), self.backend, meta)
            logits = self.model.compute_logits(hidden)
        return dict(zip(new_tokens, logits.split([len(t) for t in new_tokens.values()])))


def hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float()


def random_prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]


# ---- the model against transformers -----------------------------------------------------------

@pytest.mark.parametrize("fixture", ARCH_FIXTURES)
def test_matches_transformers(fixture, request):
    from transformers import AutoModelForCausalLM

    model_dir = request.getfixturevalue(fixture)
    model, config = load_model(model_dir, torch.float32, CPU)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    long, short = random_prompts(config.vocab_size, [13, 6])

    # (a) both whole prompts in one prefill batch
    out = PagedRunner(model, config).step({0: long, 1: short})
    torch.testing.assert_close(out[0], hf_logits(hf, long), atol=1e-4, rtol=0)
    torch.testing.assert_close(out[1], hf_logits(hf, short), atol=1e-4, rtol=0)

    # (b) in two chunks; the second attends to the cached first (and mixes a 1-token query in)
    runner = PagedRunner(model, config)
    runner.step({0: long[:5], 1: short[:5]})
    out = runner.step({0: long[5:], 1: short[5:]})
    torch.testing.assert_close(out[0], hf_logits(hf, long)[5:], atol=1e-4, rtol=0)
    torch.testing.assert_close(out[1], hf_logits(hf, short)[5:], atol=1e-4, rtol=0)

    # (c) greedy decode steps for both sequences (a decode-only batch)
    seqs = {0: long + [int(out[0][-1].argmax())], 1: short + [int(out[1][-1].argmax())]}
    for _ in range(4):
        out = runner.step({seq: tokens[-1:] for seq, tokens in seqs.items()})
        for seq, tokens in seqs.items():
            expected = hf_logits(hf, tokens)[-1]
            torch.testing.assert_close(out[seq][0], expected, atol=1e-4, rtol=0)
            assert int(out[seq][0].argmax()) == int(expected.argmax())
            tokens.append(int(out[seq][0].argmax()))


@pytest.mark.parametrize("fixture", ["llama_dir", "olmo2_dir", "smollm3_dir"])
def test_bfloat16_logits_equal_transformers_bfloat16(fixture, request):
    # Each step in transformers' dtype, in its order (OLMo 2 rotates in float32 and casts back): its logits,
    # but for a last-bit rounding here and there. Alone they are equal; after other tests in the process the
    # matrix products may block otherwise, and roundings spread: one bf16 step (0.03) at most, 0.0015 on
    # average seen in CI (smollm3). Rotating OLMo 2 in bf16 instead moved 78% of them, by 0.011 on average
    # (0.0086 over all of them) and up to 0.11: well above both bounds.
    from transformers import AutoModelForCausalLM

    model_dir = request.getfixturevalue(fixture)
    model, config = load_model(model_dir, torch.bfloat16, CPU)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    prompts = random_prompts(config.vocab_size, [20, 33], seed=int.from_bytes(os.urandom(4), "little"))
    ours = PagedRunner(model, config, dtype=torch.bfloat16, num_blocks=40).step(dict(enumerate(prompts)))
    for i, prompt in enumerate(prompts):
        apart = (ours[i] - hf_logits(hf, prompt)).abs()
        assert apart.mean() < 0.004 and apart.max() < 0.07, (apart.mean(), apart.max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fixture", ["llama_dir", "gemma2_dir"])
def test_half_precision_runs(dtype, fixture, request):
    model_dir = request.getfixturevalue(fixture)
    model, config = load_model(model_dir, dtype, CPU)
    assert all(p.dtype == dtype for p in model.parameters())
    reference, _ = load_model(model_dir, torch.float32, CPU)
    prompt = random_prompts(config.vocab_size, [11])[0]
    logits = PagedRunner(model, config, dtype=dtype).step({0: prompt})[0]
    expected = PagedRunner(reference, config).step({0: prompt})[0]
    assert logits.dtype == dtype and torch.isfinite(logits).all()  # the sampler widens them where it must
    # Half precision drifts, but must stay close to float32 relative to the logits' spread.
    assert (logits.float() - expected).abs().max() < 0.25 * expected.std()
    assert (logits.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.8


def test_tied_model_has_no_lm_head(tied_dir):
    model, config = load_model(tied_dir, torch.float32, CPU)
    assert config.tie_word_embeddings
    assert model.lm_head_weight is model.embed_tokens.weight


# ---- loader and config errors -----------------------------------------------------------------

@pytest.fixture
def llama_copy(llama_dir, tmp_path):
    return shutil.copytree(llama_dir, tmp_path / "model")


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_model(tmp_path / "nowhere", torch.float32, CPU)


def test_missing_config(llama_copy):
    (llama_copy / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(llama_copy, torch.float32, CPU)


def test_invalid_json_config(llama_copy):
    (llama_copy / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json.*not valid JSON"):
        ModelConfig.from_model_dir(llama_copy)


def _edit_config(model_dir, **changes):
    file = model_dir / "config.json"
    raw = json.loads(file.read_text())
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    file.write_text(json.dumps(raw))


def test_unsupported_architecture(llama_copy):
    _edit_config(llama_copy, model_type="gpt2")
    with pytest.raises(ValueError, match=r"config.json.*'gpt2'.*llama, mistral, qwen2, qwen3"):
        load_model(llama_copy, torch.float32, CPU)


def test_missing_required_key(llama_copy):
    _edit_config(llama_copy, hidden_size=None)
    with pytest.raises(ValueError, match="config.json.*hidden_size"):
        ModelConfig.from_model_dir(llama_copy)


def test_unsupported_rope_type(llama_copy):
    _edit_config(llama_copy, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(ValueError, match="dynamic.*default, linear, llama3, longrope, yarn"):
        ModelConfig.from_model_dir(llama_copy)


def test_v4_and_v5_rope_formats_agree(llama_dir, llama_copy):
    v5 = ModelConfig.from_model_dir(llama_dir)
    params = json.loads((llama_dir / "config.json").read_text())["rope_parameters"]
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "rope_type")}
    scaling["type"] = params["rope_type"]  # the oldest spelling
    _edit_config(llama_copy, rope_parameters=None, rope_theta=params["rope_theta"], rope_scaling=scaling)
    assert ModelConfig.from_model_dir(llama_copy) == v5
    assert v5.rope_scaling["rope_type"] == "llama3" and v5.rope_theta == params["rope_theta"]


def test_config_fields(qwen2_dir, qwen3_dir, mistral_dir):
    qwen2, qwen3 = ModelConfig.from_model_dir(qwen2_dir), ModelConfig.from_model_dir(qwen3_dir)
    mistral = ModelConfig.from_model_dir(mistral_dir)
    assert qwen2.qkv_bias and not qwen2.qk_norm and qwen2.sliding_window is None
    assert qwen3.qk_norm and qwen3.head_dim == 32 and not qwen3.qkv_bias
    assert mistral.num_key_value_heads == 1 and mistral.rope_scaling is None
    assert qwen2.dtype == "float32"


BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, vocab_size=100)


@pytest.mark.parametrize("raw, window, types", [
    (dict(model_type="mistral", sliding_window=32), 32, "SSSS"),  # every layer, as transformers' Mistral
    (dict(model_type="mistral", sliding_window=None), None, ""),
    (dict(model_type="llama", sliding_window=32), None, ""),  # Llama's attention has no window
    (dict(model_type="qwen2", sliding_window=32), None, ""),  # off unless use_sliding_window
    (dict(model_type="qwen2", sliding_window=32, use_sliding_window=True, max_window_layers=2), 32, "FFSS"),
    (dict(model_type="qwen3", sliding_window=32, use_sliding_window=True), 32, "FFFF"),  # max_window_layers 28
    (dict(model_type="qwen2", sliding_window=32, use_sliding_window=True,
          layer_types=["sliding_attention", "full_attention"] * 2), 32, "SFSF"),  # given: taken as it is
    (dict(model_type="qwen2_moe", sliding_window=32, use_sliding_window=True, max_window_layers=3, num_experts=4,
          num_experts_per_tok=2, moe_intermediate_size=32), 32, "SFSF"),
    (dict(model_type="mixtral", sliding_window=32, num_local_experts=4, num_experts_per_tok=2), 32, "SSSS"),
    (dict(model_type="mistral"), 4096, "SSSS"),  # absent: transformers' default
    (dict(model_type="qwen2", use_sliding_window=True, max_window_layers=3), 4096, "FFFS"),
    (dict(model_type="gemma2", sliding_window=None), None, ""),  # null: the sliding layers' mask is causal
    (dict(model_type="phi3"), None, ""),
])
def test_which_layers_attend_within_a_window(raw, window, types):
    config = ModelConfig.from_dict({**BASE, **raw})
    expanded = "".join("S" if t == "sliding_attention" else "F" for t in config.layer_types)
    assert (config.sliding_window, expanded) == (window, types)
    assert [config.attention_window(i) for i in range(4)] == [window if t == "S" else None for t in types or "FFFF"]


@pytest.mark.parametrize("raw, message", [
    (dict(sliding_window=-3), "sliding_window must be a positive integer"),
    (dict(sliding_window=2.5), "sliding_window must be a positive integer"),
    (dict(model_type="qwen2", use_sliding_window=True, sliding_window=8, layer_types=["full_attention"]),
     "layer_types has 1 entries for 4 layers"),
    (dict(model_type="qwen2", use_sliding_window=True, sliding_window=8, layer_types=["chunked_attention"] * 4),
     "unsupported layer_types"),
])
def test_bad_window_settings_are_refused(raw, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**BASE, "model_type": "mistral", **raw})


def test_gemma_configs_in_both_rope_formats():
    v4 = ModelConfig.from_dict({**BASE, "model_type": "gemma3_text", "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                                "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window": 512})
    v5 = ModelConfig.from_dict({**BASE, "model_type": "gemma3_text", "sliding_window": 512, "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}})
    for config in (v4, v5):
        assert (config.rope_theta, config.rope_scaling, config.local_rope_theta) == \
            (1e6, {"rope_type": "linear", "factor": 8.0}, 1e4)
        assert config.layer_types == ("sliding_attention",) * 4  # five in six: none of the first four is full
        assert config.qk_norm and config.norm_placement == "sandwich" and config.tie_word_embeddings and config.head_dim == 256
    gemma = ModelConfig.from_dict({**BASE, "model_type": "gemma", "hidden_act": "gelu"})  # its releases' spelling
    assert gemma.hidden_act == "gelu_pytorch_tanh" and gemma.embedding_multiplier == 8.0 and gemma.norm_placement == "pre"
    assert gemma.attention_scale == 256 ** -0.5 and gemma.sliding_window is None
    gemma2 = ModelConfig.from_dict({**BASE, "model_type": "gemma2", "query_pre_attn_scalar": 144,
                                    "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0})
    assert gemma2.attention_scale == 144 ** -0.5 and gemma2.sliding_window == 4096
    assert (gemma2.attn_logit_softcap, gemma2.final_logit_softcap) == (50.0, 30.0)
    assert gemma2.layer_types == ("sliding_attention", "full_attention") * 2
    # Without them, Gemma2Config's caps (50 and 30) and activation (Gemma 2 reads hidden_activation alone).
    bare = ModelConfig.from_dict({**BASE, "model_type": "gemma2", "hidden_act": "gelu"})
    assert (bare.attn_logit_softcap, bare.final_logit_softcap, bare.hidden_act) == (50.0, 30.0, "gelu_pytorch_tanh")
    assert ModelConfig.from_dict({**BASE, "model_type": "gemma3_text"}).final_logit_softcap is None


@pytest.mark.parametrize("raw, message", [
    (dict(model_type="gemma3_text", use_bidirectional_attention=True), "use_bidirectional_attention"),
    (dict(model_type="gemma2", hidden_activation="relu"), "unsupported activation 'relu'"),
    (dict(model_type="gemma3_text", rope_parameters={"full_attention": {"rope_type": "default"},
                                                     "sliding_attention": {"rope_type": "linear", "factor": 2.0}}),
     "sliding layers must use plain RoPE"),
    (dict(model_type="llama", rope_parameters={"full_attention": {"rope_type": "default"}}),
     "rope parameters per layer type"),
    (dict(model_type="gemma2", attn_logit_softcapping=-1.0), "attn_logit_softcap must be a positive number"),
])
def test_bad_gemma_settings_are_refused(raw, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**BASE, **raw})


def test_phi3_rope_settings_read_as_transformers_reads_them():
    factors = {"short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    for kind in ("su", "yarn", "longrope"):  # Phi-3's older configs name LongRoPE "su" or "yarn"
        config = ModelConfig.from_dict({**BASE, "model_type": "phi3", "max_position_embeddings": 131072,
                                        "original_max_position_embeddings": 4096,
                                        "rope_scaling": {"type": kind, **factors}})
        scaling = config.rope_scaling
        assert scaling["rope_type"] == "longrope" and scaling["original_max_position_embeddings"] == 4096
        assert scaling["attention_factor"] == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    yarn = ModelConfig.from_dict({**BASE, "model_type": "qwen2", "max_position_embeddings": 4096,  # YaRN proper
                                  "rope_scaling": {"type": "yarn", "factor": 4.0}}).rope_scaling
    assert (yarn["rope_type"], yarn["original_max_position_embeddings"], yarn["beta_fast"], yarn["beta_slow"]) == \
        ("yarn", 4096, 32, 1)
    assert yarn["attention_factor"] == pytest.approx(0.1 * math.log(4.0) + 1)
    deepseek = ModelConfig.from_dict({**BASE, "model_type": "llama", "rope_scaling": {
        "type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096}}).rope_scaling
    assert deepseek["attention_factor"] == pytest.approx((0.1 * math.log(40) + 1) / (0.0707 * math.log(40) + 1))
    # Phi3Config always has an original_max_position_embeddings (4096 by default): it wins over the rope dict's.
    bare = ModelConfig.from_dict({**BASE, "model_type": "phi3", "rope_scaling": {
        "type": "longrope", "original_max_position_embeddings": 64, **factors}})
    assert bare.rope_scaling["original_max_position_embeddings"] == 4096
    assert (bare.rms_norm_eps, bare.max_position_embeddings) == (1e-5, 4096)  # Phi3Config's defaults
    llama = ModelConfig.from_dict({**BASE, "model_type": "llama", "original_max_position_embeddings": 4096,
                                   "rope_scaling": {"type": "longrope", "original_max_position_embeddings": 64,
                                                    **factors}})
    assert llama.rope_scaling["original_max_position_embeddings"] == 64  # others: the rope dict's
    gemma3 = ModelConfig.from_dict({**BASE, "model_type": "gemma3_text", "rope_parameters": {
        "full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}})
    assert gemma3.rope_scaling["beta_fast"] == 32 and gemma3.rope_scaling["original_max_position_embeddings"] == 131072
    partial = ModelConfig.from_dict({**BASE, "model_type": "phi3", "partial_rotary_factor": 0.75})
    assert partial.rotary_dim == 12  # of head_dim 16
    with pytest.raises(ValueError, match="partial_rotary_factor 0.75 is not supported for llama"):
        ModelConfig.from_dict({**BASE, "model_type": "llama", "partial_rotary_factor": 0.75})
    with pytest.raises(ValueError, match="longrope short_factor has 8 entries; the rotary dimensions need 6"):
        ModelConfig.from_dict({**BASE, "model_type": "phi3", "partial_rotary_factor": 0.75,
                               "rope_scaling": {"type": "longrope", **factors}})


def test_fused_checkpoint_tensors_of_the_wrong_size_are_refused(phi3_dir, tmp_path):
    copy = shutil.copytree(phi3_dir, tmp_path / "model")
    name = "model.layers.0.self_attn.qkv_proj.weight"
    rewrite_weights(copy, lambda tensors: tensors.update({name: tensors[name][:-1].clone()}))
    with pytest.raises(ValueError, match="qkv_proj.weight' has 127 rows, expected q, k and v's 128"):
        load_model(copy, torch.float32, CPU)


def test_a_multimodal_checkpoint_serves_its_language_model(gemma3_multimodal_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(gemma3_multimodal_dir, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    prompt = random_prompts(500, [13])[0]
    expected = hf_logits(hf, prompt)
    # As transformers v4 saves it (language_model.model.*), and as v5 names it (model.language_model.*).
    v5 = shutil.copytree(gemma3_multimodal_dir, tmp_path / "v5")
    rewrite_weights(v5, lambda tensors: tensors.update(
        {name.replace("language_model.model.", "model.language_model.").replace("vision_tower.", "model.vision_tower."):
         tensors.pop(name) for name in list(tensors)}))
    for model_dir in (gemma3_multimodal_dir, v5):
        model, config = load_model(model_dir, torch.float32, CPU)
        assert (config.model_type, config.text_of) == ("gemma3_text", "gemma3")
        torch.testing.assert_close(PagedRunner(model, config).step({0: prompt})[0], expected, atol=1e-4, rtol=0)


def test_a_sparse_text_config_takes_transformers_defaults():
    # As the Hub's gemma-3-4b config writes it: the rest comes from Gemma3TextConfig's defaults.
    config = ModelConfig.from_dict({"model_type": "gemma3", "torch_dtype": "bfloat16", "text_config": {
        "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text", "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024}})
    assert (config.vocab_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim) == \
        (262_208, 8, 4, 256)
    assert (config.max_position_embeddings, config.dtype, config.tie_word_embeddings) == (131_072, "bfloat16", True)
    assert config.layer_types[:6] == ("sliding_attention",) * 5 + ("full_attention",)
    assert config.rope_scaling == {"rope_type": "linear", "factor": 8.0} and config.local_rope_theta == 10_000.0
    with pytest.raises(ValueError, match="text_config must be gemma3_text, got 'llama'"):
        ModelConfig.from_dict({"model_type": "gemma3", "text_config": {"model_type": "llama"}})


def test_olmo2_and_smollm3_settings():
    olmo2 = ModelConfig.from_dict({**BASE, "model_type": "olmo2"})
    assert (olmo2.norm_style, olmo2.norm_placement, olmo2.qk_norm, olmo2.qk_norm_per_head, olmo2.rms_norm_eps) == \
        ("olmo2", "post", True, False, 1e-5)
    smol = ModelConfig.from_dict({**BASE, "model_type": "smollm3", "num_hidden_layers": 8})
    assert [smol.uses_rope(i) for i in range(8)] == [True, True, True, False] * 2  # every 4th layer: NoPE
    assert smol.sliding_window is None and smol.max_position_embeddings == 32768
    assert smol.rope_theta == 2e6 and smol.tie_word_embeddings  # SmolLM3Config's defaults
    assert not ModelConfig.from_dict({**BASE, "model_type": "olmo2", "mlp_bias": True}).mlp_bias  # it has none
    windowed = ModelConfig.from_dict({**BASE, "model_type": "smollm3", "no_rope_layers": [1, 0, 1, 0],
                                      "use_sliding_window": True, "sliding_window": 64})
    assert windowed.layer_types == ("full_attention", "sliding_attention") * 2  # the NoPE layers slide


def test_corrupt_safetensors(llama_copy):
    file = llama_copy / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(llama_copy, torch.float32, CPU)
    file.write_bytes(b"\xff" * 64)
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(llama_copy, torch.float32, CPU)


def test_wrong_shape_weight(llama_copy):
    name = "model.layers.1.self_attn.k_proj.weight"
    rewrite_weights(llama_copy, lambda t: t.__setitem__(name, t[name][:-1].clone()))
    with pytest.raises(ValueError, match=rf"model.safetensors.*{name}.*\(31, 64\).*expected \(32, 64\)"):
        load_model(llama_copy, torch.float32, CPU)


def test_missing_weight(llama_copy):
    name = "model.layers.0.mlp.up_proj.weight"
    rewrite_weights(llama_copy, lambda t: t.pop(name))
    with pytest.raises(ValueError, match=rf"missing weights.*{name}"):
        load_model(llama_copy, torch.float32, CPU)


def test_no_safetensors(llama_copy):
    (llama_copy / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no safetensors"):
        load_model(llama_copy, torch.float32, CPU)


def test_sharded_checkpoint(tiny_model_factory, tmp_path):
    sharded_dir = tiny_model_factory("llama", max_shard_size="100KB")
    shards = sorted(p.name for p in sharded_dir.glob("*.safetensors"))
    assert len(shards) > 1 and (sharded_dir / "model.safetensors.index.json").is_file()
    sharded, _ = load_model(sharded_dir, torch.float32, CPU, pack=False)
    whole, _ = load_model(tiny_model_factory("llama"), torch.float32, CPU, pack=False)
    for (name, a), (_, b) in zip(sharded.state_dict().items(), whole.state_dict().items()):
        assert torch.equal(a, b), name
    broken = shutil.copytree(sharded_dir, tmp_path / "broken")
    (broken / shards[-1]).unlink()
    with pytest.raises(FileNotFoundError, match=shards[-1]):
        load_model(broken, torch.float32, CPU)


def test_eos_token_ids(llama_copy):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(llama_copy)
    expected = (tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    assert load_eos_token_ids(llama_copy) == expected
    (llama_copy / "generation_config.json").unlink()
    assert load_eos_token_ids(llama_copy) == expected[:1]  # config.json's eos_token_id
    _edit_config(llama_copy, eos_token_id=None)
    assert load_eos_token_ids(llama_copy, tokenizer) == (tokenizer.eos_token_id,)


# ---- the built-in default model ---------------------------------------------------------------

def test_default_model_dir(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    from services.worker.model_factory import default_model_dir

    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))
    path = default_model_dir()
    assert path == tmp_path / "default-model-v2" and default_model_dir() == path
    assert [p.name for p in tmp_path.iterdir()] == ["default-model-v2"]  # no temp dir left behind
    model, config = load_model(path, torch.float32, CPU)
    assert config.hidden_size == 256 and config.num_hidden_layers == 4
    tokenizer = AutoTokenizer.from_pretrained(path)
    text = "Grüße, 日本語 and 😀 — naïve café , don 't  x\n\ty"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text and max(ids) < config.vocab_size
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.eos_token_id in load_eos_token_ids(path)


# ---- the attention reference against the backend ----------------------------------------------

@pytest.mark.parametrize("batch", [
    [(0, 1), (9, 1), (4, 1)],  # decode only: (cached, new) per sequence
    [(0, 7), (9, 1), (6, 3), (3, 1)],  # mixed: a fresh prefill, decodes, a chunk after a cached prefix
])
def test_reference_matches_backend(batch):
    block_size, heads, kv_heads, dim, num_blocks = 4, 6, 2, 16, 32
    generator = torch.Generator().manual_seed(1)
    free = torch.randperm(num_blocks, generator=generator).tolist()
    seqs = []
    for cached, new in batch:
        table = [free.pop() for _ in range(-(-(cached + new) // block_size))]
        seqs.append((table, cached, new))
    shape = (num_blocks, block_size, kv_heads, dim)
    # Unused slots hold garbage that must never be read (finite, so SDPA masking is exact).
    k_cache, v_cache = torch.randn(shape, generator=generator) * 100, torch.randn(shape, generator=generator) * 100
    prefix = build_metadata([(t[:-(-c // block_size)], 0, c) for t, c, _ in seqs if c], block_size)
    write_kv(k_cache, v_cache, torch.randn(prefix.num_tokens, kv_heads, dim, generator=generator),
             torch.randn(prefix.num_tokens, kv_heads, dim, generator=generator), prefix.slot_mapping)

    meta = build_metadata(seqs, block_size)
    q = torch.randn(meta.num_tokens, heads, dim, generator=generator)
    k = torch.randn(meta.num_tokens, kv_heads, dim, generator=generator)
    v = torch.randn(meta.num_tokens, kv_heads, dim, generator=generator)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    write_kv(ref_k, ref_v, k, v, meta.slot_mapping)
    expected = paged_attention_reference(q, ref_k, ref_v, meta, scale=dim ** -0.5)

    # Poison the slots the backend must write: a missed write shows up as NaN.
    write_kv(k_cache, v_cache, torch.full_like(k, float("nan")), torch.full_like(v, float("nan")),
             meta.slot_mapping)
    out = TorchAttentionBackend([(k_cache, v_cache)], AttentionSpec(dim ** -0.5)).forward(0, q, k, v, meta)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_cache, ref_k, equal_nan=True)


@pytest.mark.parametrize("style, reference", [("llama", "models.llama.modeling_llama.LlamaRMSNorm"),
                                              ("gemma", "models.gemma2.modeling_gemma2.Gemma2RMSNorm"),
                                              ("olmo2", "models.olmo2.modeling_olmo2.Olmo2RMSNorm")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_each_norm_style_rounds_as_transformers_does(style, reference, dtype):
    # The three orders (cast then scale; scale by 1 + weight, then cast; scale, then cast) agree in float32
    # only: in 16 bits each must be transformers' own, bit for bit.
    import importlib

    from services.worker.models.layers import rms_norm_class

    module, name = reference.rsplit(".", 1)
    theirs = getattr(importlib.import_module(f"transformers.{module}"), name)(64, eps=1e-6).to(dtype)
    ours = rms_norm_class(style)(64, 1e-6).to(dtype)
    seed = int.from_bytes(os.urandom(4), "little")
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(64, generator=generator).to(dtype)
    theirs.weight.data.copy_(weight)
    ours.weight.data.copy_(weight)
    x = (torch.randn(7, 64, generator=generator) * 3).to(dtype)
    with torch.no_grad():
        assert torch.equal(ours(x), theirs(x)), f"seed {seed}"
        residual = (torch.randn(7, 64, generator=generator)).to(dtype)
        normed, summed = ours.forward_with_residual(x, residual.clone())
        assert torch.equal(summed, residual + x) and torch.equal(normed, theirs(residual + x))
