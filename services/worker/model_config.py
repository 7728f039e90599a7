"""The model architecture, read from a Hugging Face model directory's ``config.json``.

Only what the worker needs to build a Llama-family model (dense, or with mixture-of-experts layers:
moe_config.py) is kept, already
normalised: both the transformers v4 rope format (``rope_theta`` +
``rope_scaling``) and the v5 one (``rope_parameters``) become ``rope_theta`` and
``rope_scaling`` (``None`` for plain RoPE). Anything we cannot run faithfully is
refused here with a message that names the file, rather than producing a model
that silently disagrees with the checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.worker.moe_config import MOE_MODEL_TYPES, MoEConfig, parse_moe
from services.worker.multimodal_config import TEXT_MODEL_OF, text_config_of
from services.worker.gemma_config import GEMMA_MODEL_TYPES, gemma_fields, gemma_layer_types, gemma_rope
from services.worker.rope_config import PHI3_ROPE_ALIASES, parse_rope, partial_rotary_factor
from shared.json_file import read_json

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "granite", "olmo2", "smollm3", *MOE_MODEL_TYPES,
                         *GEMMA_MODEL_TYPES,
                         *TEXT_MODEL_OF)
# The dense family each MoE one shares its attention with.
_ATTENTION_FAMILY = {"mixtral": "mistral", "qwen2_moe": "qwen2", "qwen3_moe": "qwen3", "granite": "llama",
                     "olmo2": "llama", "smollm3": "llama"}
LAYER_TYPES = ("full_attention", "sliding_attention")
# Models whose sliding_window counts only with use_sliding_window on; models whose every layer slides.
_WINDOW_SWITCHED = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "smollm3")
_EVERY_LAYER_SLIDES = ("mistral", "mixtral", "qwen3_moe", "phi3")
_WINDOW_BY_DEFAULT = ("mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe")  # 4096 when config.json omits it
_REQUIRED_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
# Defaults transformers uses when config.json omits a key (save_pretrained always writes them).
_DEFAULT_ROPE_THETA = {"mixtral": 1e6, "smollm3": 2e6}  # else 10000.0
_DEFAULT_RMS_NORM_EPS = {"mixtral": 1e-5, "phi3": 1e-5, "olmo2": 1e-5}  # else 1e-6
_DEFAULT_MAX_POSITIONS = {"phi3": 4096, "gemma": 8192, "gemma2": 8192, "gemma3_text": 131_072,
                          "smollm3": 32768}  # else 2048
_DEFAULT_HEAD_DIM = {"qwen3": 128, "gemma": 256, "gemma2": 256, "gemma3_text": 256}  # else hidden / heads


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # has "rope_type" plus its parameters; None for plain RoPE
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # q_proj/k_proj/v_proj carry a bias
    qk_norm: bool  # per-head RMSNorm on q and k before rotary (Qwen3, Gemma 3)
    sliding_window: int | None  # keys a query sees in a "sliding_attention" layer, itself included; None: no such layer
    dtype: str = "float32"
    o_bias: bool = False  # o_proj carries a bias (Llama/Qwen3 attention_bias)
    mlp_bias: bool = False  # gate/up/down carry biases (Llama mlp_bias)
    moe: MoEConfig | None = None  # None: every layer has a dense MLP
    # Per layer, transformers' names: "sliding_attention" (within sliding_window) or "full_attention";
    # empty: every layer full.
    layer_types: tuple[str, ...] = ()
    # Gemma (gemma_config.py); the defaults are Llama's.
    hidden_act: str = "silu"  # the MLP gate's activation: "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU)
    # RMSNorm arithmetic: "llama" (cast, then scale by weight), "gemma" (scale by 1 + weight in float32, then
    # cast), "olmo2" (scale by weight in float32, then cast).
    norm_style: str = "llama"
    # Where the layer's norms sit: "pre" (before attention and the MLP), "sandwich" (Gemma 2/3: before and
    # after each), "post" (OLMo 2: after each, none before).
    norm_placement: str = "pre"
    qk_norm_per_head: bool = True  # False: q and k normalised over their whole projection (OLMo 2)
    rope_layers: tuple[bool, ...] = ()  # per layer, whether it rotates q and k (SmolLM3's NoPE layers); (): all
    rotate_in_float32: bool = False  # q and k rotated in float32, then cast back (OLMo 2)
    embedding_multiplier: float | None = None  # embeddings times this (Gemma, Granite)
    round_embedding_multiplier: bool = False  # Gemma rounds the multiplier to the model's dtype first
    query_pre_attn_scalar: float | None = None  # attention scale: its inverse square root; None: head_dim's
    attn_logit_softcap: float | None = None  # attention scores become cap * tanh(score / cap)
    final_logit_softcap: float | None = None  # so do the logits
    local_rope_theta: float | None = None  # sliding layers' own plain RoPE base (Gemma 3); None: one RoPE
    partial_rotary_factor: float = 1.0  # the share of each head's dimensions that rotates, from the first (Phi-4-mini)
    # Granite: attention and MLP outputs scaled before the residual add, the attention scale given, logits divided.
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None  # the attention scale itself; None: from query_pre_attn_scalar or head_dim
    logits_scaling: float = 1.0  # logits divided by this
    # The multimodal checkpoint (its model_type) whose language model this is: its weights are unwrapped and
    # the vision tower's skipped (multimodal_config.py); None: a text model's own checkpoint.
    text_of: str | None = None
    # M-RoPE (Qwen2-VL): how many of each head's rotary pairs take each of a token's three position components
    # (time, height, width), in order; None: one position per token.
    mrope_section: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError("rms_norm_eps and rope_theta must be positive")
        if self.layer_types:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
            unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if unknown:
                raise ValueError(f"unsupported layer_types {unknown}; supported: {', '.join(LAYER_TYPES)}")
        window = self.sliding_window
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
            raise ValueError(f"sliding_window must be a positive integer, got {window!r}")
        if "sliding_attention" in self.layer_types and window is None:
            raise ValueError("layer_types has sliding_attention layers but there is no sliding_window")
        if self.norm_style not in ("llama", "gemma", "olmo2") or self.norm_placement not in ("pre", "sandwich", "post"):
            raise ValueError(f"unsupported norms {self.norm_style!r} / {self.norm_placement!r}")
        if self.rope_layers and len(self.rope_layers) != self.num_hidden_layers:
            raise ValueError(f"no_rope_layers has {len(self.rope_layers)} entries for {self.num_hidden_layers} layers")
        if self.hidden_act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}")
        for name in ("query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap", "local_rope_theta",
                     "embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"{name} must be a positive number, got {value!r}")

        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(f"partial_rotary_factor {self.partial_rotary_factor} leaves {self.rotary_dim} of "
                             f"head_dim {self.head_dim} to rotate: must be a positive even number")
        section = self.mrope_section
        if section is not None and (len(section) != 3 or sum(section) != self.rotary_dim // 2 or min(section) < 0):
            raise ValueError(f"mrope_section {list(section)} must be three counts of rotary pairs adding up "
                             f"to {self.rotary_dim // 2}")
        if self.rope_scaling is not None and self.rope_scaling["rope_type"] == "longrope":
            for name in ("short_factor", "long_factor"):
                if len(self.rope_scaling[name]) != self.rotary_dim // 2:
                    raise ValueError(f"longrope {name} has {len(self.rope_scaling[name])} entries; the rotary "
                                     f"dimensions need {self.rotary_dim // 2}")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_scale(self) -> float:
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @classmethod
    def from_model_dir(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"model directory {path} does not exist or is not a directory")
        file = path / "config.json"
        if not file.is_file():
            raise FileNotFoundError(f"{file} not found: a Hugging Face model directory needs a config.json")
        raw = read_json(file)
        try:
            return cls.from_dict(raw)
        except ValueError as e:
            raise ValueError(f"{file}: {e}") from e

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported architecture model_type={model_type!r} "
                             f"(architectures={raw.get('architectures')}); "
                             f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        text_of = None
        if model_type in TEXT_MODEL_OF:
            text_of, raw = model_type, text_config_of(raw)
            model_type = raw["model_type"]
            if model_type not in SUPPORTED_MODEL_TYPES or model_type in TEXT_MODEL_OF:
                raise ValueError(f"the {text_of} checkpoint's language model is {model_type!r}, which is not "
                                 f"supported; supported: {', '.join(t for t in SUPPORTED_MODEL_TYPES if t not in TEXT_MODEL_OF)}")
        missing = [key for key in _REQUIRED_KEYS if key not in raw]
        if missing:
            raise ValueError(f"missing required key(s): {', '.join(missing)}")
        gemma = model_type in GEMMA_MODEL_TYPES
        max_positions = raw.get("max_position_embeddings", _DEFAULT_MAX_POSITIONS.get(model_type, 2048))
        if not gemma and raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {raw['hidden_act']!r}; only 'silu' is supported")
        heads = raw["num_attention_heads"]
        # Qwen3's and Gemma's config classes default head_dim rather than deriving it; mirror transformers.
        head_dim = raw.get("head_dim") or _DEFAULT_HEAD_DIM.get(model_type) or raw["hidden_size"] // heads
        if gemma:
            rope_theta, rope_scaling, local_rope_theta = gemma_rope(raw, model_type, max_positions)
            window, layer_types = gemma_layer_types(raw, model_type)
        else:
            phi3 = model_type == "phi3"
            rope_theta, rope_scaling = parse_rope(raw, _DEFAULT_ROPE_THETA.get(model_type, 10000.0), max_positions,
                                                  PHI3_ROPE_ALIASES if phi3 else None,
                                                  raw.get("original_max_position_embeddings", 4096) if phi3 else None)
            local_rope_theta = None
            window, layer_types = _parse_attention_layers(raw, model_type)
        rotary_share = partial_rotary_factor(raw)
        if rotary_share != 1.0 and model_type != "phi3":  # their attention in transformers rotates whole heads
            raise ValueError(f"partial_rotary_factor {rotary_share} is not supported for {model_type}")
        attention_bias = bool(raw.get("attention_bias", False))
        family = _ATTENTION_FAMILY.get(model_type, model_type)
        # Qwen2-MoE's config has a qkv_bias switch (on unless turned off); Qwen2's biases are always there.
        qkv_bias = (bool(raw.get("qkv_bias", True)) if model_type == "qwen2_moe"
                    else family == "qwen2" or (family in ("llama", "qwen3", *GEMMA_MODEL_TYPES) and attention_bias))
        return cls(
            model_type=model_type,
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            vocab_size=raw["vocab_size"],
            rms_norm_eps=float(raw.get("rms_norm_eps", _DEFAULT_RMS_NORM_EPS.get(model_type, 1e-6))),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_positions,
            # Gemma's and SmolLM3's are tied unless config.json says otherwise
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", gemma or model_type == "smollm3")),
            qkv_bias=qkv_bias,
            qk_norm=family in ("qwen3", "gemma3_text") or model_type == "olmo2",
            sliding_window=window,
            layer_types=layer_types,
            dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
            o_bias=family in ("llama", "qwen3", *GEMMA_MODEL_TYPES) and attention_bias,
            mlp_bias=family == "llama" and model_type != "olmo2" and bool(raw.get("mlp_bias", False)),
            moe=parse_moe(raw, model_type),
            local_rope_theta=local_rope_theta,
            partial_rotary_factor=rotary_share,
            text_of=text_of,
            mrope_section=_mrope_section(raw),
            **(gemma_fields(raw, model_type) if gemma else {}),
            **(_granite_fields(raw) if model_type == "granite" else {}),
            **(_OLMO2_FIELDS if model_type == "olmo2" else {}),
            **(_smollm3_fields(raw) if model_type == "smollm3" else {}),
        )

    def uses_rope(self, layer: int) -> bool:
        return not self.rope_layers or self.rope_layers[layer]

    def attention_window(self, layer: int) -> int | None:
        """The keys a query sees in ``layer`` (itself included), or None: its whole context."""
        if self.layer_types and self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    def mlp_width(self, layer: int) -> int:
        """The intermediate size of a layer's dense MLP, or of each expert in a sparse one."""
        return self.moe.intermediate_size if self.moe is not None and self.moe.is_sparse(layer) else self.intermediate_size


