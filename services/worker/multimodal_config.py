"""Multimodal checkpoints: the language model inside them, config and weights, and what takes images.

A vision-language checkpoint holds a vision tower, a projector and a language model. The language model's
config is the nested ``text_config`` (which the Hub's configs write sparsely, leaning on transformers'
defaults: they are filled in here), the wrapper's dtype and tying apply, and its weights are found under
``language_model.model.*`` (transformers v4) or ``model.language_model.*`` (v5), the head under
``language_model.lm_head`` or ``lm_head``; the language model loads them as its own and skips the others.

- LLaVA-1.5 (``llava``, LlavaForConditionalGeneration) and LLaVA-NeXT (``llava_next``, its any-resolution
  tiles): a language model of any family we serve (Llama, Mistral, Qwen 2...), and images, encoded by
  models/llava_vision.py.
- Qwen2-VL and Qwen2.5-VL (``qwen2_vl``, ``qwen2_5_vl``): a Qwen 2 language model whose rotary positions are
  M-RoPE's (three components per token, ``mrope_section`` of the rotary pairs each: mrope.py), and images encoded
  by models/qwen2_vl_vision.py. Their configs from before transformers v5 keep the language model's fields at the
  top level; v5 nests them as ``text_config`` of type ``qwen2_vl_text`` / ``qwen2_5_vl_text``.
- Gemma 3 from 4B up (``gemma3``, Gemma3ForConditionalGeneration), a ``gemma3_text`` language model, and images
  encoded by models/gemma3_vision.py, whose placeholders attend to each other both ways.
"""

from __future__ import annotations

from typing import Any

# The wrapper's model_type -> its language model's (None: the text_config says, Llama if it does not).
TEXT_MODEL_OF = {"gemma3": "gemma3_text", "llava": None, "llava_next": None, "qwen2_vl": "qwen2", "qwen2_5_vl": "qwen2"}
TAKES_IMAGES = ("llava", "llava_next", "qwen2_vl", "qwen2_5_vl", "gemma3")  # the wrappers whose images are served
# The wrappers whose text_config names a model_type of its own, and the wrappers that (before transformers v5)
# wrote the language model's fields beside the vision_config rather than in a text_config.
_NESTED_TEXT_TYPE = {"qwen2_vl": "qwen2_vl_text", "qwen2_5_vl": "qwen2_5_vl_text"}
_TEXT_AT_TOP_LEVEL = ("qwen2_vl", "qwen2_5_vl")
# Gemma3TextConfig's defaults for what the wrappers' text_config leave out (the rest our parser defaults alike).
_TEXT_DEFAULTS = {"gemma3_text": dict(vocab_size=262_208, hidden_size=2304, intermediate_size=9216,
                                      num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                                      head_dim=256, max_position_embeddings=131_072)}
_SKIPPED_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.",
                     "image_newline", "model.image_newline", "visual.", "model.visual.")  # (LLaVA-NeXT's row separator: the image encoder's)
_TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                  ("language_model.lm_head.", "lm_head."))


def text_config_of(raw: dict[str, Any]) -> dict[str, Any]:
    """The language model's config.json fields, from a multimodal wrapper's."""
    nested = raw.get("text_config") or {}
    if not isinstance(nested, dict):
        raise ValueError(f"text_config must be a JSON object, got {nested!r}")
    wrapper = raw["model_type"]
    text_type = TEXT_MODEL_OF[wrapper] or nested.get("model_type", "llama")
    written_type = _NESTED_TEXT_TYPE.get(wrapper, text_type)
    if nested.get("model_type", written_type) != written_type:
        raise ValueError(f"a {wrapper} checkpoint's text_config must be {written_type}, "
                         f"got {nested.get('model_type')!r}")
    top = {key: value for key, value in raw.items() if key not in ("text_config", "vision_config", "model_type")} \
        if wrapper in _TEXT_AT_TOP_LEVEL else {}
    text = {**_TEXT_DEFAULTS.get(text_type, {}), **top, **nested, "model_type": text_type}
    if wrapper in _TEXT_AT_TOP_LEVEL:
        text = _with_mrope_apart(text)
    # The head is the wrapper's: Gemma 3's ties by default, LLaVA's as its language model's config says.
    text["tie_word_embeddings"] = bool(raw.get("tie_word_embeddings", nested.get("tie_word_embeddings",
                                                                                  text_type == "gemma3_text")))
    dtype = raw.get("dtype") or raw.get("torch_dtype")
    if dtype is not None:
        text["dtype"] = dtype
    return text


def _with_mrope_apart(text: dict[str, Any]) -> dict[str, Any]:
    """M-RoPE's sections taken out of the rope dict into ``mrope_section`` (transformers' older configs call its
    kind "mrope"; the frequencies are plain RoPE's, the sections say which position component each pair takes)."""
    key = "rope_parameters" if isinstance(text.get("rope_parameters"), dict) else "rope_scaling"
    params = dict(text.get(key) or {})
    section = params.pop("mrope_section", None)
    if section is None:
        raise ValueError("a Qwen2-VL checkpoint needs mrope_section in its rope parameters")
    if params.get("type") == "mrope" or params.get("rope_type") == "mrope":
        params.pop("type", None)
        params["rope_type"] = "default"
    return {**text, key: params or None, "mrope_section": section}


def image_token_id_of(raw: dict[str, Any]) -> int | None:
    """The placeholder token of image features, for a wrapper whose images are served; None: text only."""
    if raw.get("model_type") not in TAKES_IMAGES:
        return None
    token = raw.get("image_token_id", raw.get("image_token_index"))  # (transformers v5's name, v4's)
    if not isinstance(token, int) or isinstance(token, bool) or token < 0:
        raise ValueError(f"a {raw['model_type']} checkpoint needs image_token_index, a token id; got {token!r}")
    return token


def text_checkpoint_name(name: str) -> str | None:
    """A wrapper checkpoint tensor's name in the language model's own checkpoint; None: not the language model's."""
    if name.startswith(_SKIPPED_PREFIXES):
        return None
    for prefix, plain in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return plain + name[len(prefix):]
    return name
