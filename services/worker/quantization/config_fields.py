"""Reading a ``quantization_config`` entry: each wrong value is refused naming the field and what it may be."""

from __future__ import annotations

from typing import Any

_MISSING = object()


def field(raw: dict, *names: str, default: Any = _MISSING, kind: type | tuple[type, ...] = object,
          allowed: tuple | None = None, where: str = "quantization_config") -> Any:
    """The first of ``names`` present in ``raw`` (formats spell some fields two ways), checked."""
    for name in names:
        if name in raw and raw[name] is not None:
            value = raw[name]
            break
    else:
        if default is _MISSING:
            raise ValueError(f"{where}: {names[0]} is missing")
        return default
    bad_kind = not isinstance(value, kind) or (isinstance(value, bool) and kind in (int, (int,)))
    if bad_kind:
        raise ValueError(f"{where}: {name} must be {_kind_name(kind)}, got {value!r}")
    if allowed is not None and value not in allowed:
        raise ValueError(f"{where}: {name} {value!r} is not supported; supported: "
                         f"{', '.join(map(repr, allowed))}")
    return value


def positive_group_size(value: int | None, where: str) -> int | None:
    """A group size: None or -1 (one group over the whole input), else positive."""
    if value is None or value == -1:
        return None
    if value <= 0:
        raise ValueError(f"{where}: group_size {value} is not supported; supported: -1 or a positive size")
    return value


def _kind_name(kind) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)