# OLMo 2: norms after attention and the MLP only, scaled in float32; q/k norms over the whole projection.
_OLMO2_FIELDS = dict(norm_style="olmo2", norm_placement="post", qk_norm_per_head=False, rotate_in_float32=True)


def _smollm3_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """SmolLM3's NoPE layers: no_rope_layers (1: rotates), else every no_rope_layer_interval-th layer skips RoPE."""
    given, num_layers = raw.get("no_rope_layers"), raw["num_hidden_layers"]
    if given is None:
        interval = raw.get("no_rope_layer_interval", 4)
        given = [int((i + 1) % interval != 0) for i in range(num_layers)]
    if not isinstance(given, list) or len(given) < num_layers:
        raise ValueError(f"no_rope_layers must list at least one flag per layer ({num_layers}), got {given!r}")
    return dict(rope_layers=tuple(bool(flag) for flag in given[:num_layers]))  # transformers reads the first ones


def _granite_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """Granite's four multipliers, transformers' defaults (1.0 each) where config.json omits them."""
    return dict(embedding_multiplier=float(raw.get("embedding_multiplier", 1.0)),
                residual_multiplier=float(raw.get("residual_multiplier", 1.0)),
                attention_multiplier=float(raw.get("attention_multiplier", 1.0)),
                logits_scaling=float(raw.get("logits_scaling", 1.0)))


