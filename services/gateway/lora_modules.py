"""``--lora-modules``: the LoRA adapters a gateway serves beside its model, each under a model name.

As vLLM's flag: ``name=path``, or JSON ``{"name": ..., "path": ...}`` (a ``base_model_name`` is
accepted and must be the served model's). A request whose ``model`` is an adapter's name runs with
that adapter. The path is the adapter's directory as the workers see it: the gateway does not read
it (it may run on another machine); a worker that cannot load it fails the requests for it, saying why.
"""

from __future__ import annotations

import json

from shared.lora import LoRARequest


def parse_lora_modules(entries: list[str] | None) -> list[tuple[LoRARequest, str | None]]:
    """Each entry's adapter, and the base model it names (None: not said); ValueError for a bad entry."""
    parsed: list[tuple[LoRARequest, str | None]] = []
    for entry in entries or ():
        entry = entry.strip()
        if entry.startswith("{"):
            parsed.append(_from_json(entry))
            continue
        name, sep, path = entry.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"--lora-modules takes name=path or a JSON object, got {entry!r}")
        parsed.append((LoRARequest(name.strip(), path.strip()), None))
    names = [lora.name for lora, _ in parsed]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"--lora-modules names {', '.join(repeated)} more than once")
    return parsed


def _from_json(entry: str) -> tuple[LoRARequest, str | None]:
    try:
        raw = json.loads(entry)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--lora-modules entry {entry!r} is not valid JSON: {exc}") from None
    unknown = sorted(set(raw) - {"name", "path", "base_model_name"}) if isinstance(raw, dict) else None
    if unknown is None or unknown or not isinstance(raw.get("name"), str) or not isinstance(raw.get("path"), str):
        raise ValueError(f"--lora-modules JSON takes name, path and base_model_name (strings), got {entry!r}")
    base = raw.get("base_model_name")
    if base is not None and not isinstance(base, str):
        raise ValueError(f"--lora-modules base_model_name must be a string, got {base!r}")
    return LoRARequest(raw["name"], raw["path"]), base


def adapters_for(model_name: str, entries: list[tuple[LoRARequest, str | None]]) -> dict[str, LoRARequest]:
    """The adapters by name, checked against the served model's name (known once a scheduler answered)."""
    adapters = {}
    for lora, base in entries:
        if lora.name == model_name:
            raise ValueError(f"LoRA adapter {lora.name!r} has the served model's own name")
        if base is not None and base != model_name:
            raise ValueError(f"LoRA adapter {lora.name!r} is for base model {base!r}, but this gateway serves "
                             f"{model_name!r}")
        adapters[lora.name] = lora
    return adapters
