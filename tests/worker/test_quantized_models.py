"""Quantized checkpoints (services/worker/quantization/) against their oracles.

Each checkpoint is the tests' tiny Llama packed into a format's exact on-disk layout by
tests/quantized_checkpoints.py, which also writes the oracle: the same model with each layer replaced by the
format's published dequantization. Weight-only schemes load to those very weights and generate what
transformers generates on them; W8A8 int8 equals a plain PyTorch reference of its arithmetic.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve import LLM, SamplingParams
from services.worker.model_loader import load_model
from services.worker.models.int8_linear import Int8Linear, w8a8_reference
from services.worker.quantization.dequantize import fp8_round_per_row
from services.worker.quantization.wna16_linear import WNA16Linear
from tests.oracle import assert_greedy_equal, hf_greedy, model_greedy
from tests.quantized_checkpoints import write_quantized
from tests.worker.test_model import PagedRunner, hf_logits, random_prompts

CPU = torch.device("cpu")

# scheme, write_quantized's options: every format and each of its variants (bit widths, groups, zero points,
# act-order, block edges that cut a tile).
WEIGHT_ONLY = {
    "fp8 per tensor, static activations": ("fp8", dict(static_activations=True)),
    "fp8 blocks 48x48 (partial edges)": ("fp8-block", dict(block=(48, 48))),
    "compressed-tensors fp8 W8A8": ("ct-w8a8-fp8", {}),
    "compressed-tensors W4A16 group 32": ("ct-wNa16", dict(bits=4, group_size=32)),
    "compressed-tensors W4A16 asymmetric": ("ct-wNa16", dict(bits=4, group_size=32, symmetric=False)),
    "compressed-tensors W8A16 per channel": ("ct-wNa16", dict(bits=8, group_size=0)),
    "awq group 32": ("awq", dict(group_size=32)),
    "gptq 4-bit act-order asymmetric": ("gptq", dict(bits=4, group_size=32, desc_act=True, symmetric=False)),
    "gptq 8-bit per channel": ("gptq", dict(bits=8, group_size=0)),
}


# Schemes whose layers can stay packed for the W4A16 / W8A16 GEMM (groups of 64: whole K tiles; in order).
PACKED = {
    "gptq 4-bit group 64": ("gptq", dict(bits=4, group_size=64)),
    "gptq 8-bit group 64": ("gptq", dict(bits=8, group_size=64)),
    "gptq 8-bit asymmetric group 64": ("gptq", dict(bits=8, group_size=64, symmetric=False)),
    "compressed-tensors W8A16 group 64": ("ct-wNa16", dict(bits=8, group_size=64)),
    "awq group 64": ("awq", dict(group_size=64)),
    "compressed-tensors W4A16 group 64": ("ct-wNa16", dict(bits=4, group_size=64)),
    "compressed-tensors W4A16 asymmetric group 64": ("ct-wNa16", dict(bits=4, group_size=64, symmetric=False)),
}


@pytest.fixture(scope="module")
def checkpoints(llama_dir, tmp_path_factory):
    """name -> (quantized dir, dequantized dir), written once for the module."""
    made = {}

    def make(name: str):
        if name not in made:
            known = {**WEIGHT_ONLY, **PACKED, "ct-w8a8-int8 static": ("ct-w8a8-int8", dict(static_activations=True))}
            scheme, options = known[name] if name in known else (name, {})
            made[name] = write_quantized(llama_dir, tmp_path_factory.mktemp("quantized"), scheme, **options)
        return made[name]

    return make


@pytest.mark.parametrize("name", WEIGHT_ONLY)
def test_weight_only_formats_load_the_published_dequantization(name, checkpoints):
    quantized, dequantized = checkpoints(name)
    model, _ = load_model(quantized, torch.float32, CPU, pack=False)
    plain, _ = load_model(dequantized, torch.float32, CPU, pack=False)
    theirs = dict(plain.named_parameters())
    for param_name, ours in model.named_parameters():
        torch.testing.assert_close(ours, theirs[param_name], rtol=1e-6, atol=0, msg=f"{name}: {param_name}")


@pytest.mark.parametrize("name", PACKED)
def test_weight_only_layers_kept_packed_equal_the_dequantized_model(name, checkpoints):
    """The W4A16 / W8A16 GEMM (Triton, interpreted here) over the repacked codes: prefill and decode logits equal
    the dequantized model's, in an eighth (4-bit) or a quarter (8-bit) of its float32 projection bytes, plus
    each group's scale and zero point."""
    quantized, dequantized = checkpoints(name)
    bits = PACKED[name][1]["bits"] if PACKED[name][0] != "awq" else 4
    model, config = load_model(quantized, torch.float32, CPU, pack=False, triton_gemms=True)
    plain, _ = load_model(dequantized, torch.float32, CPU, pack=False)
    packed = [m for m in model.modules() if isinstance(m, WNA16Linear)]
    assert len(packed) == 4 * config.num_hidden_layers  # qkv, o, gate_up, down in each layer
    assert {m.layout.bits for m in packed} == {bits}
    codes = sum(m.wna16_codes.numel() * 4 for m in packed)
    assert codes * 8 == bits * sum(m.in_features * m.out_features for m in packed)  # bits per weight, exactly
    prompt = random_prompts(config.vocab_size, [13], seed=5)[0]
    ours, theirs = PagedRunner(model, config), PagedRunner(plain, config)
    for step in (prompt, [int(prompt[-1])]):  # a prefill, then a decode (one row)
        torch.testing.assert_close(ours.step({0: step})[0], theirs.step({0: step})[0], atol=1e-4, rtol=0)


