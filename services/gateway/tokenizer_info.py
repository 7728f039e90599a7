"""vLLM's GET /tokenizer_info (--enable-tokenizer-info-endpoint): the served tokenizer's configuration, so
that a client can tokenize and render chats as the server does: its init arguments (special tokens,
added tokens by id, model_max_length, ...), its class and the chat template the gateway applies. File
paths (vocab_file, merges_file, tokenizer_file, name_or_path) are left out: they are the server's."""

from __future__ import annotations

from services.gateway.model import Model

PATH_FIELDS = ("vocab_file", "merges_file", "tokenizer_file", "name_or_path")


def tokenizer_info(model: Model) -> dict:
    tokenizer = model.tokenizer
    config = {name: value for name, value in (getattr(tokenizer, "init_kwargs", None) or {}).items()
              if name not in PATH_FIELDS}
    info = _json_ready(config)
    info["tokenizer_class"] = type(tokenizer).__name__
    template = getattr(tokenizer, "chat_template", None)
    if template:
        info["chat_template"] = template
    return info


def _json_ready(value):
    """AddedTokens as their text (as vLLM gives them), keys as strings, anything else unknown as its repr."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {str(key): _json_ready(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_ready(item) for item in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return repr(value)
