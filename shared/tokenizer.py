"""Tokenizer loading, through transformers, with errors that say what is wrong."""

from __future__ import annotations

import inspect
import threading
from pathlib import Path


# transformers' lazy imports are not safe from two threads at once (one may see a half-made module).
_IMPORT_LOCK = threading.Lock()


def import_tokenizer_library() -> None:
    """Import transformers' tokenizers (seconds: it imports torch too), e.g. while waiting for a backend."""
    with _IMPORT_LOCK:
        from transformers import AutoTokenizer  # noqa: F401
        # AutoTokenizer reads the model's config too, and every model's config class imports what Llama's
        # does (its validators and activations: another second and a half, else paid after the backend answers).
        from transformers import LlamaConfig  # noqa: F401


def load_tokenizer(path: str | Path):
    with _IMPORT_LOCK:
        from transformers import AutoTokenizer

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"tokenizer directory {path} does not exist")
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:  # transformers raises many types; the caller needs the path and the cause
        raise ValueError(f"cannot load the tokenizer from {path}: {exc}") from exc


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                chat_template: str | None = None, continue_final_message: bool = False,
                template_kwargs: dict | None = None, tools: list[dict] | None = None) -> str:
    """The conversation as prompt text, through the tokenizer's chat template.

    continue_final_message leaves the last message open, for the model to go on with it;
    template_kwargs are extra variables for the template (e.g. enable_thinking); tools are the
    functions the model may call (OpenAI's shape), for templates that show them."""
    from jinja2 import TemplateError

    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template; pass chat_template=... or use generate()")
    if not isinstance(messages, list):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    messages = [_template_message(i, message) for i, message in enumerate(messages)]
    if continue_final_message and (add_generation_prompt or not messages):
        raise ValueError("continue_final_message needs add_generation_prompt=False and a message to continue")
    template_kwargs = template_kwargs or {}
    taken = set(template_kwargs) & set(inspect.signature(tokenizer.apply_chat_template).parameters)
    if taken:  # they would change how the template is applied, not what it sees
        raise ValueError(f"chat template variable {sorted(taken)[0]!r} is reserved")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             chat_template=chat_template,
                                             continue_final_message=continue_final_message, tools=tools,
                                             **template_kwargs)
    except (TemplateError, TypeError) as exc:  # a bad template, one that refuses these messages, or their shape
        raise ValueError(f"the chat template cannot render these messages: {exc}") from exc


def message_text(content) -> str:
    """A message's content as a string template sees it: OpenAI's text parts joined by newlines (as
    vLLM does); null (an assistant message with tool calls) is empty."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(part, dict) and part.get("type") == "text"
                                         and isinstance(part.get("text"), str) for part in content):
        return "\n".join(part["text"] for part in content)
    raise ValueError("a message's content must be a string, null, or a list of text parts "
                     "({'type': 'text', 'text': ...}); no other part types are supported")


def _template_message(i: int, message) -> dict:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str) or not message["role"]:
        raise ValueError(f"message {i} must be a dict with a string 'role' (and 'content')")
    try:
        return {**message, "content": message_text(message.get("content"))}
    except ValueError as exc:
        raise ValueError(f"message {i}: {exc}") from None
