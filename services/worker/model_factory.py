"""Small random models saved as ordinary Hugging Face directories.

Nothing can be downloaded, so the built-in default model, the benchmark model
and the test models are made here: a byte-level BPE tokenizer trained on text
that ships with Python, plus a transformers model with seeded random weights.
The weights use a large init std so that next-token distributions are sharp:
greedy decoding then has few near-ties, and comparing our tokens with
transformers' is meaningful.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch

from services.worker.vision_model_factory import (VISION_MODEL_TYPES, add_image_tokens, save_processor,
                                                   vision_config, vision_model)
from shared.cache_dir import cache_root, made_once

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN, PAD_TOKEN = "<|im_end|>", "<|endoftext|>"
# ChatML. With tools, a system turn lists them (their function objects as JSON, one per line) and
# says how to call one: Hermes' format, which `--tool-call-parser hermes` reads. An assistant turn's
# earlier calls are written back in the same format.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' and messages[0]['content'] %}"
    "{{- messages[0]['content'] + '\n\n' }}{%- endif %}"
    "{{- 'Functions you may call, one JSON signature per line:\n<tools>\n' }}"
    "{%- for tool in tools %}{{- (tool['function'] if tool['function'] is defined else tool) | tojson }}"
    "{{- '\n' }}{%- endfor %}"
    "{{- '</tools>\nTo call one, write <tool_call>{\"name\": <its name>, \"arguments\": "
    "<a JSON object of its arguments>}</tool_call>.<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (tools and loop.first and message['role'] == 'system') %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') }}"
    "{%- for call in message['tool_calls'] or [] %}"
    "{{- '\n' if message['content'] or not loop.first else '' }}{{- '<tool_call>\n' }}"
    "{%- set arguments = call['function']['arguments'] %}"  # OpenAI's shape: JSON text; an object here too
    "{{- '{\"name\": ' + call['function']['name'] | tojson + ', \"arguments\": ' }}"
    "{{- (arguments if arguments is string else arguments | tojson) + '}' }}"
    "{{- '\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
# 0.2: the default model's greedy top-1 probability is typically ~0.2 with clear top-2 gaps,
# while attention scores stay soft enough not to collapse to one-hot.
DEFAULT_INIT_STD = 0.2
_EXTRA_CORPUS = (
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! How are you today?",
    "You are a helpful assistant.",
    "Café, naïve, façade, jalapeño — Grüße aus Köln.",
    "日本語のテキスト、中文文本、한국어 텍스트。",
    "Emoji: 😀 🚀 ✨ and math: ∑ ∫ √ π ≈ 3.14159",
)

DEFAULT_MODEL: dict[str, Any] = dict(
    model_type="llama", vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048, dtype="float32")
# 56M parameters; the tokenizer stays smaller than 32000 (the corpus runs out), the extra rows are unused.
BENCH_MODEL: dict[str, Any] = dict(
    model_type="llama", vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
    num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096, dtype="float32")
DEFAULT_MODEL_NAME = "default-model-v2"  # v2: a chat template that shows tools


@functools.lru_cache(maxsize=None)
def _trained_tokenizer_json(vocab_size: int) -> str:
    """Train once per vocabulary size per process (serialised, so callers get independent copies)."""
    from pydoc_data.topics import topics
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    # Byte-level pre-tokenizer + decoder: any UTF-8 text encodes, and decoding is lossless.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = [topics[key] for key in sorted(topics)] + list(_EXTRA_CORPUS)
    tokenizer.train_from_iterator(corpus, trainer)
    return tokenizer.to_str()


def train_tokenizer(vocab_size: int):
    """A byte-level BPE ``PreTrainedTokenizerFast`` with ChatML special tokens and chat template."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_trained_tokenizer_json(vocab_size)),
        eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, model_max_length=1 << 30,
        clean_up_tokenization_spaces=False)  # decode must invert encode exactly
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _config(model_type: str, **kwargs: Any):
    from transformers import (Gemma2Config, Gemma3TextConfig, GemmaConfig, GraniteConfig, LlamaConfig, MistralConfig,
                              MixtralConfig, Olmo2Config, Phi3Config, Qwen2Config, Qwen2MoeConfig, Qwen3Config,
                              Qwen3MoeConfig, SmolLM3Config)

    classes = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config,
               "mixtral": MixtralConfig, "qwen2_moe": Qwen2MoeConfig, "qwen3_moe": Qwen3MoeConfig,
               "gemma": GemmaConfig, "gemma2": Gemma2Config, "gemma3_text": Gemma3TextConfig, "phi3": Phi3Config,
               "granite": GraniteConfig, "olmo2": Olmo2Config, "smollm3": SmolLM3Config}
    if model_type in VISION_MODEL_TYPES:  # over the Llama (Qwen2-VL: its Qwen 2; Gemma 3: its Gemma 3) asked for
        return vision_config(model_type, Gemma3TextConfig if model_type == "gemma3" else LlamaConfig, **kwargs)
    if model_type not in classes:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(classes)}")
    return classes[model_type](**kwargs)