@pytest.mark.parametrize("scheme, options", [("gptq", dict(bits=4, group_size=16, desc_act=True)),
                                             ("ct-w8a8-int8", {})])
def test_experts_and_shared_experts_load_the_published_dequantization(scheme, options, qwen2_moe_dir, tmp_path):
    """Stacked experts and the shared expert are dequantized at load (W8A8: attention stays int8)."""
    quantized, dequantized = write_quantized(qwen2_moe_dir, tmp_path, scheme, **options)
    model, _ = load_model(quantized, torch.float32, CPU, pack=False)
    plain, _ = load_model(dequantized, torch.float32, CPU, pack=False)
    theirs = dict(plain.named_parameters())
    int8 = {f"{name}.weight": module for name, module in model.named_modules() if isinstance(module, Int8Linear)}
    assert bool(int8) == (scheme == "ct-w8a8-int8")
    for name, ours in model.named_parameters():
        if name in int8:
            ours = ours.float() * int8[name].weight_scale
        elif name.endswith("weight_scale"):
            continue
        torch.testing.assert_close(ours, theirs[name], rtol=1e-6, atol=0, msg=f"{scheme}: {name}")


@pytest.mark.parametrize("name", ["gptq 4-bit act-order asymmetric", "awq group 32", "fp8 blocks 48x48 (partial edges)"])
def test_greedy_equals_transformers_on_the_dequantized_weights(name, checkpoints):
    quantized, dequantized = checkpoints(name)
    # Ids from 3: transformers' generate masks out a prompt's pad tokens (id 0 here).
    prompts = [[3 + t % 509 for t in p] for p in random_prompts(512, [11, 5, 23], seed=7)]
    llm = LLM(str(quantized), kv_cache_memory_bytes=8 << 20)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    finally:
        llm.close()
    for prompt, out in zip(prompts, outputs):
        ref, ref_logprobs = hf_greedy(dequantized, prompt, 12)
        assert_greedy_equal(out.outputs[0].token_ids, ref, ref_logprobs, name)


