"""Which implementation serves a model (--model-impl, vLLM's name): native (this project's models,
model_config.py's SUPPORTED_MODEL_TYPES) or transformers' own modelling code over the paged KV cache
(models/transformers_model.py). auto: native where there is one.

A checkpoint the transformers path cannot serve is refused here, from its config alone, with the reason."""

from __future__ import annotations

from pathlib import Path

from services.worker.model_config import SUPPORTED_MODEL_TYPES, ModelConfig
from services.worker.multimodal_config import TAKES_IMAGES
from shared.config import MODEL_IMPLS
from shared.json_file import read_json

_ALIBI_TYPES = ("bloom", "mpt")  # their positions are ALiBi biases, which the paged backends do not add


def model_type_of(model_dir: Path) -> str | None:
    file = Path(model_dir) / "config.json"
    return read_json(file).get("model_type") if file.is_file() else None


def chosen_impl(requested: str, model_dir: Path) -> str:
    """"native" or "transformers" for the model in model_dir."""
    if requested not in MODEL_IMPLS:
        raise ValueError(f"model_impl must be one of {MODEL_IMPLS}, got {requested!r}")
    if requested != "auto":
        return requested
    model_type = model_type_of(model_dir)  # None without a config.json: the native reading says what is missing
    return "native" if model_type is None or model_type in SUPPORTED_MODEL_TYPES else "transformers"


def model_config_for(impl: str, model_dir: Path, trust_remote_code: bool = False) -> ModelConfig:
    """The model's shape as the worker sizes its KV cache by: native models' own reading of config.json,
    else what transformers' config says (the probe at load corrects the KV heads)."""
    if impl == "native":
        try:
            return ModelConfig.from_model_dir(model_dir)
        except ValueError as exc:
            if "unsupported architecture" in str(exc):
                raise ValueError(f"{exc}; --model-impl transformers (or auto) runs it through transformers' "
                                 "own modelling code") from None
            raise
    return generic_model_config(transformers_config(model_dir, trust_remote_code))


def transformers_config(model_dir: Path, trust_remote_code: bool):
    """transformers' config of the model, or why the transformers path cannot serve it."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    where = f"{Path(model_dir) / 'config.json'}"
    raw = read_json(Path(model_dir) / "config.json")
    model_type = raw.get("model_type")
    needs_code = "auto_map" in raw and model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    if "quantization_config" in raw:
        method = (raw["quantization_config"] or {}).get("quant_method") if isinstance(raw["quantization_config"],
                                                                                   dict) else None
        raise ValueError(f"{where}: a quantized checkpoint ({method}) is served by the native models only; "
                         f"model_type {model_type!r} is not one of them: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if needs_code and not trust_remote_code:
        raise ValueError(f"{where}: model_type {model_type!r} needs the repository's own Python code (auto_map); "
                         "pass --trust-remote-code to run it")
    try:
        config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code, local_files_only=True)
    except (ValueError, KeyError, OSError) as exc:
        raise ValueError(f"{where}: transformers cannot read it ({_first_line(exc)})") from None
    refusal = _refusal(config, needs_code)
    if refusal is not None:
        raise ValueError(f"{where}: model_type {model_type!r} cannot be served through transformers: {refusal}; "
                         f"natively served types: {', '.join(SUPPORTED_MODEL_TYPES)}")
    return config


def _refusal(config, remote: bool) -> str | None:
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if getattr(config, "is_encoder_decoder", False):
        return "it is an encoder-decoder model"
    if config.model_type in _ALIBI_TYPES or getattr(config, "alibi", False) \
            or getattr(config, "position_embedding_type", None) == "alibi":
        return "its positions are ALiBi biases"
    if remote:
        return None  # its class is known once loaded: the probe checks its attention
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    if name is None and config.model_type in TAKES_IMAGES:  # (Qwen2-VL's is an image-text-to-text class only)
        from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

        name = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(config.model_type)
    if name is None:
        return "transformers has no causal-LM class for it"
    if not getattr(getattr(transformers, name, None), "_supports_attention_backend", False):
        return f"{name}'s attention does not go through transformers' attention interface"
    return None


def generic_model_config(config) -> ModelConfig:
    """A ModelConfig with the shape of transformers' config (only the fields the worker sizes memory by mean
    anything on this path; a vision-language model's from its language model's config, with M-RoPE's sections)."""
    top, config = config, config.get_text_config()
    heads = config.num_attention_heads
    hidden = config.hidden_size
    kv_heads = getattr(config, "num_key_value_heads", None) or (1 if getattr(config, "multi_query", False) else heads)
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    dtype = getattr(top, "dtype", None) or getattr(top, "torch_dtype", None) or "float32"
    dtype = str(dtype).removeprefix("torch.")
    inner = next((v for v in (getattr(config, n, None) for n in ("intermediate_size", "n_inner", "ffn_dim"))
                  if isinstance(v, int)), 4 * hidden)
    return ModelConfig(
        model_type=config.model_type, hidden_size=hidden, intermediate_size=inner,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, vocab_size=config.vocab_size, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
        max_position_embeddings=_max_positions(config), tie_word_embeddings=bool(top.tie_word_embeddings),
        qkv_bias=False, qk_norm=False, sliding_window=None, dtype=dtype if dtype in _DTYPES else "float32",
        mrope_section=_mrope_section(config))


def _mrope_section(config) -> tuple[int, ...] | None:
    """M-RoPE's sections (Qwen2-VL), wherever this transformers release keeps them."""
    for params in (getattr(config, "rope_parameters", None), getattr(config, "rope_scaling", None)):
        if isinstance(params, dict) and params.get("mrope_section") is not None:
            return tuple(params["mrope_section"])
    return None


_DTYPES = ("float32", "bfloat16", "float16")


def _max_positions(config) -> int:
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError(f"config.json of model_type {config.model_type!r} gives no context length "
                     "(max_position_embeddings or n_positions)")


def _first_line(exc: Exception) -> str:
    return (str(exc).strip().splitlines() or [""])[0]


def refuse_on_transformers_path(tensor_parallel_size: int, pooling: bool, quantization: str | None = None) -> None:
    """What --model-impl transformers does not serve, refused at start by name."""
    for refused, what in ((pooling, "pooling (embeddings, classifiers)"),
                          (tensor_parallel_size > 1, "tensor parallelism"),
                          (quantization is not None, f"--quantization {quantization}")):
        if refused:
            raise ValueError(f"{what} with --model-impl transformers is not supported; serve a native architecture "
                             "(--model-impl native) for it")
