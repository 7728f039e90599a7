"""LoRA adapters: which one a request runs with, and what an adapter directory declares.

A request names its adapter by ``LoRARequest(name, path)``: the pair is the adapter's identity
everywhere (the worker's slots, the prefix-cache key), so two gateways that give one name to
different directories never share a slot or a cached block. The directory is PEFT's
(``save_pretrained``): ``adapter_config.json`` and ``adapter_model.safetensors``.

``read_adapter_config`` refuses, by name, what the worker cannot apply: DoRA, trained biases,
``modules_to_save``, per-module rank or alpha patterns, and adapters on modules other than the
attention and MLP projections (embeddings, the output head, experts).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from shared.proto import pagedserve_internal_pb2 as wire

# PEFT module names the worker applies adapters to: the projections of attention and the dense MLP.
# Phi-3 fuses q/k/v and gate/up in one projection each: its adapters name those (cut into parts on loading).
SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj")
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


@dataclass(frozen=True, slots=True, init=False)
class LoRARequest:
    """The adapter a request runs with: ``LoRARequest(name, path)``, or vLLM's ``LoRARequest(lora_name,
    lora_int_id, lora_path)`` (its id is kept, but the name and path are the identity)."""

    name: str  # how clients call it (the ``model`` of an OpenAI request)
    path: str  # its PEFT directory, as the worker sees it
    int_id: int | None = field(default=None, compare=False)  # vLLM's lora_int_id, when given

    def __init__(self, name: str | None = None, *args, path: str | None = None, lora_name: str | None = None,
                 lora_int_id: int | None = None, lora_path: str | None = None):
        rest = list(args)
        if rest and isinstance(rest[0], int) and not isinstance(rest[0], bool):
            lora_int_id = rest.pop(0)
        if rest:
            path = rest.pop(0)
        if rest:
            raise TypeError(f"LoRARequest takes (name, path) or (lora_name, lora_int_id, lora_path), got "
                            f"{len(args) + 1} positional arguments")
        object.__setattr__(self, "name", name if name is not None else lora_name)
        object.__setattr__(self, "path", path if path is not None else lora_path)
        object.__setattr__(self, "int_id", lora_int_id)
        self._check()

    # vLLM's names
    lora_name = property(lambda self: self.name)
    lora_path = property(lambda self: self.path)
    lora_int_id = property(lambda self: self.int_id)

    def _check(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a LoRA adapter needs a name, got {self.name!r}")
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"LoRA adapter {self.name!r} needs the path of its directory, got {self.path!r}")

    @property
    def cache_key(self) -> bytes:
        """Part of the prefix-cache hash: KV computed with one adapter is another adapter's garbage."""
        return b"lora" + length_prefixed(self.name) + length_prefixed(self.path)

    def to_proto(self) -> wire.LoRAAdapter:
        return wire.LoRAAdapter(name=self.name, path=self.path)

    @classmethod
    def from_proto(cls, m: wire.LoRAAdapter) -> "LoRARequest":
        return cls(m.name, m.path)


def length_prefixed(text: str) -> bytes:
    """``text`` as bytes after their count: keys joined from such parts cannot run into one another."""
    data = text.encode()
    return len(data).to_bytes(4, "little") + data


def prefix_cache_extra(cache_salt: str | None, lora: LoRARequest | None) -> bytes:
    """The extra key of a request's prefix-cache hashes (empty for neither): requests with different salts,
    or adapters, never share blocks; each part tagged and length-prefixed, so no salt spells an adapter."""
    return (b"salt" + length_prefixed(cache_salt) if cache_salt else b"") + (lora.cache_key if lora else b"")


@dataclass(frozen=True, slots=True)
class AdapterConfig:
    """What ``adapter_config.json`` says, once checked."""

    rank: int  # r
    alpha: float  # lora_alpha
    use_rslora: bool  # scale by alpha / sqrt(r) instead of alpha / r
    target_modules: frozenset[str]  # a subset of SUPPORTED_MODULES; empty when the config gives a pattern

    @property
    def scaling(self) -> float:
        return self.alpha / (self.rank ** 0.5 if self.use_rslora else self.rank)


def read_adapter_config(path: str | Path) -> AdapterConfig:
    """The adapter's config (ValueError naming what is wrong or unsupported)."""
    directory = Path(path)
    config_file, weights_file = directory / ADAPTER_CONFIG, directory / ADAPTER_WEIGHTS
    if not config_file.is_file():
        raise ValueError(f"{directory} is not a LoRA adapter: it has no {ADAPTER_CONFIG}")
    if not weights_file.is_file():
        raise ValueError(f"LoRA adapter {directory} has no {ADAPTER_WEIGHTS} (only safetensors are read)")
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{config_file} cannot be read: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{config_file} must hold a JSON object")
    _refuse_unsupported(raw, config_file)
    rank, alpha = raw.get("r", 8), raw.get("lora_alpha", 8)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"{config_file}: r must be a positive integer, got {rank!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        raise ValueError(f"{config_file}: lora_alpha must be a positive number, got {alpha!r}")
    return AdapterConfig(rank, float(alpha), bool(raw.get("use_rslora", False)), _target_modules(raw, config_file))


def _refuse_unsupported(raw: dict, config_file: Path) -> None:
    peft_type = raw.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"{config_file}: peft_type {peft_type!r} is not supported, only LORA")
    refused = {
        "use_dora": "DoRA adapters are not supported",
        "modules_to_save": "modules_to_save (fully trained modules beside the adapter, such as a classifier's score head) is not supported",
        "rank_pattern": "per-module ranks (rank_pattern) are not supported",
        "alpha_pattern": "per-module alphas (alpha_pattern) are not supported",
        "fan_in_fan_out": "fan_in_fan_out (transposed, Conv1D-style weights) is not supported",
        "lora_bias": "trained LoRA biases (lora_bias) are not supported",
    }
    for key, why in refused.items():
        if raw.get(key):
            raise ValueError(f"{config_file}: {why}")
    if raw.get("bias", "none") != "none":
        raise ValueError(f"{config_file}: trained biases (bias={raw['bias']!r}) are not supported")


def _target_modules(raw: dict, config_file: Path) -> frozenset[str]:
    """The targets a list names (checked); a regex or "all-linear" is left to the weights' names."""
    targets = raw.get("target_modules")
    if not isinstance(targets, list):
        return frozenset()
    short = {str(name).rsplit(".", 1)[-1] for name in targets}
    unsupported = sorted(short - set(SUPPORTED_MODULES))
    if unsupported:
        raise ValueError(f"{config_file}: adapters on {', '.join(unsupported)} are not supported; "
                         f"only on {', '.join(SUPPORTED_MODULES)}")
    return frozenset(short)