class W8A8Reference(torch.nn.Module):
    """A transformers Linear computing compressed-tensors' W8A8 int8 arithmetic in float64."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 input_scale: torch.Tensor | None = None):
        super().__init__()
        self.weight, self.scale, self.bias, self.input_scale = weight, scale, bias, input_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        y = w8a8_reference(flat, self.weight, self.scale, self.bias, torch.float64, self.input_scale)
        return y.to(x.dtype).view(*x.shape[:-1], -1)


def w8a8_transformers(quantized_dir, dequantized_dir):
    """transformers' model whose projections run the W8A8 reference on the checkpoint's int8 weights."""
    from transformers import AutoModelForCausalLM

    stored = load_file(quantized_dir / "model.safetensors")
    hf = AutoModelForCausalLM.from_pretrained(dequantized_dir, dtype=torch.float32, attn_implementation="eager")
    for name, module in list(hf.named_modules()):
        for child_name, child in list(module.named_children()):
            key = f"{name}.{child_name}"
            if isinstance(child, torch.nn.Linear) and f"{key}.weight_scale" in stored:
                setattr(module, child_name, W8A8Reference(stored[f"{key}.weight"], stored[f"{key}.weight_scale"],
                                                          child.bias, stored.get(f"{key}.input_scale")))
    return hf.eval()


@pytest.mark.parametrize("name", ["ct-w8a8-int8", "ct-w8a8-int8 static"])
@pytest.mark.parametrize("triton_gemms", [None, True], ids=["cpu", "triton"])
def test_w8a8_int8_runs_int8_layers_equal_to_the_reference(triton_gemms, name, checkpoints):
    """On the CPU's path (oneDNN or the reference), and through the GPU's Triton int8 GEMM (interpreted here);
    activations scaled per token, or by each layer's calibrated input_scale."""
    quantized, dequantized = checkpoints(name)
    model, config = load_model(quantized, torch.float32, CPU, triton_gemms=triton_gemms)
    int8 = [m for m in model.modules() if isinstance(m, Int8Linear)]
    assert len(int8) == 4 * config.num_hidden_layers  # qkv, o, gate_up, down in each layer
    assert all((m._gpu_matmul is not None) == bool(triton_gemms) for m in int8)
    assert all((m.input_scale is not None) == name.endswith("static") for m in int8)
    reference = w8a8_transformers(quantized, dequantized)
    float_model = w8a8_plain(dequantized)
    prompt = random_prompts(config.vocab_size, [17], seed=3)[0]
    runner = PagedRunner(model, config)
    ours = runner.step({0: prompt})[0]
    expected = hf_logits(reference, prompt)
    torch.testing.assert_close(ours, expected, atol=2e-3, rtol=0)
    # Against the unquantized model: how far W8A8 moves next-token distributions (reported, bounded loosely).
    kl = torch.nn.functional.kl_div(ours.log_softmax(-1), hf_logits(float_model, prompt).log_softmax(-1),
                                    log_target=True, reduction="batchmean").item()
    print(f"W8A8 int8 mean KL from the dequantized-weight model: {kl:.2e}")
    assert kl < 0.05


def w8a8_plain(dequantized_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(dequantized_dir, dtype=torch.float32,
                                                attn_implementation="eager").eval()


def test_fp8_on_load_rounds_each_projection_row_to_e4m3(llama_dir):
    model, _ = load_model(llama_dir, torch.float32, CPU, pack=False, quantization="fp8")
    plain, _ = load_model(llama_dir, torch.float32, CPU, pack=False)
    ours, theirs = model.layers[1].mlp.down_proj.weight, plain.layers[1].mlp.down_proj.weight
    scale = theirs.abs().amax(dim=1, keepdim=True) / 448
    torch.testing.assert_close(ours, (theirs / scale).to(torch.float8_e4m3fn).float() * scale, rtol=0, atol=0)
    assert not torch.equal(ours, theirs)
    torch.testing.assert_close(model.embed_tokens.weight, plain.embed_tokens.weight, rtol=0, atol=0)  # untouched


# FP8 checkpoints whose layers can stay FP8 (on GPUs with FP8 arithmetic), and the columns per activation scale
# (None: a token's whole row).
FP8 = {
    "fp8 per tensor, static activations": None,
    "fp8 blocks 48x48 (partial edges)": 48,
    "compressed-tensors fp8 W8A8": None,
}


class Fp8Reference(torch.nn.Module):
    """A transformers Linear over the dequantized weight whose input is first rounded to e4m3 per token and
    ``group`` columns (None: its whole row; scale: the group's largest magnitude over 448): dynamic W8A8 FP8's arithmetic, the
    product in float64."""

    def __init__(self, linear: torch.nn.Linear, group: int | None):
        super().__init__()
        self.linear, self.group = linear, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).float()
        rounded = []
        for part in flat.split(self.group or flat.shape[1], dim=1):
            scale = (part.abs().amax(dim=1, keepdim=True) / 448).clamp_min(1e-10)
            rounded.append((part / scale).to(torch.float8_e4m3fn).double() * scale.double())
        y = torch.cat(rounded, dim=1) @ self.linear.weight.double().t()
        if self.linear.bias is not None:
            y = y + self.linear.bias.double()
        return y.to(x.dtype).view(*x.shape[:-1], -1)


