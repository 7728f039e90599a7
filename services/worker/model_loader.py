"""Load a Hugging Face model directory (config.json + safetensors, or pytorch_model*.bin) into a ``LlamaForCausalLM``.

The model is built on the meta device and then given uninitialised storage
directly in the target dtype and device, so no time goes into a random
initialisation that the checkpoint overwrites. Tensors are streamed one at a
time from the safetensors files; every error names the file at fault. A quantized checkpoint's layers are
converted as they stream by (quantization/checkpoint_stream.py).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import structlog
import torch
from safetensors import safe_open

from services.worker.models.int8_linear import Int8Linear
from services.worker.models.llama import LlamaForCausalLM
from services.worker.models.packed_linear import can_pack
from services.worker.quantization.checkpoint_stream import converted_weights, quantized_layers
from services.worker.quantization.gguf_checkpoint import gguf_names, gguf_tensors
from services.worker.quantization.method import read_quantization
from services.worker.quantization.stored_layers import FP8, INT8, WNA16, keep_stored_layers
from services.worker.tensor_parallel import TensorParallel
from services.worker.model_config import ModelConfig
from shared.gguf_view import GGUF_FILE

INDEX_FILE = "model.safetensors.index.json"
BIN_INDEX_FILE = "pytorch_model.bin.index.json"

log = structlog.get_logger(__name__)


def load_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device, pack: bool = True,
               tp: TensorParallel = TensorParallel(), with_head: bool = True, num_labels: int = 0,
               max_model_len: int | None = None, quantization: str | None = None, triton_gemms: bool | None = None
               ) -> tuple[LlamaForCausalLM, ModelConfig]:
    """The model (this rank's share of it), ready for inference, and the config of that share; ``pack``
    re-lays float32 CPU projections for oneDNN (packed_linear); ``with_head``: False for a pooling model;
    ``num_labels``: a sequence classifier's (its score head); ``max_model_len``: the longest context served
    (None: the model's own); ``quantization``: --quantization (None: what the checkpoint says); ``triton_gemms``:
    run quantized layers in the Triton GEMMs (None: on a GPU): int8 W8A8 layers, and on one rank weight-only 4- and
    8-bit layers kept packed and FP8 ones kept FP8 (elsewhere those are dequantized at load)."""
    whole = ModelConfig.from_model_dir(model_dir)
    config = tp.shard(whole)
    fmt = read_quantization(model_dir, quantization)
    files = checkpoint_files(Path(model_dir))
    names = checkpoint_names(files) if fmt is not None else []
    layers = quantized_layers(names, fmt) if fmt is not None else {}
    if triton_gemms is None:
        triton_gemms = torch.device(device).type == "cuda"
    with torch.device("meta"):
        model = LlamaForCausalLM(config, tp, tp.kv_replicas(whole), with_head, num_labels, max_model_len)
        kept = keep_stored_layers(model, fmt, layers, names, torch.device(device), dtype, tp.size == 1,
                                  triton_gemms) if fmt is not None else {}
    _materialize(model, dtype, torch.device(device))
    state = {"file": None, "done": False}
    weights = _stream(files, state)
    if fmt is not None:
        held = Counter(kept.values())
        log.info("quantized weights", model=str(model_dir), quantization=fmt.describe(), layers=len(layers),
                 int8_layers=held[INT8], wna16_layers=held[WNA16], fp8_layers=held[FP8])
        weights = converted_weights(weights, layers, fmt, kept)
    try:
        model.load_weights(weights)
    except ValueError as e:
        if not state["done"]:  # raised while a tensor of this file was being loaded
            raise ValueError(f"{state['file']}: {e}") from e
        raise ValueError(f"{model_dir}: {e}") from e
    model.eval().requires_grad_(False)
    for module in model.modules():
        if isinstance(module, Int8Linear):
            module.prepare(triton_gemms)
    if pack and can_pack(dtype, torch.device(device)):
        model.pack_linear_weights()
    return model, config



def _materialize(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Give every meta parameter uninitialised storage (floating ones in ``dtype``) on ``device``. What
    ``.to(dtype).to_empty(device)`` does, without its meta-tensor path: that imports sympy, a second of
    every worker's start-up."""
    made: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is None:
                continue
            if id(param) not in made:
                kept = not param.dtype.is_floating_point or name in getattr(module, "keeps_dtype", ())
                kind = param.dtype if kept else dtype
                made[id(param)] = torch.nn.Parameter(torch.empty(param.shape, dtype=kind, device=device),
                                                     requires_grad=param.requires_grad)
            module._parameters[name] = made[id(param)]


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The weights' files: a GGUF file's directory's model.gguf (shared/gguf_view.py), else safetensors where
    there are any, else PyTorch's pickled pytorch_model*.bin."""
    if (model_dir / GGUF_FILE).is_file():
        return [model_dir / GGUF_FILE]
    try:
        return safetensors_files(model_dir)
    except FileNotFoundError as no_safetensors:
        files = _indexed_or_globbed(model_dir, BIN_INDEX_FILE, "pytorch_model.bin", "pytorch_model*.bin")
        if not files:
            raise FileNotFoundError(f"{no_safetensors}; nor pytorch_model*.bin") from None
        return files


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint files: the shards an index lists, else model.safetensors, else any *.safetensors."""
    files = _indexed_or_globbed(model_dir, INDEX_FILE, "model.safetensors", "*.safetensors")
    if not files:
        raise FileNotFoundError(f"no safetensors weights found in {model_dir} "
                                f"(looked for {INDEX_FILE}, model.safetensors, *.safetensors)")
    return files


def _indexed_or_globbed(model_dir: Path, index_name: str, single_name: str, pattern: str) -> list[Path]:
    """The shards an index lists, else the single file, else any file matching the pattern."""
    index = model_dir / index_name
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index} is not a valid checkpoint index: {e!r}") from e
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} lists shard(s) that do not exist: {', '.join(missing)}")
        return files
    single = model_dir / single_name
    if single.is_file():
        return [single]
    return sorted(model_dir.glob(pattern))


def checkpoint_names(files: list[Path]) -> list[str]:
    """Every tensor's name, without reading the tensors (safetensors' headers; a .bin memory-mapped)."""
    names = []
    for file in files:
        try:
            if file.suffix == ".gguf":
                names.extend(gguf_names(file))
            elif file.suffix == ".bin":
                names.extend(name for name, _ in _pickled_tensors(file))
            else:
                with safe_open(str(file), framework="pt", device="cpu") as f:
                    names.extend(f.keys())
        except Exception as e:  # as _stream: the file at fault named
            raise ValueError(f"cannot read checkpoint file {file}: {e}") from e
    return names


def _stream(files: list[Path], state: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, CPU tensor) from each file in turn, recording which file is current."""
    for file in files:
        state["file"] = file
        try:
            yield from READERS.get(file.suffix, _safetensors)(file)
        except Exception as e:  # safetensors raises its own error type for corrupt/truncated files
            raise ValueError(f"cannot read checkpoint file {file}: {e}") from e
    state["done"] = True


def _safetensors(file: Path) -> Iterator[tuple[str, torch.Tensor]]:
    with safe_open(str(file), framework="pt", device="cpu") as f:
        for name in f.keys():
            yield name, f.get_tensor(name)


def _pickled_tensors(file: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """A pytorch_model*.bin state dict, unpickled with weights_only (tensors and plain containers: no code
    from the file runs) and memory-mapped rather than read whole."""
    state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    if not isinstance(state, dict):
        raise ValueError(f"holds a {type(state).__name__}, not a state dict of tensors")
    yield from state.items()


READERS = {".bin": _pickled_tensors, ".gguf": gguf_tensors}  # by file suffix; else safetensors


def load_eos_token_ids(model_dir: str | Path, tokenizer=None) -> tuple[int, ...]:
    """End-of-sequence ids: generation_config.json, else config.json, else the tokenizer's eos."""
    for name in ("generation_config.json", "config.json"):
        file = Path(model_dir) / name
        if not file.is_file():
            continue
        try:
            eos = json.loads(file.read_text(encoding="utf-8")).get("eos_token_id")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
            raise ValueError(f"{file} is not valid JSON: {e}") from e
        ids = _as_ids(eos)
        if ids:
            return ids
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return (int(tokenizer.eos_token_id),)
    return ()


def _as_ids(value) -> tuple[int, ...]:
    values = value if isinstance(value, list) else [value]
    return tuple(dict.fromkeys(int(v) for v in values if isinstance(v, int) and not isinstance(v, bool)))
