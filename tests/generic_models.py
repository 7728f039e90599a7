"""Tiny random checkpoints of architectures with no native model here, for the transformers path: saved
by transformers itself (config.json, safetensors, generation config) with the tests' trained tokenizer."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 512
# Each architecture's shape in its own config's names, small; the ones that set them apart are kept on.
GENERIC_ARCHS: dict[str, dict] = {
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=256),  # learned positions, fused qkv (Conv1D)
    "gptj": dict(n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=256),  # partial interleaved rotary
    "phi": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                partial_rotary_factor=0.5, max_position_embeddings=256),  # parallel block, partial rotary
    "starcoder2": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=128, max_position_embeddings=256, sliding_window=24),  # GQA, windows
    "cohere": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=128, max_position_embeddings=256, logit_scale=0.5),  # scaled logits
    "gpt_bigcode": dict(n_embd=64, n_layer=2, n_head=4, n_positions=256, multi_query=True),  # one KV head
    "olmo": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                 max_position_embeddings=256, clip_qkv=8.0),  # non-parametric norms, clipped qkv
    "persimmon": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                      max_position_embeddings=256, partial_rotary_factor=0.5),  # q/k layernorm, squared ReLU
    "gpt_neox": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                     max_position_embeddings=256, rotary_pct=0.25),  # parallel residual, rotary_pct
    "opt": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128, word_embed_proj_dim=64,
                max_position_embeddings=256),  # learned positions offset by 2
}


def make_generic_model(path: Path, model_type: str, seed: int = 0, init_std: float = 0.3, **overrides) -> Path:
    """A random model of the architecture (GENERIC_ARCHS' shape with the overrides) and its tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from services.worker.model_factory import EOS_TOKEN, PAD_TOKEN, train_tokenizer

    tokenizer = train_tokenizer(VOCAB)
    eos, pad = tokenizer.convert_tokens_to_ids(EOS_TOKEN), tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), bos_token_id=eos, eos_token_id=eos,
                                  pad_token_id=pad, tie_word_embeddings=False,
                                  **{**GENERIC_ARCHS[model_type], **overrides})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, init_std, seed)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return Path(path)


def _randomize(model: torch.nn.Module, init_std: float, seed: int) -> None:
    """Matrices and biases ~ N(0, std), norm scales ~ 1 + N(0, 0.1): sharp logits, few near-ties."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module_name, module in sorted(model.named_modules()):
            norm = "norm" in type(module).__name__.lower()
            for name, param in module.named_parameters(recurse=False):
                noise = torch.randn(param.shape, generator=generator)
                param.copy_(1.0 + 0.1 * noise if norm and name == "weight" else init_std * noise)