def fp8_transformers(dequantized_dir, group: int | None):
    """transformers' model on the dequantized weights, each decoder projection running Fp8Reference."""
    hf = w8a8_plain(dequantized_dir)
    for layer in hf.model.layers:
        for block in (layer.self_attn, layer.mlp):
            for name, child in list(block.named_children()):
                if isinstance(child, torch.nn.Linear):
                    setattr(block, name, Fp8Reference(child, group))
    return hf


def rounded_per_row(model_dir, target):
    """A copy of the float checkpoint with each decoder projection as --quantization fp8 rounds it."""
    hf = w8a8_plain(model_dir)
    for layer in hf.model.layers:
        for block in (layer.self_attn, layer.mlp):
            for child in block.children():
                if isinstance(child, torch.nn.Linear):
                    codes, scale = fp8_round_per_row(child.weight.data)
                    child.weight.data.copy_(codes.float() * scale)
    hf.save_pretrained(target)
    return target


@pytest.mark.parametrize("name", [*FP8, "--quantization fp8 on a float checkpoint"])
def test_fp8_layers_kept_fp8_equal_the_w8a8_reference_on_its_activations(name, checkpoints, llama_dir, tmp_path):
    """The GPU's FP8 path (the block-wise Triton GEMM interpreted, torch._scaled_mm on this CPU): e4m3 weights
    kept with their scales, activations rounded to e4m3 per token (and block). transformers runs that
    arithmetic in float64 on the dequantized weights, and each of our layers is fed the very input its
    reference layer gets. (Whole-model logits agreed within 3e-6 on this CPU over 12 prompts, but one e4m3
    activation rounding the other way, as float32 inputs 1e-6 apart on another CPU may, moves one of these
    sharp models' outputs by a sizeable fraction of a logit.)"""
    from services.worker.quantization.fp8_linear import Fp8Linear

    if name in FP8:
        (quantized, dequantized), quantization, group = checkpoints(name), None, FP8[name]
    else:  # the float checkpoint's projections rounded per row at load: the oracle's weights are those
        quantized, quantization, group = llama_dir, "fp8", None
        dequantized = rounded_per_row(llama_dir, tmp_path / "rounded")
    model, config = load_model(quantized, torch.float32, CPU, pack=False, quantization=quantization,
                               triton_gemms=True)
    ours = {name: m for name, m in model.named_modules() if isinstance(m, Fp8Linear)}
    assert len(ours) == 4 * config.num_hidden_layers and all(m.weight.dtype == torch.float8_e4m3fn
                                                             for m in ours.values())
    reference = fp8_transformers(dequantized, group)
    checked = []

    def compare(name: str, module, inputs, expected):
        layer, rows = our_layer(name, ours, config)
        x = inputs[0].reshape(-1, layer.in_features)
        got = layer(x)[:, rows]
        want = expected.reshape(x.shape[0], -1)
        torch.testing.assert_close(got, want, atol=1e-5 * want.abs().max().item(), rtol=0, msg=lambda m: f"{name}: {m}")
        checked.append(name)

    for hf_name, module in reference.named_modules():
        if isinstance(module, Fp8Reference):
            module.register_forward_hook(lambda m, i, o, hf_name=hf_name: compare(hf_name, m, i, o))
    prompt = random_prompts(config.vocab_size, [17], seed=3)[0]
    hf_logits(reference, prompt)
    assert len(checked) == 7 * config.num_hidden_layers  # q, k, v, o, gate, up, down


