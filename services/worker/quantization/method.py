"""Which quantization a checkpoint uses: config.json's ``quantization_config`` (its ``quant_method``), or
--quantization (vLLM's flag), which must agree with it; ``fp8`` also quantizes a float checkpoint at load.
A method, bit width, group size or scheme not built here is refused before anything loads, naming it and
what is supported."""

from __future__ import annotations

from pathlib import Path

from services.worker.quantization.awq_format import AwqFormat
from services.worker.quantization.compressed_tensors_format import CompressedTensorsFormat
from services.worker.quantization.fp8_format import Fp8Format
from services.worker.quantization.gptq_format import GptqFormat
from services.worker.quantization.linear_format import LinearFormat
from shared.config import QUANTIZATION_METHODS
from shared.json_file import read_json

_FORMATS = {"fp8": Fp8Format, "compressed-tensors": CompressedTensorsFormat, "awq": AwqFormat, "gptq": GptqFormat}
assert tuple(_FORMATS) == QUANTIZATION_METHODS
_ALIASES = {"compressed_tensors": "compressed-tensors"}


def read_quantization(model_dir: str | Path, requested: str | None = None) -> LinearFormat | None:
    """The checkpoint's quantization format (None: a float checkpoint served as it is)."""
    file = Path(model_dir) / "config.json"
    raw = read_json(file).get("quantization_config") if file.is_file() else None
    if raw is None:
        return _on_load(requested, file)
    if not isinstance(raw, dict):
        raise ValueError(f"{file}: quantization_config must be an object")
    method = raw.get("quant_method")
    method = _ALIASES.get(method, method)
    if method not in _FORMATS:
        raise ValueError(f"{file}: quantization method {method!r} is not supported; supported: "
                         f"{', '.join(QUANTIZATION_METHODS)}")
    if requested is not None and requested != method:
        raise ValueError(f"--quantization {requested}, but {file} says the checkpoint is quantized with {method}")
    try:
        return _FORMATS[method].from_config(raw)
    except ValueError as exc:
        raise ValueError(f"{file}: {exc}") from None


def _on_load(requested: str | None, file: Path) -> LinearFormat | None:
    if requested is None:
        return None
    if requested == "fp8":
        return Fp8Format(on_load=True)
    raise ValueError(f"--quantization {requested} needs a checkpoint quantized with it, and {file} has no "
                     "quantization_config (only fp8 quantizes a float checkpoint as it loads)")
