"""Mixture-of-experts layers: their config, the routing, the experts against a token-by-token reference,
the loader's expert weights and the tensor-parallel split. (The models against transformers, and the
engine's greedy tokens against transformers', are in test_model.py and scheduler/test_engine_oracle.py.)"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F

from services.worker.model_loader import load_model
from services.worker.models.moe import SparseMoeBlock, select_experts
from services.worker.tensor_parallel import TensorParallel
from services.worker.model_config import ModelConfig
from services.worker.moe_config import MoEConfig, parse_moe
from tests.checkpoint_edits import rewrite_weights

CPU = torch.device("cpu")
BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4, vocab_size=100)


def moe_config(**overrides) -> MoEConfig:
    values = dict(num_experts=6, top_k=2, intermediate_size=24, renormalize=True, float32_weights=False,
                  sparse_layers=(0,))
    return MoEConfig(**{**values, **overrides})


# ---- config -------------------------------------------------------------------------------------

def test_mixtral_layers_are_all_sparse_with_renormalised_float32_weights():
    moe = parse_moe({**BASE, "model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2},
                    "mixtral")
    assert moe == MoEConfig(num_experts=8, top_k=2, intermediate_size=128, renormalize=True,
                            float32_weights=True, sparse_layers=(0, 1, 2, 3, 4, 5))


def test_qwen_sparse_layers_follow_the_step_and_the_dense_list():
    raw = {**BASE, "model_type": "qwen3_moe", "num_experts": 16, "num_experts_per_tok": 4,
           "moe_intermediate_size": 32, "decoder_sparse_step": 2, "mlp_only_layers": [3], "norm_topk_prob": True}
    moe = parse_moe(raw, "qwen3_moe")
    assert moe.sparse_layers == (1, 5) and moe.num_experts == 16 and moe.intermediate_size == 32
    assert moe.renormalize and not moe.float32_weights and moe.shared_expert_intermediate_size == 0
    config = ModelConfig.from_dict(raw)
    assert config.qk_norm and not config.qkv_bias and config.moe == moe
    assert [config.mlp_width(i) for i in range(6)] == [128, 32, 128, 128, 128, 32]


def test_mixtral_s_defaults_are_transformers_where_the_config_leaves_them_out():
    config = ModelConfig.from_dict({**BASE, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2})
    assert (config.rms_norm_eps, config.rope_theta) == (1e-5, 1e6)
    assert ModelConfig.from_dict({**BASE, "model_type": "mistral"}).rms_norm_eps == 1e-6


def test_ranks_need_not_divide_a_dense_size_no_layer_uses():
    raw = {**BASE, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
           "moe_intermediate_size": 32, "intermediate_size": 30}
    share = TensorParallel(0, 4).shard(ModelConfig.from_dict(raw))  # every layer sparse: 30 is never used
    assert share.moe.intermediate_size == 8
    with pytest.raises(ValueError, match=r"does not divide the model's intermediate_size \(30\)"):
        TensorParallel(0, 4).shard(ModelConfig.from_dict({**raw, "mlp_only_layers": [2]}))


def test_qwen2_moe_has_a_shared_expert_and_qkv_biases():
    raw = {**BASE, "model_type": "qwen2_moe", "num_experts": 4, "num_experts_per_tok": 2,
           "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48}
    config = ModelConfig.from_dict(raw)
    assert config.moe.shared_expert_intermediate_size == 48 and not config.moe.renormalize
    assert config.qkv_bias and not config.qk_norm
    assert not ModelConfig.from_dict({**raw, "qkv_bias": False}).qkv_bias
    assert ModelConfig.from_dict({**BASE, "model_type": "llama"}).moe is None


@pytest.mark.parametrize("edit, message", [
    (lambda raw: raw.pop("num_experts_per_tok"), "num_experts_per_tok"),
    (lambda raw: raw.pop("moe_intermediate_size"), "moe_intermediate_size"),
    (lambda raw: raw.update(num_experts_per_tok=5), r"num_experts_per_tok \(5\) exceeds.*\(4\)"),
    (lambda raw: raw.update(num_experts=0), "num_experts must be a positive integer"),
    (lambda raw: raw.update(decoder_sparse_step=0), "decoder_sparse_step"),
])
def test_bad_moe_configs_are_refused(edit, message):
    raw = {**BASE, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    edit(raw)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(raw)


# ---- routing and experts ---------------------------------------------------------------------------

def test_select_experts_takes_the_most_probable():
    logits = torch.randn(7, 6)
    for renormalize in (False, True):
        for float32_weights, dtype in ((True, torch.float32), (False, torch.bfloat16)):
            moe = moe_config(renormalize=renormalize, float32_weights=float32_weights)
            weights, ids = select_experts(logits.to(dtype), moe, dtype)
            probs = torch.softmax(logits.to(dtype).float(), dim=-1)
            expected = probs.gather(1, ids)
            if renormalize:
                expected = expected / expected.sum(-1, keepdim=True)
            assert weights.dtype == (torch.float32 if float32_weights else dtype)
            torch.testing.assert_close(weights.float(), expected.to(weights.dtype).float())
            assert [set(row) for row in ids.tolist()] == [set(row) for row in probs.topk(2).indices.tolist()]


def _block(moe: MoEConfig, hidden: int = 16, shared: int = 0, seed: int = 0) -> SparseMoeBlock:
    from services.worker.models.decoder import MLP

    tp = TensorParallel()
    block = SparseMoeBlock(hidden, moe, tp, MLP(hidden, shared, False, tp, reduce=False) if shared else None)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    return block.eval()


def _token_by_token(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """Each token through its chosen experts one at a time, written from the definition."""
    moe = block.moe
    probs = torch.softmax(F.linear(x.float(), block.gate.weight.float()), dim=-1)
    out = torch.zeros_like(x, dtype=torch.float32)
    for t in range(x.shape[0]):
        top = probs[t].topk(moe.top_k)
        weights = top.values / top.values.sum() if moe.renormalize else top.values
        for weight, e in zip(weights, top.indices.tolist()):
            gate, up = F.linear(x[t].float(), block.w13[e].float()).chunk(2)
            out[t] += weight * F.linear(F.silu(gate) * up, block.w2[e].float())
    if block.shared_expert is not None:
        shared = block.shared_expert
        gate, up = F.linear(x.float(), shared.gate_up_proj.weight.float()).chunk(2, dim=-1)
        out += (torch.sigmoid(F.linear(x.float(), block.shared_expert_gate.weight.float()))
                * F.linear(F.silu(gate) * up, shared.down_proj.weight.float()))
    return out


@pytest.mark.parametrize("tokens", [1, 3, 40])
@pytest.mark.parametrize("shared", [0, 20])
def test_experts_equal_the_token_by_token_reference(tokens, shared):
    block = _block(moe_config(renormalize=shared == 0), shared=shared, seed=tokens)
    x = torch.randn(tokens, 16)
    with torch.no_grad():
        out = block(x)
    torch.testing.assert_close(out, _token_by_token(block, x), atol=1e-4, rtol=1e-4)


def test_packed_experts_equal_the_stacked_ones():
    block = _block(moe_config(num_experts=8, top_k=3))
    x = torch.randn(33, 16)
    with torch.no_grad():
        expected = block(x)
        block.pack_experts()
        torch.testing.assert_close(block(x), expected, atol=1e-5, rtol=1e-5)


def test_bfloat16_experts_stay_close_to_float32():
    block = _block(moe_config())
    x = torch.randn(24, 16)
    with torch.no_grad():
        expected, experts32 = block(x), select_experts(block.gate(x), block.moe, torch.float32)[1]
        block.to(torch.bfloat16)
        low = x.to(torch.bfloat16)
        out, experts16 = block(low), select_experts(block.gate(low), block.moe, torch.bfloat16)[1]
    assert out.dtype == torch.bfloat16
    # A token whose router is near a tie may go to other experts in bfloat16: compare the others, row by row.
    same = (experts32.sort(-1).values == experts16.sort(-1).values).all(-1)
    assert same.sum() >= len(x) - 3, f"{len(x) - int(same.sum())} of {len(x)} tokens changed experts"
    errors = (out.float() - expected)[same].norm(dim=-1) / expected[same].norm(dim=-1)
    assert errors.max() < 0.05, errors


# ---- loading and the tensor-parallel split ---------------------------------------------------------

def test_the_checkpoint_s_experts_land_in_the_stacked_weights(mixtral_dir):
    from safetensors.torch import load_file

    model, _ = load_model(mixtral_dir, torch.float32, CPU, pack=False)
    tensors = load_file(mixtral_dir / "model.safetensors")
    block = model.layers[1].mlp
    prefix = "model.layers.1.block_sparse_moe"
    assert torch.equal(block.gate.weight, tensors[f"{prefix}.gate.weight"])
    assert torch.equal(block.w13[3], torch.cat([tensors[f"{prefix}.experts.3.w1.weight"],
                                                tensors[f"{prefix}.experts.3.w3.weight"]]))
    assert torch.equal(block.w2[2], tensors[f"{prefix}.experts.2.w2.weight"])


def test_a_missing_expert_weight_is_named(qwen3_moe_dir, tmp_path):
    broken = shutil.copytree(qwen3_moe_dir, tmp_path / "broken")
    name = "model.layers.0.mlp.experts.5.down_proj.weight"
    rewrite_weights(broken, lambda t: t.pop(name))
    with pytest.raises(ValueError, match=rf"missing weights.*{name}"):
        load_model(broken, torch.float32, CPU)


def test_ranks_split_every_expert_s_columns(qwen2_moe_dir):
    config = ModelConfig.from_model_dir(qwen2_moe_dir)
    share = TensorParallel(1, 2).shard(config)
    assert share.moe.intermediate_size == 16 and share.moe.shared_expert_intermediate_size == 24
    assert share.moe.num_experts == config.moe.num_experts
    model, _ = load_model(qwen2_moe_dir, torch.float32, CPU, pack=False, tp=TensorParallel(1, 2))
    whole, _ = load_model(qwen2_moe_dir, torch.float32, CPU, pack=False)
    ours, all_of_it = model.layers[0].mlp, whole.layers[0].mlp
    # Rank 1: the second half of each expert's gate and up rows, and of its down columns.
    assert torch.equal(ours.w13[1][:16], all_of_it.w13[1][16:32])
    assert torch.equal(ours.w13[1][16:], all_of_it.w13[1][48:])
    assert torch.equal(ours.w2[3], all_of_it.w2[3][:, 16:])


def test_ranks_that_cannot_split_the_experts_are_refused(qwen3_moe_dir, tmp_path):
    copy = shutil.copytree(qwen3_moe_dir, tmp_path / "odd")
    raw = json.loads((copy / "config.json").read_text())
    raw["moe_intermediate_size"] = 30
    (copy / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"tensor_parallel_size 4 does not divide the experts' intermediate_size \(30\)"):
        TensorParallel(0, 4).shard(ModelConfig.from_model_dir(copy))