def our_layer(hf_name: str, ours: dict, config) -> tuple:
    """Our fused layer holding transformers' ``model.layers.i.<block>.<proj>``, and its rows of the output."""
    prefix, proj = hf_name.removeprefix("model.").rsplit(".", 1)
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    inter = config.intermediate_size
    fused = {"q_proj": ("qkv_proj", slice(0, q)), "k_proj": ("qkv_proj", slice(q, q + kv)),
             "v_proj": ("qkv_proj", slice(q + kv, q + 2 * kv)), "gate_proj": ("gate_up_proj", slice(0, inter)),
             "up_proj": ("gate_up_proj", slice(inter, 2 * inter))}
    ours_name, rows = fused.get(proj, (proj, slice(None)))
    return ours[f"{prefix}.{ours_name}"], rows


# ---- refused at start, by name -----------------------------------------------------------------------

def _with_config(quantized, tmp_path, **changes):
    """A copy of the checkpoint whose quantization_config has ``changes`` (None: the key removed)."""
    import shutil

    target = tmp_path / "edited"
    shutil.copytree(quantized, target)
    raw = json.loads((target / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            raw["quantization_config"].pop(key, None)
        else:
            raw["quantization_config"][key] = value
    (target / "config.json").write_text(json.dumps(raw))
    return target


@pytest.mark.parametrize("name, changes, error", [
    ("gptq 8-bit per channel", dict(quant_method="bitsandbytes"),
     "quantization method 'bitsandbytes' is not supported; supported: fp8, compressed-tensors, awq, gptq"),
    ("gptq 8-bit per channel", dict(bits=3), "bits 3 is not supported; supported: 4, 8"),
    ("awq group 32", dict(version="gemv"), "version 'gemv' is not supported"),
    ("awq group 32", dict(group_size=0), "group_size 0 is not supported"),
    ("fp8 per tensor, static activations", dict(fmt="e5m2"), "fmt 'e5m2' is not supported"),
    ("fp8 blocks 48x48 (partial edges)", dict(weight_block_size=[48]), "weight_block_size must be two"),
])
def test_unsupported_settings_are_refused_naming_what_is(name, changes, error, checkpoints, tmp_path):
    edited = _with_config(checkpoints(name)[0], tmp_path, **changes)
    with pytest.raises(ValueError, match=error.replace("(", r"\(").replace(")", r"\)")) as info:
        load_model(edited, torch.float32, CPU)
    assert str(edited / "config.json") in str(info.value)


def test_compressed_tensors_schemes_not_built_are_refused(checkpoints, tmp_path):
    quantized = checkpoints("ct-w8a8-int8")[0]
    groups = json.loads((quantized / "config.json").read_text())["quantization_config"]["config_groups"]
    static = json.loads(json.dumps(groups))
    static["group_0"]["input_activations"].update(dynamic=False, strategy="token")
    nvfp4 = json.loads(json.dumps(groups))
    nvfp4["group_0"]["format"] = "nvfp4-pack-quantized"
    for edit, error in ((static, "strategy 'token' is not supported; supported: 'tensor'"),
                        (nvfp4, "format 'nvfp4-pack-quantized' is not supported; supported: 'int-quantized'")):
        with pytest.raises(ValueError, match=error):
            load_model(_with_config(quantized, tmp_path / error[:6], config_groups=edit), torch.float32, CPU)


def test_a_missing_scale_or_part_is_refused_naming_the_tensor(checkpoints, tmp_path):
    import shutil

    for name, dropped, error in (
            ("fp8 per tensor, static activations", "model.layers.1.mlp.up_proj.weight_scale",
             "missing tensor model.layers.1.mlp.up_proj.weight_scale or model.layers.1.mlp.up_proj.weight_scale_inv"),
            ("ct-w8a8-int8", "model.layers.0.self_attn.o_proj.weight_scale",
             "model.layers.0.self_attn.o_proj.weight is stored as torch.int8, but the checkpoint has none of"),
            ("gptq 8-bit per channel", "model.layers.0.self_attn.k_proj.scales",
             "missing tensor model.layers.0.self_attn.k_proj.scales")):
        target = tmp_path / dropped
        shutil.copytree(checkpoints(name)[0], target)
        tensors = load_file(target / "model.safetensors")
        del tensors[dropped]
        save_file(tensors, target / "model.safetensors")
        with pytest.raises(ValueError, match=error):
            load_model(target, torch.float32, CPU)


def test_quantization_flag_must_agree_with_the_checkpoint(checkpoints, llama_dir):
    with pytest.raises(ValueError, match="--quantization awq, but .* says the checkpoint is quantized with gptq"):
        load_model(checkpoints("gptq 8-bit per channel")[0], torch.float32, CPU, quantization="awq")
    with pytest.raises(ValueError, match="--quantization gptq needs a checkpoint quantized with it"):
        load_model(llama_dir, torch.float32, CPU, quantization="gptq")


def test_two_ranks_and_a_lora_adapter_over_a_quantized_checkpoint_equal_transformers(checkpoints, tmp_path):
    """Each rank dequantizes the whole tensor and keeps its share; an adapter sits on the dequantized layers."""
    from pagedserve import LoRARequest
    from tests.lora_adapters import make_adapter, merged_model

    quantized, dequantized = checkpoints("gptq 4-bit act-order asymmetric")
    adapter = make_adapter(dequantized, tmp_path / "adapter", rank=8, seed=5)
    merged = merged_model(dequantized, adapter, tmp_path / "merged")
    prompts = [[3 + t % 509 for t in p] for p in random_prompts(512, [9, 26], seed=11)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    llm = LLM(str(quantized), block_size=4, tensor_parallel_size=2, enable_lora=True, max_lora_rank=8,
              kv_cache_memory_bytes=8 << 20)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts * 2], params, use_tqdm=False,
                               lora_request=[None] * len(prompts) + [LoRARequest("adapter", str(adapter))] * len(prompts))
    finally:
        llm.close()
    for i, (prompt, out) in enumerate(zip(prompts * 2, outputs)):
        model_dir, what = (dequantized, "base") if i < len(prompts) else (merged, "adapter")
        ref, ref_logprobs = hf_greedy(model_dir, prompt, 10)
        assert_greedy_equal(out.outputs[0].token_ids, ref, ref_logprobs, f"gptq {what} on 2 ranks")


def test_a_lora_adapter_over_w8a8_int8_layers_equals_the_reference(checkpoints, tmp_path):
    """An adapter beside Int8Linear layers: the int8 product of the quantized input plus the adapter's float
    product of the input itself, against transformers running the same in float64."""
    from pagedserve import LoRARequest
    from tests.lora_adapters import make_adapter

    quantized, dequantized = checkpoints("ct-w8a8-int8")
    adapter = make_adapter(dequantized, tmp_path / "adapter", rank=8, seed=7)
    reference = w8a8_transformers(quantized, dequantized)
    with_adapter(reference, adapter)
    prompts = [[3 + t % 509 for t in p] for p in random_prompts(512, [11, 23], seed=13)]
    llm = LLM(str(quantized), block_size=4, enable_lora=True, max_lora_rank=8, kv_cache_memory_bytes=8 << 20)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False,
                               lora_request=LoRARequest("adapter", str(adapter)))
    finally:
        llm.close()
    for prompt, out in zip(prompts, outputs):
        tokens, logprobs = model_greedy(reference, prompt, 10)
        assert_greedy_equal(out.outputs[0].token_ids, tokens, logprobs, "W8A8 int8 with an adapter")


