"""The worker's LoRA adapters: ``max_loras`` slots on the device, each holding one adapter in every
wrapped projection of the model (models/lora_linear.py).

A step's adapters take slots before its forward pass; one loaded for an earlier step keeps its slot
until a step needs the room, and then the least recently used adapter that this step does not use
gives way (the scheduler runs at most ``max_loras`` distinct adapters per step, so one always can).
An evicted adapter is read from its directory again when it is next needed.

An adapter that cannot be loaded (missing, malformed, of a rank above ``max_lora_rank``, or made
for another model) fails the sequences that asked for it, with the reason; the step goes on.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from services.worker.models.lora_linear import LoRALinear, LoRATarget
from services.worker.tensor_parallel import TensorParallel
from services.worker.multimodal_config import text_checkpoint_name
from shared.lora import ADAPTER_WEIGHTS, LoRARequest, read_adapter_config

# PEFT's saved names: base_model.model.<module>.lora_A.weight (an adapter name may sit before .weight).
# A checkpoint's fused projection -> the parts it stands for here, in row order.
_FUSED_MODULES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_WEIGHT_NAME = re.compile(r"(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<kind>[AB])(?:\.[\w-]+)?\.weight")


class AdapterSlots:
    def __init__(self, model, num_slots: int, max_rank: int, tp: TensorParallel):
        self.batch, self.targets = model.add_lora(num_slots, max_rank)
        self.layers: list[LoRALinear] = list({id(t.layer): t.layer for t in self.targets.values()}.values())
        self.num_slots, self.max_rank, self.tp = num_slots, max_rank, tp
        self.multimodal = model.config.text_of is not None  # PEFT names its modules inside the wrapper
        self._loaded: OrderedDict[LoRARequest, int] = OrderedDict()  # adapter -> slot, least recently used first
        self._free = list(range(num_slots))

    def slots_for(self, adapters: list[LoRARequest | None]) -> tuple[list[int | None], dict[LoRARequest, str]]:
        """The slot of each entry's adapter (None: none, or it failed), loading the ones not on the device;
        and the adapters that failed to load, with why."""
        # In the batch's order, not a set's: every tensor-parallel rank then fills the same slots.
        wanted = list(dict.fromkeys(lora for lora in adapters if lora is not None))
        if len(wanted) > self.num_slots:
            raise ValueError(f"a step runs {len(wanted)} distinct LoRA adapters, more than max_loras={self.num_slots}")
        failed: dict[LoRARequest, str] = {}
        for lora in wanted:
            if lora in self._loaded:
                self._loaded.move_to_end(lora)
                continue
            slot = self._take_slot(wanted)  # never one of this step's
            try:
                self._load(lora, slot)
            except ValueError as exc:
                failed[lora] = f"LoRA adapter {lora.name!r} cannot be loaded: {exc}"
                self._free.append(slot)
                continue
            self._loaded[lora] = slot
        if self.tp.size > 1 and wanted:
            self._agree_on_failures(wanted, failed)
        return [self._loaded.get(lora) if lora is not None else None for lora in adapters], failed

    def _agree_on_failures(self, wanted: list[LoRARequest], failed: dict[LoRARequest, str]) -> None:
        """Every rank fails the same adapters (one whose files only some ranks could read, say): ranks that ran
        different batches would meet in their all-reduces with different shapes. Each step with adapters."""
        flags = torch.tensor([float(lora in failed) for lora in wanted], device=self.batch.device)
        self.tp.all_reduce(flags)
        for lora, flag in zip(wanted, flags.tolist()):
            if flag and lora not in failed:
                failed[lora] = f"LoRA adapter {lora.name!r} cannot be loaded on another tensor-parallel rank"

    def _take_slot(self, keep: list[LoRARequest]) -> int:
        if self._free:
            return self._free.pop()
        victim = next(lora for lora in self._loaded if lora not in keep)  # exists: len(keep) <= num_slots
        return self._loaded.pop(victim)

    def _load(self, lora: LoRARequest, slot: int) -> None:
        """Reads and checks the whole adapter, then writes it into the slot (emptied first)."""
        config = read_adapter_config(lora.path)
        if config.rank > self.max_rank:
            raise ValueError(f"its rank {config.rank} exceeds max_lora_rank={self.max_rank}")
        try:
            weights = load_file(str(Path(lora.path) / ADAPTER_WEIGHTS))
        except (OSError, SafetensorError) as exc:
            raise ValueError(f"{ADAPTER_WEIGHTS}: {exc}") from None
        pairs = self._pairs(weights, config.rank)
        for layer in self.layers:
            layer.clear_slot(slot)
        for module, (a, b) in pairs.items():
            target = self.targets[module]
            a, b = self._this_ranks_share(target, a, b)
            dtype = target.layer.lora_a.dtype
            target.layer.set_part(slot, target.part, a.to(dtype), (b.float() * config.scaling).to(dtype))

    def _pairs(self, weights: dict[str, torch.Tensor], rank: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Module -> (A [r, in], B [out, r]) of the whole model, every name and shape checked."""
        found: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in weights.items():
            match = _WEIGHT_NAME.fullmatch(name)
            module = match["module"] if match else None
            if module is not None and self.multimodal:  # language_model.model.X / model.language_model.X
                plain = text_checkpoint_name(f"{module}.weight")
                if plain is None:  # the vision tower's (PEFT's target names match its projections too): no text
                    continue       # runs through it here
                module = plain.removesuffix(".weight")
            if module is not None and not self._knows(module) and self._knows(f"model.{module}"):
                module = f"model.{module}"  # trained on the bare model (AutoModel, an embedding model)
            if module is None or not self._knows(module):
                raise ValueError(f"weight {name!r} is not an adapter of an attention or dense MLP projection of "
                                 f"this model (adapters on embeddings, the output head or experts are not supported)")
            found.setdefault(module, {})[match["kind"]] = tensor
        found = self._unfused(found)
        pairs = {}
        for module, kinds in found.items():
            if set(kinds) != {"A", "B"}:
                raise ValueError(f"{module} has lora_{''.join(kinds)} without its other half")
            a, b = kinds["A"], kinds["B"]
            expected_a, expected_b = self._whole_shapes(self.targets[module], rank)
            if tuple(a.shape) != expected_a or tuple(b.shape) != expected_b:
                raise ValueError(f"{module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; this model "
                                 f"needs {expected_a} and {expected_b} (an adapter for another model?)")
            if not (a.float().isfinite().all() and b.float().isfinite().all()):
                raise ValueError(f"{module}'s weights are not all finite")
            pairs[module] = (a, b)
        return pairs

    def _knows(self, module: str) -> bool:
        """A projection with a slot here, or a fused one (Phi-3's qkv_proj, gate_up_proj) whose parts have."""
        prefix, _, name = module.rpartition(".")
        return module in self.targets or (name in _FUSED_MODULES
                                          and f"{prefix}.{_FUSED_MODULES[name][0]}" in self.targets)

    def _unfused(self, found: dict[str, dict[str, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
        """A fused projection's adapter as its parts': one A for all, B cut by each part's rows (x A B on the
        fused output is that, part by part)."""
        out = {}
        for module, kinds in found.items():
            prefix, _, name = module.rpartition(".")
            if module in self.targets or name not in _FUSED_MODULES or set(kinds) != {"A", "B"}:
                out[module] = kinds
                continue
            parts = [f"{prefix}.{part}" for part in _FUSED_MODULES[name]]
            rows = [self.targets[part].whole for part in parts]
            if kinds["B"].shape[0] != sum(rows):
                raise ValueError(f"{module} has lora_B {tuple(kinds['B'].shape)}; this model needs {sum(rows)} rows "
                                 f"(an adapter for another model?)")
            for part, b in zip(parts, kinds["B"].split(rows)):
                out[part] = {"A": kinds["A"], "B": b}
        return out

    def _whole_shapes(self, target: LoRATarget, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
        layer = target.layer
        if target.row_parallel:
            return (rank, target.whole), (layer.part_sizes[target.part], rank)
        return (rank, layer.lora_a.shape[1]), (target.whole, rank)

    def _this_ranks_share(self, target: LoRATarget, a: torch.Tensor, b: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.tp.size == 1:
            return a, b
        if target.row_parallel:
            return a[:, self.tp.rows(target.whole)], b
        return a, b[self.tp.rows(target.whole, target.replicas)]
