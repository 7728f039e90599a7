"""``--lora-modules``: the LoRA adapters a gateway serves beside its model, each under a model name.

As vLLM's flag: ``name=path``, or JSON ``{"name": ..., "path": ..., "base_model_name": ...}`` (the
base model's name is the adapter's ``parent`` on its model card; default: the served model), several
after one flag or the flag repeated. A request whose ``model`` is an adapter's name runs with that
adapter. The path is the adapter's directory as the workers see it: the gateway does not read it (it
may run on another machine); a worker that cannot load it fails the requests for it, saying why.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from shared.lora import LoRARequest
from shared.logging import setup_logging

log = setup_logging("gateway")


@dataclass(frozen=True)
class LoRAModule:
    lora: LoRARequest
    base_model_name: str | None = None  # the card's parent; None: the served model


def parse_lora_modules(entries: list[str] | None) -> list[LoRAModule]:
    """Each entry's adapter; ValueError for a bad entry (at start-up)."""
    parsed: list[LoRAModule] = []
    for entry in entries or ():
        entry = entry.strip()
        if entry.startswith("{"):
            parsed.append(_from_json(entry))
            continue
        name, sep, path = entry.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"--lora-modules takes name=path or a JSON object, got {entry!r}")
        parsed.append(LoRAModule(LoRARequest(name.strip(), path.strip())))
    names = [module.lora.name for module in parsed]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"--lora-modules names {', '.join(repeated)} more than once")
    return parsed


def _from_json(entry: str) -> LoRAModule:
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
    return LoRAModule(LoRARequest(raw["name"], raw["path"]), base)


def adapters_for(model_names: tuple[str, ...], modules: list[LoRAModule], max_loras: int) -> dict[str, LoRAModule]:
    """The adapters by name, once the served model's names and the workers' LoRA room are known. One that
    has one of the model's own names could never be asked for: left out, with an error in the log."""
    if modules and not max_loras:
        log.error("the workers run without LoRA: requests for the --lora-modules adapters will fail",
                  hint="start the workers with --enable-lora", adapters=[m.lora.name for m in modules])
    adapters = {}
    for module in modules:
        if module.lora.name in model_names:
            log.error("a LoRA adapter has the served model's own name: left out", adapter=module.lora.name)
            continue
        adapters[module.lora.name] = module
    return adapters