class WithAdapter(torch.nn.Module):
    """``base(x) + scaling * B (A x)``, the adapter's product in float64 on the unquantized input."""

    def __init__(self, base: torch.nn.Module, a: torch.Tensor, b: torch.Tensor, scaling: float):
        super().__init__()
        self.base, self.a, self.b, self.scaling = base, a, b, scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        delta = (x.double() @ self.a.double().t()) @ self.b.double().t() * self.scaling
        return (self.base(x).double() + delta).to(x.dtype)


def with_adapter(hf, adapter_dir) -> None:
    """Every module of transformers' model the PEFT adapter in ``adapter_dir`` names gets it beside it."""
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    scaling = config["lora_alpha"] / config["r"]
    tensors = load_file(adapter_dir / "adapter_model.safetensors")
    modules = dict(hf.named_modules())
    for name, a in tensors.items():
        if ".lora_A." in name:
            module = name.removeprefix("base_model.model.").split(".lora_A.")[0]
            owner, attr = module.rsplit(".", 1)
            base = getattr(modules[owner], attr)
            setattr(modules[owner], attr, WithAdapter(base, a, tensors[name.replace(".lora_A.", ".lora_B.")], scaling))


class ShardedW8A8Reference(torch.nn.Module):
    """A row-parallel W8A8 layer on ``ranks`` ranks: each rank quantizes its contiguous share of the input
    per token, multiplies it by its columns of the int8 weight, and the all-reduce sums the scaled partial
    products (in float64 here); the bias once."""

    def __init__(self, layer: W8A8Reference, ranks: int):
        super().__init__()
        self.layer, self.ranks = layer, ranks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weight, scale = self.layer.weight, self.layer.scale
        total = sum(w8a8_reference(part, w, scale, None, torch.float64)
                    for part, w in zip(flat.chunk(self.ranks, dim=1), weight.chunk(self.ranks, dim=1)))
        if self.layer.bias is not None:
            total = total + self.layer.bias.double()
        return total.to(x.dtype).view(*x.shape[:-1], -1)


