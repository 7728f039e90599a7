"""A JSON file of a model's folder, read with errors that name it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json(file: Path, kind: type = dict, optional: bool = False) -> Any:
    """The file's value, which must be a ``kind`` (dict or list); optional: {} when there is no file."""
    if optional and not file.is_file():
        return {}
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"{file} not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from e
    if not isinstance(value, kind):
        raise ValueError(f"{file} must hold a JSON {'object' if kind is dict else 'list'}")
    return value