@torch.no_grad()
def _randomize(model: torch.nn.Module, init_std: float, seed: int, norm_center: float = 1.0) -> None:
    """Seeded weights: matrices and biases ~ N(0, std); norm weights ~ norm_center + N(0, 0.1) (Gemma's
    norms scale by 1 + weight: centred on 0 they scale by about 1, as Llama's centred on 1)."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in sorted(model.named_parameters()):
        noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
        value = norm_center + 0.1 * noise if "norm" in name else init_std * noise
        param.copy_(value)


@torch.no_grad()
def _silence_unused_rows(model: torch.nn.Module, num_tokens: int) -> None:
    """Zero the embedding and output rows of ids the tokenizer lacks.

    Their logit is then 0, far below the top real logits, so greedy decoding
    never picks an id that detokenizes to nothing and sampling almost never does.
    """
    model.get_input_embeddings().weight[num_tokens:] = 0
    model.get_output_embeddings().weight[num_tokens:] = 0


def create_model_dir(path: str | Path, *, model_type: str = "llama", vocab_size: int = 4096,
                     hidden_size: int = 256, intermediate_size: int = 704, num_hidden_layers: int = 4,
                     num_attention_heads: int = 8, num_key_value_heads: int = 4,
                     head_dim: int | None = None, max_position_embeddings: int = 2048,
                     tie_word_embeddings: bool = False, rope_scaling: dict[str, Any] | None = None,
                     dtype: str = "float32", init_std: float = DEFAULT_INIT_STD, seed: int = 0,
                     max_shard_size: str | int | None = None, **extra_config: Any) -> Path:
    """Write a random model of the given shape, its tokenizer and generation config to ``path``."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    path = Path(path)
    tokenizer = train_tokenizer(vocab_size)
    if model_type in VISION_MODEL_TYPES:  # its image placeholder (and more), tokens of their own
        extra_config.update(add_image_tokens(model_type, tokenizer))
    eos_ids = [tokenizer.convert_tokens_to_ids(EOS_TOKEN), tokenizer.convert_tokens_to_ids(PAD_TOKEN)]
    config = _config(
        model_type, vocab_size=max(vocab_size, len(tokenizer)), hidden_size=hidden_size,
        intermediate_size=intermediate_size, num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads,
        head_dim=head_dim if head_dim is not None else hidden_size // num_attention_heads,
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie_word_embeddings,
        rope_scaling=rope_scaling, bos_token_id=None, eos_token_id=eos_ids[0], pad_token_id=eos_ids[1],
        **extra_config)
    torch_dtype = getattr(torch, dtype)
    if model_type in VISION_MODEL_TYPES:
        model = vision_model(config)
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, init_std, seed, norm_center=0.0 if model_type.startswith("gemma") else 1.0)
    _silence_unused_rows(model, len(tokenizer))
    model = model.to(torch_dtype)
    model.generation_config = GenerationConfig(eos_token_id=eos_ids, pad_token_id=eos_ids[1],
                                               bos_token_id=None)
    save_kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **save_kwargs)
    tokenizer.save_pretrained(path)
    if model_type in VISION_MODEL_TYPES:
        save_processor(path, tokenizer, config)
    _check_saved_dtype(path, dtype)
    return path


def _check_saved_dtype(path: Path, dtype: str) -> None:
    """Make sure config.json records the dtype (older transformers wrote torch_dtype, newer dtype)."""
    file = path / "config.json"
    raw = json.loads(file.read_text())
    if (raw.get("dtype") or raw.get("torch_dtype")) != dtype:
        raw["dtype"] = dtype
        file.write_text(json.dumps(raw, indent=2) + "\n")


def default_model_dir() -> Path:
    """The built-in default model, created on first use and cached on disk."""
    return cached_model_dir(DEFAULT_MODEL_NAME, DEFAULT_MODEL)


def cached_model_dir(name: str, spec: dict) -> Path:
    """``create_model_dir(**spec)`` made once under cache_root() as ``name``.

    It is built in a private temporary directory and renamed into place, so a
    concurrent process either sees no directory or a complete one.
    """
    return made_once(cache_root() / name, lambda folder: create_model_dir(folder, **spec))