def test_w8a8_int8_on_two_ranks_equals_the_reference_of_sharded_quantization(checkpoints):
    """Column-parallel layers see the whole input on each rank (as one worker); row-parallel ones (o_proj,
    down_proj) quantize each rank's share of it per token, as vLLM does: the oracle does the same."""
    quantized, dequantized = checkpoints("ct-w8a8-int8")
    reference = w8a8_transformers(quantized, dequantized)
    for layer in reference.model.layers:
        layer.self_attn.o_proj = ShardedW8A8Reference(layer.self_attn.o_proj, 2)
        layer.mlp.down_proj = ShardedW8A8Reference(layer.mlp.down_proj, 2)
    prompts = [[3 + t % 509 for t in p] for p in random_prompts(512, [12, 29], seed=17)]
    llm = LLM(str(quantized), block_size=4, tensor_parallel_size=2, kv_cache_memory_bytes=8 << 20)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=0),
                               use_tqdm=False)
    finally:
        llm.close()
    for prompt, out in zip(prompts, outputs):
        tokens, logprobs = model_greedy(reference, prompt, 10)
        ours = out.outputs[0]
        assert_greedy_equal(ours.token_ids, tokens, logprobs, "W8A8 int8 on two ranks")
        # The sampled tokens' log-probabilities while the tokens agree: within 2e-6 of this oracle here; one
        # worker's quantization (the whole input per token) is up to 0.1 away and fails.
        for step, (token, expected) in enumerate(zip(ours.token_ids, tokens)):
            if token != expected:
                break
            assert ours.logprobs[step][token].logprob == pytest.approx(logprobs[step][token].item(), abs=1e-4)


def test_per_row_fp8_is_dequantized_where_scaled_mm_cannot_give_the_dtype(checkpoints, monkeypatch):
    """Some torch releases' row-wise _scaled_mm writes bfloat16 only: the loader probes it once and keeps
    per-row FP8 layers only where it runs (block layers use the Triton GEMM either way)."""
    from services.worker.quantization import stored_layers
    from services.worker.quantization.fp8_linear import Fp8Linear, scaled_mm_runs

    assert scaled_mm_runs(torch.float32, CPU)  # this CPU's torch runs it
    monkeypatch.setattr(stored_layers, "scaled_mm_runs", lambda dtype, device: False)
    per_row, _ = load_model(checkpoints("fp8 per tensor, static activations")[0], torch.float32, CPU, pack=False,
                            triton_gemms=True)
    blocks, _ = load_model(checkpoints("fp8 blocks 48x48 (partial edges)")[0], torch.float32, CPU, pack=False,
                           triton_gemms=True)
    assert not any(isinstance(m, Fp8Linear) for m in per_row.modules())
    assert per_row.layers[0].mlp.down_proj.weight.dtype == torch.float32  # dequantized at load
    assert any(isinstance(m, Fp8Linear) for m in blocks.modules())
