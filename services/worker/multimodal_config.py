"""Multimodal checkpoints served for their text: the language model inside them, config and weights.

Gemma 3 from 4B up ships as one ``gemma3`` checkpoint (Gemma3ForConditionalGeneration): a vision tower,
a projector and a ``gemma3_text`` language model. Served for text, only the language model runs: its
config is the nested ``text_config`` (which the Hub's configs write sparsely, leaning on transformers'
defaults: they are filled in here), the wrapper's dtype and tying apply, and its weights are found under
``language_model.model.*`` (transformers v4) or ``model.language_model.*`` (v5), the head under
``language_model.lm_head`` or ``lm_head``. The vision tower's and projector's weights are skipped.
Images are not taken (requests with image parts are refused by the front ends).
"""

from __future__ import annotations

from typing import Any

# The wrapper's model_type -> its language model's.
TEXT_MODEL_OF = {"gemma3": "gemma3_text"}
# Gemma3TextConfig's defaults for what the wrappers' text_config leave out (the rest our parser defaults alike).
_TEXT_DEFAULTS = {"gemma3_text": dict(vocab_size=262_208, hidden_size=2304, intermediate_size=9216,
                                      num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                                      head_dim=256, max_position_embeddings=131_072)}
_SKIPPED_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
_TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                  ("language_model.lm_head.", "lm_head."))


def text_config_of(raw: dict[str, Any]) -> dict[str, Any]:
    """The language model's config.json fields, from a multimodal wrapper's."""
    text_type = TEXT_MODEL_OF[raw["model_type"]]
    nested = raw.get("text_config") or {}
    if not isinstance(nested, dict):
        raise ValueError(f"text_config must be a JSON object, got {nested!r}")
    if nested.get("model_type", text_type) != text_type:
        raise ValueError(f"a {raw['model_type']} checkpoint's text_config must be {text_type}, "
                         f"got {nested.get('model_type')!r}")
    text = {**_TEXT_DEFAULTS[text_type], **nested, "model_type": text_type}
    text["tie_word_embeddings"] = bool(raw.get("tie_word_embeddings", True))  # the head is the wrapper's
    dtype = raw.get("dtype") or raw.get("torch_dtype")
    if dtype is not None:
        text["dtype"] = dtype
    return text


def text_checkpoint_name(name: str) -> str | None:
    """A wrapper checkpoint tensor's name in the language model's own checkpoint; None: not the language model's."""
    if name.startswith(_SKIPPED_PREFIXES):
        return None
    for prefix, plain in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return plain + name[len(prefix):]
    return name