def _mrope_section(raw: dict[str, Any]) -> tuple[int, ...] | None:
    section = raw.get("mrope_section")  # (multimodal_config.py takes it out of the rope dict)
    if section is None:
        return None
    if not isinstance(section, list) or not all(isinstance(n, int) and not isinstance(n, bool) for n in section):
        raise ValueError(f"mrope_section must be a list of integers, got {section!r}")
    return tuple(section)


def _parse_attention_layers(raw: dict[str, Any], model_type: str) -> tuple[int | None, tuple[str, ...]]:
    """(sliding_window, layer_types) as transformers reads them: which layers attend within a window."""
    # Absent, transformers' default (4096 for most); written as null, none.
    window = raw.get("sliding_window", 4096 if model_type in _WINDOW_BY_DEFAULT else None) or None
    if model_type not in _WINDOW_SWITCHED + _EVERY_LAYER_SLIDES:  # Llama's attention has no window
        window = None
    # Qwen configs carry a sliding_window value even when use_sliding_window is off. (SmolLM3 with it off attends
    # fully even where its layer_types say sliding: transformers' flash path does, its eager mask would not.)
    if model_type in _WINDOW_SWITCHED and not raw.get("use_sliding_window", False):
        window = None
    num_layers = raw["num_hidden_layers"]
    if window is None:
        return None, ()
    if model_type in _EVERY_LAYER_SLIDES:  # their attention reads the window alone (layer_types aside)
        return window, ("sliding_attention",) * num_layers
    given = raw.get("layer_types")
    if given is not None:
        if not isinstance(given, list):
            raise ValueError(f"layer_types must be a list, got {given!r}")
        return window, tuple(given)
    if model_type == "smollm3":  # its NoPE layers slide
        rope = _smollm3_fields(raw)["rope_layers"]
        return window, tuple("full_attention" if rotates else "sliding_attention" for rotates in rope)
    first_full = raw.get("max_window_layers", 28)
    if model_type == "qwen2_moe":  # every other layer below max_window_layers, from the first
        return window, tuple("sliding_attention" if i % 2 == 0 and i < first_full else "full_attention"
                             for i in range(num_layers))
    # Qwen2 and Qwen3: the layers from max_window_layers on
    return window, tuple("sliding_attention" if i >= first_full else "full_attention" for i in range(num_layers))
